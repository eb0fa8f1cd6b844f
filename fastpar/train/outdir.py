"""Folders the commands write: nothing a user already has is replaced unasked.

A run's folder (``fastpar train --out``) holds one run's history. A folder that holds another
run's record (``metrics.jsonl``, ``config.json`` or a checkpoint) is never written into silently:
``--resume`` continues that run (its metrics after the checkpoint's step are dropped, then
appended to), ``--overwrite`` first moves the old run aside to ``OUT.replaced-<time>``, and
anything else is one error that says so. A folder that holds anything a run does not write (a
user's own files) is refused even with ``--resume``. Without ``--out`` every run gets a fresh
folder under ``runs/``.

Folders written whole (``prepare-data --out``, ``export OUT``) go through :func:`fresh_folder`:
a destination holding anything is refused unless ``--overwrite``, which moves it aside the same
way; the new content is written under a temporary name and renamed into place, so a failure
leaves nothing behind and the earlier folder as it was.

Every path is checked before any rank starts or any work is done: a file, or a folder that
cannot be created or written, is one error.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import time
from dataclasses import replace
from pathlib import Path

from .checkpoint import complete_checkpoints
from .config import TrainConfig
from .profiler import profile_folder

RUN_FILES = ("metrics.jsonl", "config.json")
# Everything a run writes into its folder (a checkpoint's temporary folder lives in checkpoints/).
RUN_NAMES = frozenset(RUN_FILES + ("checkpoints", "loss.png", "profile", "tensorboard", "hang",
                                   "nccl_trace", "tokenizer.json", "data.json"))


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


def check_writable(out: Path, flag: str = "--out") -> None:
    """``out`` is a folder this process can create and write into, else one ValueError."""
    if out.exists() and not out.is_dir():
        raise ValueError(f"{flag} {out} is a file, not a folder")
    try:
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=out, prefix=".write-test-"):
            pass
    except OSError as e:
        raise ValueError(f"{flag} {out} cannot be created or written: {e.strerror or e}") from None


def foreign(out: Path, ours=RUN_NAMES) -> list[str]:
    """What ``out`` holds that is not among the names ``ours`` (sorted; empty if nothing)."""
    if not out.is_dir():
        return []
    return sorted(p.name for p in out.iterdir()
                  if p.name not in ours and not p.name.startswith(".write-test-"))


def _listing(names: list[str], most: int = 3) -> str:
    shown = ", ".join(repr(n) for n in names[:most])
    return shown + (f" and {len(names) - most} more" if len(names) > most else "")


def check_out(cfg: TrainConfig) -> None:
    """Refuse to mix runs or to write among a user's files: see the module doc. Read-only."""
    out = Path(cfg.out)
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} is a file, not a folder")
    others = foreign(out)
    if others and not cfg.overwrite:
        raise ValueError(f"--out {out} holds {_listing(others)}, which fastpar train does not "
                         "write: pick another --out (or pass --overwrite to move that folder "
                         "aside first)")
    earlier = previous_run(out)
    if earlier and not cfg.resume and not cfg.overwrite:
        raise ValueError(
            f"--out {out} already holds a run ({', '.join(earlier)}): pass --resume to continue "
            f"it, another --out for a new run, or --overwrite to move it aside first")
    if cfg.resume is True and not complete_checkpoints(out / "checkpoints"):
        raise nothing_to_resume(out, earlier)
    if cfg.profile_window and cfg.resume:
        traces = profile_folder(out, cfg.profile_window)
        if traces.is_dir() and any(traces.iterdir()):
            raise ValueError(f"--profile-steps {cfg.profile_steps}: {traces} already holds the "
                             "traces of these steps from this run's start: pick other steps, "
                             "or move that folder")


def move_aside(out: Path) -> Path:
    """Rename ``out`` to ``OUT.replaced-<time>[-N]`` beside it; returns the new name."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    aside, n = out.with_name(f"{out.name}.replaced-{stamp}"), 1
    while aside.exists():
        n += 1
        aside = out.with_name(f"{out.name}.replaced-{stamp}-{n}")
    out.rename(aside)
    return aside


def check_fresh(out: Path, flag: str, overwrite: bool, command: str) -> None:
    """``out`` can become a new folder: it does not exist, or is an empty folder, or holds
    something and ``overwrite`` moves it aside; its parent can be written. One ValueError."""
    if out.exists() and not out.is_dir():
        raise ValueError(f"{flag} {out} is a file, not a folder")
    held = sorted(p.name for p in out.iterdir()) if out.is_dir() else []
    if held and not overwrite:
        raise ValueError(f"{flag} {out} already holds {_listing(held)}: fastpar {command} "
                         "writes a new folder and replaces nothing; pick another, or pass "
                         "--overwrite to move it aside first")
    parent = next(p for p in [out.parent, *out.parent.parents] if p.exists())
    if not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK):
        raise ValueError(f"{flag} {out} cannot be created: {parent} is not a folder this user "
                         "can write")


@contextlib.contextmanager
def fresh_folder(out, flag: str, overwrite: bool, command: str, say=print):
    """Write a whole folder at ``out``: checks it (:func:`check_fresh`), yields a temporary
    folder beside it to write into, and on success renames that into place (an earlier ``out``
    moved aside first, and said). On failure the temporary folder and any parent folders made
    for it are removed: nothing is left behind and nothing earlier changes."""
    out = Path(out)
    check_fresh(out, flag, overwrite, command)
    made = [d for d in [out.parent, *out.parent.parents] if not d.exists()]
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    try:
        tmp.mkdir(parents=True)
        yield tmp
        if out.is_dir() and any(out.iterdir()):
            say(f"fastpar {command}: --overwrite: moved the earlier {out} to {move_aside(out)}")
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        for d in made:                                   # the parents made for it, if empty
            if d.exists() and not any(d.iterdir()):
                d.rmdir()
        raise


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
    check_writable(out)
    if cfg.overwrite and not cfg.resume and rank == 0 and (previous_run(out) or foreign(out)):
        what = "content of" if foreign(out) else "run in"
        aside = move_aside(out)
        out.mkdir()
        say(f"fastpar train: --overwrite: moved the earlier {what} {out} to {aside}")
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
