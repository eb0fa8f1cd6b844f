"""Shared by the bench scripts: timing, the machine's description, JSON + table output."""
from __future__ import annotations

import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent / "results"


def machine() -> dict:
    """What the numbers were measured on, recorded with every row."""
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return {"host": platform.node(), "cpu": platform.processor() or platform.machine(),
            "cores": os.cpu_count(), "gpu": gpu, "torch": torch.__version__}


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


def report(name: str, rows: list[dict], columns: list[str]) -> Path:
    """Print ``rows`` as a table and write them, with the machine, to bench/results/NAME.json."""
    widths = {c: max(len(c), *(len(_fmt(r.get(c))) for r in rows)) for c in columns}
    print("  ".join(c.ljust(widths[c]) for c in columns))
    for r in rows:
        print("  ".join(_fmt(r.get(c)).ljust(widths[c]) for c in columns))
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps({"machine": machine(), "time": time.strftime("%Y-%m-%d %H:%M"),
                                "rows": rows}, indent=2))
    print(f"wrote {path}")
    return path


def _fmt(v) -> str:
    if v is None:
        return ""
    return f"{v:.3f}" if isinstance(v, float) else str(v)


def rotated(items: list, turn: int) -> list:
    """``items`` starting at position ``turn`` (mod its length): the order of one round of
    variants that take turns, so that none always runs first or after the same one."""
    k = turn % len(items)
    return items[k:] + items[:k]
