"""Balanced stages, cutting a model into stages, and the executor in one process (pp = 1)."""
import copy
import itertools
import random
import time

import pytest
import torch
import torch.nn as nn

from fastpar.pipeline import (PipelineExecutor, PipelineStage, build_schedule, build_stages,
                              estimate_layer_costs, partition)
from pp_model import ToyModel, batch, loss_fn


def _brute_force(costs, stages):
    """The smallest possible maximum stage cost, trying every split."""
    first, last, block = costs[0], costs[-1], costs[1:-1]
    best = float("inf")
    for cuts in itertools.combinations(range(1, len(block)), stages - 1):
        bounds = (0, *cuts, len(block))
        loads = [sum(block[a:b]) for a, b in zip(bounds, bounds[1:])]
        loads[0] += first
        loads[-1] += last
        best = min(best, max(loads))
    return best


def _load(costs, parts, s):
    return (sum(costs[1:-1][i] for i in parts[s]) + (costs[0] if s == 0 else 0)
            + (costs[-1] if s == len(parts) - 1 else 0))


def test_partition_is_optimal_and_counts_embedding_and_head():
    assert partition([0] + [1] * 8 + [0], 4) == [range(0, 2), range(2, 4), range(4, 6),
                                                 range(6, 8)]
    # A head costing three blocks and an embedding costing half of one: stage loads 3.5 4 4 4,
    # where splitting the blocks alone (3 per stage) would load the last stage with 6.
    costs = [0.5] + [1] * 12 + [3]
    parts = partition(costs, 4)
    assert parts == [range(0, 3), range(3, 7), range(7, 11), range(11, 12)]
    assert [_load(costs, parts, s) for s in range(4)] == [3.5, 4, 4, 4]
    # Virtual stages: pp * v stages in model order.
    assert len(partition([1] * 10, 2, virtual_stages=4)) == 8
    rng = random.Random(0)
    for _ in range(40):
        n, stages = rng.randint(2, 9), rng.randint(1, 4)
        if n < stages:
            continue
        costs = [rng.uniform(0, 3) for _ in range(n + 2)]
        parts = partition(costs, stages)
        assert [i for p in parts for i in p] == list(range(n)) and all(parts)
        got = max(_load(costs, parts, s) for s in range(stages))
        assert got == pytest.approx(_brute_force(costs, stages))


def test_partition_of_equal_blocks_is_optimal_and_fast():
    # Equal blocks (every layer of a Transformer) take a closed form instead of the DP.
    rng = random.Random(1)
    for _ in range(60):
        n, stages = rng.randint(2, 11), rng.randint(2, 5)
        if n < stages:
            continue
        c = rng.uniform(0.5, 2)
        costs = [rng.uniform(0, 4 * c)] + [c] * n + [rng.uniform(0, 4 * c)]
        parts = partition(costs, stages)
        assert [i for p in parts for i in p] == list(range(n)) and all(parts)
        got = max(_load(costs, parts, s) for s in range(stages))
        assert got == pytest.approx(_brute_force(costs, stages)), (costs, stages, parts)
    t0 = time.perf_counter()
    parts = partition([7.0] + [1.0] * 160 + [12.0], 64)      # a 1T model's 160 layers
    assert time.perf_counter() - t0 < 2.0
    assert len(parts) == 64 and max(_load([7.0] + [1.0] * 160 + [12.0], parts, s)
                                    for s in range(64)) == pytest.approx(_brute_force_uniform())


def _brute_force_uniform():
    # 160 blocks of 1, embedding 7, head 12, 64 stages: the best maximum over every block count
    # of the first and the last stage, the middle stages sharing the rest evenly.
    best = float("inf")
    for n0 in range(1, 100):
        for nl in range(1, 160 - n0 - 62 + 1):
            q = -(-(160 - n0 - nl) // 62)
            best = min(best, max(7 + n0, 12 + nl, q))
    return best


def test_partition_bad_input():
    with pytest.raises(ValueError, match="3 blocks .* cannot fill 4 stages"):
        partition([1] * 5, 4)
    with pytest.raises(ValueError, match="cannot fill 8 stages.*pp_size=2 x virtual_stages=4"):
        partition([1] * 6, 2, 4)
    with pytest.raises(ValueError, match="must be >= 0"):
        partition([1, -1, 1, 1], 1)
    with pytest.raises(ValueError, match="pp_size=0"):
        partition([1, 1, 1], 0)


def test_estimate_layer_costs():
    model = ToyModel(vocab=64, hidden=8, layers=3)
    flops = estimate_layer_costs(model)
    block = 6 * sum(p.numel() for p in model.blocks["0"].parameters())
    assert flops == [6 * 8, block, block, block,
                     6 * (sum(p.numel() for p in model.norm.parameters()) + 64 * 8 + 64)]
    tokens, targets = batch(0, size=4, vocab=64)
    times = estimate_layer_costs(model, tokens, target=targets, loss_fn=loss_fn, steps=2)
    assert len(times) == 5 and all(t > 0 for t in times)
    assert all(p.grad is None for p in model.parameters())     # the profile leaves no gradients
    parts = build_stages(model, 0, 1, layer_costs=flops)[0]
    assert parts.block_names == ["0", "1", "2"]


def test_build_stages_cover_the_model_once():
    model = ToyModel(layers=8)
    for pp, v in ((1, 1), (2, 1), (4, 1), (2, 2), (4, 2)):
        names = []
        for rank in range(pp):
            stages = build_stages(model, rank, pp, v)
            assert [st.stage_index for st in stages] == [c * pp + rank for c in range(v)]
            for st in stages:
                names += [n for n, _ in st.named_parameters()]
        assert sorted(names) == sorted(n for n, _ in model.named_parameters()), (pp, v)
    first, = build_stages(model, 0, 2, parts=[range(0, 3), range(3, 8)])
    assert first.block_names == ["0", "1", "2"] and first.is_first and not first.is_last
    x = torch.randint(0, 32, (2, 5))
    last, = build_stages(model, 1, 2, parts=[range(0, 3), range(3, 8)])
    assert torch.equal(last(first(x)), model(x))               # the stages compose to the model


def test_build_stages_bad_input():
    model = ToyModel(layers=4)
    cases = [
        (lambda: build_stages(nn.Linear(2, 2), 0, 2), "model.blocks must be an nn.ModuleDict"),
        (lambda: build_stages(model, 2, 2), "pp_rank=2 out of range for pp_size=2"),
        (lambda: build_stages(model, 0, 2, 4), "4 blocks .* cannot fill 8 stages"),
        (lambda: build_stages(model, 0, 2, parts=[range(0, 2), range(3, 4)]),
         "stage 1 gets blocks range\\(3, 4\\), expected a non-empty range starting at block 2"),
        (lambda: build_stages(model, 0, 2, parts=[range(0, 2), range(2, 3)]),
         "end at block 3, the model has 4 blocks"),
        (lambda: build_stages(model, 0, 2, first=("tok_embeddings",)), "no attribute "
                                                                        "'tok_embeddings'"),
        (lambda: build_stages(model, 0, 2, layer_costs=[1, 2]), "layer_costs has 2 entries"),
        (lambda: PipelineStage(3, 2, {}), "stage_index=3 out of range"),
    ]
    for fn, pattern in cases:
        with pytest.raises(ValueError, match=pattern):
            fn()


class _Reuse(nn.Module):
    """A block that runs one Linear twice (its weight gradient cannot be split off)."""

    def __init__(self, hidden):
        super().__init__()
        self.fc = nn.Linear(hidden, hidden)

    def forward(self, x):
        return x + torch.tanh(self.fc(torch.tanh(self.fc(x))))


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "zb-h1"])
def test_single_process_matches_unpipelined(name):
    """pp = 1: every schedule, including the B/W split with a reused module and tied weights."""
    torch.manual_seed(0)
    model = ToyModel(layers=3)
    model.blocks["1"] = _Reuse(16)
    model.head.weight = model.embed.weight                      # tied: one parameter, two uses
    ref = copy.deepcopy(model)
    tokens, targets = batch(3, size=6)
    pipe = PipelineExecutor(build_stages(model, 0, 1), build_schedule(name, 1, 3), None,
                            loss_fn=loss_fn, record=True)
    loss = pipe.step(tokens, targets)
    ref_loss = loss_fn(ref(tokens), targets)
    ref_loss.backward()
    assert torch.allclose(loss, ref_loss, atol=1e-6)
    for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        assert torch.allclose(p.grad, q.grad, atol=1e-6, rtol=1e-5), (name, n)
    assert pipe.peak_activations == (3 if name == "gpipe" else 1)
    assert [e.action.kind for e in pipe.events].count("F") == 3
    with pytest.raises(ValueError, match="7 samples in dim 0, which do not split into "
                                         "num_microbatches=3"):
        pipe.step(tokens[:1].repeat(7, 1), targets[:1].repeat(7, 1))
    with pytest.raises(ValueError, match="micro-batch shape \\(1, 5\\) differs"):
        pipe.step(tokens[:3], targets[:3])
