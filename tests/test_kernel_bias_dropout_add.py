"""fastpar.kernels.bias_dropout_add: the Triton kernels (interpreted on CPU) against float64,
and the dropout mask: its rate, and the same mask in forward, backward and recomputation."""
import pytest
import torch
from torch.utils.checkpoint import checkpoint

from fastpar.kernels import bias_dropout_add
from fastpar.kernels.bias_dropout_add import dropout_keep_mask, philox_uint32
from kernel_testing import assert_close, leaf64, poisoned_outputs, randn, triton_path

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# (shape, strided rows, with bias, p); 1030 columns span two column blocks; 300 narrow rows make
# each backward program fold several row blocks into its db partial.
CASES = [((1, 1), False, True, 0.5), ((3, 127), True, True, 0.1),
         ((9, 1000), False, False, 0.3), ((2, 5, 1030), True, True, 0.0),
         ((4, 75, 24), False, True, 0.2)]
SEED, OFFSET = 1234, 5000


def reference(x, b, residual, keep, p):
    """residual + keep * (x + b) / (1 - p) in float64, for a given keep-mask."""
    z = x if b is None else x + b
    return residual + z * keep / (1 - p)


@pytest.fixture(autouse=True)
def _triton(monkeypatch):
    with triton_path(monkeypatch):
        yield


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape,strided,with_bias,p", CASES)
def test_forward_and_gradients_match_float64(shape, strided, with_bias, p, dtype):
    torch.manual_seed(0)
    x = randn(*shape, dtype=dtype, strided=strided, requires_grad=True)
    b = randn(shape[-1], dtype=dtype, requires_grad=True) if with_bias else None
    r = randn(*shape, dtype=dtype, strided=not strided, requires_grad=True)
    dy = randn(*shape, dtype=dtype)
    with poisoned_outputs():
        y = bias_dropout_add(x, b, r, p, True, SEED, OFFSET)
        y.backward(dy)
    keep = dropout_keep_mask(shape, p, SEED, OFFSET)
    x64, r64 = leaf64(x), leaf64(r)
    b64 = leaf64(b) if with_bias else None
    y64 = reference(x64, b64, r64, keep, p)
    y64.backward(dy.double())
    assert y.dtype == dtype and y.shape == x.shape
    assert_close(y, y64, dtype, "y")
    assert_close(x.grad, x64.grad, dtype, "dx")
    assert_close(r.grad, r64.grad, dtype, "dresidual")
    if with_bias:
        assert_close(b.grad, b64.grad, dtype, "db")


def test_mask_is_triton_philox_bit_for_bit():
    # Kept elements of x come out as exactly x / (1 - p) with a zero residual and no bias.
    x = torch.rand(40, 300) + 1.0
    y = bias_dropout_add(x, None, torch.zeros_like(x), 0.25, True, seed=2**40 + 7, offset=2**33)
    assert torch.equal(y != 0, dropout_keep_mask(x.shape, 0.25, 2**40 + 7, 2**33))
    # Counters reach the high word: distinct streams for offsets 2^32 apart.
    counters = torch.arange(8)
    assert not torch.equal(philox_uint32(3, counters), philox_uint32(3, counters + 2**32))


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_dropout_rate_and_scale(p):
    x = torch.ones(64, 1000)
    y = bias_dropout_add(x, None, torch.zeros_like(x), p, True, seed=99)
    kept = (y != 0).double().mean().item()
    sigma = (p * (1 - p) / x.numel()) ** 0.5
    assert abs(kept - (1 - p)) < 5 * sigma
    assert torch.allclose(y[y != 0], torch.full((), 1 / (1 - p)))


def test_same_mask_in_forward_backward_and_recomputation():
    torch.manual_seed(3)
    x = randn(17, 130, dtype=torch.float32, requires_grad=True)
    r = torch.zeros(17, 130)
    y = bias_dropout_add(x, None, r, 0.4, True, seed=7, offset=11)
    y.backward(torch.ones_like(y))
    keep = y != 0
    assert torch.equal(x.grad != 0, keep)                       # backward uses the forward mask
    again = bias_dropout_add(x, None, r, 0.4, True, seed=7, offset=11)
    assert torch.equal(again, y)                                # recomputation: the same mask
    other = bias_dropout_add(x, None, r, 0.4, True, seed=7, offset=11 + x.numel())
    assert not torch.equal(other != 0, keep)                    # the next offset: a new mask
    # The mask depends on the logical index only, not on the memory layout.
    xt = x.detach().t().contiguous().t()
    assert torch.equal(bias_dropout_add(xt, None, r, 0.4, True, seed=7, offset=11), y.detach())


@pytest.mark.parametrize("impl", ["triton", "torch"])
def test_activation_checkpointing_recomputes_the_same_mask(monkeypatch, impl):
    monkeypatch.setenv("FASTPAR_KERNEL_IMPL", impl)
    torch.manual_seed(4)
    x = randn(8, 96, dtype=torch.float32, requires_grad=True)
    b = randn(96, dtype=torch.float32, requires_grad=True)

    def block(x, b):  # seed=None: drawn from torch's generator, which checkpoint restores
        return bias_dropout_add(x * 2, b, x, 0.5, True).square()

    torch.manual_seed(5)
    block(x, b).sum().backward()
    grads = x.grad.clone(), b.grad.clone()
    x.grad = b.grad = None
    torch.manual_seed(5)
    checkpoint(block, x, b, use_reentrant=False).sum().backward()
    assert torch.equal(x.grad, grads[0]) and torch.equal(b.grad, grads[1])


def test_eval_mode_and_the_torch_path(monkeypatch):
    x, b, r = randn(5, 33, dtype=torch.float32), randn(33, dtype=torch.float32), \
        randn(5, 33, dtype=torch.float32)
    expected = reference(x.double(), b.double(), r.double(), torch.ones(5, 33), 0.0)
    assert_close(bias_dropout_add(x, b, r, 0.5, training=False), expected, torch.float32)
    y = bias_dropout_add(x, b, r, 0.3, True, seed=1, offset=2)
    monkeypatch.setenv("FASTPAR_KERNEL_IMPL", "torch")
    assert torch.equal(bias_dropout_add(x, b, r, 0.3, True, seed=1, offset=2) != r, y != r)
    assert_close(bias_dropout_add(x, b, r, 0.3, True, seed=1, offset=2),
                 reference(x.double(), b.double(), r.double(),
                           dropout_keep_mask(x.shape, 0.3, 1, 2), 0.3), torch.float32)
    assert torch.equal(bias_dropout_add(x, b, r, 1.0, True, seed=1), r)


def test_bad_arguments_are_one_clear_error():
    with pytest.raises(ValueError, match="p=1.5"):
        bias_dropout_add(torch.randn(4, 8), None, torch.randn(4, 8), 1.5, True, seed=0)
    with pytest.raises(ValueError, match="residual"):
        bias_dropout_add(torch.randn(4, 8), None, torch.randn(4, 7), 0.1, True, seed=0)
