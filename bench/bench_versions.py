"""Tokens/s of `fastpar train` at two versions of fastpar, same machine, link and settings.

    python bench/bench_versions.py --old /path/to/old/checkout [--layouts pp2xdp2 tp2xpp2]
        [--runs 3] [--model small] [--steps 25]

The old checkout must have its extension built in place (``python setup.py build_ext
--inplace``) and a ``fastpar/kernels`` link to its ``kernels/``; it runs with PYTHONPATH set to
it, the current version from this checkout's installed package. Each run is one ``fastpar train``
per (layout, version), the versions' order rotated every run; tokens/s is the median over the
steps after the warm-up (``--skip``). Every run is printed and kept in
bench/results/versions.json.
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

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

LAYOUTS = {"pp2xdp2": ["--pp", "2", "--dp", "2"], "tp2xpp2": ["--tp", "2", "--pp", "2"],
           "tp2": ["--tp", "2"], "pp2": ["--pp", "2"], "dp2": ["--dp", "2"]}


def run_once(version: str, old: str | None, layout: str, a) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        env = {k: v for k, v in os.environ.items()
               if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
        if old:
            env["PYTHONPATH"] = old
        ranks = 4 if "x" in layout else 2
        cmd = [sys.executable, "-m", "fastpar", "train", "--model", a.model, *LAYOUTS[layout],
               "--nproc", str(ranks), "--steps", str(a.steps), "--seq-len", str(a.seq),
               "--global-batch-size", str(a.batch), "--micro-batch-size", str(a.micro),
               "--warmup-steps", "5", "--log-every", "1000", "--out", f"{tmp}/run"]
        out = subprocess.run(cmd, cwd=tmp, env=env, capture_output=True, text=True,
                             timeout=900)
        if out.returncode:
            raise SystemExit(f"{version} {layout} failed:\n{out.stderr[-3000:]}")
        rows = [json.loads(x) for x in Path(f"{tmp}/run/metrics.jsonl").read_text().split("\n")
                if x.strip()]
        return statistics.median(r["tokens_per_s"] for r in rows[a.skip:])


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--old", required=True, help="checkout of the old version (built in place)")
    p.add_argument("--layouts", nargs="+", default=["pp2xdp2", "tp2xpp2"], choices=list(LAYOUTS))
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--model", default="small")
    p.add_argument("--steps", type=int, default=25)
    p.add_argument("--skip", type=int, default=5, help="steps left out of the median")
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--micro", type=int, default=2)
    p.add_argument("--label", default="cpu")
    a = p.parse_args()
    rows = []
    for run in range(a.runs):
        for layout in a.layouts:
            got = {}
            for version in common.rotated(["old", "new"], run):
                got[version] = run_once(version, a.old if version == "old" else None, layout, a)
            row = {"run": run, "layout": layout, "old_tok/s": got["old"],
                   "new_tok/s": got["new"], "new/old": got["new"] / got["old"]}
            print(" ".join(f"{k}={common._fmt(v)}" for k, v in row.items()), flush=True)
            rows.append(row)
    for layout in a.layouts:
        mine = [r for r in rows if r["layout"] == layout]
        rows.append({"run": "median", "layout": layout,
                     "old_tok/s": statistics.median(r["old_tok/s"] for r in mine),
                     "new_tok/s": statistics.median(r["new_tok/s"] for r in mine),
                     "new/old": statistics.median(r["new/old"] for r in mine)})
    common.report(f"versions_{a.label}", rows, ["run", "layout", "old_tok/s", "new_tok/s",
                                                "new/old"])


if __name__ == "__main__":
    main()
