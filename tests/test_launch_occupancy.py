"""The norm backwards' launch on an H100 / H200 (132 SMs), from the launcher's arithmetic alone:
several programs per SM for the weight-gradient partial sums where the rows allow, inside CUDA's
grid limits and the kernels' int32 row indices at any row count; and the same weight gradient
whatever the number of programs (within fp32 reassociation).

The launchers run on meta tensors with GPU block sizes and each kernel replaced by a recorder of
its grid and arguments (no GPU, no memory); the numbers run under the Triton interpreter."""
import importlib

import pytest
import torch

from fastpar.kernels import launch
from kernel_testing import assert_close, randn, triton_path

# The op modules (fastpar.kernels.<op> as an attribute is the op's function).
rms_norm_mod = importlib.import_module("fastpar.kernels.rms_norm")
layer_norm_mod = importlib.import_module("fastpar.kernels.layer_norm")

SMS = 132                                  # H100 / H200 SXM
WIDTHS = (16, 2048, 4096, 8192, 16384)     # 16384: rows walked in column chunks
# Row counts up to the int32 edge: 2^31 - 1600 leaves room for only 100 steps of 16 rows.
ROWS = (1, 5, 263, 8192, 70000, 2**20, 2**25, 2**31 - 16000, 2**31 - 1600)


@pytest.fixture
def gpu_blocks(monkeypatch):
    """Block sizes as on a GPU (not the interpreter's larger tiles)."""
    monkeypatch.setattr(launch, "interpreting", lambda: False)


@pytest.mark.parametrize("N", WIDTHS)
def test_reduction_grid_fills_every_sm_at_any_row_count(gpu_blocks, N):
    BLOCK_M = launch.row_blocks(N)[0]
    for M in ROWS:
        P = launch.row_reduction_programs("rms_norm", M, BLOCK_M, SMS)
        blocks = -(-M // BLOCK_M)
        where = f"M={M}, N={N}, BLOCK_M={BLOCK_M}: {P} programs"
        assert 1 <= P <= blocks, where                       # no program without rows
        int32_room = (2**31 - M) // BLOCK_M                  # programs the row loop allows
        if min(blocks, int32_room) >= 2 * SMS:
            assert P >= 2 * SMS, where                       # at least two per SM
        assert P <= launch.ROW_REDUCTION_PROGRAMS_PER_SM * SMS, where   # (P, N) partials bounded
        assert launch.checked_grid("rms_norm", P) == (P,)
        assert M - 1 + P * BLOCK_M <= launch.INT32_MAX, where   # the row loop's last step
        fwd = launch.row_grid("rms_norm", M, BLOCK_M)
        assert fwd == (blocks,) and (fwd[0] - 1) * BLOCK_M + BLOCK_M - 1 <= launch.INT32_MAX


def test_near_int32_rows_shrink_the_grid_and_past_it_one_clear_error():
    # 100 blocks of 16 below 2^31: the loop step may be at most 100 blocks.
    assert launch.row_reduction_programs("rms_norm", 2**31 - 1600, 16, SMS) == 100
    assert launch.row_reduction_programs("rms_norm", 2**31 - 16, 16, SMS) == 1
    with pytest.raises(ValueError, match=r"layer_norm: 2147483633 rows exceed the row kernels' "
                                         r"int32 row index \(at most 2147483632 rows"):
        launch.row_reduction_programs("layer_norm", 2**31 - 15, 16, SMS)
    with pytest.raises(ValueError, match="rms_norm: 2147483648 rows exceed"):
        launch.row_grid("rms_norm", 2**31, 1)
    with pytest.raises(ValueError, match="got M=8, BLOCK_M=1, sms=0, per_sm=4"):
        launch.row_reduction_programs("rms_norm", 8, 1, 0)


class _Recorder:
    """Stands in for a JIT kernel: records ``(grid, args)`` of ``kernel[grid](*args)``."""

    def __init__(self, log):
        self.log = log

    def __getitem__(self, grid):
        return lambda *args, **meta: self.log.append((tuple(grid), args))


def _meta(*shape, dtype=torch.bfloat16):
    return torch.empty(shape, dtype=dtype, device="meta")


@pytest.fixture
def launches(gpu_blocks, monkeypatch):
    """Every norm kernel launch, with the launchers seeing 132 SMs."""
    log = []
    for mod in (rms_norm_mod, layer_norm_mod):
        monkeypatch.setattr(mod, "sm_count", lambda device: SMS)
        for name in dir(mod):
            if name.startswith("_") and name.endswith("_kernel"):
                monkeypatch.setattr(mod, name, _Recorder(log))
    return log


@pytest.mark.parametrize("M,N", [(8192, 4096), (8192, 16384), (2**25, 16), (100, 8192),
                                 (2**31 - 1600, 16)])
def test_norm_backward_launchers_use_the_grid_and_size_the_partials_by_it(launches, M, N):
    x, w = _meta(M, N), _meta(N)
    stats = _meta(M, dtype=torch.float32)
    _, dw = rms_norm_mod.rms_norm_backward(x, x, w, stats)
    _, dw2, db = layer_norm_mod.layer_norm_backward(x, x, w, stats, stats)
    assert dw.shape == dw2.shape == db.shape == (N,)
    BLOCK_M = launch.row_blocks(N)[0]
    expected = launch.row_reduction_programs("norm", M, BLOCK_M, SMS)
    (rms_grid, rms_args), (ln_grid, ln_args) = launches
    assert rms_grid == ln_grid == (expected,), (rms_grid, ln_grid, expected)
    # Partial rows: rms_norm's dw (argument 5), layer_norm's dw and db (6, 7), one per program.
    for part in (rms_args[5], ln_args[6], ln_args[7]):
        assert part.dtype == torch.float32 and part.shape == (expected, N), part.shape
    if M == 8192:
        assert expected == launch.ROW_REDUCTION_PROGRAMS_PER_SM * SMS == 528


def test_norm_forward_launchers_refuse_rows_past_int32(launches):
    x, w = _meta(2**31, 16), _meta(16)
    with pytest.raises(ValueError, match="rms_norm: 2147483648 rows exceed"):
        rms_norm_mod.rms_norm_forward(x, w, 1e-6)
    with pytest.raises(ValueError, match="layer_norm: 2147483648 rows exceed"):
        layer_norm_mod.layer_norm_forward(x, w, None, 1e-5)
    assert launches == []


@pytest.mark.parametrize("N,chunk", [(24, None), (123, 32)])
def test_weight_gradients_do_not_depend_on_the_number_of_programs(monkeypatch, N, chunk):
    """dw, db from 1, 4 and 16 partial rows (1, 4, 16 programs over 300 rows in 19 blocks of
    16): equal within fp32 reassociation, and to float64."""
    if chunk:
        monkeypatch.setattr(launch, "ROW_CHUNK", chunk)        # rows in column chunks
    torch.manual_seed(0)
    with triton_path(monkeypatch):
        x, dy = randn(300, N, dtype=torch.float32), randn(300, N, dtype=torch.float32)
        w, b = randn(N, dtype=torch.float32), randn(N, dtype=torch.float32)
        _, rstd = rms_norm_mod.rms_norm_forward(x, w, 1e-6)
        _, mean, lrstd = layer_norm_mod.layer_norm_forward(x, w, b, 1e-5)
        grads, programs = [], []
        for per_sm in (1, 4, 16):
            monkeypatch.setattr(rms_norm_mod, "row_reduction_programs",
                                _counting(programs, per_sm))
            monkeypatch.setattr(layer_norm_mod, "row_reduction_programs",
                                _counting(programs, per_sm))
            _, dw = rms_norm_mod.rms_norm_backward(dy, x, w, rstd)
            _, ldw, ldb = layer_norm_mod.layer_norm_backward(dy, x, w, mean, lrstd)
            grads.append((dw, ldw, ldb))
    assert sorted(set(programs)) == [1, 4, 16], programs
    x64, dy64 = x.double(), dy.double()
    xhat = x64 * (x64.square().mean(-1, keepdim=True) + 1e-6).rsqrt()
    xc = x64 - x64.mean(-1, keepdim=True)
    lhat = xc * (xc.square().mean(-1, keepdim=True) + 1e-5).rsqrt()
    refs = ((dy64 * xhat).sum(0), (dy64 * lhat).sum(0), dy64.sum(0))
    for dw, ldw, ldb in grads:
        for got, ref, name in zip((dw, ldw, ldb), refs, ("rms dw", "ln dw", "ln db")):
            assert_close(got, ref, torch.float32, name, scale=4)
        for got, first in zip((dw, ldw, ldb), grads[0]):
            torch.testing.assert_close(got, first, rtol=1e-5, atol=1e-4)


def _counting(log, per_sm):
    """The real row_reduction_programs at ``per_sm`` programs of one SM (also on a GPU, whose
    SMs would give every row block its own program here), recording the programs it returns."""
    def programs(op, M, BLOCK_M, sms):
        p = launch.row_reduction_programs(op, M, BLOCK_M, 1, per_sm=per_sm)
        log.append(p)
        return p
    return programs
