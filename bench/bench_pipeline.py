"""Pipeline parallelism: fastpar's executor against torch.distributed.pipelining, same model and
micro-batches, on gloo.

    flock /tmp/fastpar-bench.lock python bench/bench_pipeline.py [--pp 2 4] [--runs 3]

For each pp, ``--runs`` times with fresh ranks; each run measures with bench/common.py's
``compare``: ``--rounds`` rounds in which every variant runs ``--iters`` steps as one timed
window, a barrier before it, the order rotated every round (a round's time the slowest rank's,
the median over rounds). Every number in the table is the median over the runs, fastpar / torch
the ratio of the two medians printed (each run's rows are kept in the JSON):
  torch   ScheduleGPipe, Schedule1F1B, ScheduleInterleaved1F1B (v=2),
          ScheduleInterleavedZeroBubble (one stage per rank: ZB-H1's setting),
          ScheduleZBVZeroBubble, ScheduleDualPipeV (two stages per rank in a V)
  fastpar gpipe, 1f1b, interleaved (v=2), zb-h1, zb-v, dualpipe-v
A second torch Schedule1F1B is measured like the others: the "A/A" row (its ratio to the first)
is the noise of the comparison. Reported per schedule: step ms, fastpar / torch, GFLOP/s per rank, the bubble measured from the
executor's timeline (idle / step, averaged over ranks, barrier before each step) and the bubble
and step time that ``fastpar.pipeline.simulate`` predicts from the measured per-stage F / B / W
costs and the measured one-way p2p time; fastpar 1f1b with p2p overlap off (each batch of sends
and receives waited for at once); then zb-h1 against 1f1b, and what the V placement buys: zb-v
and dualpipe-v against zb-h1 (torch's and fastpar's). The model has no MoE layer, so
DualPipeV's pairs hide nothing here: it measures the schedule, not the overlap. The measured step of each schedule is
written as a Chrome trace and a Gantt chart (bench/results/pipeline_pp*_*.json / .png). On a
2-core machine pp=4 runs four ranks on two cores: oversubscribed, so its absolute times mean
little.
"""
from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

import fastpar  # noqa: E402
from fastpar.pipeline import (PipelineExecutor, build_schedule, build_stages,  # noqa: E402
                              chrome_trace, plot_gantt, simulate)
from fastpar.testing import run_ranks  # noqa: E402

SCHEDULES = [("gpipe", 1, "ScheduleGPipe"), ("1f1b", 1, "Schedule1F1B"),
             ("interleaved", 2, "ScheduleInterleaved1F1B"),
             ("zb-h1", 1, "ScheduleInterleavedZeroBubble"),
             ("zb-v", 2, "ScheduleZBVZeroBubble"), ("dualpipe-v", 2, "ScheduleDualPipeV")]
SPLIT = ("zb-h1", "zb-v", "dualpipe-v")


class Block(nn.Module):
    def __init__(self, hidden):
        super().__init__()
        self.ln = nn.LayerNorm(hidden)
        self.fc1, self.fc2 = nn.Linear(hidden, 4 * hidden), nn.Linear(4 * hidden, hidden)

    def forward(self, x):                                   # (B, T, H)
        return x + self.fc2(F.gelu(self.fc1(self.ln(x))))


class Model(nn.Module):
    def __init__(self, vocab, hidden, layers):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.blocks = nn.ModuleDict({str(i): Block(hidden) for i in range(layers)})
        self.norm, self.head = nn.LayerNorm(hidden), nn.Linear(hidden, vocab)


def loss_fn(logits, targets):
    return F.cross_entropy(logits.flatten(0, -2), targets.flatten())


def _torch_step(model, mesh, pp, v, m, cls_name):
    from torch.distributed import pipelining

    placement = "v" if cls_name in ("ScheduleZBVZeroBubble", "ScheduleDualPipeV") else "loop"
    mods = build_stages(model, mesh.pp_rank, pp, v, placement=placement)
    stages = [pipelining.PipelineStage(s, s.stage_index, s.num_stages, mesh.device,
                                       group=mesh.pp_group) for s in mods]
    cls = getattr(pipelining, cls_name)
    single = cls_name in ("ScheduleGPipe", "Schedule1F1B")
    sched = cls(stages[0] if single else stages, n_microbatches=m, loss_fn=loss_fn)
    first = any(s.stage_index == 0 for s in mods)
    last = any(s.stage_index == s.num_stages - 1 for s in mods)

    def step(x, y):
        sched.step(*((x,) if first else ()), **({"target": y} if last else {}))
    return step, mods


def _one_way_p2p(mesh, shape, iters=20):
    """Seconds for one activation message between pp ranks 0 and 1 (half a ping-pong)."""
    t = torch.randn(shape)
    peers, rank = mesh.group_ranks("pp"), mesh.pp_rank
    dist.barrier(mesh.pp_group)
    start = time.perf_counter()
    for _ in range(iters if rank < 2 else 0):
        if rank == 0:
            dist.send(t, peers[1], group=mesh.pp_group)
            dist.recv(t, peers[1], group=mesh.pp_group)
        else:
            dist.recv(t, peers[0], group=mesh.pp_group)
            dist.send(t, peers[0], group=mesh.pp_group)
    out = torch.tensor([(time.perf_counter() - start) / (2 * iters) if rank < 2 else 0.0])
    dist.all_reduce(out, op=dist.ReduceOp.MAX, group=mesh.pp_group)
    return out.item()


def _bubble_and_costs(pipe, step, x, y, mesh, steps=3):
    """Measured bubble (barrier before each step) and per-stage mean F / B / W seconds."""
    pp, v = mesh.pp_size, pipe.schedule.virtual_stages
    bubbles, costs = [], {k: [[] for _ in range(pp * v)] for k in "FBW"}
    for _ in range(steps):
        dist.barrier(mesh.pp_group)
        t0 = time.perf_counter()
        step(x, y)
        wall = time.perf_counter() - t0
        busy = sum(e.end - e.start for e in pipe.events)
        both = torch.tensor([[wall, busy]])
        gathered = [torch.zeros_like(both) for _ in range(pp)]
        dist.all_gather(gathered, both, group=mesh.pp_group)
        walls = torch.cat(gathered)
        bubbles.append((1 - walls[:, 1] / walls[:, 0].max()).mean().item())
        for e in pipe.events:
            costs[e.action.kind][pipe.schedule.stage_index(mesh.pp_rank, e.action.chunk)].append(
                e.end - e.start)
    flat = torch.tensor([[statistics.mean(c) if c else 0.0 for c in costs[k]] for k in "FBW"])
    dist.all_reduce(flat, group=mesh.pp_group)              # each stage is on exactly one rank
    timeline = [None] * pp                                  # the last step, every rank
    dist.all_gather_object(timeline, pipe.events, group=mesh.pp_group)
    return statistics.median(bubbles), flat.tolist(), [e for r in timeline for e in r]


def _measure(rank, world_size, a):
    pp = world_size
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // pp))
    mesh = fastpar.init(pp=pp)
    torch.manual_seed(0)
    base = Model(a.vocab, a.hidden, a.layers)
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, a.vocab, (a.micro * a.m, a.seq), generator=g)
    y = torch.randint(0, a.vocab, (a.micro * a.m, a.seq), generator=g)
    variants, pipes = {}, {}
    for name, v, torch_cls in SCHEDULES:
        variants[f"torch {name}"] = _torch_step(copy.deepcopy(base), mesh, pp, v, a.m, torch_cls)
        sched = build_schedule(name, pp, a.m, v)
        mods = build_stages(copy.deepcopy(base), rank, pp, v, placement=sched.placement)
        pipe = PipelineExecutor(mods, sched, mesh.pp_group, loss_fn=loss_fn, record=True,
                                activation=((a.micro, a.seq, a.hidden), torch.float32))
        pipes[name] = pipe
        variants[f"fastpar {name}"] = (lambda x, y, pipe=pipe: pipe.step(x, y), mods)
    # An A/A control: a second torch Schedule1F1B, measured like the others.
    variants["torch 1f1b again"] = _torch_step(copy.deepcopy(base), mesh, pp, 1, a.m,
                                               "Schedule1F1B")
    # 1F1B again with every p2p batch waited for at once: what posting receives early buys.
    mods = build_stages(copy.deepcopy(base), rank, pp)
    sync = PipelineExecutor(mods, build_schedule("1f1b", pp, a.m), mesh.pp_group,
                            loss_fn=loss_fn, overlap=False)
    variants["fastpar 1f1b overlap off"] = (lambda x, y: sync.step(x, y), mods)

    def run(key):
        step, mods = variants[key]
        for mod in mods:
            mod.zero_grad(set_to_none=True)
        step(x, y)

    for key in variants:                                     # warm-up (and shape inference)
        run(key)
    # Each fastpar schedule against torch's of the same name; the rest against torch 1F1B.
    result = common.compare({key: (lambda key=key: run(key)) for key in variants},
                            "torch 1f1b", mesh.device, a.rounds, a.iters,
                            control="torch 1f1b again",
                            peers={f"fastpar {name}": f"torch {name}" for name, _, _ in SCHEDULES},
                            barrier=lambda: dist.barrier(mesh.pp_group), group=mesh.pp_group)
    out = {"ms": {key: t * 1e3 for key, t in result["median"].items()}, "compare": result,
           "p2p_ms": _one_way_p2p(mesh, (a.micro, a.seq, a.hidden)) * 1e3}
    for name, pipe in pipes.items():
        bubble, costs, events = _bubble_and_costs(pipe, lambda x, y: run(f"fastpar {name}"), x,
                                                  y, mesh)
        out[name] = {"bubble": bubble, "costs": costs, "events": events}
    return out


def _write_timelines(pp, res):
    """The measured step of each fastpar schedule as a Chrome trace (and a Gantt PNG)."""
    common.RESULTS.mkdir(exist_ok=True)
    for name, _, _ in SCHEDULES:
        events = res[name].pop("events")
        stem = common.RESULTS / f"pipeline_pp{pp}_{name}"
        chrome_trace(events, stem.with_suffix(".json"), unit_us=1e6, name=f"{name} pp={pp}")
        try:
            plot_gantt(events, stem.with_suffix(".png"), pp, f"fastpar {name}, pp={pp}, measured")
        except ImportError:
            pass


def _rows(pp, res, a, flops_per_step):
    rows = []
    comm = res["p2p_ms"] / 1e3
    sims = {}
    for name, v, torch_cls in SCHEDULES:
        fc, bc, wc = res[name]["costs"]
        split = name in SPLIT
        sim = simulate(build_schedule(name, pp, a.m, v), f=fc, b=bc, w=wc if split else 0.0,
                       comm=comm)
        sims[name] = sim
        t_ms, f_ms = res["ms"][f"torch {name}"], res["ms"][f"fastpar {name}"]
        rows.append({"pp": pp, "schedule": name, "torch": torch_cls, "torch_ms": t_ms,
                     "fastpar_ms": f_ms, "fastpar/torch": f_ms / t_ms,
                     "GFLOP/s/rank": flops_per_step / pp / (f_ms / 1e3) / 1e9,
                     "bubble_meas": res[name]["bubble"], "bubble_sim": sim.bubble_fraction,
                     "sim_ms": sim.step_time * 1e3})
    ms = res["ms"]
    rows.append({"pp": pp, "schedule": "1f1b, p2p overlap off", "torch": "Schedule1F1B",
                 "torch_ms": ms["torch 1f1b"], "fastpar_ms": ms["fastpar 1f1b overlap off"],
                 "fastpar/torch": ms["fastpar 1f1b overlap off"] / ms["torch 1f1b"]})
    rows.append({"pp": pp, "schedule": "A/A: torch 1f1b again", "torch": "Schedule1F1B",
                 "torch_ms": ms["torch 1f1b"], "fastpar_ms": ms["torch 1f1b again"],
                 "fastpar/torch": ms["torch 1f1b again"] / ms["torch 1f1b"]})
    rows.append({"pp": pp, "schedule": "zb-h1 / 1f1b", "torch": "ZB / 1F1B",
                 "torch_ms": ms["torch zb-h1"] / ms["torch 1f1b"],
                 "fastpar_ms": ms["fastpar zb-h1"] / ms["fastpar 1f1b"],
                 "sim_ms": sims["zb-h1"].step_time / sims["1f1b"].step_time,
                 "bubble_meas": res["zb-h1"]["bubble"] - res["1f1b"]["bubble"],
                 "bubble_sim": sims["zb-h1"].bubble_fraction - sims["1f1b"].bubble_fraction})
    for name, base in (("zb-v", "zb-h1"), ("dualpipe-v", "zb-h1"), ("zb-v", "1f1b"),
                       ("dualpipe-v", "1f1b")):
        rows.append({"pp": pp, "schedule": f"{name} / {base}", "torch": "V / one stage",
                     "torch_ms": ms[f"torch {name}"] / ms[f"torch {base}"],
                     "fastpar_ms": ms[f"fastpar {name}"] / ms[f"fastpar {base}"],
                     "sim_ms": sims[name].step_time / sims[base].step_time,
                     "bubble_meas": res[name]["bubble"] - res[base]["bubble"],
                     "bubble_sim": sims[name].bubble_fraction - sims[base].bubble_fraction})
    return rows


def _median_res(results: list[dict]) -> dict:
    """Every measured number of several runs' results, the median over the runs."""
    med = statistics.median
    out = {"ms": {k: med([r["ms"][k] for r in results]) for k in results[0]["ms"]},
           "p2p_ms": med([r["p2p_ms"] for r in results])}
    for name, _, _ in SCHEDULES:
        costs = [r[name]["costs"] for r in results]
        out[name] = {"bubble": med([r[name]["bubble"] for r in results]),
                     "costs": [[med(c) for c in zip(*rows)] for rows in zip(*costs)]}
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pp", type=int, nargs="+", default=[2, 4])
    p.add_argument("--m", type=int, default=8, help="micro-batches per step")
    p.add_argument("--micro", type=int, default=4, help="sequences per micro-batch")
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--vocab", type=int, default=2048)
    p.add_argument("--runs", type=int, default=3, help="fresh ranks per run; medians over runs")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--iters", type=int, default=2)
    a = p.parse_args(argv)
    h = a.hidden
    # fwd + bwd = 6 flops per weight per token: blocks (8 h^2 each) and the head (h * vocab).
    flops_per_step = 6 * (a.layers * 8 * h * h + h * a.vocab) * a.micro * a.m * a.seq
    rows, comparisons = [], []
    for pp in a.pp:
        results = []
        for _ in range(a.runs):
            res = run_ranks(_measure, pp, a, init_pg=False, timeout=3600)[0]
            _write_timelines(pp, res)
            comparisons.append({"key": f"pp{pp}", **res.pop("compare")})
            results.append(res)
        # Every column, ratios too, from the medians over the runs; each run's rows kept.
        per_run = [_rows(pp, res, a, flops_per_step) for res in results]
        merged = _median_res(results)
        med_rows = _rows(pp, merged, a, flops_per_step)
        med_rows[-1]["p2p_ms"] = merged["p2p_ms"]
        for i, row in enumerate(med_rows):
            row["runs"] = [run[i] for run in per_run]
        rows += med_rows
    common.report("pipeline", rows, ["pp", "schedule", "torch", "torch_ms", "fastpar_ms",
                                     "fastpar/torch", "GFLOP/s/rank", "bubble_meas",
                                     "bubble_sim", "sim_ms", "p2p_ms"], comparisons)


if __name__ == "__main__":
    main()
