"""Packed documents against padded ones: tokens/s and trained tokens/s of the trainer's step on
documents of mixed lengths.

    flock /tmp/fastpar-bench.lock python bench/bench_packing.py [--seq-len 256] [--batch 8]
        [--micro 4] [--rounds 8] [--iters 3] [--dp 1] [--threads 1]
    python bench/repeat.py --runs 3 -- python bench/bench_packing.py     # a table for RESULTS

The data: a prepared folder (train.bin and val.bin with their document offsets, vocabulary 256)
written to a temporary folder, random token ids in documents whose lengths are log-normal
(``--docs`` of them, seed 0, median ``--median`` tokens, sigma 1, at least 2 and at most
4 x seq_len tokens): many short documents and a few (about 5% at the defaults) longer than a
sequence, which the sampler cuts into pieces.

Each step is the whole of ``fastpar.train.trainer.train_step`` on a ``setup`` run of the tiny GPT
(4 layers, d 128, 4 heads, fp32): the sampler's host work (windows, targets, positions, each
micro-batch's Documents), forward and backward in ``--batch / --micro`` micro-batches, the loss
all-reduce, clipping, the non-finite check and AdamW; the loss is read on the host (``.item()``)
inside the window. Each rank runs ``--threads`` torch threads (default one: with a thread per
core a step slowed 10-30x on this 2-core machine whenever another process took a core, each
parallel region waiting for its descheduled thread; ``--threads 2`` on a quiet machine). Every
variant is its own run (model, optimizer, sampler) from the same seed, measured with
bench/common.py's ``compare`` (order rotated every round, ``--iters`` steps per timed window
after a barrier, the slowest rank's time), against ``packed``:
  packed        ``pack_documents`` (the trainer's default): each row a window through the next
                documents, attention stopping at each document's start: the peer
  padded        ``pad_documents``: one document (or piece) per row, padded, plain causal
                attention
  packed-again  a second ``packed``: the A/A control
tokens/s = global batch x seq_len / step; trained tokens/s = the targets the step trains
(``Batch.trained``, the whole global batch's) / step, per round, its median over rounds; trained
= the share of the step's targets that are trained.

The compared metric is ms per step: ``compare`` times steps and has no other metric. Time per
trained token, the figure that matters, is printed beside it (``per_trained``: each round's
time per trained token over its peer's in the same round, the median over rounds). Both
samplers draw the same windows at the same step (the offsets come from (seed, step)), and each
variant runs the same steps, so each one's trained count is fixed by the seed, the same in every
run of a command: time per trained token vs packed = the ms/step ratio x packed's trained / padded's
trained, the constant ``trained_ratio`` printed in the summary row.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import os
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

from fastpar.data.token_file import write_token_file  # noqa: E402
from fastpar.testing import run_ranks  # noqa: E402
from fastpar.train import TrainConfig  # noqa: E402
from fastpar.train.trainer import setup, train_step  # noqa: E402

VARIANTS = {"packed": {}, "padded": dict(pad_documents=True), "packed-again": {}}
WARMUP = 2                          # untimed steps per variant before the rounds


def lognormal_lengths(rng: np.random.Generator, n: int, median: float, sigma: float,
                      longest: int) -> np.ndarray:
    """``n`` document lengths, log-normal around ``median``, clipped to [2, ``longest``] (a
    document of one token has no target)."""
    return np.clip(rng.lognormal(np.log(median), sigma, n), 2, longest).astype(np.int64)


def write_prepared(folder: Path, lengths: dict[str, np.ndarray], seed: int = 0) -> str:
    """A prepared data folder: per split (train, val) a token file of documents of these
    lengths, random ids of a 256-token vocabulary. Returns its path."""
    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True, exist_ok=True)
    for split, ls in lengths.items():
        starts = np.concatenate([[0], np.cumsum(ls)[:-1]])
        write_token_file(folder / f"{split}.bin", rng.integers(0, 256, int(ls.sum())), 256,
                         starts)
    return str(folder)


def describe(lengths: np.ndarray, seq_len: int) -> str:
    return (f"{len(lengths)} documents, {int(lengths.sum())} tokens, median "
            f"{int(np.median(lengths))}, mean {lengths.mean():.0f}, "
            f"{(lengths > seq_len).mean():.1%} longer than {seq_len}")


class TrainerStep:
    """One variant: a trainer run of its own (``setup``: model, optimizer, sampler) and the
    steps it ran; calling it runs the next step, the loss read on the host."""

    def __init__(self, cfg: TrainConfig):
        with contextlib.redirect_stdout(io.StringIO()):     # setup's "writing to OUT"
            self.run = setup(cfg)
        self.step, self.trained, self.losses = 0, [], []

    def __call__(self) -> float:
        self.step += 1
        loss = train_step(self.run, self.step)[0].item()     # waits for the step
        self.trained.append(self.run.trained)
        self.losses.append(loss)
        return loss

    def close(self) -> None:
        self.run.watchdog.close()
        self.run.metrics.close()


def bench_config(a: dict, name: str, **kw) -> TrainConfig:
    """The trainer's config of one variant: no checkpoint, no evaluation, no sample, a
    schedule far longer than the bench so the learning rate is never at its floor."""
    return TrainConfig(model=a["model"], data=a["data"], out=str(Path(a["out"]) / name),
                       overwrite=True, seq_len=a["seq_len"], global_batch_size=a["batch"],
                       micro_batch_size=a["micro"], steps=1_000_000, log_every=1_000_000,
                       no_save=True, sample_tokens=0, **kw)


def check_aa(variants: dict, peer: str, control: str) -> None:
    """The A/A control runs the same math: its warm-up losses must equal its peer's."""
    got, want = variants[control].losses[:WARMUP], variants[peer].losses[:WARMUP]
    for s, (g, w) in enumerate(zip(got, want)):
        assert abs(g - w) <= 1e-6 * abs(w), f"{control} loss {g} at warm-up step {s} != {w}"


def per_round(v: TrainerStep, rounds: int, iters: int) -> list[int]:
    """Trained targets of each round's window (the steps after the warm-up, ``iters`` a
    round, as ``compare`` ran them)."""
    timed = v.trained[WARMUP:]
    return [sum(timed[r * iters:(r + 1) * iters]) for r in range(rounds)]


def _rank(rank, world_size, a):
    torch.set_num_threads(a["threads"])
    variants = {k: TrainerStep(bench_config(a, k, dp=world_size, **kw))
                for k, kw in VARIANTS.items()}
    for v in variants.values():
        for _ in range(WARMUP):              # allocator, optimizer state
            v()
    check_aa(variants, "packed", "packed-again")
    result = common.compare(dict(variants), "packed", variants["packed"].run.mesh.device,
                            a["rounds"], a["iters"], control="packed-again",
                            barrier=dist.barrier)
    trained = {k: per_round(v, a["rounds"], a["iters"]) for k, v in variants.items()}
    for v in variants.values():
        v.close()
    return dict(result=result, trained=trained)


def rows_of(result: dict, trained: dict[str, list[int]], peer: str, step_tokens: int,
            iters: int) -> list[dict]:
    """Per variant: ms/step and its ratio to the peer, tokens/s, trained tokens/s, the trained
    share and time per trained token vs the peer (paired by round)."""
    sec, rows = result["seconds"], []
    per_tok = {k: [s * iters / n for s, n in zip(ss, trained[k])] for k, ss in sec.items()}
    for k, ss in sec.items():
        rows.append(dict(variant=k, median_ms=1e3 * result["median"][k],
                         vs_peer=result["ratio"][k], paired=result["paired"][k],
                         tok_per_s=step_tokens / result["median"][k],
                         trained_tok_per_s=common.median([n / iters / s for n, s in
                                                          zip(trained[k], ss)]),
                         trained=sum(trained[k]) / (len(ss) * iters * step_tokens),
                         us_per_trained=1e6 * common.median(per_tok[k]),
                         per_trained=common.median([a / b for a, b in
                                                    zip(per_tok[k], per_tok[peer])])))
    return rows


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--batch", type=int, default=8, help="global batch, sequences")
    ap.add_argument("--micro", type=int, default=4, help="sequences per micro-batch")
    ap.add_argument("--docs", type=int, default=4000, help="training documents")
    ap.add_argument("--median", type=float, default=48, help="median document length")
    ap.add_argument("--dp", type=int, default=1, help="data-parallel ranks (gloo)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--label", default="cpu", help="suffix of the results file")
    args = ap.parse_args(argv)
    rng = np.random.default_rng(0)
    lengths = {s: lognormal_lengths(rng, n, args.median, 1.0, 4 * args.seq_len)
               for s, n in (("train", args.docs), ("val", max(args.docs // 20, 20)))}
    with tempfile.TemporaryDirectory(prefix="bench-packing-") as tmp:
        data = write_prepared(Path(tmp) / "data", lengths)
        a = dict(model=args.model, data=data, out=str(Path(tmp) / "runs"),
                 seq_len=args.seq_len, batch=args.batch, micro=args.micro,
                 rounds=args.rounds, iters=args.iters, threads=args.threads)
        out = run_ranks(_rank, args.dp, a, init_pg=False, timeout=1800)[0]
    result, trained = out["result"], out["trained"]
    rows = rows_of(result, trained, "packed", args.batch * args.seq_len, args.iters)
    rows.append(dict(variant="summary", trained_ratio=sum(trained["packed"]) /
                     sum(trained["padded"])))
    print(f"{args.label}: {args.model} GPT, dp={args.dp}, {args.threads} thread(s) per rank, "
          f"{args.batch} x {args.seq_len} tokens per step in micro-batches of {args.micro}; "
          f"train data: {describe(lengths['train'], args.seq_len)}")
    common.report(f"packing_{args.label}", rows,
                  ["variant", "median_ms", "vs_peer", "paired", "tok_per_s",
                   "trained_tok_per_s", "trained", "us_per_trained", "per_trained",
                   "trained_ratio"],
                  [{"key": args.label, **result}])


if __name__ == "__main__":
    main()
