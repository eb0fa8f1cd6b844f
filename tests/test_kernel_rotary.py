"""fastpar.kernels.rotary: the Triton kernel (interpreted on CPU) against float64, in place and
out of place, on strided q/k views, with one table or a table per sequence."""
import pytest
import torch

from fastpar.kernels import rotary
from fastpar.kernels.rotary import (RotaryFunction, RotaryTorchFunction, rotary_backward,
                                    rotary_forward, rotary_reference)
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


# Per-sequence tables (B, >= T, R/2): positions that restart at each document of a packed row.
# (B, T, Hq, Hk, D, R): partial rotary with odd sizes, and full rotary with R/2 = 5.
SEQUENCE_CASES = [(3, 5, 3, 1, 12, 8), (2, 7, 2, 2, 10, 10)]


def sequence_angles(B, t_max, r, dtype, seed=0):
    """cos, sin (B, t_max, r/2): each row's positions restart at 0 at random document starts."""
    g = torch.Generator().manual_seed(seed)
    new_doc = torch.rand(B, t_max, generator=g, device="cpu") < 0.3
    new_doc[:, 0] = True
    index = torch.arange(t_max, device="cpu").expand(B, t_max)
    pos = index - torch.where(new_doc, index, 0).cummax(1).values        # (B, t_max)
    assert (pos[:, 1:] == 0).any()                 # some row restarts inside it
    cos, sin = angles(t_max, r, torch.float64)
    pos = pos.to(cos.device)
    return cos[pos].to(dtype), sin[pos].to(dtype)


def reference_rows(x, cos, sin):
    """Each row b rotated alone with its own table (cos[b], sin[b]), in float64."""
    return torch.cat([reference(x[b:b + 1], cos[b], sin[b]) for b in range(x.shape[0])])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", SEQUENCE_CASES)
def test_sequence_tables_every_path_agrees(case, dtype):
    B, T, Hq, Hk, D, R = case
    torch.manual_seed(2)
    q, k = qk_views(B, T, Hq, Hk, D, dtype)
    cos, sin = sequence_angles(B, T + 2, R, dtype)      # a longer table than T
    q64, k64 = reference_rows(q.double(), cos, sin), reference_rows(k.double(), cos, sin)
    with poisoned_outputs():
        triton_q, triton_k = rotary(q, k, cos, sin)
        launcher_q = rotary_forward(q, cos, sin)
        function_q = RotaryFunction.apply(q, cos, sin, False)
    torch_q, torch_k = (RotaryTorchFunction.apply(x, cos, sin) for x in (q, k))
    ref_q, ref_k = rotary_reference(q, k, cos, sin)
    for name, out in [("rotary", triton_q), ("rotary_forward", launcher_q),
                      ("RotaryFunction", function_q), ("torch", torch_q), ("reference", ref_q)]:
        assert out.dtype == dtype
        assert_close(out, q64, dtype, f"q {name}")
    for name, out in [("rotary", triton_k), ("torch", torch_k), ("reference", ref_k)]:
        assert_close(out, k64, dtype, f"k {name}")
    # In place on strided views of one fused buffer: x itself is rotated and returned.
    q_in, k_in = qk_views(B, T, Hq, Hk, D, dtype)
    q_before, k_before = q_in.double(), k_in.double()
    q_out, k_out = rotary(q_in, k_in, cos, sin, inplace=True)
    assert q_out is q_in and k_out is k_in
    assert_close(q_in, reference_rows(q_before, cos, sin), dtype, "q in place")
    assert_close(k_in, reference_rows(k_before, cos, sin), dtype, "k in place")
    q_in = qk_views(B, T, Hq, Hk, D, dtype)[0]
    q_before = q_in.double()
    assert rotary_forward(q_in, cos, sin, inplace=True) is q_in
    assert_close(q_in, reference_rows(q_before, cos, sin), dtype, "q rotary_forward in place")


@pytest.mark.parametrize("case", SEQUENCE_CASES)
def test_sequence_table_row_is_that_row_alone(case):
    B, T, Hq, Hk, D, R = case
    torch.manual_seed(3)
    q, k = qk_views(B, T, Hq, Hk, D, torch.float32)
    cos, sin = sequence_angles(B, T + 1, R, torch.float32, seed=1)
    with poisoned_outputs():
        q_out, k_out = rotary(q, k, cos, sin)
        for b in range(B):   # the same kernel on one row with its 2-D table: the same bits
            qb, kb = rotary(q[b:b + 1], k[b:b + 1], cos[b], sin[b])
            assert torch.equal(q_out[b:b + 1], qb) and torch.equal(k_out[b:b + 1], kb)
    # A table in other strides (its last dim not contiguous) is the same table.
    cos_t, sin_t = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (cos, sin))
    assert cos_t.stride(-1) != 1
    strided = rotary(q, k, cos_t, sin_t)
    assert torch.equal(strided[0], q_out) and torch.equal(strided[1], k_out)
    # One table broadcast to every row is the 2-D table.
    cos2, sin2 = angles(T, R, torch.float32)
    expanded = rotary(q, k, cos2.expand(B, T, R // 2), sin2.expand(B, T, R // 2))
    shared = rotary(q, k, cos2, sin2)
    assert torch.equal(expanded[0], shared[0]) and torch.equal(expanded[1], shared[1])


@pytest.mark.parametrize("impl", ["triton", "torch"])
@pytest.mark.parametrize("case", SEQUENCE_CASES)
def test_sequence_table_gradients_match_float64(case, impl, monkeypatch):
    B, T, Hq, Hk, D, R = case
    monkeypatch.setenv("FASTPAR_KERNEL_IMPL", impl)
    torch.manual_seed(4)
    q, k = qk_views(B, T, Hq, Hk, D, torch.float32)
    q_leaf, k_leaf = q.detach().clone().requires_grad_(), k.detach().clone().requires_grad_()
    cos, sin = sequence_angles(B, T + 3, R, torch.float32, seed=2)
    dq, dk = torch.randn(q.shape), torch.randn(k.shape)
    with poisoned_outputs():
        torch.autograd.backward(rotary(q_leaf, k_leaf, cos, sin), [dq, dk])
        dq_launcher = rotary_backward(dq, cos, sin)
    q64, k64 = leaf64(q), leaf64(k)
    torch.autograd.backward([reference_rows(q64, cos, sin), reference_rows(k64, cos, sin)],
                            [dq.double(), dk.double()])
    assert_close(q_leaf.grad, q64.grad, torch.float32, "dq")
    assert_close(k_leaf.grad, k64.grad, torch.float32, "dk")
    assert_close(dq_launcher, q64.grad, torch.float32, "rotary_backward")


def test_sequence_table_of_another_batch_is_one_clear_error():
    q = torch.randn(2, 5, 3, 8)
    cos, sin = sequence_angles(3, 5, 8, torch.float32)
    for call in (lambda: rotary(q, None, cos, sin), lambda: rotary_forward(q, cos, sin)):
        with pytest.raises(ValueError, match=r"\(B, >= T, R/2\) with B=2"):
            call()
