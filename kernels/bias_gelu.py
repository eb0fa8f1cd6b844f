"""Bias + GELU: ``y = gelu(x + b)`` (Hendrycks & Gimpel 2016), forward and backward.

With ``z = x + b``, ``k = sqrt(2/pi)``, ``c = 0.044715``:

    tanh approximation:  gelu(z) = z/2 * (1 + t),  t = tanh(k (z + c z^3))
                         gelu'(z) = (1 + t)/2 + z/2 * (1 - t^2) * k (1 + 3 c z^2)
    exact:               gelu(z) = z * Phi(z),    gelu'(z) = Phi(z) + z * phi(z)

    dx = dy * gelu'(z),  db = sum over rows of dx

Only x and b are saved; the backward recomputes z. db is reduced in two stages (fp32 partial rows,
one per program, then a sum). Arithmetic is fp32. ``tanh(u)`` is written ``2 sigmoid(2u) - 1``,
which saturates cleanly for large |u| on every backend.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .dispatch import impl_for
from .launch import (check_float, checked_grid, elementwise_blocks, elementwise_grid,
                     reduction_programs, row_stride, rows, tile_coords)

_APPROXIMATIONS = ("tanh", "none")


@triton.jit
def _tanh(u):
    return 2.0 * tl.sigmoid(2.0 * u) - 1.0


@triton.jit
def _gelu_tanh(z):
    t = _tanh(0.7978845608028654 * (z + 0.044715 * z * z * z))
    return 0.5 * z * (1.0 + t)


@triton.jit
def _gelu_tanh_grad(z):
    t = _tanh(0.7978845608028654 * (z + 0.044715 * z * z * z))
    return 0.5 * (1.0 + t) + 0.5 * z * (1.0 - t * t) * 0.7978845608028654 * (
        1.0 + 0.134145 * z * z)


@triton.jit
def _gelu_erf(z):
    return 0.5 * z * (1.0 + tl.erf(z * 0.7071067811865476))


@triton.jit
def _gelu_erf_grad(z):
    cdf = 0.5 * (1.0 + tl.erf(z * 0.7071067811865476))
    return cdf + z * tl.exp(-0.5 * z * z) * 0.3989422804014327


@triton.jit
def _bias_gelu_fwd_kernel(
    x_ptr, b_ptr, y_ptr,                  # x, y (M, N); b (N,)
    M, N,                                 # sizes
    stride_x, stride_y,                   # row strides (last dim is contiguous)
    HAS_BIAS: tl.constexpr, TANH: tl.constexpr,
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
    y = _gelu_tanh(z) if TANH else _gelu_erf(z)
    tl.store(y_ptr + r64 * stride_y + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _bias_gelu_bwd_kernel(
    dy_ptr, x_ptr, b_ptr,                 # dy, x (M, N); b (N,)
    dx_ptr, db_part_ptr,                  # dx (M, N) contiguous; db partials (programs, N) fp32
    M, N,                                 # sizes
    stride_dy, stride_x,                  # row strides
    HAS_BIAS: tl.constexpr, TANH: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    pid = tl.program_id(1)                # reduction program; column blocks on axis 0
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    if HAS_BIAS:
        b = tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    db = tl.zeros((BLOCK_N,), dtype=tl.float32)
    # Program (j, p) owns row blocks p, p + P, ... of column block j and sums their db.
    for start in range(pid * BLOCK_M, M, tl.num_programs(1) * BLOCK_M):
        rows = start + tl.arange(0, BLOCK_M)
        mask = (rows < M)[:, None] & col_ok[None, :]
        r64 = rows.to(tl.int64)[:, None]
        z = tl.load(x_ptr + r64 * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        if HAS_BIAS:
            z += b[None, :]
        dy = tl.load(dy_ptr + r64 * stride_dy + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        dx = dy * (_gelu_tanh_grad(z) if TANH else _gelu_erf_grad(z))
        tl.store(dx_ptr + r64 * N + cols[None, :], dx.to(dx_ptr.dtype.element_ty), mask=mask)
        db += tl.sum(dx, axis=0)
    if HAS_BIAS:
        tl.store(db_part_ptr + pid.to(tl.int64) * N + cols, db, mask=col_ok)


def _check(x, bias, approximate):
    check_float("bias_gelu", x=x, bias=bias)
    if approximate not in _APPROXIMATIONS:
        raise ValueError(f"bias_gelu: approximate={approximate!r} must be one of {_APPROXIMATIONS}")
    if x.dim() == 0 or (bias is not None and bias.shape != x.shape[-1:]):
        raise ValueError(f"bias_gelu: bias {None if bias is None else tuple(bias.shape)} must "
                         f"have the shape of the last dim of x {tuple(x.shape)}")


def bias_gelu_forward(x, bias, approximate="tanh"):
    """``gelu(x + bias)`` (contiguous, x's shape and dtype)."""
    _check(x, bias, approximate)
    x2 = rows(x)
    M, N = x2.shape
    y = torch.empty((M, N), dtype=x.dtype, device=x.device)
    if M and N:
        BLOCK_M, BLOCK_N, warps = elementwise_blocks(N)
        grid = elementwise_grid("bias_gelu", M, N, BLOCK_M, BLOCK_N)
        _bias_gelu_fwd_kernel[grid](
            x2, x2 if bias is None else bias.contiguous(), y, M, N, row_stride(x2), N,
            HAS_BIAS=bias is not None, TANH=approximate == "tanh",
            BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, num_warps=warps)
    return y.view(x.shape)


def bias_gelu_backward(dy, x, bias, approximate="tanh"):
    """``(dx, dbias)`` for upstream ``dy``; dbias is None without a bias."""
    dy2, x2 = rows(dy), rows(x)
    M, N = x2.shape
    dx = torch.empty((M, N), dtype=x.dtype, device=x.device)
    BLOCK_M, BLOCK_N, warps = elementwise_blocks(max(N, 1))
    programs = reduction_programs(x.device, triton.cdiv(M, BLOCK_M))
    db_part = torch.empty((programs, N), dtype=torch.float32, device=x.device)
    if M and N:
        _bias_gelu_bwd_kernel[checked_grid("bias_gelu", triton.cdiv(N, BLOCK_N), programs)](
            dy2, x2, x2 if bias is None else bias.contiguous(), dx, db_part, M, N,
            row_stride(dy2), row_stride(x2),
            HAS_BIAS=bias is not None, TANH=approximate == "tanh",
            BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, num_warps=warps)
    else:
        db_part.zero_()
    db = None if bias is None else db_part.sum(0).to(bias.dtype)
    return dx.view(x.shape), db


class BiasGeluFunction(torch.autograd.Function):
    """Bias + GELU with the Triton kernels; saves x and the bias only."""

    @staticmethod
    def forward(ctx, x, bias, approximate):
        ctx.save_for_backward(x, bias)
        ctx.approximate = approximate
        return bias_gelu_forward(x, bias, approximate)

    @staticmethod
    def backward(ctx, dy):
        x, bias = ctx.saved_tensors
        dx, db = bias_gelu_backward(dy, x, bias, ctx.approximate)
        return dx, db, None


def bias_gelu_reference(x: torch.Tensor, bias: torch.Tensor | None,
                        approximate: str = "tanh") -> torch.Tensor:
    """The same math in torch: fp32 arithmetic (fp64 stays fp64), result in x's dtype."""
    ct = torch.promote_types(x.dtype, torch.float32)
    z = x.to(ct) if bias is None else x.to(ct) + bias.to(ct)
    return torch.nn.functional.gelu(z, approximate=approximate).to(x.dtype)


def bias_gelu(x: torch.Tensor, bias: torch.Tensor | None,
              approximate: str = "tanh") -> torch.Tensor:
    """``gelu(x + bias)`` with ``bias`` (N,) or None over the last dim of ``x``; ``approximate``
    is ``"tanh"`` or ``"none"`` (exact, erf). Triton on CUDA (see
    :func:`fastpar.kernels.impl_for`), the torch reference elsewhere."""
    if approximate not in _APPROXIMATIONS:
        raise ValueError(f"bias_gelu: approximate={approximate!r} must be one of {_APPROXIMATIONS}")
    tensors = (x,) if bias is None else (x, bias)
    if impl_for(*tensors) == "triton":
        return BiasGeluFunction.apply(x, bias, approximate)
    return bias_gelu_reference(x, bias, approximate)
