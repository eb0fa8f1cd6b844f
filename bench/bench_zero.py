"""Sharded data parallelism on an MLP: fastpar's ZeRO-1, 2 and 3 against torch's FSDP2.

    python bench/bench_zero.py [--ranks 2] [--hidden 1024] [--layers 12] [--batch 128]
    ../shared/tools/shaped-link 1gbit python bench/bench_zero.py --label 1gbit
    python bench/repeat.py --runs 3 -- ../shared/tools/shaped-link 1gbit \\
        python bench/bench_zero.py --label 1gbit

The peer is torch's own ``fully_shard`` (FSDP2) as its docs set it up: every Linear a unit and
the root one, ``reshard_after_forward=False`` (ZeRO-2's memory: the parameters gathered in the
forward stay for the backward; the gradients are reduce-scattered unit by unit during the
backward; FSDP2 prefetches the next unit's gather itself), the same AdamW. A second instance of
it is the A/A control. ``fsdp2-reshard`` (``reshard_after_forward=True``, ZeRO-3) is shown for
reference, and as the peer of ``zero3``. fastpar's variants are ``DataParallel`` +
``DistributedOptimizer`` at ``stage`` 1 and 2, the updated shards' all-gathers left to the next
forward (``overlap_param_gather``) and waited for inside the timed window; and at stage 3 with
every Linear a unit (as FSDP2's): ``zero3`` frees each unit after its forward and gathers it
again for its backward (FSDP2's ``reshard_after_forward=True``), ``zero3-keep`` keeps it from
the forward to its backward (``False``); both prefetch one unit ahead. ``compute-only`` is the floor: the same model, no communication.
Every variant runs the same step (fp32, same batch per rank) in the same run, rotated round by
round (bench/common.py ``compare``).

Peak memory per rank is measured separately for each variant, in its own processes, with
fastpar's counting CPU allocator (every tensor of the variant, from before it is built, over
three steps): ``peak_MB``.
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import os
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

import fastpar  # noqa: E402
from fastpar.data_parallel import DataParallel, DistributedOptimizer  # noqa: E402
from fastpar.extension import CPUMemory  # noqa: E402
from fastpar.testing import run_ranks  # noqa: E402

NAMES = ("fsdp2", "fsdp2-again", "fsdp2-reshard", "zero1", "zero2", "zero3", "zero3-keep",
         "compute-only")


def _mlp(hidden, layers):
    torch.manual_seed(0)
    blocks = []
    for _ in range(layers):
        blocks += [nn.Linear(hidden, hidden), nn.GELU()]
    return nn.Sequential(*blocks)


def _build(name, mesh, hidden, layers, bucket_mb):
    """(model, optimizer, finish or None) of one variant."""
    adamw = lambda params: torch.optim.AdamW(params, lr=1e-4)  # noqa: E731
    if name.startswith("fsdp2"):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        dm = init_device_mesh(mesh.device.type, (mesh.dp_size,))
        m = _mlp(hidden, layers)
        reshard = name == "fsdp2-reshard"
        for layer in m:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=dm, reshard_after_forward=reshard)
        fully_shard(m, mesh=dm, reshard_after_forward=reshard)
        return m, adamw(m.parameters()), None
    if name.startswith("zero3"):
        net = _mlp(hidden, layers)
        m = DataParallel(net, dp_group=mesh.dp_group,
                         units=[u for u in net if isinstance(u, nn.Linear)])
        opt = DistributedOptimizer(m, torch.optim.AdamW, stage=3, lr=1e-4,
                                   reshard_after_forward=name == "zero3")
        return m, opt, None
    if name.startswith("zero"):
        m = DataParallel(_mlp(hidden, layers), dp_group=mesh.dp_group, bucket_cap_mb=bucket_mb)
        opt = DistributedOptimizer(m, torch.optim.AdamW, overlap_param_gather=True,
                                   stage=int(name[-1]), lr=1e-4)
        return m, opt, opt.finish_param_sync
    m = _mlp(hidden, layers)
    return m, adamw(m.parameters()), None


def _step(model, opt, x, y):
    opt.zero_grad()
    F.mse_loss(model(x), y).backward()
    opt.step()


def _measure(rank, world_size, hidden, layers, batch, bucket_mb, rounds, iters):
    mesh = fastpar.init(dp=world_size)
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // world_size))
    variants = {n: _build(n, mesh, hidden, layers, bucket_mb) for n in NAMES}
    torch.manual_seed(100 + rank)                  # every rank its own batch
    x, y = torch.randn(batch, hidden), torch.randn(batch, hidden)
    for model, opt, finish in variants.values():   # warm-up (AdamW allocates its state)
        _step(model, opt, x, y)
        if finish:
            finish()
    # The same step everywhere: after one step every sharded variant equals FSDP2's weights.
    ref = [p.full_tensor() for p in variants["fsdp2"][0].parameters()]
    for name in ("zero1", "zero2", "zero3", "zero3-keep", "fsdp2-reshard"):
        opt = variants[name][1]
        with opt.gathered() if name.startswith("zero3") else contextlib.nullcontext():
            for p, q in zip(variants[name][0].parameters(), ref):
                p = p.full_tensor() if hasattr(p, "full_tensor") else p
                assert torch.allclose(p, q, atol=1e-6), f"{name} differs from fsdp2 after a step"
    return common.compare({n: (lambda m=m, o=o: _step(m, o, x, y))
                           for n, (m, o, _) in variants.items()},
                          "fsdp2", mesh.device, rounds, iters, control="fsdp2-again",
                          finish={n: f for n, (_, _, f) in variants.items() if f},
                          barrier=dist.barrier)


def _peak(rank, world_size, name, hidden, layers, batch, bucket_mb):
    """Peak bytes of one variant on this rank: built, three steps, all counted."""
    CPUMemory.install()
    mesh = fastpar.init(dp=world_size)
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // world_size))
    torch.manual_seed(100 + rank)
    x, y = torch.randn(batch, hidden), torch.randn(batch, hidden)
    gc.collect()
    base = CPUMemory.allocated()
    CPUMemory.reset_peak()
    model, opt, finish = _build(name, mesh, hidden, layers, bucket_mb)
    for _ in range(3):
        _step(model, opt, x, y)
        if finish:
            finish()
    return CPUMemory.peak() - base


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--batch", type=int, default=128, help="rows per rank")
    p.add_argument("--bucket-mb", type=float, default=25.0, help="fastpar's bucket cap")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--label", default="loopback", help="the link, for the table (e.g. 1gbit)")
    a = p.parse_args(argv)
    shape = (a.hidden, a.layers, a.batch, a.bucket_mb)
    result = run_ranks(_measure, a.ranks, *shape, a.rounds, a.iters, init_pg=False,
                       timeout=3600)[0]
    peaks = {n: max(run_ranks(_peak, a.ranks, n, *shape, init_pg=False, timeout=600))
             for n in NAMES if n != "fsdp2-again"}
    peaks["fsdp2-again"] = peaks["fsdp2"]
    med = result["median"]
    params = a.layers * (a.hidden * a.hidden + a.hidden)
    rows = [{"link": a.label, "ranks": a.ranks, "params_M": params / 1e6, "batch": a.batch,
             "variant": n, "median_ms": t * 1e3, "vs_fsdp2": result["ratio"][n],
             "paired": result["paired"][n], "peak_MB": peaks[n] / 2**20,
             "peak_vs_fsdp2": peaks[n] / peaks["fsdp2"]} for n, t in med.items()]
    common.report(f"zero_{a.label}", rows,
                  ["link", "variant", "params_M", "batch", "median_ms", "vs_fsdp2", "paired",
                   "peak_MB", "peak_vs_fsdp2"], [{"key": a.label, **result}])


if __name__ == "__main__":
    main()
