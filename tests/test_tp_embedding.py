"""VocabParallelEmbedding: sharded equals nn.Embedding, outputs and weight gradients, over gloo."""
import pytest
import torch
import torch.distributed as dist
from torch import nn

from fastpar.tensor_parallel.embedding import VocabParallelEmbedding
from fastpar.testing import run_ranks

D = 5


def _close(a, b, tol=1e-5):
    # torch.allclose, not torch.testing.assert_close: its first call costs seconds per rank.
    assert a.shape == b.shape and a.dtype == b.dtype, (a.shape, b.shape, a.dtype, b.dtype)
    assert torch.allclose(a, b, atol=tol, rtol=tol), f"max abs diff {(a - b).abs().max()}"


def _ids(shape, vocab, seed):
    """Random ids (same on every rank) that always include both ends and each shard edge."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(vocab, shape, generator=g).view(-1)
    edges = torch.tensor([0, vocab - 1, vocab // 2 - 1, vocab // 2])
    ids[: min(len(edges), ids.numel())] = edges[: ids.numel()]
    return ids.view(shape)


def _check_matches_reference(tp, rank, group, vocab, shape, sp, frozen, seed):
    torch.manual_seed(seed)
    ref = nn.Embedding(vocab, D)
    torch.manual_seed(seed)
    emb = VocabParallelEmbedding(vocab, D, tp_group=group, sequence_parallel=sp)
    assert torch.equal(emb.weight, ref.weight.detach().chunk(tp)[rank]), "init is not the slice"
    ref.weight.requires_grad_(not frozen)
    emb.weight.requires_grad_(not frozen)
    ids = _ids(shape, vocab, seed)
    want = ref(ids)
    out = emb(ids)
    _close(out, want.chunk(tp, dim=0)[rank] if sp else want)
    assert out.requires_grad == (not frozen)
    if frozen:
        return
    dy = torch.randn(want.shape, generator=torch.Generator().manual_seed(seed + 1))
    # (y * dy).sum().backward(), not y.backward(dy): that imports sympy, seconds per rank.
    (want * dy).sum().backward()
    (out * (dy.chunk(tp, dim=0)[rank] if sp else dy)).sum().backward()
    _close(emb.weight.grad, ref.weight.grad.chunk(tp)[rank])


def _expect_error(fn, *fragments):
    try:
        fn()
    except ValueError as e:
        msg = str(e)
        assert all(f in msg for f in fragments), (msg, fragments)
        return msg
    raise AssertionError(f"no ValueError, expected one naming {fragments}")


def _embedding_ranks(rank, world_size):
    tp, group = world_size, dist.group.WORLD
    vocab = 3 * tp  # 3 rows per shard: odd, and small enough that every shard is hit
    seed = 0
    for sp in (False, True):
        for shape in ((2 * tp, 3), (4 * tp,), (tp, 1)):
            for frozen in (False, True):
                seed += 1
                _check_matches_reference(tp, rank, group, vocab, shape, sp, frozen, seed)

    # from_embedding and full_weight round trip, requires_grad kept, no RNG consumed.
    for requires_grad in (True, False):
        torch.manual_seed(100)
        ref = nn.Embedding(vocab, D).requires_grad_(requires_grad)
        state = torch.get_rng_state()
        emb = VocabParallelEmbedding.from_embedding(ref, tp_group=group, sequence_parallel=True)
        assert torch.equal(torch.get_rng_state(), state)
        assert emb.weight.requires_grad == requires_grad and emb.sequence_parallel
        assert torch.equal(emb.weight, ref.weight.detach().chunk(tp)[rank])
        full = emb.full_weight()
        assert torch.equal(full, ref.weight.detach()) and not full.requires_grad

    # dtype is honoured and init still slices nn.Embedding's table.
    torch.manual_seed(7)
    ref = nn.Embedding(vocab, D, dtype=torch.float64)
    torch.manual_seed(7)
    emb = VocabParallelEmbedding(vocab, D, tp_group=group, dtype=torch.float64)
    assert emb.weight.dtype == torch.float64
    assert torch.equal(emb.weight, ref.weight.detach().chunk(tp)[rank])

    # Bad input: ValueError on every rank, raised before any collective (the group still works).
    errors = [
        _expect_error(lambda: VocabParallelEmbedding(2 * tp + 1, D, tp_group=group),
                      "VocabParallelEmbedding", f"num_embeddings={2 * tp + 1}", f"tp={tp}"),
        _expect_error(lambda: emb(torch.zeros(3, 2)), "VocabParallelEmbedding", "ids must be"),
    ]
    sp_emb = VocabParallelEmbedding(vocab, D, tp_group=group, sequence_parallel=True)
    errors.append(_expect_error(lambda: sp_emb(torch.zeros(tp + 1, 2, dtype=torch.long)),
                                "VocabParallelEmbedding", f"sequence length={tp + 1}", f"tp={tp}"))
    errors.append(_expect_error(lambda: sp_emb(torch.zeros(2 * tp, 2)),
                                "VocabParallelEmbedding", "integer", "float32"))
    assert sp_emb(torch.zeros(tp, 2, dtype=torch.int32)).shape == (1, 2, D)
    return errors


@pytest.mark.parametrize("world_size", [2, 4])
def test_vocab_parallel_embedding_matches_nn_embedding(world_size):
    errors = run_ranks(_embedding_ranks, world_size, timeout=90)
    assert all(e == errors[0] for e in errors), "ranks disagree on the errors"
    tp = world_size
    assert f"VocabParallelEmbedding: num_embeddings={2 * tp + 1} is not divisible by tp={tp}" \
        in errors[0][0]


def test_no_group_is_exactly_nn_embedding():
    for sp in (False, True):
        torch.manual_seed(3)
        ref = nn.Embedding(11, D)
        torch.manual_seed(3)
        emb = VocabParallelEmbedding(11, D, sequence_parallel=sp)
        assert emb.tp_size == 1 and torch.equal(emb.weight, ref.weight)
        ids = _ids((7, 3), 11, seed=4)
        want, out = ref(ids), emb(ids)
        assert torch.equal(out, want)
        dy = torch.randn(want.shape)
        want.backward(dy)
        out.backward(dy)
        assert torch.equal(emb.weight.grad, ref.weight.grad)
        assert torch.equal(emb.full_weight(), ref.weight.detach())
    shard = VocabParallelEmbedding.from_embedding(ref)
    assert torch.equal(shard.weight, ref.weight) and shard.weight is not ref.weight
    with pytest.raises(ValueError, match="VocabParallelEmbedding: ids must be an integer"):
        emb(torch.zeros(3, dtype=torch.bool))
    with pytest.raises(ValueError, match="padding_idx"):
        VocabParallelEmbedding.from_embedding(nn.Embedding(11, D, padding_idx=0))
