"""fastpar.kernels.bias_gelu: the Triton kernels (interpreted on CPU) against float64."""
import math

import pytest
import torch

from fastpar.kernels import bias_gelu
from kernel_testing import assert_close, leaf64, poisoned_outputs, randn, triton_path

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# (shape, strided rows, with bias, approximate); 1030 columns span two column blocks; 300 narrow
# rows make each backward program fold several row blocks into its db partial.
CASES = [((1, 1), False, True, "tanh"), ((3, 127), True, True, "none"),
         ((9, 1000), False, True, "tanh"), ((2, 5, 1030), True, False, "tanh"),
         ((4, 75, 24), True, True, "tanh")]


def reference(x, b, approximate):
    """gelu(x + b) in float64, written out from its definition."""
    z = x if b is None else x + b
    if approximate == "tanh":
        return 0.5 * z * (1 + torch.tanh(math.sqrt(2 / math.pi) * (z + 0.044715 * z**3)))
    return 0.5 * z * (1 + torch.erf(z / math.sqrt(2)))


@pytest.fixture(autouse=True)
def _triton(monkeypatch):
    with triton_path(monkeypatch):
        yield


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape,strided,with_bias,approximate", CASES)
def test_forward_and_gradients_match_float64(shape, strided, with_bias, approximate, dtype):
    torch.manual_seed(0)
    x = randn(*shape, dtype=dtype, strided=strided, scale=3.0, requires_grad=True)
    b = randn(shape[-1], dtype=dtype, requires_grad=True) if with_bias else None
    dy = randn(*shape, dtype=dtype)
    with poisoned_outputs():
        y = bias_gelu(x, b, approximate=approximate)
        y.backward(dy)
    x64 = leaf64(x)
    b64 = leaf64(b) if with_bias else None
    y64 = reference(x64, b64, approximate)
    y64.backward(dy.double())
    assert y.dtype == dtype and y.shape == x.shape
    assert_close(y, y64, dtype, "y")
    assert_close(x.grad, x64.grad, dtype, "dx")
    if with_bias:
        assert b.grad.dtype == dtype
        assert_close(b.grad, b64.grad, dtype, "db")


@pytest.mark.parametrize("approximate", ["tanh", "none"])
def test_extreme_inputs_stay_finite(approximate):
    x = torch.tensor([[-1e4, -30.0, -1e-6, 0.0, 1e-6, 30.0, 1e4]], dtype=torch.float32,
                     requires_grad=True)
    y = bias_gelu(x, None, approximate)
    y.sum().backward()
    x64 = leaf64(x)
    reference(x64, None, approximate).sum().backward()
    assert_close(y, reference(x64, None, approximate), torch.float32, "y")
    assert_close(x.grad, x64.grad, torch.float32, "dx")


def test_torch_path_is_the_same_math(monkeypatch):
    x, b = randn(5, 33, dtype=torch.float32), randn(33, dtype=torch.float32)
    monkeypatch.setenv("FASTPAR_KERNEL_IMPL", "torch")
    for approximate in ("tanh", "none"):
        assert_close(bias_gelu(x, b, approximate), reference(x.double(), b.double(), approximate),
                     torch.float32)


def test_bad_arguments_are_one_clear_error():
    with pytest.raises(ValueError, match="approximate='erf'"):
        bias_gelu(torch.randn(4, 8), None, approximate="erf")
    with pytest.raises(ValueError, match="last dim of x"):
        bias_gelu(torch.randn(4, 8), torch.randn(7))
