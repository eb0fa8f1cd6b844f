"""The memory model against measured peak memory, per rank, for layouts over tp, SP, pp (each
schedule), dp with and without ZeRO-1, cp, recompute and bf16.

Each layout is a real training run on gloo ranks: the trainer's own ``build_model``, ``_wrap``
(DataParallel, the ZeRO-1 optimizer), pipeline executor, ``forward_backward``, clipping and
optimizer step, two steps so the optimizer state exists. The measurement is allocator-level:
``fastpar.extension.CPUMemory`` counts every CPU tensor allocated and freed after the model is
about to be built, on every thread (gloo's and autograd's included), as
``torch.cuda.max_memory_allocated`` does on a GPU. The prediction is the memory model's row for
the rank's pipeline stage (``planner.memory_rows``, the same function the launch check, the dry
run and the planner call) less the runtime reserve, which is no tensor.

In sample: the ZeRO-1 shard terms and the zero-bubble output-gradient term were added after
seeing "dp2 zero1", "dp2 zero1 bf16 reduce" and "pp2 zb-h1"; every 4-rank layout here was first
run after those terms were frozen. The ZeRO-3 terms (``planner.zero3_bytes``) were written
before either ZeRO-3 layout here first ran. The per-layer activation terms were fitted on autograd's saved
tensors (tests/test_plan.py), not on these peaks.
"""
import gc

import pytest
import torch

import fastpar
from fastpar.extension import CPUMemory
from fastpar.pipeline import PipelineExecutor, build_schedule
from fastpar.plan.planner import memory_rows
from fastpar.testing import run_ranks
from fastpar.train import TrainConfig
from fastpar.train.memory_check import _planner_inputs
from fastpar.train.step import forward_backward, loss_fn
from fastpar.data.packing import Batch
from fastpar.train.batches import step_inputs
from fastpar.train.trainer import (_activation, _clip, _fill, _wrap, build_model,
                                   fully_sharded)

BASE = dict(model="small", seq_len=512, micro_batch_size=2, global_batch_size=8, out="unused")
LAYOUTS = {
    2: {
        "tp2 sp": dict(tp=2, sequence_parallel=True),
        # each micro-batch's forward inside the previous one's backward (fb_overlap, on by
        # default here): one micro-batch's activations and the next one's first half-block
        "tp2": dict(tp=2),
        # two micro-batches' activations and logits at once (planner.schedule_peaks)
        "tp2 interleave 2": dict(tp=2, interleave=2),
        "pp2 1f1b": dict(pp=2),
        "pp2 interleaved": dict(pp=2, virtual_stages=2, schedule="interleaved"),
        "pp2 zb-h1": dict(pp=2, schedule="zb-h1"),
        "cp2": dict(cp=2),
        "tp2 sp selective recompute": dict(tp=2, sequence_parallel=True, recompute="selective"),
        "dp2 zero1 bf16": dict(dp=2, zero=1, precision="bf16"),
        # one micro-batch per step: whole gradients and activations peak apart
        "dp2 zero2 bf16 one micro-batch": dict(dp=2, zero=2, precision="bf16",
                                               micro_batch_size=4),
        # ZeRO-3: shards, two blocks' weights and whole gradients, the root (zero3_bytes)
        "dp2 zero3 bf16 one micro-batch": dict(dp=2, zero=3, precision="bf16",
                                               micro_batch_size=4),
    },
    4: {
        "tp2 pp2": dict(tp=2, pp=2),
        "pp2 dp2 zb-h1": dict(pp=2, dp=2, schedule="zb-h1"),
        "cp2 dp2 bf16 reduce": dict(cp=2, dp=2, precision="bf16",
                                    grad_reduce_dtype="bf16"),
        "dp4 zero3 hsdp2": dict(dp=4, zero=3, dp_shard=2),
    },
}
# Also in bench/bench_memory.py's table, not in the suite (their terms are the layouts' above).
BENCH_ONLY = {
    2: {
        "pp2 gpipe": dict(pp=2, schedule="gpipe"),
        "tp2 full recompute": dict(tp=2, recompute="full"),
        "dp2 zero1": dict(dp=2, zero=1),
    },
    4: {
        # ZeRO-3 under a split backward (each unit freed after its B: the suite counts the
        # units whole in test_zero3_frees_each_unit_after_b_...; its last stage is forecast
        # +9.8 %, too near the tolerance for the suite)
        "pp2 dp2 zb-h1 zero3": dict(pp=2, dp=2, schedule="zb-h1", zero=3),
    },
}
TOLERANCE = 0.10


def _measure(rank, world, layouts=None):
    torch.set_num_threads(1)
    CPUMemory.install()
    out = {}
    for name, dims in (layouts or LAYOUTS)[world].items():
        cfg = TrainConfig(**{**BASE, **dims})
        lay = cfg.check_layout(world)
        mesh = fastpar.init(layout=lay)
        M = cfg.num_microbatches(cfg.global_batch_size, lay.dp)
        g = torch.Generator().manual_seed(0)
        V, B = cfg.model_config.vocab_size, cfg.global_batch_size // lay.dp
        x, y, *_ = step_inputs(Batch(torch.randint(0, V, (B, cfg.seq_len), generator=g),
                                     torch.randint(0, V, (B, cfg.seq_len), generator=g),
                                     None, 1), mesh, M, lambda t: t)
        gc.collect()
        base = CPUMemory.allocated()
        CPUMemory.reset_peak()
        meta = fully_sharded(cfg, mesh)              # ZeRO-3 as the trainer builds it
        chunks = build_model(cfg, mesh, "meta" if meta else None)
        ddp, opt = _wrap(cfg, chunks, mesh)
        if meta:
            _fill(cfg, chunks, mesh, opt, None, None, None)
        pipe = None
        if lay.pp > 1:
            sched = build_schedule(cfg.schedule, lay.pp, M, cfg.virtual_stages)
            pipe = PipelineExecutor(chunks, sched, mesh.pp_group, loss_fn=loss_fn(mesh.tp_group),
                                    stage_loss=True,
                                    activation=_activation(cfg, mesh, chunks, sched))
        for _ in range(2):
            with cfg.train_context("cpu"):
                forward_backward(chunks, ddp, pipe, x, y, M, mesh, interleave=cfg.interleave,
                                 fb_overlap=cfg.fb_overlapped(M))
            _clip(chunks, mesh, cfg.grad_clip, opt)
            opt.step()
            opt.zero_grad(set_to_none=True)
        peak = CPUMemory.peak() - base
        row = memory_rows(*_planner_inputs(cfg, lay, "cpu", 12.0))[mesh.pp_rank]
        del chunks, ddp, opt, pipe
        gc.collect()
        out[name] = (peak / 1e9, row["total"] - row["reserve"],
                     (CPUMemory.allocated() - base) / 1e9)
    return out


@pytest.fixture(scope="module", params=sorted(LAYOUTS))
def measured(request):
    return request.param, run_ranks(_measure, request.param, timeout=170)


def test_the_memory_model_is_within_10_percent_of_the_measured_peak(measured):
    world, ranks = measured
    worst = []
    for name in LAYOUTS[world]:
        for rank, per_layout in enumerate(ranks):
            peak, model, left = per_layout[name]
            assert left < 1e-3, f"{name} rank {rank}: {left:.4f} GB still allocated after the run"
            worst.append((abs(model - peak) / peak, name, rank, model, peak))
    bad = [w for w in worst if w[0] > TOLERANCE]
    assert not bad, "; ".join(f"{n} rank {r}: model {m:.4f} GB, measured {p:.4f} GB ({e:.1%})"
                              for e, n, r, m, p in bad)


def _units_live(rank, world):
    """The most blocks whole at once on this rank during a ZB-H1 step under ZeRO-3, from the
    optimizer's gather / free events."""
    torch.set_num_threads(1)
    cfg = TrainConfig(**{**BASE, "seq_len": 64, "pp": 2, "dp": 2,
                         "schedule": "zb-h1", "zero": 3})
    lay = cfg.check_layout(world)
    mesh = fastpar.init(layout=lay)
    M = cfg.num_microbatches(cfg.global_batch_size, lay.dp)
    chunks = build_model(cfg, mesh, "meta")
    ddp, opt = _wrap(cfg, chunks, mesh)
    _fill(cfg, chunks, mesh, opt, None, None, None)
    sched = build_schedule(cfg.schedule, lay.pp, M, cfg.virtual_stages)
    pipe = PipelineExecutor(chunks, sched, mesh.pp_group, loss_fn=loss_fn(mesh.tp_group),
                            stage_loss=True, activation=_activation(cfg, mesh, chunks, sched))
    g = torch.Generator().manual_seed(0)
    V, B = cfg.model_config.vocab_size, cfg.global_batch_size // lay.dp
    x, y = (torch.randint(0, V, (B, cfg.seq_len), generator=g) for _ in range(2))
    units = opt._units
    ddp.events.enable()
    for _ in range(2):
        forward_backward(chunks, ddp, pipe, x, y, M, mesh)
        opt.step()
        opt.zero_grad(set_to_none=True)
    live, most, gathers = set(), 0, 0
    for name, group, _ in ddp.events.take():
        if group == units.root:
            continue
        if name == "gather":
            live.add(group)
            gathers += 1
        elif name == "free":
            live.discard(group)
        most = max(most, len(live))
    return most, gathers, len(units.groups) - (units.root is not None), M


def test_zero3_frees_each_unit_after_b_under_a_split_backward():
    """Under ZB-H1 a block's weights are freed once its B has run (W reads none): at most the
    block computing and the one prefetched are whole, as the memory model counts
    (``planner.ZERO3_GATHERED``), where before every block of the stage stayed whole from its
    B to the end of the step. Each block is gathered twice per micro-batch (F, B)."""
    for most, gathers, blocks, M in run_ranks(_units_live, 4, timeout=120):
        assert blocks == 4
        assert most <= 2 and gathers == 2 * 2 * M * blocks, (most, gathers, blocks, M)
