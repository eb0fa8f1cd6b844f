"""All-reduce bandwidth through fastpar.init: 2 ranks, a 64 MB tensor, GB/s.

Run plainly it starts its own ranks on this machine (gloo on CPU, NCCL with GPUs):
    python bench/bench_allreduce.py [--ranks 2] [--mb 64] [--iters 10]
or under torchrun across machines:
    torchrun --nproc-per-node 2 bench/bench_allreduce.py
Reports the median time, the algorithm bandwidth (bytes / time) and the bus bandwidth
(algbw * 2 (n - 1) / n, the nccl-tests convention, comparable across rank counts).
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

import fastpar  # noqa: E402
from fastpar.testing import run_ranks  # noqa: E402


def _measure(rank, world_size, mb, iters):
    mesh = fastpar.init(dp=world_size)
    x = torch.randn(mb * 2**20 // 4, device=mesh.device)      # fp32, mb MiB
    times = common.time_it(lambda: dist.all_reduce(x, group=mesh.dp_group), mesh.device,
                           iters=iters)
    t = torch.tensor(times)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)   # a step is as slow as its slowest rank
    return t.tolist()


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--mb", type=int, default=64, help="tensor size in MiB")
    p.add_argument("--iters", type=int, default=10)
    args = p.parse_args(argv)
    if "RANK" in os.environ:                       # under torchrun: every rank measures
        times = _measure(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), args.mb,
                         args.iters)
        if int(os.environ["RANK"]) != 0:
            return
        n = int(os.environ["WORLD_SIZE"])
    else:
        times = run_ranks(_measure, args.ranks, args.mb, args.iters, init_pg=False,
                          timeout=600)[0]
        n = args.ranks
    med = common.median(times)
    nbytes = args.mb * 2**20
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    row = {"op": "all_reduce", "backend": backend, "ranks": n, "MiB": args.mb,
           "median_ms": med * 1e3, "min_ms": min(times) * 1e3,
           "algbw_GB/s": nbytes / med / 1e9, "busbw_GB/s": nbytes / med / 1e9 * 2 * (n - 1) / n}
    common.report("allreduce", [row], list(row))


if __name__ == "__main__":
    main()
