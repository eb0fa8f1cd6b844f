"""pp=2 x dp=2 training step of a GPT: DP reduction overlapped with the pipeline cool-down, on/off.

    python bench/bench_pp_dp.py [--model small] [--schedule 1f1b] [--rounds 6] [--iters 2]
    ../shared/tools/shaped-link 1gbit python bench/bench_pp_dp.py --label 1gbit
    python bench/repeat.py --runs 3 -- python bench/bench_pp_dp.py      # a table for RESULTS

Four gloo ranks (pp=2 x dp=2), each step the trainer's own ``_step`` (pipeline step, DP
reduction of every bucket, the pipeline's loss all-reduce) plus AdamW and zero_grad. Measured
with bench/common.py's ``compare`` (variants in one process set, the order rotated every round,
each variant's ``--iters`` steps one timed window after a barrier, the slowest rank's time),
against ``off``:
  on            each chunk's buckets start inside its last backward (the trainer's default)
  off           every bucket starts after the pipeline step (the old behaviour): the peer
  off-again     a second, identical ``off``: the A/A control, its ratio to ``off`` is the noise
  compute-only  the same step with no DP reduction at all: the floor
After the comparison, ``reduce-alone`` times the DP reduction of the accumulated gradients with
nothing else running (after an untimed pipeline step, barriers around it): what the reduction
costs with nothing to hide it behind. ``exposed`` = step - compute-only; ``hidden`` = 1 -
exposed(on) / reduce-alone, the share of the reduction that the overlap takes off the step.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

import fastpar  # noqa: E402
from fastpar.data_parallel import DataParallel  # noqa: E402
from fastpar.pipeline import PipelineExecutor, build_schedule  # noqa: E402
from fastpar.testing import run_ranks  # noqa: E402
from fastpar.train import TrainConfig  # noqa: E402
from fastpar.train.step import forward_backward, loss_fn  # noqa: E402
from fastpar.train.trainer import build_model  # noqa: E402

VARIANTS = ["on", "off", "off-again", "compute-only"]


class _Variant:
    """One model, DP wrapper, pipeline and optimizer, run as ``kind`` says."""

    def __init__(self, cfg: TrainConfig, mesh, kind: str):
        torch.manual_seed(cfg.seed)
        self.kind, self.mesh, self.M = kind, mesh, cfg.num_microbatches(cfg.global_batch_size, mesh.dp_size)
        self.chunks = build_model(cfg, mesh)
        self.ddp = (None if kind == "compute-only" else
                    DataParallel(nn.ModuleList(self.chunks), dp_group=mesh.dp_group))
        params = [p for c in self.chunks for p in c.parameters()]
        self.grad_bytes = sum(p.numel() * p.element_size() for p in params)
        self.opt = torch.optim.AdamW(params, lr=1e-4, foreach=True)
        v = cfg.virtual_stages
        self.pipe = PipelineExecutor(self.chunks, build_schedule(cfg.schedule, cfg.pp, self.M, v),
                                     mesh.pp_group, loss_fn=loss_fn(mesh.tp_group))

    def step(self, x, y) -> None:
        forward_backward(self.chunks, self.ddp, self.pipe, x, y, self.M, self.mesh,
                         overlap=self.kind == "on")
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)

    def reduce_alone(self, x, y) -> float:
        """The DP reduction of one step's gradients, nothing else running (slowest rank)."""
        self.ddp.set_requires_gradient_sync(False, wait_in_backward=False)
        self.pipe.before_backward = None
        self.pipe.step(x, y)
        dist.barrier()
        t0 = time.perf_counter()
        self.ddp.reduce_gradients()
        dist.barrier()
        t = time.perf_counter() - t0
        self.opt.zero_grad(set_to_none=True)
        return t


def _rank(rank, world_size, a):
    torch.set_num_threads(1)                 # 4 ranks on 2 cores: no intra-op threads
    mesh = fastpar.init(pp=2, dp=2)
    cfg = TrainConfig(model=a["model"], pp=2, schedule=a["schedule"],
                      virtual_stages=a["virtual_stages"], seq_len=a["seq_len"],
                      global_batch_size=a["global_batch"], micro_batch_size=a["micro_batch"])
    variants = {k: _Variant(cfg, mesh, k) for k in [*VARIANTS, "reduce-alone"]}
    g = torch.Generator().manual_seed(mesh.dp_rank)
    local = a["global_batch"] // mesh.dp_size
    x = torch.randint(0, cfg.model_config.vocab_size, (local, a["seq_len"]), generator=g)
    y = torch.randint(0, cfg.model_config.vocab_size, (local, a["seq_len"]), generator=g)
    for k in VARIANTS:                       # warm-up: shapes, allocator, optimizer state
        variants[k].step(x, y)
    alone = variants["reduce-alone"]
    alone.reduce_alone(x, y)
    result = common.compare({k: (lambda v=variants[k]: v.step(x, y)) for k in VARIANTS}, "off",
                            mesh.device, a["rounds"], a["iters"], control="off-again",
                            barrier=dist.barrier)
    result["reduce_alone"] = statistics.median(
        alone.reduce_alone(x, y) for _ in range(a["rounds"] * a["iters"]))
    ddp = variants["off"].ddp
    return dict(result=result, grad_bytes=variants["off"].grad_bytes,
                buckets=len(ddp.bucket_specs), microbatches=variants["off"].M)


def _summary(med: dict, reduce_alone: float) -> dict:
    exposed_on, exposed_off = med["on"] - med["compute-only"], med["off"] - med["compute-only"]
    return dict(exposed_on_ms=1e3 * exposed_on, exposed_off_ms=1e3 * exposed_off,
                reduce_alone_ms=1e3 * reduce_alone, hidden=1 - exposed_on / reduce_alone,
                hidden_vs_off=1 - exposed_on / exposed_off if exposed_off > 0 else float("nan"))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="small")
    ap.add_argument("--schedule", default="1f1b")
    ap.add_argument("--virtual-stages", type=int, default=1)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--global-batch", type=int, default=16)
    ap.add_argument("--micro-batch", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--iters", type=int, default=2)
    ap.add_argument("--label", default="loopback")
    args = ap.parse_args(argv)
    a = dict(model=args.model, schedule=args.schedule, virtual_stages=args.virtual_stages,
             seq_len=args.seq_len, global_batch=args.global_batch, micro_batch=args.micro_batch,
             rounds=args.rounds, iters=args.iters)
    out = run_ranks(_rank, 4, a, init_pg=False, timeout=1800)[0]     # rank 0 (pp 0, dp 0)
    result = out["result"]
    med = result["median"]
    rows = [dict(variant=k, median_ms=1e3 * med[k], vs_off=result["ratio"][k],
                 paired=result["paired"][k]) for k in VARIANTS]
    s = _summary(med, result["reduce_alone"])
    rows.append(dict(variant="summary", **s,
                     reduce_MB_s=out["grad_bytes"] / result["reduce_alone"] / 1e6))
    print(f"{args.label}: model {args.model}, {args.schedule} v{args.virtual_stages}, "
          f"{out['microbatches']} micro-batches of {args.micro_batch} x {args.seq_len}, "
          f"{out['grad_bytes'] / 1e6:.1f} MB of gradients per rank in {out['buckets']} buckets")
    common.report(f"pp_dp_{args.label}", rows,
                  ["variant", "median_ms", "vs_off", "paired", "exposed_on_ms", "exposed_off_ms",
                   "reduce_alone_ms", "hidden", "hidden_vs_off", "reduce_MB_s"],
                  [{"key": args.label, **result}])


if __name__ == "__main__":
    main()
