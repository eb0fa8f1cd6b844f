"""Data parallelism under pipeline parallelism: the DP bucket reductions of a step start inside
each chunk's last backward (not after the pipeline step), with the same numbers; pp=2 x dp=2
loss curves per schedule."""
import time

import pytest
import torch
import torch.nn as nn

from fastpar.testing import run_ranks
from fastpar.train import TrainConfig

CASES = [("1f1b", 1, False), ("interleaved", 2, False), ("zb-h1", 1, False), ("1f1b", 1, True)]


def _one_step(mesh, name, v, zero1, overlap):
    """One trainer step (fastpar.train's own pieces) on the tiny GPT; what the rank saw."""
    from fastpar.data_parallel import DataParallel, DistributedOptimizer
    from fastpar.pipeline import PipelineExecutor, build_schedule
    from fastpar.train.step import forward_backward, loss_fn
    from fastpar.train.trainer import build_model

    cfg = TrainConfig(model="tiny", pp=2, schedule=name, virtual_stages=v, seq_len=32,
                      global_batch_size=16, micro_batch_size=2, zero=int(zero1))
    M = cfg.num_microbatches(cfg.global_batch_size, mesh.dp_size)
    torch.manual_seed(cfg.seed)
    chunks = build_model(cfg, mesh)
    ddp = DataParallel(nn.ModuleList(chunks), dp_group=mesh.dp_group)
    params = [p for c in chunks for p in c.parameters()]
    opt = (DistributedOptimizer(ddp, torch.optim.AdamW, lr=1e-2) if zero1
           else torch.optim.AdamW(params, lr=1e-2))
    stages = chunks
    pipe = PipelineExecutor(stages, build_schedule(name, 2, M, v), mesh.pp_group,
                            loss_fn=loss_fn(mesh.tp_group), record=True)
    accumulated = []                # when any gradient was accumulated (hooks, this thread)
    for p in params:
        p.register_post_accumulate_grad_hook(lambda _p: accumulated.append(time.perf_counter_ns()))
    g = torch.Generator().manual_seed(100 + mesh.dp_rank)
    x = torch.randint(0, 256, (16 // mesh.dp_size, 32), generator=g)
    y = torch.randint(0, 256, (16 // mesh.dp_size, 32), generator=g)
    ddp.events.enable()
    forward_backward(chunks, ddp, pipe, x, y, M, mesh, overlap=overlap)
    events = ddp.events.take()
    backward_end = max(e.end for e in pipe.events if e.action.kind in ("B", "W"))
    backward_end_ns = int((pipe.step_start + backward_end) * 1e9)
    launches = [t for kind, _, t in events if kind == "launch"]
    grads = [p.grad.clone() for p in params] if not zero1 else []
    opt.step()
    return dict(buckets=len(ddp.bucket_specs), launches=len(launches),
                before_backward_end=sum(t < backward_end_ns for t in launches),
                before_last_grad=sum(t < max(accumulated) for t in launches),
                grads=grads, params=[p.detach().clone() for p in params])


def _overlap_run(rank, world_size):
    import fastpar

    torch.set_num_threads(1)
    mesh = fastpar.init(pp=2, dp=2)
    out = {}
    for name, v, zero1 in CASES:
        on, off = (_one_step(mesh, name, v, zero1, overlap) for overlap in (True, False))
        same = all(torch.equal(a, b) for a, b in zip(on.pop("grads"), off.pop("grads")))
        same = same and all(torch.equal(a, b) for a, b in zip(on.pop("params"),
                                                              off.pop("params")))
        out[(name, v, zero1)] = dict(on=on, off=off, same=same)
    return out


def test_dp_buckets_start_inside_the_last_backward_and_numbers_are_identical():
    per_rank = run_ranks(_overlap_run, 4, init_pg=False, timeout=240)
    for rank, out in enumerate(per_rank):
        for case, r in out.items():
            on, off = r["on"], r["off"]
            where = f"rank {rank} {case}"
            assert on["launches"] == off["launches"] == on["buckets"] >= 2, (where, r)
            # On: a bucket was all-reducing while this rank still computed gradients of other
            # parameters, i.e. before its last backward action had finished.
            assert on["before_last_grad"] >= 1, (where, r)
            assert on["before_backward_end"] >= 1, (where, r)
            # Off (the old behaviour): every bucket starts after the whole pipeline step.
            assert off["before_backward_end"] == off["before_last_grad"] == 0, (where, r)
            assert r["same"], f"{where}: overlap on and off differ"


# The loss curve of pp=2 x dp=2 per schedule against one process (few steps: CI time).
BASE = dict(model="tiny", seq_len=32, global_batch_size=8, micro_batch_size=2, steps=6,
            warmup_steps=2, log_every=100, no_save=True)
LAYOUTS = {
    "pp2-dp2-1f1b": dict(pp=2, dp=2, schedule="1f1b"),
    "pp2-dp2-interleaved": dict(pp=2, dp=2, schedule="interleaved", virtual_stages=2),
    "pp2-dp2-zbh1": dict(pp=2, dp=2, schedule="zb-h1"),
    "pp2-dp2-1f1b-zero1": dict(pp=2, dp=2, schedule="1f1b", zero=1),
}


def _train(rank, world_size, kwargs):
    from fastpar.train import train

    return [r["loss"] for r in train(TrainConfig(**kwargs))]


def _losses(world, out, **kwargs):
    return run_ranks(_train, world, dict(BASE, out=str(out), **kwargs), init_pg=False,
                     timeout=240)[0]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return _losses(1, tmp_path_factory.mktemp("ref"))


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_pp_dp_loss_curve_equals_single_process(name, reference, tmp_path):
    losses = _losses(4, tmp_path, **LAYOUTS[name])
    for step, (a, b) in enumerate(zip(losses, reference, strict=True), 1):
        assert abs(a - b) <= 1e-5 * abs(b), f"{name} step {step}: {a} vs {b}"
