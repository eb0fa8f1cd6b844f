"""Bias + dropout + residual add: ``y = residual + dropout_p(x + b)``, forward and backward.

Element ``i`` (its row-major index in x's shape) is kept when the top 24 bits of the Philox-4x32-10
counter-based random number ``philox(seed, offset + i)`` (Salmon et al. 2011, as ``tl.randint``)
are at least ``round(p * 2^24)``; kept elements are scaled by ``1 / (1 - p)``:

    y  = residual + keep * (x + b) / (1 - p)
    dx = keep * dy / (1 - p),  db = sum over rows of dx,  dresidual = dy

The mask is a pure function of (seed, offset, index): the backward regenerates it instead of
saving it (nothing is saved at all), a recomputation under activation checkpointing gets the same
mask, and the torch reference implements the same Philox, so CPU and GPU drop the same elements.
A caller that draws several masks from one seed advances ``offset`` by ``x.numel()`` each time.
db is reduced in two stages (fp32 partial rows, then a sum). Arithmetic is fp32.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .dispatch import impl_for
from .launch import (check_float, checked_grid, elementwise_blocks, elementwise_grid,
                     reduction_programs, row_stride, rows, tile_coords)

_MASK32 = 0xFFFFFFFF
# Philox-4x32 round multipliers and key increments (the constants tl.randint uses).
_PHILOX_ROUND_A, _PHILOX_ROUND_B = 0xD2511F53, 0xCD9E8D57
_PHILOX_KEY_A, _PHILOX_KEY_B = 0x9E3779B9, 0xBB67AE85


@triton.jit
def _keep(seed, idx, threshold):
    """True where element ``idx`` (int64) survives dropout."""
    return (tl.randint(seed, idx) >> 8).to(tl.int32) >= threshold


@triton.jit
def _bias_dropout_add_fwd_kernel(
    x_ptr, b_ptr, res_ptr, y_ptr,         # x, residual, y (M, N); b (N,)
    M, N,                                 # sizes
    stride_x, stride_res, stride_y,       # row strides (last dim is contiguous)
    seed, offset, threshold, scale,       # mask: philox(seed, offset + i) >> 8 >= threshold
    HAS_BIAS: tl.constexpr, DROPOUT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    pid_m, pid_n = tile_coords(N, BLOCK_N)          # tiles folded into grid axis 0
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rows < M)[:, None] & (cols < N)[None, :]
    r64 = rows.to(tl.int64)[:, None]
    z = tl.load(x_ptr + r64 * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        z += tl.load(b_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    if DROPOUT:
        z = tl.where(_keep(seed, offset + r64 * N + cols[None, :], threshold), z * scale, 0.0)
    res = tl.load(res_ptr + r64 * stride_res + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + r64 * stride_y + cols[None, :], (res + z).to(y_ptr.dtype.element_ty),
             mask=mask)


@triton.jit
def _bias_dropout_add_bwd_kernel(
    dy_ptr,                               # dy (M, N)
    dx_ptr, db_part_ptr,                  # dx (M, N) contiguous; db partials (programs, N) fp32
    M, N,                                 # sizes
    stride_dy,                            # row stride
    seed, offset, threshold, scale,       # the forward's mask
    HAS_BIAS: tl.constexpr, DROPOUT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    pid = tl.program_id(1)                # reduction program; column blocks on axis 0
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    db = tl.zeros((BLOCK_N,), dtype=tl.float32)
    # Program (j, p) owns row blocks p, p + P, ... of column block j and sums their db.
    for start in range(pid * BLOCK_M, M, tl.num_programs(1) * BLOCK_M):
        rows = start + tl.arange(0, BLOCK_M)
        mask = (rows < M)[:, None] & col_ok[None, :]
        r64 = rows.to(tl.int64)[:, None]
        dx = tl.load(dy_ptr + r64 * stride_dy + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        if DROPOUT:
            dx = tl.where(_keep(seed, offset + r64 * N + cols[None, :], threshold), dx * scale, 0.0)
        tl.store(dx_ptr + r64 * N + cols[None, :], dx.to(dx_ptr.dtype.element_ty), mask=mask)
        db += tl.sum(dx, axis=0)
    if HAS_BIAS:
        tl.store(db_part_ptr + pid.to(tl.int64) * N + cols, db, mask=col_ok)


def _mask_args(p: float, training: bool, seed: int | None, offset: int):
    """``(dropout on, seed, offset, threshold, scale)`` for the kernels and the reference."""
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"bias_dropout_add: p={p} must be in [0, 1]")
    if not (training and p > 0):
        return False, 0, 0, 0, 1.0
    if seed is None:  # from torch's CPU generator, which torch.utils.checkpoint restores
        seed = int(torch.randint(0, 2**62, (), dtype=torch.int64, device="cpu"))
    if not (0 <= seed < 2**63 and 0 <= offset < 2**63):
        raise ValueError(f"bias_dropout_add: seed={seed} and offset={offset} must be in [0, 2^63)")
    return True, seed, offset, round(p * (1 << 24)), (0.0 if p == 1 else 1.0 / (1.0 - p))


def _check(x, bias, residual):
    check_float("bias_dropout_add", x=x, bias=bias, residual=residual)
    if x.dim() == 0 or residual.shape != x.shape or (bias is not None and
                                                        bias.shape != x.shape[-1:]):
        raise ValueError(f"bias_dropout_add: residual {tuple(residual.shape)} must have x's shape "
                         f"{tuple(x.shape)} and bias {None if bias is None else tuple(bias.shape)} "
                         "its last dim")


def bias_dropout_add_forward(x, bias, residual, dropout, seed, offset, threshold, scale):
    """``residual + dropout(x + bias)`` (contiguous, x's shape and dtype)."""
    _check(x, bias, residual)
    x2, r2 = rows(x), rows(residual)
    M, N = x2.shape
    y = torch.empty((M, N), dtype=x.dtype, device=x.device)
    if M and N:
        BLOCK_M, BLOCK_N, warps = elementwise_blocks(N)
        grid = elementwise_grid("bias_dropout_add", M, N, BLOCK_M, BLOCK_N)
        _bias_dropout_add_fwd_kernel[grid](
            x2, x2 if bias is None else bias.contiguous(), r2, y, M, N,
            row_stride(x2), row_stride(r2), N, seed, offset, threshold, scale,
            HAS_BIAS=bias is not None, DROPOUT=dropout,
            BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, num_warps=warps)
    return y.view(x.shape)


def bias_dropout_add_backward(dy, has_bias, x_dtype, dropout, seed, offset, threshold, scale):
    """``(dx, dbias)`` for upstream ``dy``; dbias is fp32, or None without a bias."""
    dy2 = rows(dy)
    M, N = dy2.shape
    dx = torch.empty((M, N), dtype=x_dtype, device=dy.device)
    BLOCK_M, BLOCK_N, warps = elementwise_blocks(max(N, 1))
    programs = reduction_programs(dy.device, triton.cdiv(M, BLOCK_M))
    db_part = torch.empty((programs, N), dtype=torch.float32, device=dy.device)
    if M and N:
        _bias_dropout_add_bwd_kernel[checked_grid("bias_dropout_add", triton.cdiv(N, BLOCK_N),
                                                   programs)](
            dy2, dx, db_part, M, N, row_stride(dy2), seed, offset, threshold, scale,
            HAS_BIAS=has_bias, DROPOUT=dropout,
            BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, num_warps=warps)
    else:
        db_part.zero_()
    return dx.view(dy.shape), (db_part.sum(0) if has_bias else None)


class BiasDropoutAddFunction(torch.autograd.Function):
    """Bias + dropout + residual with the Triton kernels; saves no tensor (the mask is
    regenerated from seed and offset)."""

    @staticmethod
    def forward(ctx, x, bias, residual, dropout, seed, offset, threshold, scale):
        ctx.args = (dropout, seed, offset, threshold, scale)
        ctx.dtypes = (x.dtype, None if bias is None else bias.dtype, residual.dtype)
        return bias_dropout_add_forward(x, bias, residual, *ctx.args)

    @staticmethod
    def backward(ctx, dy):
        x_dtype, b_dtype, r_dtype = ctx.dtypes
        dx, db = bias_dropout_add_backward(dy, b_dtype is not None, x_dtype, *ctx.args)
        db = None if db is None else db.to(b_dtype)
        return dx, db, dy.to(r_dtype), None, None, None, None, None


def _mulhilo32(a: int, x: torch.Tensor):
    """High and low 32 bits of ``a * x`` for a 32-bit constant ``a`` and int64 ``x`` in
    [0, 2^32), in int64 arithmetic without overflow (16-bit limbs of ``a``)."""
    lo = x * (a & 0xFFFF)                                # < 2^48
    t = x * (a >> 16) + (lo >> 16)                       # < 2^49
    return t >> 16, ((t & 0xFFFF) << 16) | (lo & 0xFFFF)


def philox_uint32(seed: int, counters: torch.Tensor) -> torch.Tensor:
    """Philox-4x32-10 in torch: the first 32-bit word for key ``seed`` and int64 ``counters``,
    bit for bit what ``tl.randint(seed, counters)`` returns (as int64 in [0, 2^32))."""
    c0, c1 = counters & _MASK32, (counters >> 32) & _MASK32
    c2 = torch.zeros_like(c0)
    c3 = torch.zeros_like(c0)
    k0, k1 = seed & _MASK32, (seed >> 32) & _MASK32
    for _ in range(10):
        hi_b, lo_b = _mulhilo32(_PHILOX_ROUND_B, c2)
        hi_a, lo_a = _mulhilo32(_PHILOX_ROUND_A, c0)
        c0, c1, c2, c3 = hi_b ^ c1 ^ k0, lo_b, hi_a ^ c3 ^ k1, lo_a
        k0, k1 = (k0 + _PHILOX_KEY_A) & _MASK32, (k1 + _PHILOX_KEY_B) & _MASK32
    return c0


def _keep_mask(shape, seed, offset, threshold, device) -> torch.Tensor:
    index = torch.arange(offset, offset + torch.Size(shape).numel(), dtype=torch.int64,
                         device=device)
    return ((philox_uint32(seed, index) >> 8) >= threshold).view(shape)


def dropout_keep_mask(shape, p: float, seed: int, offset: int = 0,
                      device: torch.device | str | None = None) -> torch.Tensor:
    """The boolean keep-mask :func:`bias_dropout_add` uses for ``shape`` in training."""
    return _keep_mask(shape, seed, offset, round(p * (1 << 24)), device)


def bias_dropout_add_reference(x, bias, residual, dropout, seed, offset, threshold, scale):
    """The same math in torch (the same Philox mask): fp32 arithmetic, result in x's dtype."""
    ct = torch.promote_types(x.dtype, torch.float32)
    z = x.to(ct) if bias is None else x.to(ct) + bias.to(ct)
    if dropout:
        keep = _keep_mask(x.shape, seed, offset, threshold, x.device)
        z = torch.where(keep, z * scale, torch.zeros((), dtype=ct, device=x.device))
    return (residual.to(ct) + z).to(x.dtype)


def bias_dropout_add(x: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor,
                     p: float, training: bool = True, seed: int | None = None,
                     offset: int = 0) -> torch.Tensor:
    """``residual + dropout_p(x + bias)`` with ``bias`` (N,) or None; in eval mode or with p=0
    it is ``residual + x + bias``. The mask is fixed by ``(seed, offset)``: the same arguments
    give the same mask in forward, backward and any recomputation. ``seed=None`` draws one from
    torch's CPU generator. Triton on CUDA (see :func:`fastpar.kernels.impl_for`), the torch
    reference (same mask) elsewhere."""
    args = _mask_args(p, training, seed, offset)
    tensors = (x, residual) if bias is None else (x, bias, residual)
    if impl_for(*tensors) == "triton":
        return BiasDropoutAddFunction.apply(x, bias, residual, *args)
    return bias_dropout_add_reference(x, bias, residual, *args)
