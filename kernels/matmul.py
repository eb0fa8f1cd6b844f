"""Matmul with a fused epilogue: ``c = act(a @ b + bias) + residual``, forward and backward.

What it is for today: a standalone fused GEMM + epilogue op, checked by
tests/test_kernel_matmul.py and benchmarked by bench/bench_kernels.py against cuBLAS, cuBLAS with
the epilogue in eager torch, and torch.compile. The model does not call it: its linears are
``F.linear`` or the extension's GEMM <-> collective pipelines
(fastpar/tensor_parallel/overlap.py), and their bias epilogues are ``bias_gelu`` and
``bias_dropout_add``.

a (..., K), b (K, N), bias (N,), residual (..., N); ``act`` is None, ``"gelu"`` (tanh
approximation) or ``"silu"``. Each program computes one (BLOCK_M, BLOCK_N) tile of c with fp32
accumulation (``tl.dot``), then applies the epilogue in registers before the single store, so the
pre-activation never makes a round trip through memory unless the backward needs it.

Tile order: programs are numbered so that row chunks of ``GROUP_M * BLOCK_M`` rows are issued in
order, and within a chunk the tiles go down its columns, so the chunk's A rows stay in L2 while B
is streamed (the grouped ordering of the Triton tutorial).

Backward, with ``z = a @ b + bias`` (stored in c's dtype when an activation is used):

    dz = dc * act'(z)          (``_matmul_bwd_kernel``, which also reduces dbias = sum_rows dz)
    da = dz @ b^T,  db = a^T @ dz,  dresidual = dc

da and db reuse the forward kernel on transposed views (no copies). fp32 inputs use IEEE fp32
products unless torch allows TF32 (``torch.backends.cuda.matmul.allow_tf32``). Reference: Triton
tutorial ``03-matrix-multiplication.py``.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .bias_gelu import _gelu_tanh, _gelu_tanh_grad
from .dispatch import impl_for
from .launch import (check_float, checked_grid, elementwise_blocks, interpreting,
                     reduction_programs, rows)
from .swiglu import _silu, _silu_grad

ACTIVATIONS = {None: 0, "gelu": 1, "silu": 2}


@triton.jit
def _tile_coords(pid, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    """(pid_m, pid_n) of program ``pid``: row chunks of GROUP_M tile rows in order, and inside a
    chunk down each column of tiles before moving right."""
    tiles_per_chunk = GROUP_M * num_pid_n
    chunk = pid // tiles_per_chunk
    first_m = chunk * GROUP_M
    chunk_rows = tl.minimum(num_pid_m - first_m, GROUP_M)      # the last chunk may be short
    within = pid % tiles_per_chunk
    return first_m + within % chunk_rows, within // chunk_rows


def _configs():
    """Tile configs: one under the interpreter (which cannot autotune); on a GPU a small one for
    small problems and a few large ones (Hopper-sized) that the autotuner picks from."""
    small = triton.Config({"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 32, "GROUP_M": 8},
                          num_warps=4, num_stages=3)
    if interpreting():
        return [small]
    big = [(128, 256, 64, 8, 3), (256, 128, 64, 8, 3), (128, 128, 64, 8, 4), (128, 128, 64, 4, 4),
           (128, 64, 32, 4, 4)]
    return [small] + [triton.Config({"BLOCK_M": m, "BLOCK_N": n, "BLOCK_K": k, "GROUP_M": 8},
                                    num_warps=w, num_stages=s) for m, n, k, w, s in big]


def _prune(configs, named_args, **kwargs):
    """The small config alone below ~1 GFLOP (no autotuning cost); else the large ones, those
    with 64-wide K steps only for 16-bit inputs (fp32 tiles would not fit shared memory)."""
    if len(configs) == 1:
        return configs
    M, N, K = named_args["M"], named_args["N"], named_args["K"]
    if M * N * K < (1 << 30):
        return configs[:1]
    wide = named_args["a_ptr"].element_size() == 2
    return [c for c in configs[1:] if wide or c.kwargs["BLOCK_K"] == 32]


@triton.autotune(configs=_configs(), key=["M", "N", "K"],
                 prune_configs_by={"early_config_prune": _prune})
@triton.jit
def _matmul_fwd_kernel(
    a_ptr, b_ptr, bias_ptr, res_ptr,      # a (M, K), b (K, N), bias (N,), residual (M, N)
    c_ptr, pre_ptr,                       # c (M, N); pre-activation z (M, N), both contiguous
    M, N, K,                              # sizes
    stride_am, stride_ak,                 # strides of a, b, residual: any layout
    stride_bk, stride_bn,
    stride_rm, stride_rn,
    HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr,       # 0 none, 1 gelu (tanh), 2 silu
    HAS_RESIDUAL: tl.constexpr, STORE_PRE: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,                          # fp32 inputs: "ieee" or "tf32"
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    pid_m, pid_n = _tile_coords(tl.program_id(0), tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N),
                                GROUP_M)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    # Ragged rows/columns wrap around (rm % M) so the loads need no M/N mask; they are never
    # stored. Only the last K step is masked.
    am = (rm % M).to(tl.int64)
    bn = (rn % N).to(tl.int64)
    a_tile = a_ptr + am[:, None] * stride_am + rk[None, :] * stride_ak
    b_tile = b_ptr + rk[:, None] * stride_bk + bn[None, :] * stride_bn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        k_left = K - k * BLOCK_K
        a = tl.load(a_tile, mask=rk[None, :] < k_left, other=0.0)
        b = tl.load(b_tile, mask=rk[:, None] < k_left, other=0.0)
        acc = tl.dot(a, b, acc, input_precision=INPUT_PRECISION)
        a_tile += BLOCK_K * stride_ak
        b_tile += BLOCK_K * stride_bk
    # Epilogue in fp32 registers.
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    mask = (rm < M)[:, None] & (rn < N)[None, :]
    out = rm.to(tl.int64)[:, None] * N + rn[None, :]
    if STORE_PRE:
        tl.store(pre_ptr + out, acc.to(pre_ptr.dtype.element_ty), mask=mask)
    if ACTIVATION == 1:
        acc = _gelu_tanh(acc)
    elif ACTIVATION == 2:
        acc = _silu(acc)
    if HAS_RESIDUAL:
        res = res_ptr + rm.to(tl.int64)[:, None] * stride_rm + rn[None, :] * stride_rn
        acc += tl.load(res, mask=mask, other=0.0).to(tl.float32)
    tl.store(c_ptr + out, acc.to(c_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _matmul_bwd_kernel(
    dc_ptr, pre_ptr,                      # dc (M, N) with row stride; pre-activation z (M, N)
    dz_ptr, db_part_ptr,                  # dz (M, N) contiguous; dbias partials (programs, N)
    M, N,                                 # sizes
    stride_dc,                            # row stride of dc (its last dim is contiguous)
    ACTIVATION: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    pid = tl.program_id(1)                # reduction program; column blocks on axis 0
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    db = tl.zeros((BLOCK_N,), dtype=tl.float32)
    # Program (j, p) owns row blocks p, p + P, ... of column block j and sums their dbias.
    for start in range(pid * BLOCK_M, M, tl.num_programs(1) * BLOCK_M):
        rows = start + tl.arange(0, BLOCK_M)
        mask = (rows < M)[:, None] & col_ok[None, :]
        r64 = rows.to(tl.int64)[:, None]
        dz = tl.load(dc_ptr + r64 * stride_dc + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        if ACTIVATION != 0:
            z = tl.load(pre_ptr + r64 * N + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            if ACTIVATION == 1:
                dz = dz * _gelu_tanh_grad(z)
            else:
                dz = dz * _silu_grad(z)
            tl.store(dz_ptr + r64 * N + cols[None, :], dz.to(dz_ptr.dtype.element_ty), mask=mask)
        db += tl.sum(dz, axis=0)
    if HAS_BIAS:
        tl.store(db_part_ptr + pid.to(tl.int64) * N + cols, db, mask=col_ok)


def _check(a, b, bias, activation, residual):
    check_float("matmul", a=a, b=b, bias=bias, residual=residual)
    if activation not in ACTIVATIONS:
        raise ValueError(f"matmul: activation={activation!r} must be one of {list(ACTIVATIONS)}")
    if a.dim() < 1 or b.dim() != 2 or a.shape[-1] != b.shape[0]:
        raise ValueError(f"matmul: a {tuple(a.shape)} and b {tuple(b.shape)} must be (..., K) "
                         "and (K, N)")
    if a.dtype != b.dtype:
        raise ValueError(f"matmul: a ({a.dtype}) and b ({b.dtype}) must have one dtype")
    out = (*a.shape[:-1], b.shape[1])
    if bias is not None and bias.shape != out[-1:]:
        raise ValueError(f"matmul: bias {tuple(bias.shape)} must be ({out[-1]},)")
    if residual is not None and residual.shape != out:
        raise ValueError(f"matmul: residual {tuple(residual.shape)} must be the output's {out}")


def matmul_forward(a, b, bias=None, activation=None, residual=None, store_pre=False):
    """``(c, pre)``: c = act(a @ b + bias) + residual (contiguous, a's dtype) and, with
    ``store_pre``, the pre-activation ``a @ b + bias`` (M, N) in a's dtype (else None)."""
    _check(a, b, bias, activation, residual)
    a2 = a.reshape(-1, a.shape[-1])
    M, K = a2.shape
    N = b.shape[1]
    c = torch.empty((M, N), dtype=a.dtype, device=a.device)
    pre = torch.empty((M, N), dtype=a.dtype, device=a.device) if store_pre else None
    r2 = None if residual is None else residual.reshape(M, N)
    if M and N:
        if K == 0:
            a2, b, K = torch.zeros((M, 1), dtype=a.dtype, device=a.device), \
                torch.zeros((1, N), dtype=b.dtype, device=b.device), 1
        # "ieee" only for fp32 without TF32: for 16-bit inputs it would turn off tensor cores.
        ieee = a.dtype == torch.float32 and not torch.backends.cuda.matmul.allow_tf32
        grid = lambda meta: checked_grid(
            "matmul", triton.cdiv(M, meta["BLOCK_M"]) * triton.cdiv(N, meta["BLOCK_N"]))
        _matmul_fwd_kernel[grid](
            a2, b, c if bias is None else bias, c if r2 is None else r2, c,
            c if pre is None else pre, M, N, K, *a2.stride(), *b.stride(),
            *((0, 0) if r2 is None else r2.stride()),
            HAS_BIAS=bias is not None, ACTIVATION=ACTIVATIONS[activation],
            HAS_RESIDUAL=r2 is not None, STORE_PRE=store_pre,
            INPUT_PRECISION="ieee" if ieee else "tf32")
    return c.view(*a.shape[:-1], N), pre


def matmul_backward(dc, a, b, pre, activation, has_bias, needs_a=True, needs_b=True):
    """``(da, db, dbias)`` for upstream ``dc``; each is None when not needed (dbias is fp32)."""
    N = b.shape[1]
    dc2 = rows(dc.reshape(-1, N))
    M = dc2.shape[0]
    dz, dbias = dc2, None
    if activation is not None or has_bias:
        if activation is not None:
            dz = torch.empty((M, N), dtype=a.dtype, device=a.device)
        BLOCK_M, BLOCK_N, warps = elementwise_blocks(max(N, 1))
        programs = reduction_programs(a.device, triton.cdiv(M, BLOCK_M))
        db_part = torch.empty((programs, N), dtype=torch.float32, device=a.device)
        if M and N:
            _matmul_bwd_kernel[checked_grid("matmul", triton.cdiv(N, BLOCK_N), programs)](
                dc2, dc2 if pre is None else pre, dz, db_part, M, N, dc2.stride(0) if M > 1 else N,
                ACTIVATION=ACTIVATIONS[activation], HAS_BIAS=has_bias,
                BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, num_warps=warps)
        else:
            db_part.zero_()
        dbias = db_part.sum(0) if has_bias else None
    dz = dz.to(a.dtype)
    da = matmul_forward(dz, b.t())[0].view(a.shape) if needs_a else None
    db = matmul_forward(a.reshape(-1, a.shape[-1]).t(), dz)[0] if needs_b else None
    return da, db, dbias


class MatmulFunction(torch.autograd.Function):
    """Matmul + epilogue with the Triton kernels; saves a, b and (with an activation) the
    pre-activation z."""

    @staticmethod
    def forward(ctx, a, b, bias, activation, residual):
        store_pre = activation is not None and any(ctx.needs_input_grad[:3])
        c, pre = matmul_forward(a, b, bias, activation, residual, store_pre)
        ctx.save_for_backward(a, b, pre)
        ctx.activation = activation
        ctx.dtypes = (None if bias is None else bias.dtype,
                      None if residual is None else residual.dtype)
        return c

    @staticmethod
    def backward(ctx, dc):
        a, b, pre = ctx.saved_tensors
        bias_dtype, res_dtype = ctx.dtypes
        need_a, need_b, need_bias, _, need_res = ctx.needs_input_grad
        da, db, dbias = matmul_backward(dc, a, b, pre, ctx.activation, need_bias, need_a, need_b)
        dbias = None if dbias is None else dbias.to(bias_dtype)
        dres = dc.to(res_dtype) if need_res else None
        return da, db, dbias, None, dres


def matmul_reference(a, b, bias=None, activation=None, residual=None):
    """The same math in torch: fp32 products and epilogue (fp64 stays fp64), result in a's
    dtype."""
    ct = torch.promote_types(a.dtype, torch.float32)
    z = a.to(ct) @ b.to(ct)
    if bias is not None:
        z = z + bias.to(ct)
    if activation == "gelu":
        z = torch.nn.functional.gelu(z, approximate="tanh")
    elif activation == "silu":
        z = torch.nn.functional.silu(z)
    if residual is not None:
        z = z + residual.to(ct)
    return z.to(a.dtype)


def matmul(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None,
           activation: str | None = None, residual: torch.Tensor | None = None) -> torch.Tensor:
    """``act(a @ b + bias) + residual`` for a (..., K), b (K, N) (any strides: pass
    ``weight.t()`` for an nn.Linear weight), bias (N,), residual (..., N); ``activation`` is
    None, ``"gelu"`` (tanh approximation) or ``"silu"``. Triton on CUDA (see
    :func:`fastpar.kernels.impl_for`), the torch reference elsewhere."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"matmul: activation={activation!r} must be one of {list(ACTIVATIONS)}")
    tensors = [t for t in (a, b, bias, residual) if t is not None]
    if impl_for(*tensors) == "triton":
        return MatmulFunction.apply(a, b, bias, activation, residual)
    return matmul_reference(a, b, bias, activation, residual)
