"""All-reduce bandwidth: fastpar's path against torch's dist.all_reduce, 2 ranks, a 64 MB tensor.

Run plainly it starts its own ranks on this machine (gloo on CPU, NCCL with GPUs):
    python bench/bench_allreduce.py [--ranks 2] [--mb 64] [--rounds 5] [--iters 10]
or under torchrun across machines:
    torchrun --nproc-per-node 2 bench/bench_allreduce.py
Variants, measured with bench/common.py's ``compare`` (the order rotated every round, each
round's ``--iters`` all-reduces timed as one window, the slowest rank, medians over rounds):
  torch        dist.all_reduce on the default (world) group, as torch's documentation calls it
  torch-again  the same on a second buffer: an A/A control, its ratio to torch is the noise
  fastpar      what DataParallel's buckets go through: the dp group ``fastpar.init`` built
               (NCCL: high-priority streams) and ``all_reduce_async`` + wait
Reports the median time, the ratio to torch, the algorithm bandwidth (bytes / time) and the bus
bandwidth (algbw * 2 (n - 1) / n, the nccl-tests convention, comparable across rank counts).
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
from fastpar.data_parallel.comm import all_reduce_async  # noqa: E402
from fastpar.testing import run_ranks  # noqa: E402


def _measure(rank, world_size, mb, rounds, iters):
    mesh = fastpar.init(dp=world_size)
    # One fp32 buffer of mb MiB per variant. Each sum multiplies its values by about the rank
    # count; should they overflow to inf, adding infs costs what adding numbers costs.
    bufs = {name: torch.randn(mb * 2**20 // 4, device=mesh.device)
            for name in ("torch", "torch-again", "fastpar")}

    def fastpar_all_reduce():
        work = all_reduce_async(bufs["fastpar"], mesh.dp_group)
        if work is not None:
            work.wait()

    variants = {"torch": lambda: dist.all_reduce(bufs["torch"]),
                "torch-again": lambda: dist.all_reduce(bufs["torch-again"]),
                "fastpar": fastpar_all_reduce}
    for fn in variants.values():                   # warm-up (connections, NCCL's channels)
        for _ in range(2):
            fn()
    return common.compare(variants, "torch", mesh.device, rounds, iters,
                          control="torch-again", barrier=dist.barrier)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--mb", type=int, default=64, help="tensor size in MiB")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--iters", type=int, default=10, help="all-reduces per variant and round")
    p.add_argument("--label", default="loopback", help="the link, for the table (e.g. 1gbit)")
    args = p.parse_args(argv)
    if "RANK" in os.environ:                       # under torchrun: every rank measures
        result = _measure(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), args.mb,
                          args.rounds, args.iters)
        if int(os.environ["RANK"]) != 0:
            return
        n = int(os.environ["WORLD_SIZE"])
    else:
        result = run_ranks(_measure, args.ranks, args.mb, args.rounds, args.iters,
                           init_pg=False, timeout=600)[0]
        n = args.ranks
    nbytes = args.mb * 2**20
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    rows = []
    for name, med in result["median"].items():
        rows.append({"link": args.label, "op": "all_reduce", "variant": name, "backend": backend,
                     "ranks": n, "MiB": args.mb, "median_ms": med * 1e3, "vs_torch": result["ratio"][name],
                     "min_ms": min(result["seconds"][name]) * 1e3,
                     "algbw_GB/s": nbytes / med / 1e9,
                     "busbw_GB/s": nbytes / med / 1e9 * 2 * (n - 1) / n})
    common.report(f"allreduce_{args.label}", rows, list(rows[0]), [{"key": args.label, **result}])


if __name__ == "__main__":
    main()
