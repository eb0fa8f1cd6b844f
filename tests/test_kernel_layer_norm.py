"""fastpar.kernels.layer_norm: the Triton kernels (interpreted on CPU) against float64."""
import pytest
import torch

from fastpar.kernels import launch, layer_norm
from kernel_testing import assert_close, leaf64, poisoned_outputs, randn, triton_path

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# (shape, strided rows, with bias); 300 narrow rows: each backward program folds several row
# blocks into its dw, db partials.
CASES = [((1, 1), False, True), ((3, 127), True, True), ((9, 1000), False, False),
         ((2, 5, 96), True, True), ((4, 75, 24), False, True)]
# Rows wider than launch.ROW_CHUNK, walked in column chunks: (shape, strided, with bias, chunk cap
# or None for the real one). 75 rows of 123 in chunks of 32: four chunks, the last ragged, and
# more row blocks than backward programs, so each program adds several row blocks into its
# partials in memory; 12288 is a genuinely wide row (two chunks at the real cap).
WIDE_CASES = [((75, 123), True, True, 32), ((3, 1000), False, False, 256),
              ((2, 12288), False, True, None)]


def reference(x, w, b, eps):
    """LayerNorm in float64."""
    mean = x.mean(-1, keepdim=True)
    var = (x - mean).pow(2).mean(-1, keepdim=True)
    y = (x - mean) / (var + eps).sqrt() * w
    return y if b is None else y + b


@pytest.fixture(autouse=True)
def _triton(monkeypatch):
    with triton_path(monkeypatch):
        yield


def _check_against_float64(shape, strided, with_bias, dtype):
    torch.manual_seed(0)
    n = shape[-1]
    x = randn(*shape, dtype=dtype, strided=strided, scale=2.0, requires_grad=True)
    x.data.add_(0.5)
    w = randn(n, dtype=dtype, requires_grad=True)
    b = randn(n, dtype=dtype, requires_grad=True) if with_bias else None
    dy = randn(*shape, dtype=dtype)
    with poisoned_outputs():
        y = layer_norm(x, w, b, eps=1e-5)
        y.backward(dy)
    x64, w64 = leaf64(x), leaf64(w)
    b64 = leaf64(b) if with_bias else None
    y64 = reference(x64, w64, b64, 1e-5)
    y64.backward(dy.double())
    assert y.dtype == dtype and y.shape == x.shape
    assert_close(y, y64, dtype, "y")
    assert_close(x.grad, x64.grad, dtype, "dx")
    assert_close(w.grad, w64.grad, dtype, "dw")
    if with_bias:
        assert b.grad.dtype == dtype
        assert_close(b.grad, b64.grad, dtype, "db")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape,strided,with_bias", CASES)
def test_forward_and_gradients_match_float64(shape, strided, with_bias, dtype):
    _check_against_float64(shape, strided, with_bias, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape,strided,with_bias,chunk", WIDE_CASES)
def test_wide_rows_in_column_chunks_match_float64(monkeypatch, shape, strided, with_bias, chunk,
                                                   dtype):
    if chunk is not None:
        monkeypatch.setattr(launch, "ROW_CHUNK", chunk)
    BLOCK_M, BLOCK_N, _, chunked = launch.row_blocks(shape[-1])
    assert chunked and BLOCK_N == launch.ROW_CHUNK < shape[-1]
    _check_against_float64(shape, strided, with_bias, dtype)


@pytest.mark.parametrize("chunk", [None, 64], ids=["whole_row", "chunked"])
def test_rows_with_a_large_offset_keep_their_precision(monkeypatch, chunk):
    # E[x^2] - E[x]^2 in fp32 would lose every digit of the variance here.
    if chunk is not None:
        monkeypatch.setattr(launch, "ROW_CHUNK", chunk)
    torch.manual_seed(2)
    x = (randn(6, 300, dtype=torch.float32) + 3000.0).requires_grad_()
    w = randn(300, dtype=torch.float32)
    y = layer_norm(x, w, None, eps=1e-5)
    x64 = leaf64(x)
    assert_close(y, reference(x64, w.double(), None, 1e-5), torch.float32, "y", scale=50)


def test_torch_path_is_the_same_math(monkeypatch):
    x, w, b = randn(5, 33, dtype=torch.float32), randn(33, dtype=torch.float32), \
        randn(33, dtype=torch.float32)
    monkeypatch.setenv("FASTPAR_KERNEL_IMPL", "torch")
    expected = reference(x.double(), w.double(), b.double(), 1e-5)
    assert_close(layer_norm(x, w, b), expected, torch.float32)


def test_bad_shapes_are_one_clear_error():
    with pytest.raises(ValueError, match="last dim of x"):
        layer_norm(torch.randn(4, 8), torch.randn(8), torch.randn(7))
