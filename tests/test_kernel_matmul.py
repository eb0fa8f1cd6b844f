"""fastpar.kernels.matmul: the Triton kernels (interpreted on CPU) against float64, every
epilogue, strided operands, and the row-chunk tile order."""
import math

import pytest
import torch
import triton
import triton.language as tl

from fastpar.kernels import matmul
from fastpar.kernels.matmul import _tile_coords
from kernel_testing import (DEVICE, assert_close, leaf64, poisoned_outputs, randn,
                                     triton_path)

# bf16 tl.dot is wrong under the interpreter: bf16 matmul is checked on a GPU only.
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE.type == "cuda" else [])
# (a shape, N, bias, activation, residual)
CASES = [((1, 1), 1, True, "gelu", True), ((3, 127), 5, False, None, False),
         ((127, 100), 300, True, "gelu", False), ((2, 9, 70), 33, True, "silu", True),
         ((65, 64), 130, False, "silu", False), ((130, 31), 66, True, None, True)]


def reference(a, b, bias, activation, residual):
    """act(a @ b + bias) + residual in float64."""
    z = a @ b + (0 if bias is None else bias)
    if activation == "gelu":
        z = 0.5 * z * (1 + torch.tanh(math.sqrt(2 / math.pi) * (z + 0.044715 * z**3)))
    elif activation == "silu":
        z = z * torch.sigmoid(z)
    return z if residual is None else z + residual


@pytest.fixture(autouse=True)
def _triton(monkeypatch):
    with triton_path(monkeypatch):
        yield


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("a_shape,N,with_bias,activation,with_residual", CASES)
def test_forward_and_gradients_match_float64(a_shape, N, with_bias, activation, with_residual,
                                             dtype):
    torch.manual_seed(0)
    K = a_shape[-1]
    a = randn(*a_shape, dtype=dtype, strided=True, requires_grad=True)
    w = randn(N, K, dtype=dtype, scale=K**-0.5, requires_grad=True)      # nn.Linear layout
    bias = randn(N, dtype=dtype, requires_grad=True) if with_bias else None
    out_shape = (*a_shape[:-1], N)
    residual = randn(*out_shape, dtype=dtype, requires_grad=True) if with_residual else None
    dc = randn(*out_shape, dtype=dtype)
    with poisoned_outputs():
        c = matmul(a, w.t(), bias, activation, residual)                # b = w.t(): strided
        c.backward(dc)
    a64, w64 = leaf64(a), leaf64(w)
    bias64 = leaf64(bias) if with_bias else None
    res64 = leaf64(residual) if with_residual else None
    c64 = reference(a64, w64.t(), bias64, activation, res64)
    c64.backward(dc.double())
    assert c.dtype == dtype and c.shape == out_shape
    assert_close(c, c64, dtype, "c")
    assert_close(a.grad, a64.grad, dtype, "da")
    assert_close(w.grad, w64.grad, dtype, "db")
    if with_bias:
        assert_close(bias.grad, bias64.grad, dtype, "dbias")
    if with_residual:
        assert_close(residual.grad, res64.grad, dtype, "dresidual")


def test_column_major_operands_and_a_transposed_residual():
    torch.manual_seed(1)
    a = randn(40, 48, dtype=torch.float32).t().requires_grad_()          # (48, 40), strides (1, 48)
    b = randn(40, 20, dtype=torch.float32, requires_grad=True)
    residual = randn(20, 48, dtype=torch.float32).t()
    c = matmul(a, b, None, "gelu", residual)
    c.sum().backward()
    a64, b64 = leaf64(a), leaf64(b)
    c64 = reference(a64, b64, None, "gelu", residual.double())
    c64.sum().backward()
    assert_close(c, c64, torch.float32, "c")
    assert_close(a.grad, a64.grad, torch.float32, "da")
    assert_close(b.grad, b64.grad, torch.float32, "db")


@triton.jit
def _record_tile_order(out_ptr, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    pid = tl.program_id(0)
    pid_m, pid_n = _tile_coords(pid, num_pid_m, num_pid_n, GROUP_M)
    tl.store(out_ptr + 2 * pid, pid_m)
    tl.store(out_ptr + 2 * pid + 1, pid_n)


@pytest.mark.parametrize("num_pid_m,num_pid_n,group_m", [(7, 5, 2), (16, 3, 8), (1, 4, 8)])
def test_tiles_finish_row_chunks_in_order(num_pid_m, num_pid_n, group_m):
    out = torch.full((num_pid_m * num_pid_n, 2), -1, dtype=torch.int32)
    _record_tile_order[(num_pid_m * num_pid_n,)](out, num_pid_m, num_pid_n, GROUP_M=group_m)
    tiles = [tuple(t) for t in out.tolist()]
    assert sorted(tiles) == [(m, n) for m in range(num_pid_m) for n in range(num_pid_n)]
    chunks = [m // group_m for m, _ in tiles]
    assert chunks == sorted(chunks)          # every tile of chunk c is issued before chunk c + 1


def test_torch_path_is_the_same_math(monkeypatch):
    a, b, bias = randn(5, 7, dtype=torch.float32), randn(7, 3, dtype=torch.float32), \
        randn(3, dtype=torch.float32)
    monkeypatch.setenv("FASTPAR_KERNEL_IMPL", "torch")
    for act in (None, "gelu", "silu"):
        assert_close(matmul(a, b, bias, act), reference(a.double(), b.double(), bias.double(),
                                                        act, None), torch.float32)


def test_bad_arguments_are_one_clear_error():
    with pytest.raises(ValueError, match="activation='relu'"):
        matmul(torch.randn(4, 8), torch.randn(8, 3), activation="relu")
    with pytest.raises(ValueError, match=r"must be \(\.\.\., K\) and \(K, N\)"):
        matmul(torch.randn(4, 8), torch.randn(7, 3))
    with pytest.raises(ValueError, match="one dtype"):
        matmul(torch.randn(4, 8), torch.randn(8, 3, dtype=torch.float16))
