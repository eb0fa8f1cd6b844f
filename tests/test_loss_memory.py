"""Peak memory of the vocab-parallel loss, forward + backward, measured on CPU.

:class:`LiveBytes` is a TorchDispatchMode that, after every op, adds up the bytes of the live
storages that ops inside it allocated (a storage is counted from the op that creates it until its
last tensor dies: weakrefs on storages, which torch keeps one Python object each). Its peak is the
loss's extra memory above its inputs, the gradient included, as a caching allocator on a GPU would
see it. Scratch memory inside one op (a kernel's own workspace; the Triton interpreter's numpy
arrays) is not seen; the launchers' outputs are.

The bound, for N rows of V = V/tp bf16 logits: peak <= 2 N V (the gradient, bf16) + 128 N (row
statistics: the (N, 4) fp32 shard statistics, the global max and log-sum, the loss, masks and the
upstream gradient, each (N,) or (N, 4)) + 64 KiB (constants). The torch reference may add two fp32
temporaries of :data:`REFERENCE_CHUNK` elements (a row chunk of logits in fp32 and its
probabilities). The implementation this replaced held the logits in fp32, ``z - max`` and its exp,
three fp32 (N, V) tensors at once (12 N V bytes) and the fp32 softmax until backward: it exceeds
the bound by far.
"""
from __future__ import annotations

import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from fastpar.kernels.cross_entropy import REFERENCE_CHUNK
from fastpar.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy

ROW_BYTES, SLACK = 128, 64 << 10


class LiveBytes(TorchDispatchMode):
    """Peak bytes of live storages allocated by the ops run inside it."""

    def __init__(self):
        super().__init__()
        self.live: dict[int, weakref.ref] = {}
        self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {_storage(a).data_ptr() for a in tree_flatten((args, kwargs))[0]
                  if _storage(a) is not None}
        for t in tree_flatten(out)[0]:
            s = _storage(t)
            if s is None or s.nbytes() == 0 or s.data_ptr() in inputs or id(s) in self.live:
                continue                                 # a view, an in-place op, or known
            self.live[id(s)] = weakref.ref(s, lambda _, key=id(s): self.live.pop(key, None))
        self.peak = max(self.peak, self.now())
        return out

    def now(self) -> int:
        return sum(s().nbytes() for s in list(self.live.values()) if s() is not None)


def _storage(x):
    if isinstance(x, torch.Tensor):
        return x.untyped_storage()
    return x if isinstance(x, torch.UntypedStorage) else None


class OldVocabParallelCrossEntropy(torch.autograd.Function):
    """The implementation this file guards against, at tp = 1: fp32 logits, shifted logits and
    their exp in the forward, the fp32 softmax kept for the backward."""

    @staticmethod
    def forward(ctx, logits, target):
        z = logits.reshape(-1, logits.shape[-1]).float()            # (N, V) fp32
        t = target.reshape(-1)
        m = z.max(dim=-1).values
        s = z - m.unsqueeze(-1)                                      # (N, V) fp32
        exp_s = s.exp()                                              # (N, V) fp32
        sums = torch.stack([exp_s.sum(-1), s.gather(-1, t[:, None])[:, 0]], dim=-1)
        loss = sums[:, 0].log() - sums[:, 1]
        ctx.save_for_backward(exp_s.div_(sums[:, :1]), t)
        ctx.dtype, ctx.shape = logits.dtype, logits.shape
        return loss.view(target.shape)

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, t = ctx.saved_tensors
        grad = softmax.clone()
        grad[torch.arange(grad.shape[0]), t] -= 1
        grad.mul_(grad_loss.reshape(-1, 1))
        return grad.to(ctx.dtype).view(ctx.shape), None


def peak_bytes(loss_fn, N, V, label_smoothing=0.0, dtype=torch.bfloat16):
    """Peak extra bytes of ``loss_fn(logits, target, label_smoothing)`` forward and backward,
    over its inputs; checks the gradient against F.cross_entropy on a few rows."""
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(N, V, generator=g) * 3).to(dtype).requires_grad_()
    target = torch.randint(V, (N,), generator=g)
    dy = torch.rand(N, generator=g)
    with LiveBytes() as mem:
        (loss_fn(logits, target, label_smoothing) * dy).sum().backward()
    rows = slice(0, 4)
    z = logits.detach()[rows].float().requires_grad_()
    (torch.nn.functional.cross_entropy(z, target[rows], reduction="none",
                                       label_smoothing=label_smoothing) * dy[rows]).sum().backward()
    assert torch.allclose(logits.grad[rows].float(), z.grad, atol=1e-2, rtol=1e-2)
    return mem.peak


def new_loss(logits, target, label_smoothing):
    return vocab_parallel_cross_entropy(logits, target, label_smoothing=label_smoothing)


def old_loss(logits, target, label_smoothing):
    assert label_smoothing == 0
    return OldVocabParallelCrossEntropy.apply(logits, target)


def bound(N, V, extra=0):
    return 2 * N * V + ROW_BYTES * N + SLACK + extra


def test_the_tracker_sees_allocations_views_and_frees():
    x = torch.randn(1000)
    with LiveBytes() as mem:
        a = x * 2                                  # 4000 bytes
        b = a[10:].view(-1, 2)                     # a view: no new storage
        a.add_(1)                                  # in place
        del a                                      # b keeps the storage alive
        c = torch.empty(500, dtype=torch.float64)  # 4000 more
        assert mem.now() == 8000
        del b, c
        assert mem.now() == 0
        _ = torch.ones(10)
    assert mem.peak == 8000


@pytest.mark.parametrize("label_smoothing", [0.0, 0.1])
def test_triton_loss_holds_the_gradient_and_rows_only(monkeypatch, label_smoothing):
    """512 rows x 8192 classes of bf16 logits (the interpreter runs one program per row, ~4 s a
    pass): peak <= gradient + O(N), where the old implementation needs over 6x the gradient."""
    monkeypatch.setenv("FASTPAR_KERNEL_IMPL", "triton")
    N, V = 512, 8192
    new = peak_bytes(new_loss, N, V, label_smoothing)
    old = peak_bytes(old_loss, N, V)
    assert new <= bound(N, V), (new, bound(N, V))
    assert old >= 12 * N * V > 3 * bound(N, V), (old, bound(N, V))  # 3 fp32 (N, V) at once


@pytest.mark.parametrize("label_smoothing", [0.0, 0.1])
def test_torch_reference_loss_works_in_row_chunks(monkeypatch, label_smoothing):
    """2048 x 8192 bf16 on the torch reference: the gradient, two fp32 row chunks and O(N)."""
    monkeypatch.setenv("FASTPAR_KERNEL_IMPL", "torch")
    N, V = 2048, 8192
    chunks = 2 * 4 * REFERENCE_CHUNK
    new = peak_bytes(new_loss, N, V, label_smoothing)
    old = peak_bytes(old_loss, N, V)
    assert new <= bound(N, V, chunks), (new, bound(N, V, chunks))
    assert old >= 12 * N * V > 3 * bound(N, V, chunks), (old, bound(N, V, chunks))
