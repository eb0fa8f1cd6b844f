"""fastpar.kernels.rotary: the Triton kernel (interpreted on CPU) against float64, in place and
out of place, on strided q/k views."""
import pytest
import torch

from fastpar.kernels import rotary
from kernel_testing import assert_close, leaf64, poisoned_outputs, triton_path

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# (B, T, Hq, Hk, D, R): single everything, partial rotary, odd heads and a non-power-of-two D.
CASES = [(1, 1, 1, 1, 2, 2), (2, 7, 3, 1, 16, 8), (1, 9, 5, 3, 130, 130)]


def angles(t_max, r, dtype):
    """cos, sin (t_max, r/2) of t * theta_i, theta_i = 10000^(-2i/r)."""
    inv = 10000.0 ** (-torch.arange(0, r, 2, dtype=torch.float64) / r)
    phase = torch.arange(t_max, dtype=torch.float64)[:, None] * inv[None, :]
    return phase.cos().to(dtype), phase.sin().to(dtype)


def reference(x, cos, sin):
    """Rotate-half RoPE in float64 (cos, sin: (>= T, R/2))."""
    T, r2 = x.shape[1], cos.shape[1]
    c, s = cos[:T, None].double(), sin[:T, None].double()
    x1, x2, rest = x[..., :r2], x[..., r2:2 * r2], x[..., 2 * r2:]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s, rest], -1)


def qk_views(B, T, Hq, Hk, D, dtype):
    """q and k as strided views of one fused (B, T, Hq + 2 Hk, D) qkv projection output."""
    qkv = torch.randn(B, T, Hq + 2 * Hk, D, dtype=torch.float32).to(dtype)
    return qkv[:, :, :Hq], qkv[:, :, Hq:Hq + Hk]


@pytest.fixture(autouse=True)
def _triton(monkeypatch):
    with triton_path(monkeypatch):
        yield


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("inplace", [False, True], ids=["out_of_place", "in_place"])
@pytest.mark.parametrize("case", CASES)
def test_forward_and_gradients_match_float64(case, inplace, dtype):
    B, T, Hq, Hk, D, R = case
    torch.manual_seed(0)
    q, k = qk_views(B, T, Hq, Hk, D, dtype)
    q_leaf, k_leaf = q.detach().clone().requires_grad_(), k.detach().clone().requires_grad_()
    cos, sin = angles(T + 3, R, dtype)                 # a longer cache than T, as in a model
    dq, dk = torch.randn(q.shape).to(dtype), torch.randn(k.shape).to(dtype)
    with poisoned_outputs():
        if inplace:   # rotate strided views of a non-leaf in place
            qkv = torch.cat([q_leaf * 1, k_leaf * 1, torch.zeros(B, T, Hk, D, dtype=dtype)], 2)
            q_in, k_in = qkv[:, :, :Hq], qkv[:, :, Hq:Hq + Hk]
            q_out, k_out = rotary(q_in, k_in, cos, sin, inplace=True)
            assert q_out is q_in and k_out is k_in
        else:
            q_out, k_out = rotary(q_leaf, k_leaf, cos, sin)
        torch.autograd.backward([q_out, k_out], [dq, dk])
    q64, k64 = leaf64(q), leaf64(k)
    y64 = reference(q64, cos, sin), reference(k64, cos, sin)
    torch.autograd.backward(y64, [dq.double(), dk.double()])
    assert q_out.dtype == dtype and q_out.shape == q.shape
    assert_close(q_out, y64[0], dtype, "q")
    assert_close(k_out, y64[1], dtype, "k")
    assert_close(q_leaf.grad, q64.grad, dtype, "dq")
    assert_close(k_leaf.grad, k64.grad, dtype, "dk")


def test_head_major_layout_and_no_k():
    # (B, H, T, D) storage seen as (B, T, H, D): every stride but the last is unusual.
    torch.manual_seed(1)
    q = torch.randn(2, 4, 9, 64).transpose(1, 2).requires_grad_()
    cos, sin = angles(9, 64, torch.float32)
    q_out, k_out = rotary(q, None, cos, sin)
    assert k_out is None
    q_out.sum().backward()
    q64 = leaf64(q)
    reference(q64, cos, sin).sum().backward()
    assert_close(q_out, reference(q64, cos, sin), torch.float32, "q")
    assert_close(q.grad, q64.grad, torch.float32, "dq")


def test_torch_path_is_the_same_math(monkeypatch):
    q, k = qk_views(2, 5, 3, 1, 12, torch.float32)
    cos, sin = angles(5, 8, torch.float32)
    monkeypatch.setenv("FASTPAR_KERNEL_IMPL", "torch")
    q_out, k_out = rotary(q, k, cos, sin)
    assert_close(q_out, reference(q.double(), cos, sin), torch.float32)
    expected = reference(k.double(), cos, sin)
    rotary(q, k, cos, sin, inplace=True)
    assert_close(k, expected, torch.float32)


def test_bad_shapes_are_one_clear_error():
    q = torch.randn(2, 5, 3, 8)
    cos, sin = angles(5, 8, torch.float32)
    with pytest.raises(ValueError, match="must be \\(B, T, H, D\\)"):
        rotary(q, torch.randn(2, 4, 3, 8), cos, sin)
    with pytest.raises(ValueError, match="R <= D"):
        rotary(q, None, *angles(4, 8, torch.float32))
