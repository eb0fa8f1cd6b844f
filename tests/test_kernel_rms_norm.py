"""fastpar.kernels.rms_norm: the Triton kernels (interpreted on CPU) against float64."""
import pytest
import torch

from fastpar.kernels import launch, rms_norm
from fastpar.kernels.rms_norm import rms_norm_reference
from kernel_testing import assert_close, leaf64, poisoned_outputs, randn, triton_path

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# (shape, strided rows): a single element, odd sizes, non-powers of two, 3-D, and 300 narrow
# rows, so each program of the backward folds several row blocks into its dw partial.
CASES = [((1, 1), False), ((3, 127), True), ((9, 1000), False), ((2, 5, 96), True),
         ((4, 75, 24), False)]
# Rows wider than launch.ROW_CHUNK, walked in column chunks: (shape, strided, chunk cap or None for
# the real one). 75 rows of 123 in chunks of 32: four chunks, the last ragged, and more row blocks
# than backward programs, so each program adds several row blocks into its dw partial in memory;
# 12288 is a genuinely wide row (two chunks at the real cap).
WIDE_CASES = [((75, 123), True, 32), ((3, 1000), False, 256), ((2, 12288), False, None)]


def reference(x, w, eps):
    """RMSNorm in float64."""
    return x * (x.pow(2).mean(-1, keepdim=True) + eps).rsqrt() * w


@pytest.fixture(autouse=True)
def _triton(monkeypatch):
    with triton_path(monkeypatch):
        yield


def _check_against_float64(shape, strided, dtype):
    torch.manual_seed(0)
    x = randn(*shape, dtype=dtype, strided=strided, scale=3.0, requires_grad=True)
    w = randn(shape[-1], dtype=dtype, requires_grad=True)
    dy = randn(*shape, dtype=dtype)
    with poisoned_outputs():
        y = rms_norm(x, w, eps=1e-6)
        y.backward(dy)
    x64, w64 = leaf64(x), leaf64(w)
    y64 = reference(x64, w64, 1e-6)
    y64.backward(dy.double())
    assert y.dtype == dtype and y.shape == x.shape
    assert_close(y, y64, dtype, "y")
    assert_close(x.grad, x64.grad, dtype, "dx")
    assert_close(w.grad, w64.grad, dtype, "dw")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape,strided", CASES)
def test_forward_and_gradients_match_float64(shape, strided, dtype):
    _check_against_float64(shape, strided, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape,strided,chunk", WIDE_CASES)
def test_wide_rows_in_column_chunks_match_float64(monkeypatch, shape, strided, chunk, dtype):
    if chunk is not None:
        monkeypatch.setattr(launch, "ROW_CHUNK", chunk)
    BLOCK_M, BLOCK_N, _, chunked = launch.row_blocks(shape[-1])
    assert chunked and BLOCK_N == launch.ROW_CHUNK < shape[-1]
    _check_against_float64(shape, strided, dtype)


def test_fp32_weight_with_bf16_input_and_transposed_input():
    torch.manual_seed(1)
    x = randn(40, 24, dtype=torch.bfloat16).t().requires_grad_()    # last dim strided
    w = randn(40, dtype=torch.float32, requires_grad=True)
    y = rms_norm(x, w)
    y.backward(torch.ones_like(y))
    x64, w64 = leaf64(x), leaf64(w)
    reference(x64, w64, 1e-6).backward(torch.ones_like(x64))
    assert y.dtype == torch.bfloat16 and w.grad.dtype == torch.float32
    assert_close(y, reference(x64, w64, 1e-6), torch.bfloat16, "y")
    assert_close(x.grad, x64.grad, torch.bfloat16, "dx")
    assert_close(w.grad, w64.grad, torch.float32, "dw", scale=4)


def test_torch_path_is_the_same_math(monkeypatch):
    x, w = randn(5, 33, dtype=torch.float32), randn(33, dtype=torch.float32)
    monkeypatch.setenv("FASTPAR_KERNEL_IMPL", "torch")
    assert_close(rms_norm(x, w), reference(x.double(), w.double(), 1e-6), torch.float32)
    assert rms_norm_reference(x.half(), w.half()).dtype == torch.float16


def test_bad_weight_shape_is_one_clear_error():
    with pytest.raises(ValueError, match="weight shape"):
        rms_norm(torch.randn(4, 8), torch.randn(7))
    with pytest.raises(ValueError, match="dtype torch.int64"):
        rms_norm(torch.ones(4, 8, dtype=torch.long), torch.randn(8))
