"""Data-parallel MLP training step (forward, backward, AdamW), fastpar against torch DDP.

    python bench/bench_dp_mlp.py [--ranks 2] [--hidden 1024] [--layers 12] [--batch 128]
    ../shared/tools/shaped-link 1gbit python bench/bench_dp_mlp.py --label 1gbit
    ../shared/tools/shaped-link 1gbit python bench/bench_dp_mlp.py --label 1gbit-b1536 \
        --batch 1536 --bucket-mb 4 --rounds 6 --iters 2   # a backward longer than the reduction

``hidden`` is the share of the reduction a variant hides; it is bounded by the backward's length
over the reduction's, and by the last bucket, which can only start when backward ends.

Measured with bench/common.py's ``compare``: variants in the same run, interleaved round by
round, the order rotated each round (medians reported, ratios from the same medians). Each round
times its steps as one window that also holds the wait for the last step's deferred work
(ZeRO-1's parameter gather), so nothing a variant launches finishes outside the timing. Several
runs: ``python bench/repeat.py --runs 3 -- python bench/bench_dp_mlp.py ...``. Variants:
  ddp           torch DistributedDataParallel, same bucket size, gradient_as_bucket_view=True
  ddp-again     a second, identical DDP model: an A/A control, its ratio to ddp is the noise
  overlap-off   fastpar DataParallel, every bucket reduced after backward
  overlap-on    fastpar DataParallel, each bucket reduced as soon as its gradients are ready
  zero1         overlap-on + DistributedOptimizer (reduce-scatter, sharded AdamW stepped
                bucket by bucket, each bucket's all-gather started as soon as it is stepped and
                waited for by the next forward)
  zero1-step    zero1 with overlap_step=True: each bucket's shard is stepped (and its gather
                started) the moment its reduce-scatter lands, while later buckets still reduce
  dp-step       overlap-on + an unsharded DistributedOptimizer with overlap_step=True: each
                bucket's parameters are stepped as soon as its all-reduce lands
  compute-only  the same model and local batch with no communication at all: the floor
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

import fastpar  # noqa: E402
from fastpar.data_parallel import DataParallel, DistributedOptimizer  # noqa: E402
from fastpar.testing import run_ranks  # noqa: E402


def _mlp(hidden, layers):
    torch.manual_seed(0)
    blocks = []
    for _ in range(layers):
        blocks += [nn.Linear(hidden, hidden), nn.GELU()]
    return nn.Sequential(*blocks)


def _state_bytes(opt) -> int:
    return sum(t.numel() * t.element_size() for s in opt.state.values() for t in s.values()
               if torch.is_tensor(t))


def _variants(mesh, hidden, layers, bucket_mb):
    g = mesh.dp_group
    adamw = lambda params: torch.optim.AdamW(params, lr=1e-4)  # noqa: E731
    out = {}
    # DDP as its docs recommend at its best: gradients as bucket views (no copy in or out).
    m = DDP(_mlp(hidden, layers), process_group=g, bucket_cap_mb=bucket_mb,
            gradient_as_bucket_view=True)
    out["ddp"] = (m, adamw(m.parameters()))
    m = DDP(_mlp(hidden, layers), process_group=g, bucket_cap_mb=bucket_mb,
            gradient_as_bucket_view=True)
    out["ddp-again"] = (m, adamw(m.parameters()))
    for overlap in (False, True):
        m = DataParallel(_mlp(hidden, layers), dp_group=g, bucket_cap_mb=bucket_mb,
                         overlap=overlap)
        out["overlap-" + ("on" if overlap else "off")] = (m, adamw(m.parameters()))
    m = DataParallel(_mlp(hidden, layers), dp_group=g, bucket_cap_mb=bucket_mb)
    out["zero1"] = (m, DistributedOptimizer(m, torch.optim.AdamW, overlap_param_gather=True,
                                            lr=1e-4))
    m = DataParallel(_mlp(hidden, layers), dp_group=g, bucket_cap_mb=bucket_mb)
    out["zero1-step"] = (m, DistributedOptimizer(m, torch.optim.AdamW, overlap_param_gather=True,
                                                 overlap_step=True, lr=1e-4))
    m = DataParallel(_mlp(hidden, layers), dp_group=g, bucket_cap_mb=bucket_mb)
    out["dp-step"] = (m, DistributedOptimizer(m, torch.optim.AdamW, shard=False,
                                              overlap_step=True, lr=1e-4))
    m = _mlp(hidden, layers)
    out["compute-only"] = (m, adamw(m.parameters()))
    return out


def _measure(rank, world_size, hidden, layers, batch, bucket_mb, rounds, iters):
    mesh = fastpar.init(dp=world_size)
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // world_size))
    variants = _variants(mesh, hidden, layers, bucket_mb)
    torch.manual_seed(100 + rank)                  # every rank its own batch
    x, y = torch.randn(batch, hidden), torch.randn(batch, hidden)

    def step(model, opt):
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        opt.step()

    for model, opt in variants.values():           # warm-up (AdamW allocates its state)
        step(model, opt)
    zeros = ("zero1", "zero1-step")
    for name in zeros:
        variants[name][1].finish_param_sync()
    ref = [p.detach() for p in variants["ddp"][0].parameters()]
    for name in ("overlap-off", "overlap-on", *zeros, "dp-step"):   # the same step as DDP
        for p, q in zip(variants[name][0].parameters(), ref):
            assert torch.allclose(p, q, atol=1e-6), f"{name} differs from ddp after a step"
    # The round's last parameter gather (ZeRO-1) is waited for inside the window.
    result = common.compare({n: (lambda m=m, o=o: step(m, o)) for n, (m, o) in variants.items()},
                            "ddp", mesh.device, rounds, iters, control="ddp-again",
                            finish={n: variants[n][1].finish_param_sync for n in zeros},
                            barrier=dist.barrier)
    state = {"plain": _state_bytes(variants["ddp"][1]),
             "zero1": variants["zero1"][1].state_bytes(),
             "zero1-step": variants["zero1-step"][1].state_bytes(),
             "dp-step": variants["dp-step"][1].state_bytes()}
    return result, state


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--batch", type=int, default=128, help="rows per rank")
    p.add_argument("--bucket-mb", type=float, default=25.0, help="bucket cap, both libraries")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--label", default="loopback", help="the link, for the table (e.g. 1gbit)")
    a = p.parse_args(argv)
    result, state = run_ranks(_measure, a.ranks, a.hidden, a.layers, a.batch, a.bucket_mb,
                              a.rounds, a.iters, init_pg=False, timeout=3600)[0]
    med = result["median"]
    params = a.layers * (a.hidden * a.hidden + a.hidden)
    flops = 6 * a.batch * params                     # fwd + bwd of the linear layers, per rank
    floor, off = med["compute-only"], med["overlap-off"]
    exposed_off = max(off - floor, 1e-9)             # the whole reduction, nothing hidden
    common_row = {"link": a.label, "ranks": a.ranks, "params_M": params / 1e6, "batch": a.batch,
                  "bucket_mb": a.bucket_mb}
    rows = []
    for name, t in med.items():
        row = {**common_row, "variant": name, "median_ms": t * 1e3,
               "vs_ddp": result["ratio"][name],
               "GFLOP/s/rank": flops / t / 1e9,
               "state_MB": state.get(name, state["plain"]) / 2**20}
        if name in ("ddp", "ddp-again", "overlap-on", "zero1", "zero1-step", "dp-step"):
            row["hidden"] = 1 - max(t - floor, 0.0) / exposed_off
        rows.append(row)
    # The reduction itself: what overlap-off adds to the floor.
    rows.append({**common_row, "variant": "reduction (off - floor)",
                 "median_ms": exposed_off * 1e3, "comm_share": exposed_off / off,
                 "GB/s": 4 * params / exposed_off / 1e9})
    rows.append({**common_row, "variant": "on/off ratio", "vs_ddp": med["overlap-on"] / off})
    rows.append({**common_row, "variant": "zero1 state / plain",
                 "state_MB": state["zero1"] / state["plain"]})
    common.report(f"dp_mlp_{a.label}", rows,
                  ["link", "variant", "params_M", "batch", "bucket_mb", "median_ms", "vs_ddp",
                   "hidden", "comm_share", "GB/s", "GFLOP/s/rank", "state_MB"],
                  [{"key": a.label, **result}])


if __name__ == "__main__":
    main()
