"""The output folder of a run: one folder, one run's history.

A folder that holds another run's record (``metrics.jsonl``, ``config.json`` or a checkpoint) is
never written into silently: ``--resume`` continues that run (its metrics are appended to),
``--overwrite`` first moves the old run aside to ``OUT.replaced-<time>``, and anything else is one
error that says so. Without ``--out`` every run gets a fresh folder under ``runs/``. The path
itself is checked before any rank starts: a file, or a folder that cannot be created or written,
is one error.
"""
from __future__ import annotations

import os
import tempfile
import time
from dataclasses import replace
from pathlib import Path

from .checkpoint import complete_checkpoints
from .config import TrainConfig

RUN_FILES = ("metrics.jsonl", "config.json")


def default_out(root: str = "runs") -> str:
    """A fresh folder for a run without ``--out``: ``runs/<torchrun's run id>`` under a
    torchrun whose ranks share an id, else ``runs/run-YYYYmmdd-HHMMSS[-N]``, created here so two
    runs started in the same second do not share it."""
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "none")
    if "RANK" in os.environ and run_id not in ("", "none"):
        return str(Path(root) / run_id)
    stamp = time.strftime("run-%Y%m%d-%H%M%S")
    for n in range(1, 1000):
        path = Path(root) / (stamp if n == 1 else f"{stamp}-{n}")
        try:
            path.mkdir(parents=True)
            return str(path)
        except FileExistsError:
            continue
        except OSError as e:
            raise ValueError(f"cannot create the output folder {path}: {e.strerror}") from None
    raise ValueError(f"no free run folder under {root}/ for {stamp}")


def previous_run(out: Path) -> list[str]:
    """What in ``out`` belongs to an earlier run (empty if nothing)."""
    found = [name for name in RUN_FILES if (out / name).exists()]
    ckpt = out / "checkpoints"
    if ckpt.is_dir():
        steps = sorted(p.name for p in ckpt.iterdir() if p.name.startswith("step_"))
        if steps:
            found.append(f"checkpoints/{steps[-1]}" + (f" (+{len(steps) - 1} more)"
                                                      if len(steps) > 1 else ""))
    return found


def check_writable(out: Path) -> None:
    """``out`` is a folder this process can create and write into, else one ValueError."""
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} is a file, not a folder")
    try:
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=out, prefix=".write-test-"):
            pass
    except OSError as e:
        raise ValueError(f"--out {out} cannot be created or written: {e.strerror or e}") from None


def check_out(cfg: TrainConfig) -> None:
    """Refuse to mix runs: see the module doc. Read-only apart from creating the folder."""
    out = Path(cfg.out)
    check_writable(out)
    earlier = previous_run(out)
    if earlier and not cfg.resume and not cfg.overwrite:
        raise ValueError(
            f"--out {out} already holds a run ({', '.join(earlier)}): pass --resume to continue "
            f"it, another --out for a new run, or --overwrite to move it aside first")
    if cfg.resume is True and not complete_checkpoints(out / "checkpoints"):
        raise nothing_to_resume(out, earlier)


def nothing_to_resume(out, earlier=()) -> ValueError:
    held = f" (it holds {', '.join(earlier)})" if earlier else ""
    return ValueError(f"--resume: {out} has no complete checkpoint{held}: there is nothing to "
                      "resume; start without --resume, or pass --resume auto to start fresh "
                      "when there is none")


def prepare_out(cfg: TrainConfig, rank: int = 0, say=print) -> TrainConfig:
    """Check ``cfg.out`` and, on rank 0 with ``--overwrite`` (and no resume), move an earlier run
    aside. Returns the config the ranks run with (``overwrite`` done, so off)."""
    check_out(cfg)
    out = Path(cfg.out)
    if cfg.overwrite and not cfg.resume and rank == 0 and previous_run(out):
        aside = out.with_name(f"{out.name}.replaced-{time.strftime('%Y%m%d-%H%M%S')}")
        n = 1
        while aside.exists():
            n += 1
            aside = aside.with_name(f"{out.name}.replaced-{time.strftime('%Y%m%d-%H%M%S')}-{n}")
        out.rename(aside)
        out.mkdir()
        say(f"fastpar train: --overwrite: moved the earlier run in {out} to {aside}")
    return replace(cfg, overwrite=False)


def resolve_out(cfg: TrainConfig, world_size: int) -> TrainConfig:
    """``cfg`` with ``out`` set: the given folder, else a fresh one (:func:`default_out`)."""
    if cfg.out is not None:
        return cfg
    shared = os.environ.get("TORCHELASTIC_RUN_ID", "none") not in ("", "none")
    if world_size > 1 and not shared:
        raise ValueError(f"out= must be given when {world_size} ranks start without a launcher "
                         "(each would pick its own fresh folder)")
    return replace(cfg, out=default_out())
