"""Grouped GEMM for mixture-of-experts layers: one weight per group of consecutive rows.

The N rows of ``x`` (N, K) are sorted by group (expert): group g owns the ``counts[g]`` rows after
those of groups < g (``counts`` (G,) on x's device, sum N, zeros allowed). With ``w`` (G, M, K)
stacked like nn.Linear weights, ``x_g`` those rows and ``dy`` the upstream gradient:

    y_g  = x_g @ w[g]^T         (N, M) in all
    dx_g = dy_g @ w[g]          (N, K): the same grouped GEMM with w[g] not transposed
    dw_g = dy_g^T @ x_g         (G, M, K): a reduction over group g's rows; zero if it has none

No host synchronisation: the grids come from N and G alone. The row GEMMs launch
``cdiv(N, BLOCK_M) + G`` row tiles (each group's last tile may be partial, so the groups hold at
most that many); each program reads the counts, finds by a prefix sum which group and tile of it
it holds, and returns at once past the last group's tiles. dw has one program per (M, K) tile and
group, walking that group's rows. Rows past ``sum(counts)`` are neither read nor written, and the
kernels clamp the groups to N, so counts summing past N read nothing out of bounds (the sum is
not checked on the Triton path: that would be a host sync). fp32 accumulation (fp32 inputs in
full precision, no TF32), results in x's dtype; x, w and dy are made contiguous.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .dispatch import impl_for
from .launch import check_float, checked_grid, interpreting, tile_coords


@triton.jit
def _dot(a, b, acc, FP32: tl.constexpr):
    """``acc + a @ b``, fp32 products and sums (no TF32). ``FP32`` upcasts a and b first: the
    interpreter's tl.dot multiplies bf16 as its raw uint16 bits."""
    if FP32:
        a, b = a.to(tl.float32), b.to(tl.float32)
    return tl.dot(a, b, acc, input_precision="ieee")


@triton.jit
def _group_tile(counts_ptr, N, G, BLOCK_M: tl.constexpr, BLOCK_G: tl.constexpr):
    """(group, first row, end row) of this program's tile of BLOCK_M rows (grid axis 0 numbers
    the tiles group after group); group is G past the last group's tiles."""
    t = tl.program_id(0)
    gs = tl.arange(0, BLOCK_G)
    c = tl.load(counts_ptr + gs, mask=gs < G, other=0)
    tiles = tl.cdiv(c, BLOCK_M)
    tile_end = tl.cumsum(tiles, 0)
    g = tl.sum((tile_end <= t).to(tl.int32), 0)
    mine = gs == g
    row_end = tl.sum(tl.where(mine, tl.cumsum(c, 0), 0), 0)
    first = row_end - tl.sum(tl.where(mine, c, 0), 0)
    first += (t - tl.sum(tl.where(mine, tile_end - tiles, 0), 0)) * BLOCK_M
    return g, tl.minimum(first, N), tl.minimum(row_end, N)


@triton.jit
def _grouped_mm_kernel(
    a_ptr, w_ptr, c_ptr, counts_ptr,      # a (N, K); w (G, M, K) if W_T else (G, K, M); c (N, M)
    N, K, M, G,                           # rows, inner dim, output columns, groups
    W_T: tl.constexpr,                    # c_g = a_g @ w[g]^T (forward), else a_g @ w[g] (dx)
    FP32: tl.constexpr,                   # upcast before tl.dot (the interpreter)
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_G: tl.constexpr,
):
    g, first, end = _group_tile(counts_ptr, N, G, BLOCK_M, BLOCK_G)
    if g >= G:                            # the grid's spare tiles
        return
    rows = first + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    row_ok, col_ok = rows < end, cols < M
    r64 = rows.to(tl.int64)
    a_ptrs = a_ptr + r64[:, None] * K + ks[None, :]                   # (BLOCK_M, BLOCK_K)
    w_g = w_ptr + g.to(tl.int64) * M * K
    if W_T:                                                          # (BLOCK_K, BLOCK_N) of w[g]^T
        w_ptrs = w_g + cols.to(tl.int64)[None, :] * K + ks[:, None]
        w_step = BLOCK_K
    else:
        w_ptrs = w_g + ks.to(tl.int64)[:, None] * M + cols[None, :]
        w_step = BLOCK_K * M
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = k0 + ks < K
        a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(w_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        acc = _dot(a, b, acc, FP32)
        a_ptrs += BLOCK_K
        w_ptrs += w_step
    tl.store(c_ptr + r64[:, None] * M + cols[None, :], acc.to(c_ptr.dtype.element_ty),
             mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _grouped_mm_dw_kernel(
    dy_ptr, x_ptr, dw_ptr, counts_ptr,    # dy (N, M); x (N, K); dw (G, M, K); counts (G,)
    N, K, M, G,
    FP32: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_G: tl.constexpr,
):
    pid_m, pid_k = tile_coords(K, BLOCK_N)          # (M, K) tiles on axis 0, the group on axis 1
    g = tl.program_id(1)
    gs = tl.arange(0, BLOCK_G)
    c = tl.load(counts_ptr + gs, mask=gs <= g, other=0)
    row_end = tl.sum(c, 0)
    first = tl.minimum(row_end - tl.sum(tl.where(gs == g, c, 0), 0), N)
    row_end = tl.minimum(row_end, N)
    ms = pid_m * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = pid_k * BLOCK_N + tl.arange(0, BLOCK_N)
    rs = tl.arange(0, BLOCK_R)
    m_ok, k_ok = ms < M, ks < K
    acc = tl.zeros((BLOCK_N, BLOCK_N), dtype=tl.float32)
    for r0 in range(first, row_end, BLOCK_R):
        r = r0 + rs
        r_ok = r < row_end
        r64 = r.to(tl.int64)
        dyt = tl.load(dy_ptr + r64[None, :] * M + ms[:, None], mask=m_ok[:, None] & r_ok[None, :],
                      other=0.0)                                     # (BLOCK_N, BLOCK_R) of dy^T
        x = tl.load(x_ptr + r64[:, None] * K + ks[None, :], mask=r_ok[:, None] & k_ok[None, :],
                    other=0.0)
        acc = _dot(dyt, x, acc, FP32)
    out = dw_ptr + g.to(tl.int64) * M * K + ms.to(tl.int64)[:, None] * K + ks[None, :]
    tl.store(out, acc.to(dw_ptr.dtype.element_ty), mask=m_ok[:, None] & k_ok[None, :])


def blocks(dtype: torch.dtype) -> tuple[int, int, int, int, int]:
    """``(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages)``: row tiles of BLOCK_M, output tiles
    BLOCK_N wide, BLOCK_K of the inner dim a step (dw: BLOCK_N x BLOCK_N tiles, BLOCK_K rows a
    step). Small under the interpreter, so small tests still span several tiles and steps."""
    if interpreting():
        return 16, 32, 32, 4, 1
    return 128, 128, 64 if dtype.itemsize == 2 else 32, 8, 3


def _check(x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor) -> None:
    if (x.dim() != 2 or w.dim() != 3 or x.shape[1] != w.shape[2] or x.dtype != w.dtype
            or counts.shape != w.shape[:1] or counts.dtype not in (torch.int32, torch.int64)
            or counts.device != x.device):
        raise ValueError(
            f"grouped_mm: needs x (N, K), w (G, M, K) of one dtype and counts (G,) int64 (or "
            f"int32) on x's device; got x {tuple(x.shape)} {x.dtype}, w {tuple(w.shape)} "
            f"{w.dtype}, counts {tuple(counts.shape)} {counts.dtype} on {counts.device} (x on "
            f"{x.device})")


def _mm(a: torch.Tensor, w: torch.Tensor, counts: torch.Tensor, M: int, w_t: bool):
    """(N, M) = per group a_g @ w[g]^T (``w_t``) or a_g @ w[g]."""
    a, w, counts = a.contiguous(), w.contiguous(), counts.to(torch.int64).contiguous()
    (N, K), G = a.shape, w.shape[0]
    c = torch.empty((N, M), dtype=a.dtype, device=a.device)
    if N and M and G:
        BM, BN, BK, warps, stages = blocks(a.dtype)
        grid = checked_grid("grouped_mm", triton.cdiv(N, BM) + G, triton.cdiv(M, BN))
        _grouped_mm_kernel[grid](a, w, c, counts, N, K, M, G, W_T=w_t,
                                 FP32=interpreting(), BLOCK_M=BM, BLOCK_N=BN, BLOCK_K=BK,
                                 BLOCK_G=triton.next_power_of_2(G),
                                 num_warps=warps, num_stages=stages)
    return c


def grouped_mm_forward(x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """``y`` (N, M) in x's dtype: per group ``x_g @ w[g]^T``."""
    _check(x, w, counts)
    check_float("grouped_mm", x=x, w=w)
    return _mm(x, w, counts, w.shape[1], True)


def grouped_mm_backward(dy: torch.Tensor, x: torch.Tensor, w: torch.Tensor,
                        counts: torch.Tensor, need_dx: bool = True, need_dw: bool = True):
    """``(dx, dw)`` for upstream ``dy`` (N, M); None for one not needed."""
    dy = dy.contiguous()
    dx = _mm(dy, w, counts, x.shape[1], False) if need_dx else None
    if not need_dw:
        return dx, None
    x, counts = x.contiguous(), counts.to(torch.int64).contiguous()
    (N, K), (G, M) = x.shape, w.shape[:2]
    dw = torch.empty((G, M, K), dtype=w.dtype, device=w.device)
    if dw.numel():
        _, BN, BK, warps, stages = blocks(x.dtype)
        grid = checked_grid("grouped_mm", triton.cdiv(M, BN) * triton.cdiv(K, BN), G)
        _grouped_mm_dw_kernel[grid](dy, x, dw, counts, N, K, M, G,
                                    FP32=interpreting(), BLOCK_N=BN, BLOCK_R=BK,
                                    BLOCK_G=triton.next_power_of_2(G), num_warps=warps,
                                    num_stages=stages)
    return dx, dw


class GroupedMMFunction(torch.autograd.Function):
    """The grouped GEMM with the Triton kernels; saves x, w and counts."""

    @staticmethod
    def forward(ctx, x, w, counts):
        ctx.save_for_backward(x, w, counts)
        return grouped_mm_forward(x, w, counts)

    @staticmethod
    def backward(ctx, dy):
        x, w, counts = ctx.saved_tensors
        return (*grouped_mm_backward(dy, x, w, counts, *ctx.needs_input_grad[:2]), None)


def grouped_mm_reference(x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """The same math in torch, one F.linear per group (reads counts on the host): fp32
    arithmetic (fp64 stays fp64), result in x's dtype."""
    sizes = counts.tolist()
    if sum(sizes) != x.shape[0] or min(sizes, default=0) < 0:
        raise ValueError(f"grouped_mm: counts {sizes} must be >= 0 and sum to x's {x.shape[0]} "
                         "rows")
    ct = torch.promote_types(x.dtype, torch.float32)
    ys = [F.linear(xg, w[g].to(ct)) for g, xg in enumerate(x.to(ct).split(sizes))]
    return torch.cat([x.new_zeros((0, w.shape[1]), dtype=ct), *ys]).to(x.dtype)


def grouped_mm(x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """``y`` (N, M): rows of x (N, K) sorted by group, ``counts[g]`` of them for group g, each
    times its group's ``w[g]^T`` (w (G, M, K)); Triton on CUDA (see
    :func:`fastpar.kernels.impl_for`), the torch reference elsewhere."""
    _check(x, w, counts)
    if impl_for(x, w, counts) == "triton":
        return GroupedMMFunction.apply(x, w, counts)
    return grouped_mm_reference(x, w, counts)
