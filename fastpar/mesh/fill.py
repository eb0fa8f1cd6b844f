"""Work to run while a transfer travels: DualPipe's overlapped forward and backward.

A pipeline rank that runs one micro-batch's forward and another's backward as a pair (DualPipeV's
overlapped F and B, :class:`fastpar.pipeline.Action` ``overlap``) makes the backward an iterator
of steps (one layer's input gradient each) and runs the forward inside :func:`filling`. A layer
that starts a transfer and would then wait for it (the MoE layer's token dispatch and return)
calls :func:`fill` first: one step of the other micro-batch's backward runs while the transfer
travels. On a GPU the transfer is on its own stream and the step's kernels on the compute stream;
on CPU gloo's threads move the data while the calling thread computes.

The steps run in the same order on every rank of a group (the fill points are fixed by the model
and the schedule, never by timing), so collectives inside a step (the backward's own
all-to-alls, the data-parallel hooks) are issued in the same order everywhere.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch

_work: list = []            # the iterators being filled from, innermost last
_busy = False               # a step is running: its own waits do not fill


@contextmanager
def filling(steps: Iterator):
    """While inside, :func:`fill` runs the next step of ``steps``."""
    _work.append(steps)
    try:
        yield steps
    finally:
        _work.pop()


def fill() -> bool:
    """Run one step of the work being filled from, if any (not from inside a step). Returns
    whether one ran."""
    global _busy
    if not _work or _busy:
        return False
    _busy = True
    try:
        with torch.enable_grad():       # (a custom Function's forward runs without)
            next(_work[-1])
        return True
    except StopIteration:
        return False
    finally:
        _busy = False


def drain(steps: Iterator) -> None:
    """Run what is left of ``steps``."""
    for _ in steps:
        pass
