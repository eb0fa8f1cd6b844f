"""fastpar.kernels.swiglu: the Triton kernels (interpreted on CPU) against float64."""
import pytest
import torch

from fastpar.kernels import swiglu
from kernel_testing import assert_close, leaf64, poisoned_outputs, randn, triton_path

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
SHAPES = [(1, 1), (3, 127), (9, 1000), (2, 5, 1030), (4, 75, 24)]


def reference(gate, up):
    """silu(gate) * up in float64."""
    return gate * torch.sigmoid(gate) * up


@pytest.fixture(autouse=True)
def _triton(monkeypatch):
    with triton_path(monkeypatch):
        yield


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES)
def test_forward_and_gradients_match_float64(shape, dtype):
    torch.manual_seed(0)
    gate = randn(*shape, dtype=dtype, scale=4.0, requires_grad=True)
    up = randn(*shape, dtype=dtype, strided=True, requires_grad=True)
    dy = randn(*shape, dtype=dtype)
    with poisoned_outputs():
        y = swiglu(gate, up)
        y.backward(dy)
    g64, u64 = leaf64(gate), leaf64(up)
    y64 = reference(g64, u64)
    y64.backward(dy.double())
    assert y.dtype == dtype and y.shape == gate.shape
    assert_close(y, y64, dtype, "y")
    assert_close(gate.grad, g64.grad, dtype, "dgate")
    assert_close(up.grad, u64.grad, dtype, "dup")


def test_halves_of_one_fused_projection_need_no_copy():
    # gate and up are strided views of one (T, 2F) tensor, as after a fused up-projection.
    torch.manual_seed(1)
    h = randn(9, 2 * 77, dtype=torch.float32, scale=3.0, requires_grad=True)
    y = swiglu(h[:, :77], h[:, 77:])
    y.sum().backward()
    h64 = leaf64(h)
    reference(h64[:, :77], h64[:, 77:]).sum().backward()
    assert_close(y, reference(h64[:, :77], h64[:, 77:]), torch.float32, "y")
    assert_close(h.grad, h64.grad, torch.float32, "dh")


def test_extreme_gates_stay_finite():
    gate = torch.tensor([[-1e4, -80.0, 0.0, 80.0, 1e4, 3e38]], dtype=torch.float32)
    up = torch.ones_like(gate)
    y = swiglu(gate, up)
    assert_close(y, reference(gate.double(), up.double()), torch.float32)


def test_torch_path_is_the_same_math(monkeypatch):
    g, u = randn(5, 33, dtype=torch.float32), randn(5, 33, dtype=torch.float32)
    monkeypatch.setenv("FASTPAR_KERNEL_IMPL", "torch")
    assert_close(swiglu(g, u), reference(g.double(), u.double()), torch.float32)


def test_shape_mismatch_is_one_clear_error():
    with pytest.raises(ValueError, match="must have one shape"):
        swiglu(torch.randn(4, 8), torch.randn(4, 7))
