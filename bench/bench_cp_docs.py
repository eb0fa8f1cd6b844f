"""Context parallelism over packed documents at cp=2: chunks dealt out by attention work
(``cp_balance="work"``) against the fixed zigzag pairs, the trainer's step on the same data.

    flock /tmp/fastpar-bench.lock python bench/bench_cp_docs.py [--seq-len 2048] [--batch 4]
        [--micro 2] [--rounds 8] [--iters 3]
    python bench/repeat.py --runs 3 -- python bench/bench_cp_docs.py     # a table for RESULTS

Two gloo ranks, one CP group: each sequence is cut into 4 chunks of seq_len / 4, two per rank.
The data (bench_packing.py's ``write_prepared``: train.bin and val.bin with document offsets,
vocabulary 256, seed 0) mixes a few long documents with many short ones: each of ``--docs``
documents is long (60-95% of a sequence) with probability ``--long``, else log-normal around 24
tokens (sigma 0.8). A window is picked in proportion to a document's length, so most rows start
with a long document and end in short ones; under the zigzag the rank holding the middle chunks
then has most of the attention work. The sequence is long enough for that work to weigh: a
token attends to its position + 1 keys, about 670 on average at 2048 tokens, which makes
attention about 40% of the tiny model's step FLOPs (13% at 512).

Each step is the whole of ``fastpar.train.trainer.train_step`` of the tiny GPT (4 layers, d 128,
4 heads, fp32) with packed documents (the trainer's default): the sampler's host work and each
micro-batch's layout, forward and backward over the key/value ring in ``--batch / --micro``
micro-batches, the loss all-reduce, clipping, the non-finite check and AdamW; the loss is read
on the host inside the window. Measured with bench/common.py's ``compare`` (order rotated every
round, ``--iters`` steps per timed window after a barrier, the slowest rank's time), against
``zigzag``:
  zigzag        rank r holds chunks r and 3 - r of every micro-batch: the peer
  work          each micro-batch's chunks dealt out by attention work: the layout of least
                ring critical path (``Documents.cp_layout``)
  zigzag-again  a second ``zigzag``: the A/A control
Beside the times: tokens/s and trained tokens/s (as bench_packing.py); ``pairs_computed`` and
``pairs_skipped``, the (sequence, query chunk, key chunk) block pairs the ring computed and
skipped because no document connects them (``ring_attention.BLOCK_PAIRS``: every layer's,
forward and backward, summed over both ranks, per step; which pairs a document connects does
not depend on the layout, so both layouts skip the same ones), and ``pairs_max_rank``, the
computed pairs of the rank with the most (how the layout spreads them); ``imbalance``: per
step, the ring's critical path over perfect balance (each ring step lasts as long as its
busiest rank's query-key pairs; summed over the steps, over the total / cp), the median over
the timed steps (1 is perfect balance; the steps are the same for every variant: same seed,
same step numbers).
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
from bench_packing import (WARMUP, TrainerStep, bench_config, check_aa, describe,  # noqa: E402
                           per_round, rows_of, write_prepared)

from fastpar.context_parallel.ring_attention import BLOCK_PAIRS  # noqa: E402
from fastpar.models.documents import Documents  # noqa: E402
from fastpar.testing import run_ranks  # noqa: E402

VARIANTS = ("zigzag", "work", "zigzag-again")
CP = 2


def mixed_lengths(rng: np.random.Generator, n: int, seq_len: int, p_long: float) -> np.ndarray:
    """``n`` document lengths: long (60-95% of ``seq_len``) with probability ``p_long``, else
    log-normal around 24 tokens, at least 2."""
    long = rng.integers(int(0.6 * seq_len), int(0.95 * seq_len), n)
    short = np.clip(rng.lognormal(np.log(24), 0.8, n), 2, seq_len)
    return np.where(rng.random(n) < p_long, long, short).astype(np.int64)


def imbalance(v: TrainerStep, steps: range) -> list[float]:
    """Per step: the ring's critical path over perfect balance, in query-key pairs
    (``Documents.ring_balance``: each ring step as long as its busiest rank, summed over the
    steps, over the total / cp), averaged over the micro-batches; from each micro-batch's
    Documents in the variant's layout (rebuilt on the host, outside the timing)."""
    run = v.run
    out = []
    for step in steps:
        parts = run.sampler.batch(step).positions.chunk(run.micro_batches)
        out.append(float(np.mean([Documents(p, cp_balance=run.cfg.cp_balance).ring_balance(CP)
                                  for p in parts])))
    return out


def _counted(step, tally: dict):
    """``step`` with the ring's block pairs it computed and skipped added to ``tally``."""
    def run():
        before = dict(BLOCK_PAIRS)
        step()
        for k in tally:
            tally[k] += BLOCK_PAIRS[k] - before[k]
    return run


def _rank(rank, world_size, a):
    torch.set_num_threads(1)                 # 2 ranks on 2 cores
    variants = {k: TrainerStep(bench_config(a, k, cp=CP, cp_balance=k.removesuffix("-again")))
                for k in VARIANTS}
    for v in variants.values():
        for _ in range(WARMUP):              # allocator, optimizer state
            v()
    check_aa(variants, "zigzag", "zigzag-again")
    for s, (w, z) in enumerate(zip(variants["work"].losses, variants["zigzag"].losses)):
        assert abs(w - z) <= 1e-4 * abs(z), f"work loss {w} at warm-up step {s} != zigzag's {z}"
    pairs = {k: {"computed": 0, "skipped": 0} for k in VARIANTS}
    result = common.compare({k: _counted(v, pairs[k]) for k, v in variants.items()}, "zigzag",
                            variants["zigzag"].run.mesh.device, a["rounds"], a["iters"],
                            control="zigzag-again", barrier=dist.barrier)
    timed = range(WARMUP + 1, WARMUP + a["rounds"] * a["iters"] + 1)
    imb = {k: imbalance(v, timed) for k, v in variants.items()} if rank == 0 else None
    trained = {k: per_round(v, a["rounds"], a["iters"]) for k, v in variants.items()}
    for v in variants.values():
        v.close()
    return dict(result=result, trained=trained, pairs=pairs, imbalance=imb)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=4, help="global batch, sequences")
    ap.add_argument("--micro", type=int, default=2, help="sequences per micro-batch")
    ap.add_argument("--docs", type=int, default=3000, help="training documents")
    ap.add_argument("--long", type=float, default=0.1, help="share of long documents")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--label", default="loopback", help="suffix of the results file")
    args = ap.parse_args(argv)
    rng = np.random.default_rng(0)
    lengths = {s: mixed_lengths(rng, n, args.seq_len, args.long)
               for s, n in (("train", args.docs), ("val", max(args.docs // 20, 20)))}
    with tempfile.TemporaryDirectory(prefix="bench-cp-docs-") as tmp:
        data = write_prepared(Path(tmp) / "data", lengths)
        a = dict(model=args.model, data=data, out=str(Path(tmp) / "runs"),
                 seq_len=args.seq_len, batch=args.batch, micro=args.micro,
                 rounds=args.rounds, iters=args.iters)
        outs = run_ranks(_rank, CP, a, init_pg=False, timeout=1800)
    result, trained, steps = outs[0]["result"], outs[0]["trained"], args.rounds * args.iters
    rows = rows_of(result, trained, "zigzag", args.batch * args.seq_len, args.iters)
    for row in rows:
        k = row["variant"]
        for what in ("computed", "skipped"):
            row[f"pairs_{what}"] = sum(o["pairs"][k][what] for o in outs) / steps
        row["pairs_max_rank"] = max(o["pairs"][k]["computed"] for o in outs) / steps
        row["imbalance"] = common.median(outs[0]["imbalance"][k])
    print(f"{args.label}: {args.model} GPT, cp={CP}, {args.batch} x {args.seq_len} tokens per "
          f"step in micro-batches of {args.micro}, packed; train data: "
          f"{describe(lengths['train'], args.seq_len)}, "
          f"{(lengths['train'] > 0.5 * args.seq_len).mean():.1%} longer than half of it")
    common.report(f"cp_docs_{args.label}", rows,
                  ["variant", "median_ms", "vs_peer", "paired", "tok_per_s",
                   "trained_tok_per_s", "trained", "pairs_computed", "pairs_skipped",
                   "pairs_max_rank", "imbalance"],
                  [{"key": args.label, **result}])


if __name__ == "__main__":
    main()
