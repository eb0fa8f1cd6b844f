"""MoE under a pipeline: DualPipeV's overlapped pairs (each micro-batch's expert all-to-alls
travelling while the paired one computes, both ways) against ZB-V on the same V placement.

    python bench/bench_moe_pp.py [--seq-len 256] [--moe-ffn 512] [--rounds 6] [--iters 2]
    python bench/repeat.py --runs 3 -- ../shared/tools/shaped-link 100mbit \\
        python bench/bench_moe_pp.py --moe-ffn 128 --rounds 4 --iters 1 --label 100mbit

Four gloo ranks: pp2 x dp2, the experts split over the two dp ranks of each stage (ep 2), each
pp rank holding stages r and 3 - r (the V). The model: 8 blocks, d 256, 8 heads, every MLP a
mixture of 8 SwiGLU experts of 512 (``--moe-ffn``), top 2, dropless, ``--micro`` micro-batches of one sequence
per rank per step. Each step is the pipeline's whole forward and backward (every all-to-all,
every p2p transfer inside the window); no optimizer step and no data-parallel reduction. Measured
with bench/common.py's ``compare`` (order rotated every round, ``--iters`` steps per timed
window after a barrier, the slowest rank's time), against ``zb-v``:
  dualpipe-v         DualPipeV as the trainer runs it: in the steady state each F runs with the
                     B of another micro-batch, the two taking turns at their all-to-alls' waits
                     (fastpar.mesh.fill.pair), the MoE dispatch in two chunks (``--ep-chunks``)
  dualpipe-v-serial  DualPipeV's order, each pair's F then its B (no turns): what the order alone
                     does
  zb-v               ZB-V, the same placement and split backward, no pairs: the peer
  zb-v-again         a second ``zb-v``: the A/A control
  floor              DualPipeV with every rank holding all 8 experts and computing its own
                     tokens' rows through the same expert-parallel path over a group of itself
                     (every all-to-all a local copy): the same compute, no transfer
``exposed`` = step - floor; ``hidden`` = 1 - exposed(variant) / exposed(zb-v). On 2 cores the
four ranks share the cores (compute is slowed, waits are not), so only the waits' share means
much; a shaped link gives the all-to-alls the time they take on a cluster.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

import fastpar  # noqa: E402
from fastpar.mesh import ep_groups, fill  # noqa: E402
from fastpar.models import GPT, GPTConfig  # noqa: E402
from fastpar.models.moe import moe_layers  # noqa: E402
from fastpar.pipeline import PipelineExecutor, build_schedule, build_stages  # noqa: E402
from fastpar.testing import run_ranks  # noqa: E402
from fastpar.train.step import loss_fn  # noqa: E402

VARIANTS = ("dualpipe-v", "dualpipe-v-serial", "zb-v", "zb-v-again", "floor")


def config(a) -> GPTConfig:
    return GPTConfig(vocab_size=256, n_layers=8, d_model=256, n_heads=8,
                     max_seq_len=a["seq_len"], n_experts=8, moe_top_k=2, moe_ffn=a["moe_ffn"],
                     moe_aux_loss=0.01)


def _serial(first, second):
    """fill.pair without turns: the F, then the B."""
    first()
    second()
    return 0.0, 0.0


@contextlib.contextmanager
def _patched(on: bool):
    real = fill.pair
    if on:
        fill.pair = _serial
    try:
        yield
    finally:
        fill.pair = real


class _Variant:
    def __init__(self, cfg, mesh, kind, ep_group, alone, a):
        name = "zb-v" if kind.startswith("zb-v") else "dualpipe-v"
        sched = build_schedule(name, 2, a["micro"], 2)
        torch.manual_seed(0)
        make = lambda **kw: GPT(cfg, ep_group=None if kind == "floor" else ep_group,  # noqa
                                ep_chunks=a["ep_chunks"], **kw)
        self.chunks = build_stages(make, mesh.pp_rank, 2, 2, num_blocks=cfg.n_layers,
                                   placement=sched.placement)
        if kind == "floor":                 # the same path, its all-to-alls over this rank alone
            for m in moe_layers(self.chunks):
                m.ep_group = alone
        self.pipe = PipelineExecutor(self.chunks, sched, mesh.pp_group, loss_fn=loss_fn(None),
                                     activation=((a["seq_len"], 1, cfg.d_model), torch.float32),
                                     stage_loss=True)
        self.serial = kind == "dualpipe-v-serial"

    def step(self, x, y) -> None:
        with _patched(self.serial):
            self.pipe.step(x, y)
        for c in self.chunks:
            c.zero_grad(set_to_none=True)


def _rank(rank, world_size, a):
    torch.set_num_threads(1)                 # 4 ranks on 2 cores
    mesh = fastpar.init(pp=2, dp=2)
    ep_group, _ = ep_groups(mesh, 2)
    cfg = config(a)
    g = torch.Generator().manual_seed(mesh.dp_rank)
    tokens = torch.randint(0, cfg.vocab_size, (a["micro"], a["seq_len"] + 1), generator=g)
    x, y = tokens[:, :-1], tokens[:, 1:]
    alone = [dist.new_group([r]) for r in range(world_size)][rank]
    variants = {k: _Variant(cfg, mesh, k, ep_group, alone, a) for k in VARIANTS}
    steps = {k: (lambda v=variants[k]: v.step(x, y)) for k in VARIANTS}
    for k in steps:                          # warm-up: allocator
        steps[k]()
    result = common.compare(steps, "zb-v", mesh.device, a["rounds"], a["iters"],
                            control="zb-v-again", barrier=dist.barrier)
    rows = a["seq_len"] * 2                  # assignments per micro-batch per layer (top 2)
    return dict(result=result, hop=rows * cfg.d_model * 4 // 2)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--micro", type=int, default=8, help="micro-batches per step (>= 4)")
    ap.add_argument("--ep-chunks", type=int, default=2)
    ap.add_argument("--moe-ffn", type=int, default=512, help="each expert's inner size: the "
                    "smaller, the more the all-to-alls weigh against the experts' compute")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--iters", type=int, default=2)
    ap.add_argument("--label", default="loopback")
    args = ap.parse_args(argv)
    a = dict(seq_len=args.seq_len, micro=args.micro, ep_chunks=args.ep_chunks,
             moe_ffn=args.moe_ffn, rounds=args.rounds, iters=args.iters)
    out = run_ranks(_rank, 4, a, init_pg=False, timeout=1800)[0]
    result = out["result"]
    med = result["median"]
    floor = med["floor"]
    rows = [dict(variant=k, median_ms=1e3 * med[k], vs_zbv=med[k] / med["zb-v"],
                 paired=result["paired"][k], exposed_ms=1e3 * (med[k] - floor)) for k in med]
    exposed = med["zb-v"] - floor
    for k in ("dualpipe-v", "dualpipe-v-serial"):
        rows.append(dict(variant=f"hidden ({k})",
                         hidden=1 - (med[k] - floor) / exposed if exposed > 0 else None))
    print(f"{args.label}: MoE GPT (8 blocks, d 256, 8 experts of {args.moe_ffn}, top 2), pp2 x ep2 (4 "
          f"ranks), {args.micro} micro-batches of 1 x {args.seq_len} tokens per rank per step; "
          f"about {out['hop'] / 1e6:.2f} MB per rank per all-to-all per layer")
    common.report(f"moe_pp_{args.label}", rows,
                  ["variant", "median_ms", "vs_zbv", "paired", "exposed_ms", "hidden"],
                  [{"key": args.label, **result}])


if __name__ == "__main__":
    main()
