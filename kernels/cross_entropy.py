"""Cross-entropy over the last dim, per row, with a fused softmax backward; and its
vocab-parallel building blocks.

For a row of logits ``z`` (V,), a target class ``t`` and label smoothing ``eps``:

    m = max_j z_j,   s = sum_j exp(z_j - m),   d = sum_j (z_j - m),   lse = m + log(s)
    loss = (1 - eps) * ((m - z_t) + log(s)) + eps * (log(s) - d / V)     (0 if t == ignore_index)
    dloss/dz_j = (exp((z_j - m) - log(s)) - (1 - eps) * [j == t] - eps / V) * dloss

(``d / V`` is the mean logit minus m: ``eps * (lse - mean z)`` is the smoothing term of
``F.cross_entropy``.) The forward reads each row once, in chunks of BLOCK_V, keeping a running max
and sum (online softmax, Milakov & Gimelshein 2018) and a running ``d`` rescaled the same way
(every term <= 0, so no cancellation), and loads z_t directly; it writes the four statistics of a
row side by side, an (N, 4) fp32 tensor. lse stays split in m and log(s): folded into one fp32
number it would lose log(s) to rounding once |m| is large (bf16 logits reach 1e4 and beyond). The
backward recomputes the probabilities chunk by chunk and writes the gradient straight in the
logits' dtype, so no (N, V) fp32 tensor ever exists.

Vocab-parallel: a tensor-parallel rank holding the classes ``[vocab_start, vocab_start + V)``
calls :func:`cross_entropy_shard_stats` for its (N, 4) statistics; :func:`cross_entropy_combine`
turns the statistics of all shards, stacked (tp, N, 4) in rank order, into the full-vocabulary
loss, ``M = max_r m_r``, ``S = sum_r s_r exp(m_r - M)``, ``z_t = sum_r z_t,r`` (0 off the owning
rank), ``D = sum_r d_r + V_r (m_r - M)``. Its gradient is :func:`cross_entropy_shard_grad` with the
global M and log(S), local and without communication. The torch reference walks rows in chunks of
about :data:`REFERENCE_CHUNK` elements, so it too holds no fp32 copy of the logits.

No copy of the logits either: the public functions and :class:`CrossEntropyFunction` read the rows
in memory order (:mod:`.row_order`), so a transposed view - the model's (B, S, V) logits over its
sequence-first (S, B, V) head output - is read in place, and the gradient comes back with the
logits' strides (contiguous (S, B, V) under the view), what the head's backward GEMM reads as it
is. ``vocab`` (the real classes of the whole vocabulary) marks the columns of a shard at or past
``vocab - vocab_start`` as padding: no probability, zero gradient, no masked copy of the logits.
Reference: Liger-Kernel ``ops/cross_entropy.py``; Megatron-LM ``tensor_parallel/cross_entropy.py``.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .dispatch import impl_for
from .launch import FLOAT_DTYPES, check_float, checked_grid, row_stride, rows, warps_for
from .row_order import from_memory_rows, memory_order, memory_rows, to_memory_rows

# Statistics per row, columns of the (N, 4) tensor the forward writes.
MAX, SUMEXP, TARGET_LOGIT, SUM_SHIFTED = range(4)
STATS = 4
# Elements of fp32 working memory (per temporary) the torch reference processes at a time.
REFERENCE_CHUNK = 1 << 20


@triton.jit
def _cross_entropy_fwd_kernel(
    z_ptr, t_ptr,                         # logits (N, V); target (N,) int64
    stats_ptr,                            # (N, 4) fp32 out: max, sum exp(z - max), target
                                          # logit, sum (z - max)
    V,                                    # classes in this shard
    stride_z,                             # row stride of the logits
    vocab_start, ignore_index,            # this shard's first class; the ignored target
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    z_row = z_ptr + row * stride_z
    cols = tl.arange(0, BLOCK_V)
    # The first chunk sets the running max m and sums s, d; each later one rescales them once (one
    # exp per element, plus one per chunk). A max of -inf (all masked so far) shifts by 0, not inf.
    z = tl.load(z_row + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
    m = tl.max(z, axis=0)
    shift = tl.where(m == float("-inf"), 0.0, m)
    s = tl.sum(tl.exp(z - shift), axis=0)
    d = tl.sum(tl.where(cols < V, z - shift, 0.0), axis=0)
    for start in range(BLOCK_V, V, BLOCK_V):
        col_ok = start + cols < V
        z = tl.load(z_row + start + cols, mask=col_ok, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(z, axis=0))
        shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        s = s * tl.exp(m - shift) + tl.sum(tl.exp(z - shift), axis=0)
        # The `start` earlier terms move by m - m_new each; while m is -inf, d is -inf already.
        d = tl.where(m == float("-inf"), d, d + start * (m - m_new))
        d += tl.sum(tl.where(col_ok, z - shift, 0.0), axis=0)
        m = m_new
    t = tl.load(t_ptr + row)
    t_local = t - vocab_start
    owned = (t != ignore_index) & (t_local >= 0) & (t_local < V)
    zt = tl.load(z_row + tl.where(owned, t_local, 0), mask=owned, other=0.0).to(tl.float32)
    out = stats_ptr + row * 4
    tl.store(out, m)
    tl.store(out + 1, s)
    tl.store(out + 2, zt)
    tl.store(out + 3, d)


@triton.jit
def _cross_entropy_bwd_kernel(
    z_ptr, t_ptr,                         # logits (N, V); target (N,) int64
    max_ptr, logsum_ptr, dloss_ptr,       # (N,) fp32: lse = max + logsum; upstream gradient
    dz_ptr,                               # gradient (N, V), contiguous, the logits' dtype
    V,                                    # classes in this shard
    stride_z, stride_dloss,               # strides (dloss may be broadcast: stride 0)
    vocab_start, ignore_index,
    eps, vocab,                           # label smoothing; real classes of the full vocabulary
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    z_row = z_ptr + row * stride_z
    dz_row = dz_ptr + row * V
    cols = tl.arange(0, BLOCK_V)
    t = tl.load(t_ptr + row)
    valid = t != ignore_index
    t_local = t - vocab_start
    real_cols = vocab - vocab_start       # columns from here on are vocabulary padding
    g = tl.where(valid, tl.load(dloss_ptr + row * stride_dloss).to(tl.float32), 0.0)
    row_max = tl.load(max_ptr + row)
    log_sum = tl.load(logsum_ptr + row)
    hit = 1.0 - eps                       # the target's weight; every class gets eps / vocab
    spread = eps / vocab
    for start in range(0, V, BLOCK_V):
        col_ok = start + cols < V
        real = start + cols < real_cols
        z = tl.load(z_row + start + cols, mask=col_ok & real, other=float("-inf"))
        p = tl.exp((z.to(tl.float32) - row_max) - log_sum)   # 0 past the row's end
        grad = (p - tl.where(start + cols == t_local, hit, 0.0) - spread) * g
        grad = tl.where(valid & real, grad, 0.0)
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
    """Per row (the logits' N rows), fp32: the (N, 4) statistics ``max``, ``sum exp(z - max)``,
    the target's logit (0 off this shard or ignored) and ``sum (z - max)`` (columns
    :data:`MAX`, :data:`SUMEXP`, :data:`TARGET_LOGIT`, :data:`SUM_SHIFTED`)."""
    check_float("cross_entropy", logits=logits)
    _check(logits, target)
    z2 = rows(logits)
    t = target.reshape(-1).to(torch.int64).contiguous()
    N, V = z2.shape
    stats = torch.empty((N, STATS), dtype=torch.float32, device=logits.device)
    if N:
        BLOCK_V = _block_v(V, block_v)
        _cross_entropy_fwd_kernel[checked_grid("cross_entropy", N)](
            z2, t, stats, V, row_stride(z2), vocab_start, ignore_index,
            BLOCK_V=BLOCK_V, num_warps=warps_for(BLOCK_V))
    return stats


def cross_entropy_backward(logits, target, row_max, log_sum, grad_loss, vocab_start=0,
                           ignore_index=-100, block_v=None, label_smoothing=0.0, vocab=None):
    """d(loss)/d(logits) for upstream ``grad_loss`` (shape of target), in the logits' dtype;
    ``row_max`` and ``log_sum`` (N,) fp32 are the two parts of lse; ``vocab`` (the real classes
    of the full vocabulary, default this shard's width) spreads the label smoothing, and the
    columns at or past ``vocab - vocab_start`` (padding) get a zero gradient."""
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
            float(label_smoothing), int(vocab or V),
            BLOCK_V=BLOCK_V, num_warps=warps_for(BLOCK_V))
    return dz.view(logits.shape)


class CrossEntropyFunction(torch.autograd.Function):
    """Per-row cross-entropy with the Triton kernels, rows read in memory order (no copy of the
    logits, a gradient with their strides); saves the logits, the target, the row max and
    log-sum (N,) fp32."""

    @staticmethod
    def forward(ctx, logits, target, ignore_index):
        ctx.order = order = memory_order(logits)
        t = to_memory_rows(target, target.shape, order)
        stats = cross_entropy_forward(memory_rows(logits, order), t, 0, ignore_index)
        row_max, zt = stats[:, MAX].contiguous(), stats[:, TARGET_LOGIT]
        log_sum = stats[:, SUMEXP].log()
        loss = torch.where(t != ignore_index, (row_max - zt) + log_sum,
                           torch.zeros((), device=zt.device))
        ctx.save_for_backward(logits, t, row_max, log_sum)
        ctx.ignore_index = ignore_index
        return from_memory_rows(loss, target.shape, order)

    @staticmethod
    def backward(ctx, grad_loss):
        logits, t, row_max, log_sum = ctx.saved_tensors
        lead = logits.shape[:-1]
        dz = cross_entropy_backward(memory_rows(logits, ctx.order), t, row_max, log_sum,
                                    to_memory_rows(grad_loss, lead, ctx.order), 0,
                                    ctx.ignore_index)
        return from_memory_rows(dz, lead, ctx.order), None, None


def cross_entropy_reference(logits: torch.Tensor, target: torch.Tensor,
                            ignore_index: int = -100) -> torch.Tensor:
    """The same math in torch: fp32 (fp64 stays fp64), loss (shape of target) in that dtype."""
    ct = torch.promote_types(logits.dtype, torch.float32)
    loss = torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]).to(ct), target.reshape(-1).long(),
        reduction="none", ignore_index=ignore_index)
    return loss.view(target.shape)


def _row_chunks(N: int, V: int):
    """Row slices of about REFERENCE_CHUNK elements each."""
    step = max(1, REFERENCE_CHUNK // max(V, 1))
    return (slice(i, min(i + step, N)) for i in range(0, N, step))


def _owned(t, vocab_start, V, ignore_index):
    """(owned, local class id: 0 where not owned) of targets ``t`` (n,) for the shard."""
    t_local = t - vocab_start
    owned = (t != ignore_index) & (t_local >= 0) & (t_local < V)
    return owned, t_local.masked_fill(~owned, 0)


def _shard_stats_reference(logits, target, vocab_start, ignore_index):
    ct = torch.promote_types(logits.dtype, torch.float32)
    t = target.reshape(-1).long()
    N, V = t.numel(), logits.shape[-1]
    stats = torch.empty((N, STATS), dtype=ct, device=logits.device)
    if V == 0:                                                 # a shard of padding only
        stats[:, MAX], stats[:, SUMEXP:] = float("-inf"), 0.0
        return stats
    z2 = logits.reshape(-1, V)
    for r in _row_chunks(N, V):
        z = z2[r].to(ct)                                       # (n, V): may alias fp32 logits
        m = z.amax(-1)
        shifted = z - torch.where(m == float("-inf"), torch.zeros_like(m), m)[:, None]
        owned, t_local = _owned(t[r], vocab_start, V, ignore_index)
        stats[r, MAX] = m
        stats[r, TARGET_LOGIT] = z.gather(1, t_local[:, None])[:, 0].masked_fill(~owned, 0.0)
        stats[r, SUM_SHIFTED] = shifted.sum(-1)
        stats[r, SUMEXP] = shifted.exp_().sum(-1)
        del z, shifted                                         # before the next chunk's
    return stats


def _shard_grad_reference(logits, target, row_max, log_sum, grad_loss, vocab_start,
                          ignore_index, label_smoothing, vocab):
    ct = torch.promote_types(logits.dtype, torch.float32)
    z2 = logits.reshape(-1, logits.shape[-1])
    t = target.reshape(-1).long()
    N, V = z2.shape
    real = max(0, min(V, vocab - vocab_start))                # columns past it: padding
    g = grad_loss.reshape(-1).to(ct)
    dz = torch.empty((N, V), dtype=logits.dtype, device=logits.device)
    dz[:, real:] = 0.0
    for r in _row_chunks(N, V) if real else ():
        p = z2[r, :real].to(ct) - row_max[r].to(ct)[:, None]  # (n, real): a new tensor
        p.sub_(log_sum[r].to(ct)[:, None]).exp_()
        if label_smoothing:
            p.sub_(label_smoothing / vocab)
        owned, t_local = _owned(t[r], vocab_start, real, ignore_index)
        hit = owned.nonzero()[:, 0]
        p[hit, t_local[hit]] -= 1.0 - label_smoothing
        p.mul_(g[r][:, None]).masked_fill_((t[r] == ignore_index)[:, None], 0.0)
        dz[r, :real] = p
        del p                                                  # before the next chunk's
    return dz.view(logits.shape)


def cross_entropy(logits: torch.Tensor, target: torch.Tensor,
                  ignore_index: int = -100) -> torch.Tensor:
    """Per-row cross-entropy of ``logits`` (..., V) against class ids ``target`` (...): fp32
    loss of target's shape, 0 where ``target == ignore_index``; no reduction. Triton on CUDA
    (see :func:`fastpar.kernels.impl_for`), the torch reference elsewhere."""
    _check(logits, target)
    if impl_for(logits, target) == "triton":
        return CrossEntropyFunction.apply(logits, target, ignore_index)
    return cross_entropy_reference(logits, target, ignore_index)


def _use_triton(logits, *tensors) -> bool:
    # fp64 logits (gradient checks) have no kernel: the reference keeps them in fp64.
    return logits.dtype in FLOAT_DTYPES and impl_for(logits, *tensors) == "triton"


def cross_entropy_shard_stats(logits: torch.Tensor, target: torch.Tensor, vocab_start: int = 0,
                              ignore_index: int = -100, vocab: int | None = None
                              ) -> torch.Tensor:
    """For the shard ``logits`` (..., V) of classes ``[vocab_start, vocab_start + V)``: per row
    (flattened) the (N, 4) statistics max ``m``, ``sum exp(z - m)``, the target's logit (0 when
    the target is in another shard or ignored) and ``sum (z - m)``, fp32 (fp64 for fp64 logits),
    over the real classes only: those below ``vocab`` (default: all; the rest is padding).
    Not differentiable: combine shards with :func:`cross_entropy_combine`, then take the gradient
    with :func:`cross_entropy_shard_grad`. Reads the rows in memory order, in place."""
    _check(logits, target)
    order = memory_order(logits)
    z2, t = memory_rows(logits, order), to_memory_rows(target, target.shape, order)
    if vocab is not None:                                   # (N, real): a strided view
        z2 = z2[:, :max(0, min(z2.shape[1], vocab - vocab_start))]
    if _use_triton(logits, target):
        stats = cross_entropy_forward(z2, t, vocab_start, ignore_index)
    else:
        stats = _shard_stats_reference(z2, t, vocab_start, ignore_index)
    return from_memory_rows(stats, target.shape, order).reshape(-1, STATS)


def cross_entropy_combine(stats: torch.Tensor, target: torch.Tensor, vocab: int,
                          ignore_index: int = -100, label_smoothing: float = 0.0,
                          width: int | None = None):
    """``(loss, row_max, log_sum)`` (N,) each from the statistics of every shard of the
    vocabulary, ``stats`` (shards, N, 4) in shard order (``width`` columns each, default
    ``vocab / shards``; ``vocab`` real classes in all, the columns past them padding):
    the loss (0 on ignored rows) and the global ``M`` and ``log S`` that
    :func:`cross_entropy_shard_grad` takes. The shards combine in a fixed order, so every rank
    that holds the same ``stats`` gets bit-identical results."""
    m, s, zt, d = stats.unbind(-1)                           # (shards, N) each
    row_max = m.amax(0)
    shift = torch.where(row_max == float("-inf"), torch.zeros_like(row_max), row_max)
    # exp(m_r - M) <= 1; a shard whose max is -inf adds nothing (its s_r is 0 as well).
    log_sum = (s * (m - shift).exp()).sum(0).log()
    loss = (row_max - zt.sum(0)) + log_sum
    if label_smoothing > 0:
        # sum_j (z_j - M) = sum_r d_r + V_r (m_r - M): every term <= 0. (-inf shards: d_r = -inf;
        # a shard of padding only, V_r = 0, adds nothing.)
        width = width or vocab // stats.shape[0]
        real = (vocab - width * torch.arange(stats.shape[0], device=m.device)).clamp(0, width)
        real = real[:, None]                                 # V_r (shards, 1)
        shifted = torch.where(real > 0, d + real * (m - shift), 0.0).sum(0)
        loss = (1 - label_smoothing) * loss + label_smoothing * (log_sum - shifted / vocab)
    valid = target.reshape(-1) != ignore_index
    return loss.masked_fill(~valid, 0.0), row_max, log_sum


def cross_entropy_shard_grad(logits: torch.Tensor, target: torch.Tensor, row_max: torch.Tensor,
                             log_sum: torch.Tensor, grad_loss: torch.Tensor,
                             vocab_start: int = 0, ignore_index: int = -100,
                             label_smoothing: float = 0.0, vocab: int | None = None
                             ) -> torch.Tensor:
    """d(loss)/d(shard logits) given the full-vocabulary row max ``M`` and ``log(S)`` (N,) fp32
    (lse = M + log S) and the upstream ``grad_loss`` (target's shape):
    ``(exp(z - M - log S) - (1 - eps) onehot - eps / vocab) * grad_loss`` in the logits' dtype,
    0 on ignored rows and on padding (columns at or past ``vocab - vocab_start``); ``vocab`` (the
    real classes) defaults to this shard's width. One new tensor, with the logits' strides when
    they are dense (their rows are read in memory order, in place)."""
    _check(logits, target)
    vocab = vocab or logits.shape[-1]
    lead, order = target.shape, memory_order(logits)
    z2 = memory_rows(logits, order)
    t, m, ls, g = (to_memory_rows(x, lead, order) for x in (target, row_max, log_sum, grad_loss))
    if _use_triton(logits, target, row_max, log_sum, grad_loss):
        grad = cross_entropy_backward(z2, t, m, ls, g, vocab_start, ignore_index,
                                      label_smoothing=label_smoothing, vocab=vocab)
    else:
        grad = _shard_grad_reference(z2, t, m, ls, g, vocab_start, ignore_index,
                                     label_smoothing, vocab)
    return from_memory_rows(grad, lead, order)
