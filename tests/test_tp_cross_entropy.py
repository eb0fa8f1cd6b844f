"""vocab_parallel_cross_entropy: sharded equals F.cross_entropy on the full logits, over gloo, on
the torch reference and on the Triton kernels (interpreted on CPU, TRITON_INTERPRET=1)."""
import os

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from fastpar.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from fastpar.testing import run_ranks

# (target shape, classes per rank, logit scale, extremes, ignore_index, label smoothing, how the
# logits are made: "leaf", "exp" (a non-leaf whose producer saves it), "t" (non-contiguous view))
CASES = [
    ((5,), 3, 1.0, False, -100, 0.0, "leaf"),
    ((3, 7), 5, 3.0, True, -100, 0.1, "leaf"),
    ((2, 3, 1), 1, 1.0, True, 0, 0.1, "leaf"),  # one class per rank; ignore a real class id
    ((123,), 2, 10.0, True, 7, 0.0, "leaf"),
    ((), 4, 1.0, False, -100, 0.1, "leaf"),  # a single token, 0-d target
    ((4, 3), 3, 0.5, False, -100, 0.1, "exp"),
    ((3, 5), 2, 2.0, True, -100, 0.0, "t"),
]


def _close(a, b, tol):
    # torch.allclose, not torch.testing.assert_close: its first call costs seconds per rank.
    assert a.shape == b.shape and a.dtype == b.dtype, (a.shape, b.shape, a.dtype, b.dtype)
    assert torch.allclose(a, b, atol=tol, rtol=tol), f"max abs diff {(a - b).abs().max()}"


def _data(shape, vocab, scale, extremes, ignore_index, seed):
    """Full logits (..., V) and targets (...), the same on every rank."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(*shape, vocab, generator=g) * scale
    target = torch.randint(vocab, shape, generator=g)
    flat, t = logits.view(-1, vocab), target.view(-1)
    if extremes:  # +-1e4: huge winners on several ranks, hopeless targets, an all -1e4 row
        pick = torch.rand(flat.shape, generator=g)
        flat[pick < 0.15], flat[pick > 0.85] = 1e4, -1e4
        flat[0] = -1e4
        flat[2 % len(flat), t[2 % len(t)]] = -1e4
    t[1::3] = ignore_index
    return logits, target


def _check_case(tp, rank, group, case, seed, dtype, tol):
    shape, per_rank, scale, extremes, ignore_index, eps, make = case
    vocab = per_rank * tp
    full, target = _data(shape, vocab, scale, extremes, ignore_index, seed)
    full = full.to(dtype).requires_grad_()
    kw = dict(ignore_index=ignore_index, label_smoothing=eps)
    ref_in = full.exp() if make == "exp" else full
    want = F.cross_entropy(ref_in.float().view(-1, vocab), target.view(-1), reduction="none",
                           **kw).view(shape)
    dy = torch.randn(shape, generator=torch.Generator().manual_seed(seed + 1))
    # (y * dy).sum().backward(), not y.backward(dy): that imports sympy, seconds per rank.
    (want * dy).sum().backward()

    if make == "t":  # the same values as a non-contiguous (transposed) view of another leaf
        leaf = full.detach().chunk(tp, -1)[rank].transpose(0, 1).contiguous().requires_grad_()
        logits = leaf.transpose(0, 1)
    else:
        leaf = full.detach().chunk(tp, -1)[rank].clone().requires_grad_()
        logits = leaf.exp() if make == "exp" else leaf
    before, version = logits.detach().clone(), logits._version
    loss = vocab_parallel_cross_entropy(logits, target, tp_group=group, **kw)
    assert loss.dtype == torch.float32 and loss.shape == target.shape
    _close(loss, want.detach(), tol)
    (loss * dy).sum().backward()
    assert logits._version == version and torch.equal(logits.detach(), before), "logits written"
    grad = leaf.grad.transpose(0, 1) if make == "t" else leaf.grad
    assert grad.dtype == dtype
    _close(grad.float(), full.grad.chunk(tp, -1)[rank].float(), tol)
    ignored = target == ignore_index
    assert ignored.any() or target.numel() == 1
    assert (loss[ignored] == 0).all() and (grad[ignored] == 0).all()


def _expect_error(fn, *fragments):
    try:
        fn()
    except ValueError as e:
        assert all(f in str(e) for f in fragments), (str(e), fragments)
        return str(e)
    raise AssertionError(f"no ValueError, expected one naming {fragments}")


# FASTPAR_KERNEL_IMPL: the torch reference, or the Triton kernels under the interpreter.
IMPLS = ["torch", "triton"]


def _cross_entropy_ranks(rank, world_size, impl):
    os.environ["FASTPAR_KERNEL_IMPL"] = impl
    tp, group = world_size, dist.group.WORLD
    for seed, case in enumerate(CASES):
        _check_case(tp, rank, group, case, seed, torch.float32, 1e-5)
    _check_case(tp, rank, group, ((6, 5), 8, 4.0, False, -100, 0.1, "leaf"), 99,
                torch.bfloat16, 1e-2)  # loss exact from the bf16 values; grad rounded to bf16

    # Bad input: ValueError on every rank, raised before any collective (the group still works).
    logits = torch.randn(2, 3, 4)
    errors = [
        _expect_error(lambda: vocab_parallel_cross_entropy(
            logits, torch.zeros(2, 4, dtype=torch.long), tp_group=group), "(2, 4)", "(2, 3, 4)"),
        _expect_error(lambda: vocab_parallel_cross_entropy(
            logits, torch.zeros(2, 3), tp_group=group), "integer", "float32"),
        _expect_error(lambda: vocab_parallel_cross_entropy(
            logits, torch.zeros(2, 3, dtype=torch.long), tp_group=group, label_smoothing=1.5),
            "label_smoothing=1.5"),
    ]
    _check_case(tp, rank, group, CASES[0], 0, torch.float32, 1e-5)
    return errors


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("world_size", [2, 4])
def test_vocab_parallel_cross_entropy_matches_full(world_size, impl):
    errors = run_ranks(_cross_entropy_ranks, world_size, impl, timeout=120)
    assert all(e == errors[0] for e in errors), "ranks disagree on the errors"
    assert "target shape (2, 4) does not match logits shape (2, 3, 4)" in errors[0][0]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("case", CASES)
def test_no_group_is_plain_cross_entropy(monkeypatch, case, impl):
    monkeypatch.setenv("FASTPAR_KERNEL_IMPL", impl)
    _check_case(1, 0, None, case, seed=5, dtype=torch.float32, tol=1e-5)


@pytest.mark.parametrize("impl", IMPLS)
def test_no_group_bf16_saves_no_fp32_logits(monkeypatch, impl):
    """What backward keeps: the logits themselves and (N,) rows of statistics, nothing of
    (N, V) size in fp32."""
    monkeypatch.setenv("FASTPAR_KERNEL_IMPL", impl)
    logits = torch.randn(6, 40).bfloat16().requires_grad_()
    loss = vocab_parallel_cross_entropy(logits, torch.randint(40, (6,)), label_smoothing=0.1)
    saved = loss.grad_fn.saved_tensors
    assert saved[0] is logits
    assert all(t.numel() <= 6 for t in saved[1:]), [tuple(t.shape) for t in saved]
    _check_case(1, 0, None, ((6, 5), 8, 4.0, False, -100, 0.1, "leaf"), 99, torch.bfloat16, 1e-2)


@pytest.mark.parametrize("impl", IMPLS)
def test_no_group_goes_through_the_function_and_fp64_gradcheck(monkeypatch, impl):
    # fp64 has no kernel: under FASTPAR_KERNEL_IMPL=triton too it stays on the fp64 reference.
    monkeypatch.setenv("FASTPAR_KERNEL_IMPL", impl)
    logits = torch.randn(3, 4, 6, dtype=torch.float64, requires_grad=True)
    target = torch.tensor([[0, 5, -100, 2], [1, 1, 3, 4], [-100, 0, 5, 5]])
    loss = vocab_parallel_cross_entropy(logits, target, label_smoothing=0.1)
    assert type(loss.grad_fn).__name__ == "VocabParallelCrossEntropyBackward"
    want = F.cross_entropy(logits.view(-1, 6), target.view(-1), reduction="none",
                           label_smoothing=0.1).view(3, 4)
    assert loss.dtype == torch.float64 and torch.allclose(loss, want, atol=1e-12)
    assert torch.autograd.gradcheck(
        lambda x: vocab_parallel_cross_entropy(x, target, label_smoothing=0.1), (logits,))
    with pytest.raises(ValueError, match=r"target shape \(3, 4\) does not match logits shape"):
        vocab_parallel_cross_entropy(logits[0], target)
