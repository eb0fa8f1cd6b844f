"""The extension's multi-tensor pack / unpack / scale ops against plain torch."""
import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from fastpar import extension

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
SHAPES = [(1,), (5,), (123,), (3, 7), (40000,), (0,), (2, 3, 5)]


def _tol(*dtypes):
    low = any(d in (torch.float16, torch.bfloat16) for d in dtypes)
    return dict(atol=1e-2, rtol=1e-2) if low else dict(atol=1e-6, rtol=1e-6)


def _tensors(dtype):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(s, generator=g).to(dtype) for s in SHAPES]


@pytest.mark.parametrize("src", DTYPES)
@pytest.mark.parametrize("dst", DTYPES)
def test_pack_then_unpack(src, dst):
    ts = _tensors(src)
    n = sum(t.numel() for t in ts)
    out = torch.full((n + 3,), 7.0, dtype=dst)          # poisoned, and longer than needed
    extension.multi_tensor_pack(ts, out, 0.25)
    ref = torch.cat([t.reshape(-1).double() for t in ts]) * 0.25
    assert torch.allclose(out[:n].double(), ref, **_tol(src, dst))
    assert torch.equal(out[n:], torch.full((3,), 7.0, dtype=dst)), "tail must be left alone"
    back = [torch.full(t.shape, -5.0, dtype=src) for t in ts]
    extension.multi_tensor_unpack(out, back, 4.0)
    for t, b in zip(ts, back):
        assert torch.allclose(b.double(), t.double(), **_tol(src, dst))


def test_exact_for_same_dtype_and_unit_scale():
    ts = _tensors(torch.float32)
    out = torch.empty(sum(t.numel() for t in ts))
    extension.multi_tensor_pack(ts, out)
    assert torch.equal(out, torch.cat([t.reshape(-1) for t in ts]))
    # Same as torch's own conversion, elementwise, for a dtype change.
    out16 = torch.empty_like(out, dtype=torch.bfloat16)
    extension.multi_tensor_pack(ts, out16)
    assert torch.equal(out16, out.to(torch.bfloat16))


@pytest.mark.parametrize("dtype", DTYPES)
def test_scale_in_place(dtype):
    ts = _tensors(dtype)
    ref = [t.double() * -0.5 for t in ts]
    extension.multi_tensor_scale(ts, -0.5)
    for t, r in zip(ts, ref):
        assert torch.allclose(t.double(), r, **_tol(dtype))
    extension.multi_tensor_scale([], 2.0)                      # nothing to do


def test_views_into_one_buffer():
    buf = torch.zeros(10)
    views = [buf[0:4].view(2, 2), buf[4:10]]
    extension.multi_tensor_unpack(torch.arange(10.0), views, 2.0)
    assert torch.equal(buf, torch.arange(10.0) * 2)


def test_bad_input_names_the_argument():
    out = torch.empty(10)
    cases = [
        (lambda: extension.multi_tensor_pack([torch.ones(11)], out), "out has 10 elements but the "
                                                                "tensors need 11"),
        (lambda: extension.multi_tensor_pack([torch.ones(2), torch.ones(4, 2).t()], out),
         "tensors[1] (shape [2, 4]) must be contiguous"),
        (lambda: extension.multi_tensor_pack([torch.ones(2), torch.ones(2).double()], out),
         "tensors[1] is Double but tensors[0] is Float"),
        (lambda: extension.multi_tensor_unpack(torch.ones(4, 4).t(), [torch.ones(2)]),
         "flat must be contiguous"),
        (lambda: extension.multi_tensor_scale([torch.ones(3, dtype=torch.int32)], 2.0),
         "tensors must be float, double, half or bfloat16, got Int"),
        (lambda: extension.multi_tensor_pack([torch.ones(2)], torch.ones(4, dtype=torch.int64)),
         "out must be float, double, half or bfloat16"),
    ]
    for fn, message in cases:
        with pytest.raises(RuntimeError) as e:
            fn()
        assert message in str(e.value), str(e.value)


def test_fake_tensors_trace_without_running():
    with FakeTensorMode():
        ts = [torch.empty(3), torch.empty(2, 2)]
        out = torch.empty(7)
        extension.multi_tensor_pack(ts, out, 0.5)
        extension.multi_tensor_unpack(out, ts, 2.0)
        extension.multi_tensor_scale(ts, 3.0)
