"""SwiGLU: ``y = silu(gate) * up`` (Shazeer 2020), forward and backward.

With ``s = sigmoid(gate)`` and the upstream gradient ``dy``:

    silu(g)  = g * s
    d up     = dy * g * s
    d gate   = dy * up * s * (1 + g * (1 - s))

Nothing but the two inputs is saved: the backward recomputes ``s`` (one exp per element) instead
of storing an activation. ``gate`` and ``up`` may be strided row views, e.g. the two halves of one
fused (..., 2F) projection, so no copy is made. Arithmetic is fp32. Reference: Liger-Kernel
``ops/swiglu.py``.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .dispatch import impl_for
from .launch import check_float, elementwise_blocks, elementwise_grid, row_stride, rows, tile_coords


@triton.jit
def _silu(g):
    """silu(g) = g * sigmoid(g), g fp32."""
    return g * tl.sigmoid(g)


@triton.jit
def _silu_grad(g):
    """d silu(g) / dg = s * (1 + g * (1 - s)), s = sigmoid(g), g fp32."""
    s = tl.sigmoid(g)
    return s * (1.0 + g * (1.0 - s))


@triton.jit
def _swiglu_fwd_kernel(
    gate_ptr, up_ptr, y_ptr,                  # (M, N) each
    M, N,                                     # sizes
    stride_gate, stride_up, stride_y,         # row strides (last dim is contiguous)
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    pid_m, pid_n = tile_coords(N, BLOCK_N)          # tiles folded into grid axis 0
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rows < M)[:, None] & (cols < N)[None, :]
    r64 = rows.to(tl.int64)[:, None]
    g = tl.load(gate_ptr + r64 * stride_gate + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    u = tl.load(up_ptr + r64 * stride_up + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    y = _silu(g) * u
    tl.store(y_ptr + r64 * stride_y + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _swiglu_bwd_kernel(
    dy_ptr, gate_ptr, up_ptr,                 # (M, N) each
    dgate_ptr, dup_ptr,                       # (M, N) each, contiguous
    M, N,                                     # sizes
    stride_dy, stride_gate, stride_up,        # row strides (outputs use N)
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    pid_m, pid_n = tile_coords(N, BLOCK_N)          # tiles folded into grid axis 0
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rows < M)[:, None] & (cols < N)[None, :]
    r64 = rows.to(tl.int64)[:, None]
    dy = tl.load(dy_ptr + r64 * stride_dy + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    g = tl.load(gate_ptr + r64 * stride_gate + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    u = tl.load(up_ptr + r64 * stride_up + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    out = r64 * N + cols[None, :]
    tl.store(dgate_ptr + out, (dy * u * _silu_grad(g)).to(dgate_ptr.dtype.element_ty), mask=mask)
    tl.store(dup_ptr + out, (dy * _silu(g)).to(dup_ptr.dtype.element_ty), mask=mask)


def swiglu_forward(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` (contiguous, gate's shape and dtype)."""
    check_float("swiglu", gate=gate, up=up)
    if gate.shape != up.shape or gate.dim() == 0:
        raise ValueError(f"swiglu: gate {tuple(gate.shape)} and up {tuple(up.shape)} must have "
                         "one shape (at least 1-D)")
    g2, u2 = rows(gate), rows(up)
    M, N = g2.shape
    y = torch.empty((M, N), dtype=gate.dtype, device=gate.device)
    if M and N:
        BLOCK_M, BLOCK_N, warps = elementwise_blocks(N)
        grid = elementwise_grid("swiglu", M, N, BLOCK_M, BLOCK_N)
        _swiglu_fwd_kernel[grid](g2, u2, y, M, N, row_stride(g2), row_stride(u2), N,
                                 BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, num_warps=warps)
    return y.view(gate.shape)


def swiglu_backward(dy: torch.Tensor, gate: torch.Tensor, up: torch.Tensor):
    """``(dgate, dup)`` for upstream ``dy``."""
    dy2, g2, u2 = rows(dy), rows(gate), rows(up)
    M, N = g2.shape
    dgate = torch.empty((M, N), dtype=gate.dtype, device=gate.device)
    dup = torch.empty((M, N), dtype=up.dtype, device=up.device)
    if M and N:
        BLOCK_M, BLOCK_N, warps = elementwise_blocks(N)
        grid = elementwise_grid("swiglu", M, N, BLOCK_M, BLOCK_N)
        _swiglu_bwd_kernel[grid](dy2, g2, u2, dgate, dup, M, N,
                                 row_stride(dy2), row_stride(g2), row_stride(u2),
                                 BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, num_warps=warps)
    return dgate.view(gate.shape), dup.view(up.shape)


class SwiGLUFunction(torch.autograd.Function):
    """SwiGLU with the Triton kernels; saves only gate and up."""

    @staticmethod
    def forward(ctx, gate, up):
        ctx.save_for_backward(gate, up)
        return swiglu_forward(gate, up)

    @staticmethod
    def backward(ctx, dy):
        gate, up = ctx.saved_tensors
        return swiglu_backward(dy, gate, up)


def swiglu_reference(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """The same math in torch: fp32 arithmetic (fp64 stays fp64), result in gate's dtype."""
    ct = torch.promote_types(gate.dtype, torch.float32)
    return (torch.nn.functional.silu(gate.to(ct)) * up.to(ct)).to(gate.dtype)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for two tensors of one shape; Triton on CUDA (see
    :func:`fastpar.kernels.impl_for`), the torch reference elsewhere."""
    if impl_for(gate, up) == "triton":
        return SwiGLUFunction.apply(gate, up)
    return swiglu_reference(gate, up)
