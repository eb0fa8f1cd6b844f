"""Tensor-parallel MLP block (Column -> GELU -> Row), forward + backward, fastpar vs torch DTensor.

    python bench/bench_tp_mlp.py [--ranks 2] [--hidden 512] [--tokens 2048] [--rounds 5]
    ../shared/tools/shaped-link 1gbit python bench/bench_tp_mlp.py --label 1gbit

Measured with bench/common.py's ``compare``: variants in the same run, interleaved round by
round, the order rotated every round, each round's ``--iters`` steps timed as one window
(medians reported, ratios from the same medians). Variants:
  dtensor       torch's parallelize_module with ColwiseParallel / RowwiseParallel
  dtensor-again a second, identical DTensor block: an A/A control, its ratio is the noise
  dtensor-sp    the sequence-parallel plan as torchtitan writes it: ColwiseParallel with
                sequence-sharded input (all-gather), RowwiseParallel with sequence-sharded
                output (reduce-scatter); the peer of the sp-* rows
  overlap-off   fastpar layers, plain collectives after each GEMM
  overlap-on    fastpar layers, collectives overlapped with GEMMs in the C++ extension
  sp-off/sp-on  the same with sequence parallelism (all-gather / reduce-scatter)
  compute-only  each rank's GEMM shards with no communication at all: the floor
The ``vs_peer`` column divides each row by its peer: dtensor-sp for sp-*, dtensor otherwise.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

import fastpar  # noqa: E402
from fastpar.tensor_parallel import ColumnParallelLinear, RowParallelLinear  # noqa: E402
from fastpar.testing import run_ranks  # noqa: E402


class MLP(nn.Module):
    def __init__(self, fc1, fc2):
        super().__init__()
        self.fc1, self.fc2 = fc1, fc2

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


def _variants(mesh, hidden, ffn, tokens, chunks):
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   parallelize_module)

    tp, g, rank = mesh.tp_size, mesh.tp_group, mesh.tp_rank
    torch.manual_seed(0)
    ref = MLP(nn.Linear(hidden, ffn), nn.Linear(ffn, hidden))
    x = torch.randn(tokens, hidden)
    xs = x.chunk(tp, 0)[rank].contiguous()
    out = {}
    dmesh = DeviceMesh("cpu", mesh.group_ranks("tp"))
    for name in ("dtensor", "dtensor-again"):
        dt = MLP(nn.Linear(hidden, ffn), nn.Linear(ffn, hidden))
        dt.load_state_dict(ref.state_dict())
        out[name] = (parallelize_module(dt, dmesh, {"fc1": ColwiseParallel(),
                                                    "fc2": RowwiseParallel()}), x)
    dt = MLP(nn.Linear(hidden, ffn), nn.Linear(ffn, hidden))
    dt.load_state_dict(ref.state_dict())
    out["dtensor-sp"] = (parallelize_module(dt, dmesh, {
        "fc1": ColwiseParallel(input_layouts=Shard(0)),
        "fc2": RowwiseParallel(output_layouts=Shard(0))}), xs)
    for sp in (False, True):
        for overlap in (False, True):
            m = MLP(ColumnParallelLinear.from_linear(ref.fc1, g, sequence_parallel=sp,
                                                     overlap=overlap),
                    RowParallelLinear.from_linear(ref.fc2, g, sequence_parallel=sp,
                                                  overlap=overlap, chunks=chunks))
            name = ("sp-" if sp else "overlap-") + ("on" if overlap else "off")
            out[name] = (m, xs if sp else x)
    local = MLP(nn.Linear(hidden, ffn // tp), nn.Linear(ffn // tp, hidden))
    out["compute-only"] = (local, x)
    return out


def _measure(rank, world_size, hidden, tokens, rounds, iters, chunks):
    mesh = fastpar.init(tp=world_size)
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // world_size))
    variants = _variants(mesh, hidden, 4 * hidden, tokens, chunks)

    def step(model, x):
        x = x.detach().requires_grad_()
        model(x).float().square().mean().backward()

    for name, (model, x) in variants.items():      # warm-up, and a correctness cross-check
        step(model, x)
    return common.compare({n: (lambda m=m, x=x: step(m, x)) for n, (m, x) in variants.items()},
                          "dtensor", mesh.device, rounds, iters, control="dtensor-again",
                          peers={"sp-off": "dtensor-sp", "sp-on": "dtensor-sp"},
                          barrier=dist.barrier)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--chunks", type=int, default=RowParallelLinear.__init__.__kwdefaults__["chunks"],
                   help="RowParallelLinear's GEMM + all-reduce chunks")
    p.add_argument("--label", default="loopback", help="the link, for the table (e.g. 1gbit)")
    a = p.parse_args(argv)
    result = run_ranks(_measure, a.ranks, a.hidden, a.tokens, a.rounds, a.iters, a.chunks,
                       init_pg=False, timeout=3600)[0]
    med, ratio = result["median"], result["ratio"]
    # fwd + bwd = 3x the forward's 2 GEMMs of 2*T*h*4h flops each, split over the ranks.
    flops = 3 * 2 * (2 * a.tokens * a.hidden * 4 * a.hidden) / a.ranks
    floor = med["compute-only"]
    rows = []
    for name, t in med.items():
        rows.append({"link": a.label, "variant": name, "tp": a.ranks, "hidden": a.hidden,
                     "tokens": a.tokens, "median_ms": t * 1e3,
                     "vs_peer": ratio[name],
                     "comm_share": max(0.0, 1 - floor / t),
                     "GFLOP/s/rank": flops / t / 1e9})
    rows.append({"link": a.label, "variant": "on/off ratio", "median_ms": "",
                 "vs_peer": med["overlap-on"] / med["overlap-off"],
                 "comm_share": max(0.0, 1 - floor / med["overlap-off"])})
    rows.append({"link": a.label, "variant": "sp on/off ratio", "median_ms": "",
                 "vs_peer": med["sp-on"] / med["sp-off"]})
    rows.append({"link": a.label, "variant": "A/A (dtensor-again / dtensor)", "median_ms": "",
                 "vs_peer": ratio["dtensor-again"]})
    common.report(f"tp_mlp_{a.label}", rows, ["link", "variant", "tp", "hidden", "tokens",
                                              "median_ms", "vs_peer", "comm_share",
                                              "GFLOP/s/rank"],
                  [{"key": a.label, **result}])


if __name__ == "__main__":
    main()
