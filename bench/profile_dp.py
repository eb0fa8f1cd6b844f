"""Where a data-parallel step spends its time: DDP (bucket views) vs fastpar's DataParallel and
ZeRO-1, phase by phase, on the bench_dp_mlp.py model.

    python bench/profile_dp.py [--steps 12] [--hidden 1024] [--layers 12] [--batch 128]
    ../shared/tools/shaped-link 10gbit python bench/profile_dp.py --label 10gbit
    python bench/profile_dp.py --ops 15        # also each variant's top operators (torch.profiler)

Each step is cut into phases timed on the host with a barrier before the step: ``zero_grad``,
``forward``, ``backward`` (up to the return of ``backward()``: for both libraries that includes
waiting for every bucket's reduction; with ``overlap_step`` (dp-step, zero1-step) also the
optimizer), ``step`` (the optimizer; ZeRO-1's launches the parameter all-gathers) and ``gather`` (ZeRO-1's wait for that gather, which the next forward would do).
Variants take turns step by step in a rotated order. Reported per variant and phase: the median
over steps of the slowest rank's time. With ``--ops N`` one more step per variant runs under
torch.profiler and its N most expensive operators (self CPU time, rank 0) are printed. A
diagnostic, not a comparison: bench_dp_mlp.py measures the step.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
from bench_dp_mlp import _variants  # noqa: E402

import fastpar  # noqa: E402
from fastpar.testing import run_ranks  # noqa: E402

PHASES = ("zero_grad", "forward", "backward", "step", "gather")
SHOWN = ("ddp", "ddp-again", "overlap-on", "dp-step", "zero1", "zero1-step", "compute-only")


def _profile(rank, world_size, hidden, layers, batch, bucket_mb, steps, ops):
    mesh = fastpar.init(dp=world_size)
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // world_size))
    variants = {n: v for n, v in _variants(mesh, hidden, layers, bucket_mb).items() if n in SHOWN}
    torch.manual_seed(100 + rank)
    x, y = torch.randn(batch, hidden), torch.randn(batch, hidden)

    def step(name):
        model, opt = variants[name]
        marks = [time.perf_counter()]
        opt.zero_grad()
        marks.append(time.perf_counter())
        loss = F.mse_loss(model(x), y)
        marks.append(time.perf_counter())
        loss.backward()
        marks.append(time.perf_counter())
        opt.step()
        marks.append(time.perf_counter())
        if name.startswith("zero1"):
            opt.finish_param_sync()
        marks.append(time.perf_counter())
        return [b - a for a, b in zip(marks, marks[1:])]

    names = list(variants)
    for n in names:                                 # warm-up
        step(n)
    times = {n: [] for n in names}
    for s in range(steps):
        for n in common.rotated(names, s):
            dist.barrier()
            times[n].append(step(n))
    t = torch.tensor([times[n] for n in names], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)        # each phase as slow as the slowest rank
    med = {n: [statistics.median(t[i, :, p].tolist()) for p in range(len(PHASES))]
           for i, n in enumerate(names)}
    tables = {}
    if ops:
        for n in names:
            dist.barrier()
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                step(n)
            tables[n] = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=ops)
    return med, tables


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--bucket-mb", type=float, default=25.0)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--ops", type=int, default=0, help="print each variant's top N operators")
    p.add_argument("--label", default="loopback")
    a = p.parse_args(argv)
    med, tables = run_ranks(_profile, a.ranks, a.hidden, a.layers, a.batch, a.bucket_mb,
                            a.steps, a.ops, init_pg=False, timeout=3600)[0]
    for n, table in tables.items():
        print(f"== {n}: top operators of one step, rank 0\n{table}")
    rows = [{"link": a.label, "variant": n, **{ph + "_ms": v * 1e3 for ph, v in zip(PHASES, m)},
             "total_ms": sum(m) * 1e3} for n, m in med.items()]
    common.report(f"profile_dp_{a.label}", rows,
                  ["link", "variant", *(ph + "_ms" for ph in PHASES), "total_ms"])


if __name__ == "__main__":
    main()
