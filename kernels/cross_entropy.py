"""Cross-entropy over the last dim, per row, with a fused softmax backward; and its
vocab-parallel building blocks.

For a row of logits ``z`` (V,) and a target class ``t``:

    m = max_j z_j,   s = sum_j exp(z_j - m),   lse = m + log(s)
    loss = (m - z_t) + log(s)              (0 where t == ignore_index)
    dloss/dz_j = (exp((z_j - m) - log(s)) - [j == t]) * dloss

The forward reads each row once, in chunks of BLOCK_V, keeping a running max and sum (online
softmax, Milakov & Gimelshein 2018) and loading z_t directly; it saves m and log(s), (N,)
fp32 each. lse stays split in those two parts: folded into one fp32 number it would lose log(s) to
rounding once |m| is large (bf16 logits reach 1e4 and beyond). The backward recomputes the
probabilities chunk by chunk and writes the gradient straight in the logits' dtype, so no (N, V)
fp32 probability tensor ever exists.

Vocab-parallel: a tensor-parallel rank holding the classes ``[vocab_start, vocab_start + V)``
calls :func:`cross_entropy_shard_stats` for its (m, s, z_t); the full-vocabulary values follow from
three all-reduces of (N,) vectors: ``M = max_r m_r``, ``S = sum_r s_r exp(m_r - M)``,
``z_t = sum_r z_t,r`` (0 off the owning rank), loss ``(M - z_t) + log(S)``. Its gradient is
:func:`cross_entropy_shard_grad` with the global M and log(S), local and without communication.
Reference: Liger-Kernel ``ops/cross_entropy.py``; Megatron-LM ``tensor_parallel/cross_entropy.py``.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .dispatch import impl_for
from .launch import check_float, checked_grid, row_stride, rows, warps_for


@triton.jit
def _cross_entropy_fwd_kernel(
    z_ptr, t_ptr,                         # logits (N, V); target (N,) int64
    max_ptr, sumexp_ptr, zt_ptr,          # per row, fp32: max, sum exp(z - max), target logit
    V,                                    # classes in this shard
    stride_z,                             # row stride of the logits
    vocab_start, ignore_index,            # this shard's first class; the ignored target
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    z_row = z_ptr + row * stride_z
    cols = tl.arange(0, BLOCK_V)
    # The first chunk sets the running max m and sum s; each later one rescales s once (one exp
    # per element, plus one per chunk). A max of -inf (all masked so far) shifts by 0, not inf.
    z = tl.load(z_row + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
    m = tl.max(z, axis=0)
    s = tl.sum(tl.exp(z - tl.where(m == float("-inf"), 0.0, m)), axis=0)
    for start in range(BLOCK_V, V, BLOCK_V):
        z = tl.load(z_row + start + cols, mask=start + cols < V, other=float("-inf"))
        z = z.to(tl.float32)
        m_new = tl.maximum(m, tl.max(z, axis=0))
        shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        s = s * tl.exp(m - shift) + tl.sum(tl.exp(z - shift), axis=0)
        m = m_new
    t = tl.load(t_ptr + row)
    t_local = t - vocab_start
    owned = (t != ignore_index) & (t_local >= 0) & (t_local < V)
    zt = tl.load(z_row + tl.where(owned, t_local, 0), mask=owned, other=0.0).to(tl.float32)
    tl.store(max_ptr + row, m)
    tl.store(sumexp_ptr + row, s)
    tl.store(zt_ptr + row, zt)


@triton.jit
def _cross_entropy_bwd_kernel(
    z_ptr, t_ptr,                         # logits (N, V); target (N,) int64
    max_ptr, logsum_ptr, dloss_ptr,       # (N,) fp32: lse = max + logsum; upstream gradient
    dz_ptr,                               # gradient (N, V), contiguous, the logits' dtype
    V,                                    # classes in this shard
    stride_z, stride_dloss,               # strides (dloss may be broadcast: stride 0)
    vocab_start, ignore_index,
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    z_row = z_ptr + row * stride_z
    dz_row = dz_ptr + row * V
    cols = tl.arange(0, BLOCK_V)
    t = tl.load(t_ptr + row)
    valid = t != ignore_index
    t_local = t - vocab_start
    g = tl.where(valid, tl.load(dloss_ptr + row * stride_dloss).to(tl.float32), 0.0)
    row_max = tl.load(max_ptr + row)
    log_sum = tl.load(logsum_ptr + row)
    for start in range(0, V, BLOCK_V):
        col_ok = start + cols < V
        z = tl.load(z_row + start + cols, mask=col_ok, other=0.0).to(tl.float32)
        grad = (tl.exp((z - row_max) - log_sum) - tl.where(start + cols == t_local, 1.0, 0.0)) * g
        grad = tl.where(valid, grad, 0.0)
        tl.store(dz_row + start + cols, grad.to(dz_ptr.dtype.element_ty), mask=col_ok)


def _block_v(V: int, block_v: int | None) -> int:
    return block_v or min(triton.next_power_of_2(max(V, 16)), 4096)


def _check(logits, target):
    if logits.dim() == 0 or target.shape != logits.shape[:-1]:
        raise ValueError(f"cross_entropy: target {tuple(target.shape)} must be the shape of the "
                         f"logits {tuple(logits.shape)} without the last (vocab) dim")
    if target.is_floating_point() or target.is_complex() or target.dtype == torch.bool:
        raise ValueError(f"cross_entropy: target must hold integer class ids, got {target.dtype}")


def cross_entropy_forward(logits, target, vocab_start=0, ignore_index=-100, block_v=None):
    """``(max, sumexp, target_logit)`` per row, fp32 (N,) each, over the logits' N rows."""
    check_float("cross_entropy", logits=logits)
    _check(logits, target)
    z2 = rows(logits)
    t = target.reshape(-1).to(torch.int64).contiguous()
    N, V = z2.shape
    stats = [torch.empty((N,), dtype=torch.float32, device=logits.device) for _ in range(3)]
    if N:
        BLOCK_V = _block_v(V, block_v)
        _cross_entropy_fwd_kernel[checked_grid("cross_entropy", N)](
            z2, t, *stats, V, row_stride(z2), vocab_start, ignore_index,
            BLOCK_V=BLOCK_V, num_warps=warps_for(BLOCK_V))
    return tuple(stats)


def cross_entropy_backward(logits, target, row_max, log_sum, grad_loss, vocab_start=0,
                           ignore_index=-100, block_v=None):
    """d(loss)/d(logits) for upstream ``grad_loss`` (shape of target), in the logits' dtype;
    ``row_max`` and ``log_sum`` (N,) fp32 are the two parts of lse."""
    z2 = rows(logits)
    t = target.reshape(-1).to(torch.int64).contiguous()
    N, V = z2.shape
    dloss = grad_loss.reshape(-1)                                   # (N,); may have stride 0
    dz = torch.empty((N, V), dtype=logits.dtype, device=logits.device)
    if N:
        BLOCK_V = _block_v(V, block_v)
        _cross_entropy_bwd_kernel[checked_grid("cross_entropy", N)](
            z2, t, row_max.contiguous(), log_sum.contiguous(), dloss, dz, V, row_stride(z2),
            dloss.stride(0) if N > 1 else 0, vocab_start, ignore_index,
            BLOCK_V=BLOCK_V, num_warps=warps_for(BLOCK_V))
    return dz.view(logits.shape)


class CrossEntropyFunction(torch.autograd.Function):
    """Per-row cross-entropy with the Triton kernels; saves the logits (no copy), the target,
    the row max and log-sum (N,) fp32."""

    @staticmethod
    def forward(ctx, logits, target, ignore_index):
        row_max, sumexp, zt = cross_entropy_forward(logits, target, 0, ignore_index)
        log_sum = sumexp.log()
        valid = target.reshape(-1) != ignore_index
        loss = torch.where(valid, (row_max - zt) + log_sum, torch.zeros((), device=zt.device))
        ctx.save_for_backward(logits, target, row_max, log_sum)
        ctx.ignore_index = ignore_index
        return loss.view(target.shape)

    @staticmethod
    def backward(ctx, grad_loss):
        logits, target, row_max, log_sum = ctx.saved_tensors
        dz = cross_entropy_backward(logits, target, row_max, log_sum, grad_loss, 0,
                                    ctx.ignore_index)
        return dz, None, None


def cross_entropy_reference(logits: torch.Tensor, target: torch.Tensor,
                            ignore_index: int = -100) -> torch.Tensor:
    """The same math in torch: fp32 (fp64 stays fp64), loss (shape of target) in that dtype."""
    ct = torch.promote_types(logits.dtype, torch.float32)
    loss = torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]).to(ct), target.reshape(-1).long(),
        reduction="none", ignore_index=ignore_index)
    return loss.view(target.shape)


def _shard_stats_reference(logits, target, vocab_start, ignore_index):
    ct = torch.promote_types(logits.dtype, torch.float32)
    z = logits.reshape(-1, logits.shape[-1]).to(ct)
    t = target.reshape(-1).long() - vocab_start
    owned = (target.reshape(-1) != ignore_index) & (t >= 0) & (t < z.shape[1])
    m = z.max(-1).values
    shift = torch.where(m == float("-inf"), torch.zeros_like(m), m)
    s = (z - shift[:, None]).exp().sum(-1)
    zt = z.gather(1, t.masked_fill(~owned, 0)[:, None])[:, 0].masked_fill(~owned, 0.0)
    return m, s, zt


def _shard_grad_reference(logits, target, row_max, log_sum, grad_loss, vocab_start,
                          ignore_index):
    ct = torch.promote_types(logits.dtype, torch.float32)
    z = logits.reshape(-1, logits.shape[-1]).to(ct)
    t = target.reshape(-1).long()
    grad = ((z - row_max.to(ct)[:, None]) - log_sum.to(ct)[:, None]).exp()
    owned = (t != ignore_index) & (t >= vocab_start) & (t < vocab_start + z.shape[1])
    rows_owned = owned.nonzero()[:, 0]
    grad[rows_owned, t[rows_owned] - vocab_start] -= 1
    g = grad_loss.reshape(-1).to(ct).masked_fill(t == ignore_index, 0.0)
    grad = torch.where((t != ignore_index)[:, None], grad * g[:, None],
                       torch.zeros((), dtype=ct, device=z.device))
    return grad.to(logits.dtype).view(logits.shape)


def cross_entropy(logits: torch.Tensor, target: torch.Tensor,
                  ignore_index: int = -100) -> torch.Tensor:
    """Per-row cross-entropy of ``logits`` (..., V) against class ids ``target`` (...): fp32
    loss of target's shape, 0 where ``target == ignore_index``; no reduction. Triton on CUDA
    (see :func:`fastpar.kernels.impl_for`), the torch reference elsewhere."""
    _check(logits, target)
    if impl_for(logits, target) == "triton":
        return CrossEntropyFunction.apply(logits, target, ignore_index)
    return cross_entropy_reference(logits, target, ignore_index)


def cross_entropy_shard_stats(logits: torch.Tensor, target: torch.Tensor, vocab_start: int = 0,
                              ignore_index: int = -100):
    """For the shard ``logits`` (..., V) of classes ``[vocab_start, vocab_start + V)``: per row
    (flattened, (N,) fp32 each) its max ``m``, ``sum exp(z - m)`` and the target's logit (0 when
    the target is in another shard or ignored). Not differentiable: pair it with
    :func:`cross_entropy_shard_grad`."""
    _check(logits, target)
    if impl_for(logits, target) == "triton":
        return cross_entropy_forward(logits, target, vocab_start, ignore_index)
    return _shard_stats_reference(logits, target, vocab_start, ignore_index)


def cross_entropy_shard_grad(logits: torch.Tensor, target: torch.Tensor, row_max: torch.Tensor,
                             log_sum: torch.Tensor, grad_loss: torch.Tensor,
                             vocab_start: int = 0, ignore_index: int = -100) -> torch.Tensor:
    """d(loss)/d(shard logits) given the full-vocabulary row max ``M`` and ``log(S)`` (N,) fp32
    (lse = M + log S) and the upstream ``grad_loss`` (target's shape):
    ``(exp(z - M - log S) - onehot) * grad_loss`` in the logits' dtype, 0 on ignored rows."""
    _check(logits, target)
    if impl_for(logits, target, row_max, log_sum, grad_loss) == "triton":
        return cross_entropy_backward(logits, target, row_max, log_sum, grad_loss, vocab_start,
                                      ignore_index)
    return _shard_grad_reference(logits, target, row_max, log_sum, grad_loss, vocab_start,
                                 ignore_index)
