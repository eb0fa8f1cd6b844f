"""Run a bench several times and print every run's numbers as one markdown table.

    python bench/repeat.py --runs 3 -- python bench/bench_dp_mlp.py --label loopback
    python bench/repeat.py --runs 3 -- ../shared/tools/shaped-link 1gbit \\
        python bench/bench_dp_mlp.py --label 1gbit
    python bench/repeat.py --files bench/results/dp_mlp_a.json bench/results/dp_mlp_b.json

The command after ``--`` (a link-shaping prefix included) runs ``--runs`` times, one after the
other. Each run's bench writes bench/results/<name>.json through ``common.report``, tagged with
the run id this script puts in its environment; those files are read back after the run. For
each comparison (``common.compare``; one per key, e.g. per pp or per model) the table gives, per
variant, its peer, every run's ratio to the peer and median ms, and the median over the runs of
each, and the paired ratio (each round's time over its peer's in the same round) per run and its
median over every round of every run; then the A/A control's ratios over the runs and over the
rounds inside them, its spread.
The command and the machine head the table, ready for bench/RESULTS.md; every run's results are
kept in bench/results/repeat_<name>.json. ``--files`` tabulates results already written, one
file per run.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402


def run_once(cmd: list[str], results: Path = common.RESULTS) -> list[tuple[Path, dict]]:
    """Run ``cmd`` once; the result files its bench wrote (found by the run id)."""
    run_id = uuid.uuid4().hex
    start = time.time()
    rc = subprocess.run(cmd, env={**os.environ, common.RUN_ID_ENV: run_id}).returncode
    if rc != 0:
        raise SystemExit(f"repeat: {shlex.join(cmd)} exited with {rc}")
    found = []
    for path in sorted(results.glob("*.json")):
        if path.stat().st_mtime < start - 1:
            continue
        doc = _load(path)
        if doc is not None and doc.get("run_id") == run_id:
            found.append((path, doc))
    if not found:
        raise SystemExit(f"repeat: no bench/results/*.json with run id {run_id} after "
                         f"{shlex.join(cmd)} (does it report through common.report, and does "
                         f"its prefix keep the environment?)")
    return found


def _load(path: Path) -> dict | None:
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) and doc.get("comparisons") else None


def _nums(xs, fmt="{:.3f}") -> str:
    return ", ".join(fmt.format(x) for x in xs)


def _count(n: int, what: str) -> str:
    return f"{n} {what}{'' if n == 1 else 's'}"


def _machine(m: dict) -> str:
    gpu = m.get("gpu") or "no GPU"
    isa = f" ({m['isa']})" if m.get("isa") else ""
    return (f"{m.get('host')}, {m.get('cpu')}{isa}, {m.get('cores')} cores, {gpu}, "
            f"torch {m.get('torch')}")


def _round_ratios(cmp: dict, name: str) -> list[float] | None:
    """Each round's time over its peer's in the same round (older results: from ``seconds``)."""
    if "round_ratio" in cmp:
        return cmp["round_ratio"][name]
    if name in cmp.get("aa_rounds", {}):
        return cmp["aa_rounds"][name]
    if "seconds" in cmp:
        return [a / b for a, b in zip(cmp["seconds"][name],
                                      cmp["seconds"][cmp["peer_of"][name]])]
    return None


def table(docs: list[dict], command: str) -> str:
    """The markdown table of several runs' result documents (``common.report``'s JSON)."""
    by_key: dict[str, list[dict]] = {}
    for doc in docs:
        for cmp in doc["comparisons"]:
            by_key.setdefault(cmp.get("key", ""), []).append(cmp)
    machines = {_machine(d["machine"]) for d in docs}
    times = sorted(d.get("time", "") for d in docs)
    out = [f"`{command}`", "",
           f"Machine: {'; '.join(sorted(machines))}. Runs: {times[0]} to {times[-1]}."]
    for key, cmps in by_key.items():
        first = cmps[0]
        few = " (fewer than the 3 a RESULTS.md table needs)" if len(cmps) < 3 else ""
        out += ["", f"{key + ': ' if key else ''}{_count(len(cmps), 'run')}{few}, each "
                f"{_count(first['rounds'], 'round')} of {_count(first['iters'], 'step')} per "
                f"variant; ratio = variant median / peer median in the same run; paired = "
                f"median of each round's time / its peer's in that round; medians over runs "
                f"taken separately, the paired one over every round of every run.", "",
                "| variant | peer | vs peer, per run | vs peer, median | paired, per run | "
                "paired, all rounds | ms per run | ms, median |",
                "|---|---|---|---|---|---|---|---|"]
        for name in first["median"]:
            ratios = [c["ratio"][name] for c in cmps]
            ms = [c["median"][name] * 1e3 for c in cmps]
            rounds = [_round_ratios(c, name) for c in cmps]
            if all(r is not None for r in rounds):
                paired = (_nums([statistics.median(r) for r in rounds]),
                          f"{statistics.median([x for r in rounds for x in r]):.3f}")
            else:
                paired = ("n/a", "n/a")
            label = f"{name} (A/A)" if name in first["controls"] else name
            out.append(f"| {label} | {first['peer_of'][name]} | {_nums(ratios)} | "
                       f"{statistics.median(ratios):.3f} | {paired[0]} | {paired[1]} | "
                       f"{_nums(ms, '{:.1f}')} | {statistics.median(ms):.1f} |")
        out.append("")
        for c in first["controls"]:
            runs = [cmp["aa"][c] for cmp in cmps]
            per_run = [cmp["aa_rounds"][c] for cmp in cmps]
            rounds = [r for rs in per_run for r in rs]
            paired = [statistics.median(rs) for rs in per_run]
            out.append(f"A/A control {c} / {first['peer_of'][c]}: {min(runs):.3f}-"
                       f"{max(runs):.3f} over the runs (spread {max(runs) - min(runs):.3f}), "
                       f"paired {min(paired):.3f}-{max(paired):.3f} over the runs, "
                       f"{min(rounds):.3f}-{max(rounds):.3f} over single rounds.")
    return "\n".join(out)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    cmd = argv[argv.index("--") + 1:] if "--" in argv else []
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=3, help="how many times to run the command")
    p.add_argument("--files", nargs="+", type=Path, help="tabulate these results instead")
    a = p.parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    if a.files:
        docs = [d for d in map(_load, a.files) if d is not None]
        if len(docs) != len(a.files):
            raise SystemExit("repeat: some --files hold no compare results")
        print(table(docs, "; ".join(dict.fromkeys(str(d.get("command")) for d in docs))))
        return
    if not cmd or a.runs < 1:
        p.error("give --runs N (>= 1) and the bench command after --")
    docs, name = [], None
    for i in range(a.runs):
        print(f"repeat: run {i + 1} of {a.runs}: {shlex.join(cmd)}", flush=True)
        found = run_once(cmd)
        name = name or "+".join(path.stem for path, _ in found)
        docs += [doc for _, doc in found]
    command = shlex.join(["python", "bench/repeat.py", "--runs", str(a.runs), "--", *cmd])
    kept = common.RESULTS / f"repeat_{name}.json"
    kept.write_text(json.dumps({"command": command, "runs": docs}, indent=2))
    print(f"\nwrote {kept}\n")
    print(table(docs, command))


if __name__ == "__main__":
    main()
