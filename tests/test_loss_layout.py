"""The loss reads the logits where they lie and leaves vocabulary padding out by itself.

Any layout of the logits whose rows flatten in memory order (contiguous, the transposed view the
model's head produces, permuted, a sliced or stepped sequence) is read without a copy and gets
its gradient with the logits' strides; one that does not flatten (a gap between rows) still gives
the right numbers through a copy. With ``vocab`` / ``vocab_size`` the padding columns take no part
in the loss (label smoothing spreads over the real classes only) and get an exact zero gradient,
also on a shard that holds padding only. Torch reference and Triton (interpreted on CPU).
"""
import pytest
import torch
import torch.nn.functional as F

from fastpar.kernels import cross_entropy, cross_entropy_shard_grad, cross_entropy_shard_stats
from fastpar.kernels.cross_entropy import cross_entropy_combine
from fastpar.kernels.row_order import from_memory_rows, memory_order, memory_rows, to_memory_rows
from fastpar.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from test_loss_memory import BigTensors, ce_kernels

IMPLS = ["torch", "triton"]
V = 40


def _layout(name: str, g: torch.Generator) -> torch.Tensor:
    """Logits (..., V) laid out as ``name`` says, over a fresh base tensor."""
    if name == "contiguous":
        return torch.randn(3, 5, V, generator=g)
    if name == "transposed":                                    # the model's (B, S, V) view
        return torch.randn(5, 3, V, generator=g).transpose(0, 1)
    if name == "permuted":
        return torch.randn(2, 3, 4, V, generator=g).permute(2, 0, 1, 3)
    if name == "sliced":                                        # (B, S - 1, V) of (S, B, V)
        return torch.randn(6, 3, V, generator=g)[:-1].transpose(0, 1)
    if name == "stepped":                                       # every other position
        return torch.randn(3, 10, V, generator=g)[:, ::2]
    assert name == "gapped"                                     # rows of unequal spacing
    return torch.randn(3, 6, V, generator=g)[:, :-1]


DENSE = {"contiguous", "transposed", "permuted"}
LAYOUTS = sorted(DENSE) + ["gapped", "sliced", "stepped"]


def test_memory_order_flattens_views_and_round_trips():
    g = torch.Generator().manual_seed(0)
    for name in LAYOUTS:
        z = _layout(name, g)
        order = memory_order(z)
        rows = memory_rows(z, order)
        shares = rows.untyped_storage().data_ptr() == z.untyped_storage().data_ptr()
        assert shares == (name != "gapped"), f"{name}: a copy ({order})"
        back = from_memory_rows(rows, z.shape[:-1], order)
        assert torch.equal(back, z), name
        ids = torch.arange(z[..., 0].numel()).view(z.shape[:-1])
        assert torch.equal(from_memory_rows(to_memory_rows(ids, ids.shape, order), ids.shape,
                                            order), ids), name
    assert memory_order(torch.randn(5, 3, V).transpose(0, 1)) == (1, 0)
    assert memory_order(torch.randn(3, 6, V)[:, :-1]) == (0, 1)     # no order flattens it


def _forward_backward(loss_fn, z, target, dy):
    """(loss, the gradient as it reaches the logits, BigTensors of the forward and backward)."""
    view = z.view_as(z)                        # a non-leaf: its gradient is seen as made
    grads = []
    view.register_hook(grads.append)
    with BigTensors(z.numel()) as big:
        loss = loss_fn(view, target)
        (loss * dy).sum().backward()
    return loss, grads[0], big


def _check_layout(layout, loss_fn, eps):
    g = torch.Generator().manual_seed(1)
    z = (_layout(layout, g) * 3).requires_grad_()
    target = torch.randint(V, z.shape[:-1], generator=g)
    target.view(-1)[::4] = -100
    dy = torch.rand(z.shape[:-1], generator=g)
    z64 = z.detach().double().requires_grad_()
    want = F.cross_entropy(z64.reshape(-1, V), target.reshape(-1), reduction="none",
                           label_smoothing=eps).view(target.shape)
    (want * dy).sum().backward()
    loss, grad, big = _forward_backward(loss_fn, z, target, dy)
    assert torch.allclose(loss.double(), want, atol=1e-5), (loss, want)
    assert torch.allclose(grad.double(), z64.grad, atol=1e-5)
    if layout != "gapped":                     # read in place; one new tensor, the gradient
        assert big.copies == [] and big.new == ["aten::empty"], (big.copies, big.new)
    if layout in DENSE:                        # what the producer's backward reads as it is
        assert grad.stride() == z.stride(), (grad.stride(), z.stride())


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_vocab_parallel_reads_any_layout_in_place(monkeypatch, impl, layout):
    monkeypatch.setenv("FASTPAR_KERNEL_IMPL", impl)
    monkeypatch.setattr(ce_kernels, "REFERENCE_CHUNK", 2 * V)   # row chunks: a part of the rows
    _check_layout(layout, lambda x, t: vocab_parallel_cross_entropy(x, t, label_smoothing=0.1),
                  0.1)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_triton_cross_entropy_reads_any_layout_in_place(monkeypatch, layout):
    monkeypatch.setenv("FASTPAR_KERNEL_IMPL", "triton")
    _check_layout(layout, cross_entropy, 0.0)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("eps", [0.0, 0.1])
def test_padding_is_left_out_on_every_shard(monkeypatch, impl, eps):
    """4 shards of 16 columns, 37 real classes: 16, 16, 5 and 0 real columns. The padding holds
    large finite values (the head's output there), which must not count."""
    monkeypatch.setenv("FASTPAR_KERNEL_IMPL", impl)
    g = torch.Generator().manual_seed(2)
    N, width, vocab, tp = 9, 16, 37, 4
    full = torch.randn(N, tp * width, generator=g) * 2
    full[:, vocab:] = 30.0
    target = torch.randint(vocab, (N,), generator=g)
    target[3] = -100
    dloss = torch.rand(N, generator=g)
    z64 = full[:, :vocab].double().requires_grad_()
    want = F.cross_entropy(z64, target, reduction="none", label_smoothing=eps)
    (want * dloss).sum().backward()
    shards = full.chunk(tp, -1)
    stats = torch.stack([cross_entropy_shard_stats(z, target, r * width, vocab=vocab)
                         for r, z in enumerate(shards)])
    loss, m, log_sum = cross_entropy_combine(stats, target, vocab, label_smoothing=eps,
                                             width=width)
    assert torch.allclose(loss.double(), want, atol=1e-5), (loss, want)
    grad = torch.cat([cross_entropy_shard_grad(z, target, m, log_sum, dloss, r * width,
                                               label_smoothing=eps, vocab=vocab)
                      for r, z in enumerate(shards)], -1)
    assert torch.equal(grad[:, vocab:], torch.zeros_like(grad[:, vocab:]))
    assert torch.allclose(grad[:, :vocab].double(), z64.grad, atol=1e-5)

    # The same through the tensor-parallel function on one device.
    whole = full.clone().requires_grad_()
    loss1 = vocab_parallel_cross_entropy(whole, target, label_smoothing=eps, vocab_size=vocab)
    (loss1 * dloss).sum().backward()
    assert torch.allclose(loss1.double(), want, atol=1e-5)
    assert torch.equal(whole.grad[:, vocab:], torch.zeros_like(whole.grad[:, vocab:]))
    assert torch.allclose(whole.grad[:, :vocab].double(), z64.grad, atol=1e-5)


def test_bad_vocab_size_is_one_clear_error():
    logits, target = torch.randn(4, 8), torch.zeros(4, dtype=torch.long)
    for bad in (0, 9):
        with pytest.raises(ValueError, match=rf"vocab_size={bad} must be in \[1, 8\]"):
            vocab_parallel_cross_entropy(logits, target, vocab_size=bad)
