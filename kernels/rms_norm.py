"""RMSNorm over the last dim (Zhang & Sennrich 2019), forward and backward.

For a row ``x`` of N elements and a weight ``w`` (N,):

    rstd = 1 / sqrt(mean(x^2) + eps)          (kept per row, fp32, for the backward)
    y    = x * rstd * w

With ``xhat = x * rstd`` and the upstream gradient ``dy``:

    dx = rstd * (dy*w - xhat * mean(dy*w * xhat))
    dw = sum over rows of dy * xhat

The backward reduces dw in two stages: each program accumulates the rows it owns into a fp32
partial row, then the partials (one per program, a few programs per SM) are summed. Inputs are
loaded in their dtype and all arithmetic is fp32.

Rows up to ``ROW_CHUNK`` elements (see ``launch.py``) are held in registers whole. Wider rows
(``CHUNKED``) are walked in chunks of BLOCK_N columns, so no program holds more than one chunk:
a first pass sums the row reduction (``sum x^2``, or ``sum dy*w*xhat`` in the backward), a second
writes the outputs; the backward's dw partial row then lives in memory (zeroed by the launcher),
each chunk adding into it. References: Liger-Kernel ``ops/rms_norm.py``; Triton
tutorial ``05-layer-norm.py``.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .dispatch import impl_for
from .launch import (check_float, checked_grid, row_blocks, row_grid, row_reduction_programs,
                     row_stride, rows, sm_count)


@triton.jit
def _rms_norm_fwd_kernel(
    x_ptr, w_ptr, y_ptr, rstd_ptr,        # x, y (M, N); w (N,); rstd (M,) fp32
    M, N,                                 # sizes
    stride_x, stride_y,                   # row strides (last dim is contiguous)
    eps,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CHUNKED: tl.constexpr,                # N > BLOCK_N: two passes over column chunks
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < M
    r64 = rows.to(tl.int64)[:, None]
    if CHUNKED:
        sum_sq = tl.zeros((BLOCK_M,), dtype=tl.float32)
        for start in range(0, N, BLOCK_N):
            cols = start + tl.arange(0, BLOCK_N)
            mask = row_ok[:, None] & (cols < N)[None, :]
            x = tl.load(x_ptr + r64 * stride_x + cols[None, :], mask=mask, other=0.0)
            x = x.to(tl.float32)
            sum_sq += tl.sum(x * x, axis=1)
        rstd = 1.0 / tl.sqrt(sum_sq / N + eps)                                # (BLOCK_M,)
        for start in range(0, N, BLOCK_N):
            cols = start + tl.arange(0, BLOCK_N)
            mask = row_ok[:, None] & (cols < N)[None, :]
            x = tl.load(x_ptr + r64 * stride_x + cols[None, :], mask=mask, other=0.0)
            w = tl.load(w_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)
            y = x.to(tl.float32) * rstd[:, None] * w[None, :]
            tl.store(y_ptr + r64 * stride_y + cols[None, :], y.to(y_ptr.dtype.element_ty),
                     mask=mask)
    else:
        cols = tl.arange(0, BLOCK_N)
        mask = row_ok[:, None] & (cols < N)[None, :]
        x = tl.load(x_ptr + r64 * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / N + eps)                 # (BLOCK_M,)
        y = x * rstd[:, None] * w[None, :]
        tl.store(y_ptr + r64 * stride_y + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)
    tl.store(rstd_ptr + rows, rstd, mask=row_ok)


@triton.jit
def _rms_norm_bwd_kernel(
    dy_ptr, x_ptr, w_ptr, rstd_ptr,       # dy, x (M, N); w (N,); rstd (M,) fp32
    dx_ptr, dw_part_ptr,                  # dx (M, N); dw partials (programs, N) fp32
    M, N,                                 # sizes
    stride_dy, stride_x, stride_dx,       # row strides
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CHUNKED: tl.constexpr,                # N > BLOCK_N: two passes; dw partials zeroed, in memory
):
    pid = tl.program_id(0)
    dw_row = dw_part_ptr + pid.to(tl.int64) * N
    # Program p owns row blocks p, p + P, p + 2P, ... and sums their dw.
    if CHUNKED:
        for start in range(pid * BLOCK_M, M, tl.num_programs(0) * BLOCK_M):
            rows = start + tl.arange(0, BLOCK_M)
            row_ok = rows < M
            r64 = rows.to(tl.int64)[:, None]
            rstd = tl.load(rstd_ptr + rows, mask=row_ok, other=0.0)
            c = tl.zeros((BLOCK_M,), dtype=tl.float32)
            for col0 in range(0, N, BLOCK_N):
                cols = col0 + tl.arange(0, BLOCK_N)
                mask = row_ok[:, None] & (cols < N)[None, :]
                x = tl.load(x_ptr + r64 * stride_x + cols[None, :], mask=mask, other=0.0)
                dy = tl.load(dy_ptr + r64 * stride_dy + cols[None, :], mask=mask, other=0.0)
                w = tl.load(w_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)
                xhat = x.to(tl.float32) * rstd[:, None]
                c += tl.sum(xhat * dy.to(tl.float32) * w[None, :], axis=1)
            c = c / N                                                       # (BLOCK_M,)
            # The previous row block's dw stores (by other threads) land before they are re-read.
            tl.debug_barrier()
            for col0 in range(0, N, BLOCK_N):
                cols = col0 + tl.arange(0, BLOCK_N)
                col_ok = cols < N
                mask = row_ok[:, None] & col_ok[None, :]
                x = tl.load(x_ptr + r64 * stride_x + cols[None, :], mask=mask, other=0.0)
                dy = tl.load(dy_ptr + r64 * stride_dy + cols[None, :], mask=mask, other=0.0)
                w = tl.load(w_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
                xhat = x.to(tl.float32) * rstd[:, None]
                dy = dy.to(tl.float32)
                dx = (dy * w[None, :] - xhat * c[:, None]) * rstd[:, None]
                tl.store(dx_ptr + r64 * stride_dx + cols[None, :],
                         dx.to(dx_ptr.dtype.element_ty), mask=mask)
                dw = tl.load(dw_row + cols, mask=col_ok, other=0.0)
                tl.store(dw_row + cols, dw + tl.sum(dy * xhat, axis=0), mask=col_ok)
    else:
        cols = tl.arange(0, BLOCK_N)
        col_ok = cols < N
        w = tl.load(w_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
        dw = tl.zeros((BLOCK_N,), dtype=tl.float32)
        for start in range(pid * BLOCK_M, M, tl.num_programs(0) * BLOCK_M):
            rows = start + tl.arange(0, BLOCK_M)
            row_ok = rows < M
            mask = row_ok[:, None] & col_ok[None, :]
            r64 = rows.to(tl.int64)[:, None]
            x = tl.load(x_ptr + r64 * stride_x + cols[None, :], mask=mask, other=0.0)
            dy = tl.load(dy_ptr + r64 * stride_dy + cols[None, :], mask=mask, other=0.0)
            rstd = tl.load(rstd_ptr + rows, mask=row_ok, other=0.0)
            xhat = x.to(tl.float32) * rstd[:, None]
            dy = dy.to(tl.float32)
            wdy = dy * w[None, :]
            c = tl.sum(xhat * wdy, axis=1) / N                              # (BLOCK_M,)
            dx = (wdy - xhat * c[:, None]) * rstd[:, None]
            tl.store(dx_ptr + r64 * stride_dx + cols[None, :], dx.to(dx_ptr.dtype.element_ty),
                     mask=mask)
            dw += tl.sum(dy * xhat, axis=0)
        tl.store(dw_row + cols, dw, mask=col_ok)


def _check(x: torch.Tensor, weight: torch.Tensor) -> None:
    check_float("rms_norm", x=x, weight=weight)
    if x.dim() == 0 or weight.shape != x.shape[-1:]:
        raise ValueError(f"rms_norm: weight shape {tuple(weight.shape)} must be ({x.shape[-1]},), "
                         f"the last dim of x {tuple(x.shape)}")


def rms_norm_forward(x: torch.Tensor, weight: torch.Tensor, eps: float):
    """``(y, rstd)``: y like x (contiguous), rstd (M,) fp32 over the M rows of x."""
    _check(x, weight)
    x2 = rows(x)
    M, N = x2.shape
    y = torch.empty((M, N), dtype=x.dtype, device=x.device)
    rstd = torch.empty((M,), dtype=torch.float32, device=x.device)
    if M:
        BLOCK_M, BLOCK_N, warps, chunked = row_blocks(N)
        _rms_norm_fwd_kernel[row_grid("rms_norm", M, BLOCK_M)](
            x2, weight.contiguous(), y, rstd, M, N, row_stride(x2), N, eps,
            BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, CHUNKED=chunked, num_warps=warps)
    return y.view(x.shape), rstd


def rms_norm_backward(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                      rstd: torch.Tensor):
    """``(dx, dw)`` for upstream ``dy`` (shape of x)."""
    x2, dy2 = rows(x), rows(dy)
    M, N = x2.shape
    dx = torch.empty((M, N), dtype=x.dtype, device=x.device)
    BLOCK_M, BLOCK_N, warps, chunked = row_blocks(N)
    # A few programs per SM (launch.ROW_REDUCTION_PROGRAMS_PER_SM), each with a partial row.
    programs = row_reduction_programs("rms_norm", M, BLOCK_M, sm_count(x.device))
    # Chunked rows add into their dw partial row in memory, so it starts at zero.
    dw_part = (torch.zeros if chunked or not M else torch.empty)(
        (programs, N), dtype=torch.float32, device=x.device)
    if M:
        _rms_norm_bwd_kernel[checked_grid("rms_norm", programs)](
            dy2, x2, weight.contiguous(), rstd, dx, dw_part, M, N,
            row_stride(dy2), row_stride(x2), N,
            BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, CHUNKED=chunked, num_warps=warps)
    return dx.view(x.shape), dw_part.sum(0).to(weight.dtype)


class RMSNormFunction(torch.autograd.Function):
    """RMSNorm with the Triton kernels; saves x, the weight and rstd (M,) for the backward."""

    @staticmethod
    def forward(ctx, x, weight, eps):
        y, rstd = rms_norm_forward(x, weight, eps)
        ctx.save_for_backward(x, weight, rstd)
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight, rstd = ctx.saved_tensors
        dx, dw = rms_norm_backward(dy, x, weight, rstd)
        return dx, dw, None


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """The same math in torch: fp32 arithmetic (fp64 stays fp64), result in x's dtype."""
    ct = torch.promote_types(x.dtype, torch.float32)
    xf = x.to(ct)
    y = xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps) * weight.to(ct)
    return y.to(x.dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """RMSNorm of ``x`` (..., N) with ``weight`` (N,), in x's dtype; Triton on CUDA (see
    :func:`fastpar.kernels.impl_for`), the torch reference elsewhere."""
    if impl_for(x, weight) == "triton":
        return RMSNormFunction.apply(x, weight, eps)
    return rms_norm_reference(x, weight, eps)
