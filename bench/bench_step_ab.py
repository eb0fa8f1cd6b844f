"""The trainer's step before and after a change: two checkouts, the same command, taking turns.

    flock /tmp/fastpar-bench.lock python bench/bench_step_ab.py --before /tmp/fp_before \\
        [--after .] [--layouts tp2 cp2 dp2] [--rounds 3] [--steps 8] [--model small]

Each round runs ``fastpar train`` once per checkout per layout (2 ranks, ``--no-save``, no sample),
the checkouts' order rotated every round, the checkout chosen by ``PYTHONPATH`` (both use this
Python and its torch). A run's time is the median ``step_time_s`` of its steps after the first two
(warm-up), read from its ``metrics.jsonl``; tokens/s = global batch x seq / that time. Per layout
it prints every round's times and the medians over the rounds, after/before (lower is better), and
the two checkouts' losses at the last step, which must agree to within bf16-free fp32 noise (the
same math): a run whose loss differs by more than 1e-3 is flagged.

The step includes the whole of ``train_step``: forward and backward, the gradient sync, the loss
all-reduce, clipping, the non-finite guard and the optimizer; logging every ``--log-every``
steps (default: only at the last step, as a long run logs rarely).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

LAYOUTS = {"tp2": ["--tp", "2"], "cp2": ["--cp", "2"], "dp2": ["--dp", "2"],
           "tp2-sp": ["--tp", "2", "--sequence-parallel"], "pp2": ["--pp", "2"]}


def run(checkout: Path, layout: str, args) -> tuple[float, float]:
    """(median step time after warm-up, last loss) of one ``fastpar train`` run."""
    out = Path(tempfile.mkdtemp(prefix=f"ab-{layout}-"))
    cmd = [sys.executable, "-m", "fastpar", "train", "--nproc", "2", *LAYOUTS[layout],
           "--model", args.model, "--seq-len", str(args.seq), "--global-batch-size",
           str(args.batch), "--micro-batch-size", str(args.micro), "--steps", str(args.steps),
           "--log-every", str(args.log_every or args.steps), "--no-save", "--sample-tokens", "0",
           "--out", str(out), "--overwrite"]
    env = {**os.environ, "PYTHONPATH": str(checkout.resolve())}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=checkout)
    if proc.returncode:
        raise SystemExit(f"{checkout} {layout} failed:\n{proc.stdout[-2000:]}{proc.stderr[-3000:]}")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    times = [r["step_time_s"] for r in rows if r["step"] > 2]
    return statistics.median(times), rows[-1]["loss"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", type=Path, required=True)
    ap.add_argument("--after", type=Path, default=Path("."))
    ap.add_argument("--layouts", nargs="+", default=["tp2", "cp2", "dp2"], choices=list(LAYOUTS))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--log-every", type=int, default=0)
    ap.add_argument("--model", default="small")
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--micro", type=int, default=2)
    args = ap.parse_args()
    sides = {"before": args.before, "after": args.after}
    tokens = args.batch * args.seq
    print(f"# {' '.join(sys.argv)}")
    print("| layout | round order | before ms | after ms | before loss | after loss |")
    print("|---|---|---|---|---|---|")
    summary = []
    for layout in args.layouts:
        got = {k: [] for k in sides}
        for rnd in range(args.rounds):
            order = list(sides) if rnd % 2 == 0 else list(reversed(sides))
            res = {k: run(sides[k], layout, args) for k in order}
            for k, v in res.items():
                got[k].append(v)
            flag = " (losses differ)" if abs(res["before"][1] - res["after"][1]) > 1e-3 else ""
            print(f"| {layout} | {'/'.join(order)} | {res['before'][0] * 1e3:.1f} | "
                  f"{res['after'][0] * 1e3:.1f} | {res['before'][1]:.5f} | "
                  f"{res['after'][1]:.5f}{flag} |", flush=True)
        med = {k: statistics.median(t for t, _ in v) for k, v in got.items()}
        summary.append((layout, med["before"], med["after"]))
    print("\n| layout | before tok/s | after tok/s | after/before time |")
    print("|---|---|---|---|")
    for layout, b, a in summary:
        print(f"| {layout} | {tokens / b:.0f} | {tokens / a:.0f} | {a / b:.3f} |")


if __name__ == "__main__":
    main()
