"""Rotary position embedding (RoPE, Su et al. 2021) on q and k, in place or out of place.

q (B, T, Hq, D) and k (B, T, Hk, D) in any strides with a contiguous last dim; ``cos`` and
``sin`` (>= T, R/2) hold ``cos(t * theta_i)``, ``sin(t * theta_i)`` for the R <= D rotated
dims of each head, or (B, >= T, R/2) a table per sequence (positions that restart at each
document of a packed row) (GPT-NeoX / Llama "rotate half" layout). With ``x1 = x[:R/2]``,
``x2 = x[R/2:R]`` of one head at position t:

    y1 = x1 * cos - x2 * sin
    y2 = x2 * cos + x1 * sin          y[R:] = x[R:]   (partial rotary passes the rest through)

The rotation is orthogonal, so the backward is the rotation by -theta (``sin`` negated): the
backward launches the same kernel with ``CONJUGATE=True`` and needs only cos and sin, which are
treated as constants (no gradient). In place, q and k are overwritten (autograd knows through
``mark_dirty``). Arithmetic is fp32. Reference: Su et al., "RoFormer"; flash-attention
``ops/triton/rotary.py``.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .dispatch import impl_for
from .launch import check_float, checked_grid, warps_for


@triton.jit
def _rotary_fwd_kernel(
    x_ptr, y_ptr, cos_ptr, sin_ptr,       # x, y (B, T, H, D); cos, sin ([B,] >= T, R2)
    T, H, D, R2,                          # sizes; R2 = rotated dims / 2
    sx_b, sx_t, sx_h,                     # x strides (the last dim is contiguous)
    sy_b, sy_t, sy_h,                     # y strides (y may be x: in place)
    stride_cos_b, stride_cos,             # cos and sin strides: sequence (0: one table), row
    CONJUGATE: tl.constexpr, COPY_REST: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_R2: tl.constexpr, BLOCK_REST: tl.constexpr,
):
    bt = tl.program_id(0)                 # one (batch, position) per program
    b, t = (bt // T).to(tl.int64), (bt % T).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    cols = tl.arange(0, BLOCK_R2)
    col_ok = cols < R2
    mask = (heads < H)[:, None] & col_ok[None, :]
    row = b * stride_cos_b + t * stride_cos
    c = tl.load(cos_ptr + row + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    s = tl.load(sin_ptr + row + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    if CONJUGATE:
        s = -s
    h64 = heads.to(tl.int64)[:, None]     # heads * stride may pass 2^31 in a (B, H, T, D) view
    x_row = x_ptr + b * sx_b + t * sx_t + h64 * sx_h                     # (BLOCK_H, 1)
    y_row = y_ptr + b * sy_b + t * sy_t + h64 * sy_h
    x1 = tl.load(x_row + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_row + R2 + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    tl.store(y_row + cols[None, :], (x1 * c - x2 * s).to(y_ptr.dtype.element_ty), mask=mask)
    tl.store(y_row + R2 + cols[None, :], (x2 * c + x1 * s).to(y_ptr.dtype.element_ty), mask=mask)
    if COPY_REST:                         # out of place with R < D: pass x[R:] through
        rest = 2 * R2 + tl.arange(0, BLOCK_REST)
        rest_mask = (heads < H)[:, None] & (rest < D)[None, :]
        tl.store(y_row + rest[None, :], tl.load(x_row + rest[None, :], mask=rest_mask),
                 mask=rest_mask)


def _check_shapes(q, k, cos, sin):
    for name, x in (("q", q), ("k", k)):
        if x is None:
            continue
        if x.dim() != 4 or x.shape[:2] != q.shape[:2] or x.shape[3] != q.shape[3]:
            raise ValueError(f"rotary: {name} {tuple(x.shape)} must be (B, T, H, D) with the B, "
                             f"T and D of q {tuple(q.shape)}")
    B, T, D = q.shape[0], q.shape[1], q.shape[3]
    if cos.shape != sin.shape or cos.dim() not in (2, 3) or cos.shape[-2] < T or \
            2 * cos.shape[-1] > D or (cos.dim() == 3 and cos.shape[0] != B):
        raise ValueError(f"rotary: cos {tuple(cos.shape)} and sin {tuple(sin.shape)} must be "
                         f"(>= T, R/2) or (B, >= T, R/2) with B={B}, T={T} and R <= D={D}")


def _angles(t: torch.Tensor, T: int, dtype) -> torch.Tensor:
    """cos or sin ([B,] >= T, R/2) -> its first T rows, broadcastable to (B, T, 1, R/2)."""
    return (t[:T] if t.dim() == 2 else t[:, :T]).unsqueeze(-2).to(dtype)


def _launch(x: torch.Tensor, y: torch.Tensor, cos, sin, conjugate: bool) -> None:
    """Rotate x (B, T, H, D) into y (which may be x)."""
    B, T, H, D = x.shape
    R2 = cos.shape[-1]
    if x.numel() == 0 or R2 == 0:
        if y is not x:
            y.copy_(x)
        return
    if x.stride(3) != 1 or y.stride(3) != 1:
        raise ValueError("rotary: the head dim must be contiguous (stride 1)")
    cos, sin = cos.contiguous(), sin.contiguous()
    BLOCK_R2 = triton.next_power_of_2(R2)
    BLOCK_H = min(triton.next_power_of_2(H), max(1, 2048 // BLOCK_R2))
    copy_rest = y is not x and 2 * R2 < D
    BLOCK_REST = triton.next_power_of_2(D - 2 * R2) if copy_rest else 1
    _rotary_fwd_kernel[checked_grid("rotary", B * T, triton.cdiv(H, BLOCK_H))](
        x, y, cos, sin, T, H, D, R2, *x.stride()[:3], *y.stride()[:3],
        cos.stride(0) if cos.dim() == 3 else 0, cos.stride(-2),
        CONJUGATE=conjugate, COPY_REST=copy_rest,
        BLOCK_H=BLOCK_H, BLOCK_R2=BLOCK_R2, BLOCK_REST=BLOCK_REST,
        num_warps=warps_for(2 * BLOCK_H * BLOCK_R2))


def _rotate(x, cos, sin, inplace, conjugate):
    if not inplace and x.stride(3) != 1:
        x = x.contiguous()
    y = x if inplace else torch.empty(x.shape, dtype=x.dtype, device=x.device)
    _launch(x, y, cos, sin, conjugate)
    return y


def rotary_forward(x, cos, sin, inplace=False):
    """``x`` (B, T, H, D) rotated: a new tensor, or x itself in place."""
    check_float("rotary", x=x, cos=cos, sin=sin)
    _check_shapes(x, None, cos, sin)
    return _rotate(x, cos, sin, inplace, False)


def rotary_backward(dy, cos, sin):
    """The upstream gradient rotated back (a new tensor)."""
    return _rotate(dy, cos, sin, False, True)


class RotaryFunction(torch.autograd.Function):
    """RoPE of one tensor (q or k) with the Triton kernel; saves cos and sin only. One tensor
    per call: autograd allows a Function that writes a view in place a single output."""

    @staticmethod
    def forward(ctx, x, cos, sin, inplace):
        ctx.save_for_backward(cos, sin)
        y = rotary_forward(x, cos, sin, inplace)
        if inplace:
            ctx.mark_dirty(x)
        return y

    @staticmethod
    def backward(ctx, dy):
        cos, sin = ctx.saved_tensors
        return rotary_backward(dy, cos, sin), None, None, None


def _rotate_torch(x, cos, sin, conjugate: bool) -> torch.Tensor:
    """x (B, T, H, D) rotated (by -theta when ``conjugate``) into a new (B, T, H, D) tensor in
    x's dtype, in fp32 arithmetic: a few whole-tensor torch ops (no Python per head)."""
    ct = torch.promote_types(x.dtype, torch.float32)
    T, D, r2 = x.shape[1], x.shape[3], cos.shape[-1]
    c, s = _angles(cos, T, ct), _angles(sin, T, ct)                     # ([B,] T, 1, R/2)
    xf = x.to(ct)
    x1, x2 = xf[..., :r2], xf[..., r2:2 * r2]
    y = torch.empty(x.shape, dtype=ct, device=x.device)
    y1, y2 = y[..., :r2], y[..., r2:2 * r2]
    sign = 1.0 if conjugate else -1.0
    torch.mul(x1, c, out=y1).addcmul_(x2, s, value=sign)        # x1 cos -+ x2 sin
    torch.mul(x2, c, out=y2).addcmul_(x1, s, value=-sign)       # x2 cos +- x1 sin
    if 2 * r2 < D:
        y[..., 2 * r2:] = xf[..., 2 * r2:]
    return y if ct == x.dtype else y.to(x.dtype)


class RotaryTorchFunction(torch.autograd.Function):
    """RoPE of one tensor off CUDA, as :class:`RotaryFunction`: forward and backward each a
    handful of whole-tensor ops (the plain reference's autograd runs about three times as
    many); saves cos and sin only."""

    @staticmethod
    def forward(ctx, x, cos, sin):
        ctx.save_for_backward(cos, sin)
        return _rotate_torch(x, cos, sin, False)

    @staticmethod
    def backward(ctx, dy):
        cos, sin = ctx.saved_tensors
        return _rotate_torch(dy, cos, sin, True), None, None


def rotary_reference(q, k, cos, sin, inplace=False):
    """The same math in torch: fp32 arithmetic (fp64 stays fp64), results in q's and k's dtype."""
    def rotate(x):
        if x is None:
            return None
        ct = torch.promote_types(x.dtype, torch.float32)
        T, r2 = x.shape[1], cos.shape[-1]
        c, s = _angles(cos, T, ct), _angles(sin, T, ct)                 # ([B,] T, 1, R/2)
        x1, x2 = x[..., :r2].to(ct), x[..., r2:2 * r2].to(ct)
        y = torch.cat([x1 * c - x2 * s, x2 * c + x1 * s, x[..., 2 * r2:].to(ct)], -1)
        return x.copy_(y) if inplace else y.to(x.dtype)
    return rotate(q), rotate(k)


def rotary(q: torch.Tensor, k: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
           inplace: bool = False):
    """Rotate ``q`` (B, T, Hq, D) and ``k`` (B, T, Hk, D) (or None) by the angles whose
    ``cos``/``sin`` (>= T, R/2), or (B, >= T, R/2) per sequence, are given; returns ``(q_rot, k_rot)``. With ``inplace`` q and
    k are overwritten and returned. Triton on CUDA (see :func:`fastpar.kernels.impl_for`),
    elsewhere torch ops (:class:`RotaryTorchFunction`; in place or under torch.compile, the
    plain reference)."""
    _check_shapes(q, k, cos, sin)
    tensors = (q, cos, sin) if k is None else (q, k, cos, sin)
    if impl_for(*tensors) == "triton":
        return tuple(None if x is None else RotaryFunction.apply(x, cos, sin, inplace)
                     for x in (q, k))
    if inplace or torch.compiler.is_compiling():    # compiled: inductor fuses the reference
        return rotary_reference(q, k, cos, sin, inplace)
    return tuple(None if x is None else RotaryTorchFunction.apply(x, cos, sin) for x in (q, k))
