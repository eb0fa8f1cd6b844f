"""Fault injection for the reliability tests: ``FASTPAR_FAULT=KIND@STEPS[:RANK][,...]``.

    kill@6:1       rank 1 kills itself (SIGKILL) right after step 6
    hang@3:1       rank 1 stops (sleeps) at the start of step 3, before its collectives
    skip@3:1       rank 1 skips one collective at step 3, the loss all-reduce (neither issued
                   nor recorded; the others issue it): the ranks deadlock out of step
    nan@5          a gradient is NaN on every rank at step 5 (as after an overflow)
    nan@3-5:0      on rank 0 only, at steps 3, 4 and 5
    nan-loss@5     the loss is NaN at step 5
    kill-save@8    every rank dies while writing the checkpoint of step 8, before it is complete

Without a rank every rank is hit; faults separated by commas all apply. A fault fires on the
first attempt only: a worker restarted by the launcher (TORCHELASTIC_RESTART_COUNT > 0) runs
clean, as a real job would after a transient failure. Unset, nothing here costs anything.
"""
from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass

import torch

from ..mesh.flight import recorder

KINDS = ("kill", "hang", "skip", "nan", "nan-loss", "kill-save")


@dataclass(frozen=True)
class Fault:
    kind: str
    first: int
    last: int
    rank: int | None

    def hits(self, kind: str, step: int, rank: int) -> bool:
        return (kind == self.kind and self.first <= step <= self.last
                and self.rank in (None, rank))


def parse(spec: str) -> Fault:
    """``KIND@STEPS[:RANK]`` -> :class:`Fault`; raises ValueError naming the bad part."""
    try:
        kind, rest = spec.split("@", 1)
        steps, _, rank = rest.partition(":")
        first, _, last = steps.partition("-")
        fault = Fault(kind, int(first), int(last or first), int(rank) if rank else None)
    except ValueError:
        raise ValueError(f"FASTPAR_FAULT={spec!r} is not KIND@STEP[-STEP][:RANK]") from None
    if kind not in KINDS:
        raise ValueError(f"FASTPAR_FAULT={spec!r}: kind {kind!r} is not one of {KINDS}")
    return fault


class Faults(tuple):
    """The faults of this attempt; ``hits`` if any of them does."""

    def hits(self, kind: str, step: int, rank: int) -> bool:
        return any(f.hits(kind, step, rank) for f in self)


def from_env() -> Faults:
    """The faults to inject in this attempt (none on a restarted attempt)."""
    spec = os.environ.get("FASTPAR_FAULT")
    if not spec or int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0:
        return Faults()
    return Faults(parse(part.strip()) for part in spec.split(","))


def after_step(faults: Faults, step: int, rank: int) -> None:
    if faults.hits("kill", step, rank):
        os.kill(os.getpid(), signal.SIGKILL)


def before_step(faults: Faults, step: int, rank: int) -> None:
    if faults.hits("hang", step, rank):
        while True:             # a rank that stopped taking part, e.g. stuck in I/O
            time.sleep(3600)


def poison(faults: Faults, step: int, rank: int, loss: torch.Tensor, modules) -> None:
    """Make this rank's loss, or its first gradient, NaN; or skip its next collective (the
    trainer calls this right before the loss all-reduce)."""
    if faults.hits("skip", step, rank):
        recorder.skips += 1
    if faults.hits("nan-loss", step, rank):
        loss.fill_(float("nan"))
    if faults.hits("nan", step, rank):
        for p in (p for m in modules for p in m.parameters()):
            g = getattr(p, "main_grad", None) if p.grad is None else p.grad
            if g is not None:
                g.view(-1)[0] = float("nan")
                return


def during_save(faults: Faults, step: int, rank: int) -> None:
    if faults.hits("kill-save", step, rank):
        os.kill(os.getpid(), signal.SIGKILL)
