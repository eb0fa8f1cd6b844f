"""fastpar.kernels.cross_entropy: the Triton kernels (interpreted on CPU) against float64, with
extreme logits, ignored targets, and the vocab-parallel statistics of tensor-parallel shards."""
import pytest
import torch

from fastpar.kernels import cross_entropy, cross_entropy_shard_grad, cross_entropy_shard_stats
from fastpar.kernels.cross_entropy import (_shard_stats_reference, cross_entropy_backward,
                                           cross_entropy_combine, cross_entropy_forward)
from kernel_testing import assert_close, leaf64, poisoned_outputs, randn, triton_path

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# (rows shape, V, strided rows): one class, odd sizes, two chunks of 4096 with a ragged tail.
CASES = [((1,), 1, False), ((3,), 127, True), ((37,), 1000, False), ((2, 3), 5000, True)]


def reference(logits, target, ignore_index=-100):
    """Per-row cross-entropy in float64, from log-softmax."""
    logp = torch.log_softmax(logits.double(), -1)
    valid = target != ignore_index
    picked = logp.gather(-1, target.masked_fill(~valid, 0).unsqueeze(-1)).squeeze(-1)
    return torch.where(valid, -picked, torch.zeros((), dtype=torch.float64))


def targets(shape, V, ignore_every=4, ignore_index=-100):
    t = torch.randint(0, V, shape)
    t.view(-1)[::ignore_every] = ignore_index
    return t


@pytest.fixture(autouse=True)
def _triton(monkeypatch):
    with triton_path(monkeypatch):
        yield


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape,V,strided", CASES)
def test_loss_and_gradient_match_float64(shape, V, strided, dtype):
    torch.manual_seed(0)
    logits = randn(*shape, V, dtype=dtype, strided=strided, scale=4.0, requires_grad=True)
    target = targets(shape, V)
    dloss = torch.rand(shape)
    with poisoned_outputs():
        loss = cross_entropy(logits, target)
        loss.backward(dloss)
    z64 = leaf64(logits)
    loss64 = reference(z64, target)
    loss64.backward(dloss.double())
    assert loss.dtype == torch.float32 and loss.shape == target.shape
    assert_close(loss, loss64, torch.float32, "loss", scale=4)
    assert_close(logits.grad, z64.grad, dtype, "dlogits")
    assert (logits.grad.view(-1, V)[target.view(-1) == -100] == 0).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_extreme_logits(dtype):
    big = 6e4 if dtype == torch.float16 else 1e30
    logits = torch.randn(6, 300).to(dtype)
    logits[0, 7] = big                           # one dominant class (the target: loss 0)
    logits[1, :] = -big                          # a flat row at the bottom of the range
    logits[2, 100:] = float("-inf")              # masked (padded) vocabulary
    logits[3, ::2] = big                         # ties at the top of the range
    logits[4, 5] = -big                          # target logit far below the rest
    logits[5, :] = float("-inf")
    logits[5, 299] = 0.0                         # all mass on one class that is not the target
    target = torch.tensor([7, 3, 50, 4, 5, 10])
    logits.requires_grad_()
    loss = cross_entropy(logits, target)
    loss.sum().backward()                        # upstream gradient broadcast (stride 0)
    z64 = leaf64(logits)
    loss64 = reference(z64, target)
    loss64.sum().backward()
    assert_close(loss, loss64, torch.float32, "loss", scale=4)
    assert_close(logits.grad, z64.grad, dtype, "dlogits")


def test_custom_ignore_index_and_online_chunks():
    torch.manual_seed(1)
    logits, target = randn(9, 1000, dtype=torch.float32, scale=8.0), targets((9,), 1000, 3, 0)
    m, sumexp, zt, _ = cross_entropy_forward(logits, target, ignore_index=0,
                                             block_v=64).unbind(-1)  # 16 chunks
    valid = target != 0
    assert_close(torch.where(valid, (m - zt) + sumexp.log(), 0.0), reference(logits, target, 0),
                 torch.float32, scale=4)
    grad = cross_entropy_backward(logits, target, m, sumexp.log(), torch.ones(9), ignore_index=0,
                                  block_v=64)
    z64 = leaf64(logits)
    reference(z64, target, 0).sum().backward()
    assert_close(grad, z64.grad, torch.float32)


def smoothed_reference(logits, target, eps, ignore_index=-100):
    """F.cross_entropy with label smoothing, per row, in float64."""
    V = logits.shape[-1]
    return torch.nn.functional.cross_entropy(
        logits.double().view(-1, V), target.view(-1), reduction="none",
        ignore_index=ignore_index, label_smoothing=eps).view(target.shape)


@pytest.mark.parametrize("eps", [0.0, 0.1])
@pytest.mark.parametrize("impl", ["triton", "torch"])
@pytest.mark.parametrize("tp", [1, 4])
def test_vocab_parallel_shards_combine_to_the_full_loss(monkeypatch, impl, tp, eps):
    """Combine the per-shard statistics as the tensor-parallel function does (stacked in rank
    order): loss and gradient equal the unsharded ones, with and without label smoothing."""
    monkeypatch.setenv("FASTPAR_KERNEL_IMPL", impl)
    torch.manual_seed(2)
    N, V = 11, 1000
    logits, target = randn(N, V, dtype=torch.float16, scale=5.0), targets((N,), V)
    shards = logits.chunk(tp, dim=-1)
    starts = [i * (V // tp) for i in range(tp)]
    with poisoned_outputs():
        stats = torch.stack([cross_entropy_shard_stats(z, target, s)
                             for z, s in zip(shards, starts)])
    assert stats.shape == (tp, N, 4) and stats.dtype == torch.float32
    loss, m, log_sum = cross_entropy_combine(stats, target, V, label_smoothing=eps)
    assert_close(loss, smoothed_reference(logits, target, eps), torch.float32, "loss", scale=4)
    dloss = torch.rand(N)
    with poisoned_outputs():
        grad = torch.cat([cross_entropy_shard_grad(z, target, m, log_sum, dloss, s,
                                                   label_smoothing=eps, vocab=V)
                          for z, s in zip(shards, starts)], -1)
    z64 = leaf64(logits)
    smoothed_reference(z64, target, eps).backward(dloss.double())
    assert grad.dtype == torch.float16
    assert_close(grad, z64.grad, torch.float16, "dlogits")


def test_shard_statistics_in_chunks_with_masked_classes():
    """The kernel's four statistics against float64, over 16 chunks of 64 classes: large offsets
    (the running sum of z - max is rescaled as the max grows), a shard whose first chunks are all
    -inf, a target in another shard and an ignored one."""
    torch.manual_seed(3)
    N, V, start = 6, 1000, 2000
    logits = randn(N, V, dtype=torch.float32, scale=3.0)
    logits[0] += 1e4                                        # |z| large, the spread small
    logits[1, :300] = float("-inf")                         # max found only in a later chunk
    logits[2, ::7] = 50.0                                   # many ties at the top
    logits[3, -1] = 80.0                                    # the max in the last (ragged) chunk
    target = torch.tensor([2005, 2400, 17, -100, 2999, 2000])
    stats = cross_entropy_forward(logits, target, start, block_v=64)
    z = logits.double()
    m = z.amax(-1)
    t_local = (target - start).clamp(0, V - 1)
    owned = (target >= start) & (target < start + V)
    want = torch.stack([m, (z - m[:, None]).exp().sum(-1),
                        torch.where(owned, z.gather(1, t_local[:, None])[:, 0], 0.0),
                        torch.where(z.isfinite(), z - m[:, None], 0.0).sum(-1)], -1)
    want[1, 3] = float("-inf")                              # sum (z - m) over -inf classes
    assert_close(stats[:, :3], want[:, :3], torch.float32, "m, s, z_t")
    assert_close(stats[:, 3], want[:, 3], torch.float32, "sum (z - m)")
    reference = _shard_stats_reference(logits, target, start, -100)
    assert_close(reference, want, torch.float32, "torch reference")


def test_torch_path_is_the_same_math(monkeypatch):
    logits, target = randn(4, 3, 50, dtype=torch.float32), targets((4, 3), 50)
    monkeypatch.setenv("FASTPAR_KERNEL_IMPL", "torch")
    assert_close(cross_entropy(logits, target), reference(logits, target), torch.float32)


def test_bad_arguments_are_one_clear_error():
    with pytest.raises(ValueError, match="without the last"):
        cross_entropy(torch.randn(4, 10), torch.zeros(5, dtype=torch.long))
    with pytest.raises(ValueError, match="integer class ids"):
        cross_entropy(torch.randn(4, 10), torch.zeros(4))
