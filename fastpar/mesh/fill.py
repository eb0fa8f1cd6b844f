"""Work to run while a transfer travels: DualPipe's overlapped forward and backward.

A pipeline rank that runs one micro-batch's forward and another's backward as a pair (DualPipeV's
overlapped F and B, :class:`fastpar.pipeline.Action` ``overlap``) makes the backward an iterator
of steps (one layer's input gradient each) and runs the forward inside :func:`filling`. A layer
that starts a transfer and would then wait for it (the MoE layer's token dispatch and return)
calls :func:`fill` first: the other micro-batch's backward steps due there run while the
transfer travels (spread evenly over the forward's fill points, which the rank counts on a
forward that runs alone). On a GPU the transfer is on its own stream and the step's kernels on the compute stream;
on CPU gloo's threads move the data while the calling thread computes.

The steps run in the same order on every rank of a group (the fill points are fixed by the model
and the schedule, never by timing), so collectives inside a step (the backward's own
all-to-alls, the data-parallel hooks) are issued in the same order everywhere.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch

_work: list = []            # what is being filled from, innermost last
_busy = False               # a step is running: its own waits do not fill
calls = 0                   # fill points reached so far (with work to run or not)


class _Work:
    def __init__(self, steps: Iterator, n: int | None, points: int | None):
        self.steps, self.n, self.points = steps, n, points
        self.calls = self.done = 0
        self.over = False


@contextmanager
def filling(steps: Iterator, n: int | None = None, points: int | None = None):
    """While inside, :func:`fill` runs steps of ``steps``: one per call, or, given its ``n``
    steps and the ``points`` fill points the work inside will reach (count them with
    :data:`calls` on a run without filling), spread evenly over them, the earlier points
    taking the extra ones."""
    _work.append(_Work(steps, n, points))
    try:
        yield steps
    finally:
        _work.pop()


def fill() -> bool:
    """Run the steps due at this fill point of the work being filled from, if any (not from
    inside a step). Returns whether one ran."""
    global _busy, calls
    calls += 1
    if not _work or _busy:
        return False
    w = _work[-1]
    w.calls += 1
    due = w.done + 1 if not (w.n and w.points) else -(-w.calls * w.n // w.points)
    ran = False
    _busy = True
    try:
        with torch.enable_grad():       # (a custom Function's forward runs without)
            while w.done < due and not w.over:
                try:
                    next(w.steps)
                    ran = True
                except StopIteration:
                    w.over = True
                w.done += 1
        return ran
    finally:
        _busy = False


def drain(steps: Iterator) -> None:
    """Run what is left of ``steps``."""
    for _ in steps:
        pass
