"""Shared by the bench scripts: the measuring method, the machine's description, JSON + table
output.

Every multi-rank bench measures with :func:`compare`: all variants live in one process set and
take turns round by round, the order rotated every round; each variant's ``iters`` steps are
timed as one window that also holds every wait the steps defer (``finish``), a barrier before
it; a round's time is the slowest rank's; each variant's median over rounds is divided by its
peer's median, and an A/A control (a second, identical instance of the peer) gives the noise.
A paired ratio is also kept: each round's time over its peer's time in the same round (the two
windows are minutes apart at most, so a drift of the machine's speed cancels), its median over
rounds; a run's A/A control gives the spread of both.
``bench/repeat.py`` runs a bench several times and tabulates every run.
"""
from __future__ import annotations

import json
import os
import platform
import shlex
import statistics
import sys
import time
from pathlib import Path
from typing import Callable, Iterable

import torch
import torch.distributed as dist

RESULTS = Path(__file__).resolve().parent / "results"
RUN_ID_ENV = "FASTPAR_BENCH_RUN"     # set by bench/repeat.py; report() writes it to the JSON


def machine() -> dict:
    """What the numbers were measured on, recorded with every row."""
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return {"host": platform.node(), "cpu": _cpu_model() or platform.processor() or
            platform.machine(), "cores": os.cpu_count(), "gpu": gpu, "torch": torch.__version__,
            "isa": torch.backends.cpu.get_cpu_capability()}


def _cpu_model() -> str | None:
    """The CPU's model name (Linux), e.g. 'Intel(R) Xeon(R) Processor'; None elsewhere."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def command() -> str:
    """This process's command line, as it could be typed again."""
    return shlex.join(["python", *sys.argv])


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_it(fn, device: torch.device, warmup: int = 2, iters: int = 10) -> list[float]:
    """Seconds per call of ``fn`` for ``iters`` calls after ``warmup`` untimed ones."""
    for _ in range(warmup):
        fn()
    sync(device)
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - start)
    return times


def time_steps(fn, device: torch.device, iters: int, finish=None) -> float:
    """Seconds per step of ``iters`` calls of ``fn`` timed as one window that also holds
    ``finish()`` (every wait a step defers to the next one, e.g. ZeRO-1's parameter gather):
    nothing a step launches completes outside the window."""
    sync(device)
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    if finish is not None:
        finish()
    sync(device)
    return (time.perf_counter() - start) / iters


def median(xs: list[float]) -> float:
    return statistics.median(xs)


def rotated(items: list, turn: int) -> list:
    """``items`` starting at position ``turn`` (mod its length): the order of one round of
    variants that take turns, so that each runs first in turn (the cyclic order is kept, so
    each still follows the same one whenever it is not first)."""
    k = turn % len(items)
    return items[k:] + items[:k]


def compare(variants: dict[str, Callable[[], object]], peer: str, device: torch.device,
            rounds: int, iters: int, *, control: str | Iterable[str],
            peers: dict[str, str] | None = None,
            finish: dict[str, Callable[[], object]] | None = None,
            barrier: Callable[[], object] | None = None, group=None) -> dict:
    """Time every variant against its peer, the benches' one method.

    ``variants`` maps a name to one step (no arguments). ``peer`` names the variant the others
    are divided by; ``peers`` gives another peer to some variants (e.g. the sequence-parallel
    rows' own). ``control`` names the A/A control(s): a second, identical instance of a peer,
    whose ratio to it is the noise of the comparison; at least one is required and each must be
    a variant other than its peer. Each of ``rounds`` rounds runs every variant, in an order
    rotated every round (:func:`rotated`), as one window of ``iters`` steps plus its
    ``finish[name]()`` (:func:`time_steps`), ``barrier()`` before each window. With
    torch.distributed initialised each round's time is the slowest rank's in ``group``.

    Returns (JSON-ready): ``seconds`` per variant per round (per step), ``median`` per variant,
    ``peer_of``, ``ratio`` = median / its peer's median (the same medians as printed), ``aa``
    per control (its ratio) and ``aa_rounds`` (its per-round ratios: the spread inside a run),
    ``round_ratio`` per variant (each round's time / its peer's in that round) and ``paired``,
    their median.
    """
    names = list(variants)
    peer_of = {n: peer for n in names}
    peer_of.update(peers or {})
    controls = [control] if isinstance(control, str) else list(control)
    finish = finish or {}
    if peer not in variants:
        raise ValueError(f"peer {peer!r} is not a variant: {names}")
    if not controls:
        raise ValueError(f"no A/A control of the peer {peer!r}: name a second instance of it")
    for c in controls:
        if c not in variants or c == peer_of[c]:
            raise ValueError(f"A/A control {c!r} must be a variant other than its peer "
                             f"{peer_of.get(c, peer)!r}: {names}")
    unknown = sorted({*peer_of} - {*names} | {*peer_of.values()} - {*names} | {*finish} - {*names})
    if unknown:
        raise ValueError(f"peers / finish name unknown variants {unknown}: {names}")
    if rounds < 1 or iters < 1:
        raise ValueError(f"rounds={rounds} and iters={iters} must be >= 1")

    seconds = {n: [] for n in names}
    for r in range(rounds):
        for n in rotated(names, r):
            if barrier is not None:
                barrier()
            seconds[n].append(time_steps(variants[n], device, iters, finish.get(n)))
    if dist.is_available() and dist.is_initialized():
        t = torch.tensor([seconds[n] for n in names], dtype=torch.float64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)   # as slow as the slowest rank
        seconds = dict(zip(names, t.tolist()))
    med = {n: median(seconds[n]) for n in names}
    ratio = {n: med[n] / med[peer_of[n]] for n in names}
    round_ratio = {n: [a / b for a, b in zip(seconds[n], seconds[peer_of[n]])] for n in names}
    return {"peer": peer, "peer_of": peer_of, "controls": controls, "rounds": rounds,
            "iters": iters, "seconds": seconds, "median": med, "ratio": ratio,
            "aa": {c: ratio[c] for c in controls},
            "aa_rounds": {c: round_ratio[c] for c in controls},
            "round_ratio": round_ratio,
            "paired": {n: median(round_ratio[n]) for n in names}}


def report(name: str, rows: list[dict], columns: list[str],
           comparisons: list[dict] | None = None) -> Path:
    """Print ``rows`` as a table and write them, with the command, the machine and the
    :func:`compare` results (each with a ``key`` such as "pp2"), to bench/results/NAME.json."""
    widths = {c: max(len(c), *(len(_fmt(r.get(c))) for r in rows)) for c in columns}
    print(f"$ {command()}")
    print("  ".join(c.ljust(widths[c]) for c in columns))
    for r in rows:
        print("  ".join(_fmt(r.get(c)).ljust(widths[c]) for c in columns))
    for cmp in comparisons or []:
        aa = ", ".join(f"{c} / {cmp['peer_of'][c]} {r:.3f}" for c, r in cmp["aa"].items())
        print(f"A/A{' ' + cmp['key'] if cmp.get('key') else ''}: {aa}")
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps({"command": command(), "machine": machine(),
                                "time": time.strftime("%Y-%m-%d %H:%M"),
                                "run_id": os.environ.get(RUN_ID_ENV), "rows": rows,
                                "comparisons": comparisons or []}, indent=2))
    print(f"wrote {path}  ({machine()})")
    return path


def _fmt(v) -> str:
    if v is None:
        return ""
    return f"{v:.3f}" if isinstance(v, float) else str(v)
