"""Context parallelism at cp=2: the key/value ring overlapped with block attention, against the
ring made blocking and against no ring at all; and activation memory per rank vs cp=1.

    python bench/bench_cp.py [--seq-len 2048] [--rounds 6] [--iters 2]
    ../shared/tools/shaped-link 1gbit python bench/bench_cp.py --label 1gbit
    python bench/repeat.py --runs 3 -- python bench/bench_cp.py      # a table for RESULTS

Two gloo ranks, one sequence split over them (each holds chunks r and 3 - r of 4). Each step is
the whole training step of the tiny GPT (4 layers, d 128, 4 heads) on this rank's half of a
batch of sequences: forward, backward (the ring again, with dK/dV) and AdamW. Measured with
bench/common.py's ``compare`` (order rotated every round, each variant's ``--iters`` steps one
timed window after a barrier, the slowest rank's time), against ``blocking``:
  on              the ring as the model runs it: step i+1's k/v in flight while block i computes
  blocking        each transfer waited as soon as it is posted (same numbers): the peer
  blocking-again  a second ``blocking``: the A/A control
  no-comm         the same compute with every transfer replaced by a local copy: the floor
``exposed`` = step - no-comm. Memory: the bytes the forward saves for backward (every saved
tensor's storage once) of one sequence of ``--memory-seq-len`` tokens at cp=1 and on one cp=2
rank.
"""
from __future__ import annotations

import argparse
import importlib
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

import fastpar  # noqa: E402
from fastpar.context_parallel import shard_sequence  # noqa: E402
from fastpar.models import GPT, get_config  # noqa: E402
from fastpar.testing import run_ranks  # noqa: E402

VARIANTS = ("on", "blocking", "blocking-again", "no-comm")
ring = importlib.import_module("fastpar.context_parallel.ring_attention")   # its _start_ring


def _local_copy(send, recv, group, tag, overlap, stream):
    """The floor's transfer: none (the received block is this rank's own)."""
    recv.copy_(send)
    return []


class _Variant:
    def __init__(self, cfg, mesh, kind: str):
        torch.manual_seed(0)
        self.model = GPT(cfg, cp_group=mesh.cp_group)
        for layer in self.model.layers.values():
            layer.attn.cp_overlap = kind == "on"
        self.kind = kind
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4, foreach=True)

    def step(self, x, y) -> None:
        real = ring._start_ring
        if self.kind == "no-comm":
            ring._start_ring = _local_copy
        try:
            self.model(x, y).backward()
        finally:
            ring._start_ring = real
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)


def saved_bytes(model, x, y) -> int:
    """Bytes of every distinct storage the forward saves for backward."""
    seen = {}

    def pack(t):
        st = t.untyped_storage()
        seen[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(x, y)
    del loss
    return sum(seen.values())


def _rank(rank, world_size, a):
    torch.set_num_threads(1)                 # 2 ranks on 2 cores
    mesh = fastpar.init(cp=2, dp=1)
    cfg = get_config("tiny").replace(max_seq_len=max(a["seq_len"], a["memory_seq_len"]))
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, cfg.vocab_size, (a["batch"], a["seq_len"] + 1), generator=g)
    x, y = (shard_sequence(t, mesh.cp_rank, 2, dim=1) for t in (tokens[:, :-1], tokens[:, 1:]))
    variants = {k: _Variant(cfg, mesh, k) for k in VARIANTS}
    for k in VARIANTS:                       # warm-up: allocator, optimizer state
        variants[k].step(x, y)
    result = common.compare({k: (lambda v=variants[k]: v.step(x, y)) for k in VARIANTS},
                            "blocking", mesh.device, a["rounds"], a["iters"],
                            control="blocking-again", barrier=dist.barrier)
    long = torch.randint(0, cfg.vocab_size, (1, a["memory_seq_len"] + 1), generator=g)
    lx, ly = long[:, :-1], long[:, 1:]
    torch.manual_seed(0)
    mem_cp = saved_bytes(GPT(cfg, cp_group=mesh.cp_group),
                         *(shard_sequence(t, mesh.cp_rank, 2, dim=1) for t in (lx, ly)))
    mem_one = saved_bytes(GPT(cfg), lx, ly) if rank == 0 else 0
    kv_hop = 2 * a["batch"] * (a["seq_len"] // 2) * cfg.kv_heads * cfg.head_dim * 4
    return dict(result=result, mem_cp=mem_cp, mem_one=mem_one, kv_hop=kv_hop)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--memory-seq-len", type=int, default=4096)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--iters", type=int, default=2)
    ap.add_argument("--label", default="loopback")
    args = ap.parse_args(argv)
    a = dict(seq_len=args.seq_len, batch=args.batch, memory_seq_len=args.memory_seq_len,
             rounds=args.rounds, iters=args.iters)
    out = run_ranks(_rank, 2, a, init_pg=False, timeout=1800)[0]
    result = out["result"]
    med = result["median"]
    rows = [dict(variant=k, median_ms=1e3 * med[k], vs_blocking=result["ratio"][k],
                 paired=result["paired"][k], exposed_ms=1e3 * (med[k] - med["no-comm"]))
            for k in VARIANTS]
    exposed_on, exposed_blocking = (med[k] - med["no-comm"] for k in ("on", "blocking"))
    rows.append(dict(variant="summary",
                     hidden=1 - exposed_on / exposed_blocking if exposed_blocking > 0 else None,
                     memory_cp1_MB=out["mem_one"] / 1e6, memory_cp2_MB=out["mem_cp"] / 1e6,
                     memory_ratio=out["mem_cp"] / out["mem_one"]))
    print(f"{args.label}: tiny GPT, cp=2, {args.batch} x {args.seq_len} tokens per step, "
          f"{out['kv_hop'] / 1e6:.2f} MB of k/v per hop per layer; memory at "
          f"{args.memory_seq_len} tokens")
    common.report(f"cp_{args.label}", rows,
                  ["variant", "median_ms", "vs_blocking", "paired", "exposed_ms", "hidden",
                   "memory_cp1_MB", "memory_cp2_MB", "memory_ratio"],
                  [{"key": args.label, **result}])


if __name__ == "__main__":
    main()
