"""LayerNorm over the last dim (Ba et al. 2016), forward and backward.

For a row ``x`` of N elements, weight ``w`` (N,) and an optional bias ``b`` (N,):

    mean = sum(x) / N,  rstd = 1 / sqrt(sum((x - mean)^2) / N + eps)   (kept per row, fp32)
    xhat = (x - mean) * rstd,  y = xhat * w + b

With the upstream gradient ``dy`` and ``g = dy * w``:

    dx = rstd * (g - mean(g) - xhat * mean(g * xhat))
    dw = sum over rows of dy * xhat,  db = sum over rows of dy

The variance is taken around the mean (two passes over registers), not as E[x^2] - E[x]^2, so
rows with a large offset keep their precision. dw and db are reduced in two stages: fp32 partial
rows, one per program (a few programs per SM), then a sum. Arithmetic is fp32.

Rows up to ``ROW_CHUNK`` elements (see ``launch.py``) are held in registers whole. Wider rows
(``CHUNKED``) are walked in chunks of BLOCK_N columns, so no program holds more than one chunk: the
forward makes three passes (mean, variance around it, output), the backward two (the row sums
mean(g), mean(g * xhat), then dx); its dw, db partial rows then live in memory (zeroed by the
launcher), each chunk adding into them. Reference: Triton tutorial
``05-layer-norm.py``; Liger-Kernel ``ops/layer_norm.py``.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .dispatch import impl_for
from .launch import (check_float, checked_grid, row_blocks, row_grid, row_reduction_programs,
                     row_stride, rows, sm_count)


@triton.jit
def _layer_norm_fwd_kernel(
    x_ptr, w_ptr, b_ptr, y_ptr,           # x, y (M, N); w, b (N,)
    mean_ptr, rstd_ptr,                   # (M,) fp32 each
    M, N,                                 # sizes
    stride_x, stride_y,                   # row strides (last dim is contiguous)
    eps,
    HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CHUNKED: tl.constexpr,                # N > BLOCK_N: three passes over column chunks
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < M
    r64 = rows.to(tl.int64)[:, None]
    if CHUNKED:
        total = tl.zeros((BLOCK_M,), dtype=tl.float32)
        for start in range(0, N, BLOCK_N):
            cols = start + tl.arange(0, BLOCK_N)
            mask = row_ok[:, None] & (cols < N)[None, :]
            x = tl.load(x_ptr + r64 * stride_x + cols[None, :], mask=mask, other=0.0)
            total += tl.sum(x.to(tl.float32), axis=1)
        mean = total / N                                                  # (BLOCK_M,)
        total_sq = tl.zeros((BLOCK_M,), dtype=tl.float32)
        for start in range(0, N, BLOCK_N):
            cols = start + tl.arange(0, BLOCK_N)
            mask = row_ok[:, None] & (cols < N)[None, :]
            x = tl.load(x_ptr + r64 * stride_x + cols[None, :], mask=mask, other=0.0)
            xc = tl.where(mask, x.to(tl.float32) - mean[:, None], 0.0)
            total_sq += tl.sum(xc * xc, axis=1)
        rstd = 1.0 / tl.sqrt(total_sq / N + eps)
        for start in range(0, N, BLOCK_N):
            cols = start + tl.arange(0, BLOCK_N)
            col_ok = cols < N
            mask = row_ok[:, None] & col_ok[None, :]
            x = tl.load(x_ptr + r64 * stride_x + cols[None, :], mask=mask, other=0.0)
            w = tl.load(w_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
            y = (x.to(tl.float32) - mean[:, None]) * rstd[:, None] * w[None, :]
            if HAS_BIAS:
                y += tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
            tl.store(y_ptr + r64 * stride_y + cols[None, :], y.to(y_ptr.dtype.element_ty),
                     mask=mask)
    else:
        cols = tl.arange(0, BLOCK_N)
        col_ok = cols < N
        mask = row_ok[:, None] & col_ok[None, :]
        x = tl.load(x_ptr + r64 * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        mean = tl.sum(x, axis=1) / N                                      # (BLOCK_M,)
        xc = tl.where(mask, x - mean[:, None], 0.0)
        rstd = 1.0 / tl.sqrt(tl.sum(xc * xc, axis=1) / N + eps)
        w = tl.load(w_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
        y = xc * rstd[:, None] * w[None, :]
        if HAS_BIAS:
            y += tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        tl.store(y_ptr + r64 * stride_y + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)
    tl.store(mean_ptr + rows, mean, mask=row_ok)
    tl.store(rstd_ptr + rows, rstd, mask=row_ok)


@triton.jit
def _layer_norm_bwd_kernel(
    dy_ptr, x_ptr, w_ptr, mean_ptr, rstd_ptr,     # dy, x (M, N); w (N,); mean, rstd (M,) fp32
    dx_ptr, dw_part_ptr, db_part_ptr,             # dx (M, N); dw, db partials (programs, N) fp32
    M, N,                                         # sizes
    stride_dy, stride_x, stride_dx,               # row strides
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CHUNKED: tl.constexpr,                # N > BLOCK_N: two passes; partials zeroed, in memory
):
    pid = tl.program_id(0)
    dw_row = dw_part_ptr + pid.to(tl.int64) * N
    db_row = db_part_ptr + pid.to(tl.int64) * N
    # Program p owns row blocks p, p + P, p + 2P, ... and sums their dw, db.
    if CHUNKED:
        for start in range(pid * BLOCK_M, M, tl.num_programs(0) * BLOCK_M):
            rows = start + tl.arange(0, BLOCK_M)
            row_ok = rows < M
            r64 = rows.to(tl.int64)[:, None]
            mean = tl.load(mean_ptr + rows, mask=row_ok, other=0.0)
            rstd = tl.load(rstd_ptr + rows, mask=row_ok, other=0.0)
            c1 = tl.zeros((BLOCK_M,), dtype=tl.float32)
            c2 = tl.zeros((BLOCK_M,), dtype=tl.float32)
            for col0 in range(0, N, BLOCK_N):
                cols = col0 + tl.arange(0, BLOCK_N)
                mask = row_ok[:, None] & (cols < N)[None, :]
                x = tl.load(x_ptr + r64 * stride_x + cols[None, :], mask=mask, other=0.0)
                dy = tl.load(dy_ptr + r64 * stride_dy + cols[None, :], mask=mask, other=0.0)
                w = tl.load(w_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)
                xhat = tl.where(mask, (x.to(tl.float32) - mean[:, None]) * rstd[:, None], 0.0)
                g = dy.to(tl.float32) * w[None, :]
                c1 += tl.sum(g * xhat, axis=1)
                c2 += tl.sum(g, axis=1)
            c1 = c1 / N                                                     # (BLOCK_M,)
            c2 = c2 / N
            # The previous row block's dw, db stores (by other threads) land before they are
            # re-read.
            tl.debug_barrier()
            for col0 in range(0, N, BLOCK_N):
                cols = col0 + tl.arange(0, BLOCK_N)
                col_ok = cols < N
                mask = row_ok[:, None] & col_ok[None, :]
                x = tl.load(x_ptr + r64 * stride_x + cols[None, :], mask=mask, other=0.0)
                dy = tl.load(dy_ptr + r64 * stride_dy + cols[None, :], mask=mask, other=0.0)
                w = tl.load(w_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
                xhat = tl.where(mask, (x.to(tl.float32) - mean[:, None]) * rstd[:, None], 0.0)
                dy = dy.to(tl.float32)
                g = dy * w[None, :]
                dx = (g - c2[:, None] - xhat * c1[:, None]) * rstd[:, None]
                tl.store(dx_ptr + r64 * stride_dx + cols[None, :],
                         dx.to(dx_ptr.dtype.element_ty), mask=mask)
                dw = tl.load(dw_row + cols, mask=col_ok, other=0.0)
                tl.store(dw_row + cols, dw + tl.sum(dy * xhat, axis=0), mask=col_ok)
                db = tl.load(db_row + cols, mask=col_ok, other=0.0)
                tl.store(db_row + cols, db + tl.sum(dy, axis=0), mask=col_ok)
    else:
        cols = tl.arange(0, BLOCK_N)
        col_ok = cols < N
        w = tl.load(w_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
        dw = tl.zeros((BLOCK_N,), dtype=tl.float32)
        db = tl.zeros((BLOCK_N,), dtype=tl.float32)
        for start in range(pid * BLOCK_M, M, tl.num_programs(0) * BLOCK_M):
            rows = start + tl.arange(0, BLOCK_M)
            row_ok = rows < M
            mask = row_ok[:, None] & col_ok[None, :]
            r64 = rows.to(tl.int64)[:, None]
            x = tl.load(x_ptr + r64 * stride_x + cols[None, :], mask=mask, other=0.0)
            dy = tl.load(dy_ptr + r64 * stride_dy + cols[None, :], mask=mask, other=0.0)
            mean = tl.load(mean_ptr + rows, mask=row_ok, other=0.0)
            rstd = tl.load(rstd_ptr + rows, mask=row_ok, other=0.0)
            xhat = tl.where(mask, (x.to(tl.float32) - mean[:, None]) * rstd[:, None], 0.0)
            dy = dy.to(tl.float32)
            g = dy * w[None, :]
            c1 = tl.sum(g * xhat, axis=1) / N                               # (BLOCK_M,)
            c2 = tl.sum(g, axis=1) / N
            dx = (g - c2[:, None] - xhat * c1[:, None]) * rstd[:, None]
            tl.store(dx_ptr + r64 * stride_dx + cols[None, :], dx.to(dx_ptr.dtype.element_ty),
                     mask=mask)
            dw += tl.sum(dy * xhat, axis=0)
            db += tl.sum(dy, axis=0)
        tl.store(dw_row + cols, dw, mask=col_ok)
        tl.store(db_row + cols, db, mask=col_ok)


def _check(x, weight, bias):
    check_float("layer_norm", x=x, weight=weight, bias=bias)
    n = x.shape[-1:] if x.dim() else None
    if weight.shape != n or (bias is not None and bias.shape != n):
        raise ValueError(f"layer_norm: weight {tuple(weight.shape)} and bias "
                         f"{None if bias is None else tuple(bias.shape)} must have the shape of "
                         f"the last dim of x {tuple(x.shape)}")


def layer_norm_forward(x, weight, bias, eps):
    """``(y, mean, rstd)``: y like x (contiguous); mean, rstd (M,) fp32 over the M rows."""
    _check(x, weight, bias)
    x2 = rows(x)
    M, N = x2.shape
    y = torch.empty((M, N), dtype=x.dtype, device=x.device)
    mean = torch.empty((M,), dtype=torch.float32, device=x.device)
    rstd = torch.empty((M,), dtype=torch.float32, device=x.device)
    if M:
        BLOCK_M, BLOCK_N, warps, chunked = row_blocks(N)
        w = weight.contiguous()
        _layer_norm_fwd_kernel[row_grid("layer_norm", M, BLOCK_M)](
            x2, w, w if bias is None else bias.contiguous(), y, mean, rstd, M, N,
            row_stride(x2), N, eps,
            HAS_BIAS=bias is not None, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, CHUNKED=chunked,
            num_warps=warps)
    return y.view(x.shape), mean, rstd


def layer_norm_backward(dy, x, weight, mean, rstd):
    """``(dx, dw, db)`` for upstream ``dy`` (shape of x); db is fp32 (cast by the caller)."""
    x2, dy2 = rows(x), rows(dy)
    M, N = x2.shape
    dx = torch.empty((M, N), dtype=x.dtype, device=x.device)
    BLOCK_M, BLOCK_N, warps, chunked = row_blocks(N)
    # A few programs per SM (launch.ROW_REDUCTION_PROGRAMS_PER_SM), each with a partial row.
    programs = row_reduction_programs("layer_norm", M, BLOCK_M, sm_count(x.device))
    # Chunked rows add into their partial rows in memory, so they start at zero.
    alloc = torch.zeros if chunked or not M else torch.empty
    dw_part = alloc((programs, N), dtype=torch.float32, device=x.device)
    db_part = alloc((programs, N), dtype=torch.float32, device=x.device)
    if M:
        _layer_norm_bwd_kernel[checked_grid("layer_norm", programs)](
            dy2, x2, weight.contiguous(), mean, rstd, dx, dw_part, db_part, M, N,
            row_stride(dy2), row_stride(x2), N,
            BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, CHUNKED=chunked, num_warps=warps)
    return dx.view(x.shape), dw_part.sum(0).to(weight.dtype), db_part.sum(0)


class LayerNormFunction(torch.autograd.Function):
    """LayerNorm with the Triton kernels; saves x, the weight, mean and rstd (M,)."""

    @staticmethod
    def forward(ctx, x, weight, bias, eps):
        y, mean, rstd = layer_norm_forward(x, weight, bias, eps)
        ctx.save_for_backward(x, weight, mean, rstd)
        ctx.bias_dtype = None if bias is None else bias.dtype
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight, mean, rstd = ctx.saved_tensors
        dx, dw, db = layer_norm_backward(dy, x, weight, mean, rstd)
        db = None if ctx.bias_dtype is None else db.to(ctx.bias_dtype)
        return dx, dw, db, None


def layer_norm_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                         eps: float = 1e-5) -> torch.Tensor:
    """The same math in torch: fp32 arithmetic (fp64 stays fp64), result in x's dtype."""
    ct = torch.promote_types(x.dtype, torch.float32)
    xf = x.to(ct)
    mean = xf.mean(-1, keepdim=True)
    xc = xf - mean
    y = xc * torch.rsqrt(xc.square().mean(-1, keepdim=True) + eps) * weight.to(ct)
    if bias is not None:
        y = y + bias.to(ct)
    return y.to(x.dtype)


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
               eps: float = 1e-5) -> torch.Tensor:
    """LayerNorm of ``x`` (..., N) with ``weight`` and optional ``bias`` (N,), in x's dtype;
    Triton on CUDA (see :func:`fastpar.kernels.impl_for`), the torch reference elsewhere."""
    tensors = (x, weight) if bias is None else (x, weight, bias)
    if impl_for(*tensors) == "triton":
        return LayerNormFunction.apply(x, weight, bias, eps)
    return layer_norm_reference(x, weight, bias, eps)
