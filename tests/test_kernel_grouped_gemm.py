"""fastpar.kernels.grouped_gemm: the Triton kernels (interpreted on CPU) against a float64 loop of
matmuls, forward and both gradients; and no host sync on the Triton path."""
import pytest
import torch

from fastpar.kernels import grouped_mm
from fastpar.kernels.grouped_gemm import blocks
from fastpar.testing import count_host_syncs
from kernel_testing import assert_close, leaf64, poisoned_outputs, randn, triton_path

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# Rows per group: uneven, empty groups (first, middle, last), one group with every row, many
# one-row groups; none sums to a multiple of the interpreter's 16-row tiles.
COUNTS = [[5, 0, 17, 3, 12], [0, 0, 45, 0], [45], [1] * 9 + [0, 20]]
K, M = 70, 37                             # neither a multiple of the 32-wide blocks


def reference(x, w, counts):
    """Per group x_g @ w[g]^T, in x's dtype (float64 here)."""
    out, start = [x.new_zeros(0, w.shape[1])], 0
    for g, n in enumerate(counts):
        out.append(x[start:start + n] @ w[g].T)
        start += n
    return torch.cat(out)


@pytest.fixture(autouse=True)
def _triton(monkeypatch):
    with triton_path(monkeypatch):
        yield


def _inputs(counts, dtype, k=K, m=M):
    torch.manual_seed(0)
    x = randn(sum(counts), k, dtype=dtype, requires_grad=True)
    w = randn(len(counts), m, k, dtype=dtype, scale=0.5, requires_grad=True)
    return x, w, torch.tensor(counts, dtype=torch.int64)


def test_interpreter_blocks_are_what_the_shapes_assume():
    assert blocks(torch.float32)[:3] == (16, 32, 32)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("counts", COUNTS, ids=lambda c: "-".join(map(str, c)))
def test_forward_and_gradients_match_float64(counts, dtype):
    x, w, c = _inputs(counts, dtype)
    dy = randn(x.shape[0], M, dtype=dtype)
    with poisoned_outputs():
        y = grouped_mm(x, w, c)
        y.backward(dy)
    x64, w64 = leaf64(x), leaf64(w)
    y64 = reference(x64, w64, counts)
    y64.backward(dy.double())
    assert y.dtype == dtype and x.grad.dtype == w.grad.dtype == dtype
    assert_close(y, y64, dtype, "y")
    assert_close(x.grad, x64.grad, dtype, "dx")
    assert_close(w.grad, w64.grad, dtype, "dw")
    for g, n in enumerate(counts):
        if n == 0:
            assert (w.grad[g] == 0).all(), f"dw of the empty group {g} is not zero"


def test_strided_inputs_and_one_gradient():
    # x a column slice, w a transposed view, counts a strided int32 view: the wrapper copies them.
    torch.manual_seed(1)
    x = randn(30, K, dtype=torch.float32, strided=True)
    wt = randn(3, K, M, dtype=torch.float32, requires_grad=True)
    counts = [10, 0, 20]
    strided = torch.tensor([10, 7, 0, 7, 20], dtype=torch.int32)[::2]
    y = grouped_mm(x, wt.transpose(1, 2), strided)
    y.sum().backward()
    w64 = leaf64(wt)
    y64 = reference(x.double(), w64.transpose(1, 2), counts)
    y64.sum().backward()
    assert_close(y, y64, torch.float32, "y")
    assert_close(wt.grad, w64.grad, torch.float32, "dw")


def test_no_rows_and_no_columns():
    x, w, c = _inputs([0, 0], torch.float32)
    assert grouped_mm(x, w, c).shape == (0, M)
    x, w, c = _inputs([3, 4], torch.float32, m=0)
    assert grouped_mm(x, w, c).shape == (7, 0)


def test_triton_path_makes_no_host_sync():
    x, w, c = _inputs(COUNTS[0], torch.bfloat16)
    with count_host_syncs() as seen:
        grouped_mm(x, w, c).sum().backward()
    assert seen == [], seen
    with count_host_syncs() as seen:      # the counter sees what the torch reference reads
        torch.tensor([1, 2]).tolist()
    assert seen


def test_torch_path_is_the_same_math(monkeypatch):
    x, w, c = _inputs(COUNTS[0], torch.float32)
    monkeypatch.setenv("FASTPAR_KERNEL_IMPL", "torch")
    y = grouped_mm(x, w, c)
    y.sum().backward()
    x64, w64 = leaf64(x), leaf64(w)
    reference(x64, w64, COUNTS[0]).sum().backward()
    assert_close(y, reference(x.double(), w.double(), COUNTS[0]), torch.float32)
    assert_close(w.grad, w64.grad, torch.float32, "dw")
    with pytest.raises(ValueError, match="sum to x's 37 rows"):
        grouped_mm(x, w, torch.tensor([5, 0, 17, 3, 13]))


@pytest.mark.parametrize("x, w, counts, what", [
    ((6, 8), (2, 4, 8), (3,), "counts"),
    ((6, 8), (2, 4, 9), (2,), r"w \(2, 4, 9\)"),
    ((6,), (2, 4, 8), (2,), r"x \(6,\)"),
    ((6, 8), (4, 8), (2,), r"w \(4, 8\)"),
])
def test_bad_shapes_are_one_clear_error(x, w, counts, what):
    with pytest.raises(ValueError, match=f"grouped_mm: needs .*{what}"):
        grouped_mm(torch.randn(x), torch.randn(w), torch.ones(counts, dtype=torch.int64))


def test_bad_dtypes_are_one_clear_error():
    x, w = torch.randn(6, 8), torch.randn(2, 4, 8, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="torch.float32, w .* torch.bfloat16"):
        grouped_mm(x, w, torch.tensor([3, 3]))
    with pytest.raises(ValueError, match="counts .* torch.float32"):
        grouped_mm(x, w.float(), torch.tensor([3.0, 3.0]))
