"""Work to run while a transfer travels: DualPipe's overlapped forward and backward.

A pipeline rank that runs one micro-batch's forward and another's backward as a pair (DualPipeV's
overlapped F and B, :class:`fastpar.pipeline.Action` ``overlap``) runs them with :func:`pair`: two
coroutines that take turns. A layer that starts a transfer and would then wait for it (the MoE
layer's token dispatch and return, forward and backward) calls :func:`fill` first: the side that
called it pauses there and the other side runs until it reaches a fill point of its own (or ends);
then the first resumes and waits for a transfer that has travelled meanwhile. So the forward's
all-to-alls travel under the backward's compute and the backward's under the forward's. On a GPU
the transfers are on their own streams and the compute on the compute stream; on CPU gloo's
threads move the data while the running side computes.

Each side runs on a thread of its own, but only one runs at a time, and the turns change at the
fill points only, which the model and the schedule fix (never timing): the collectives of both
sides are issued in the same order on every rank of a group. The thread-local state a side
needs (grad mode, autocast, the CUDA stream) is the caller's.
"""
from __future__ import annotations

import contextlib
import threading
import time
from typing import Callable

import torch

calls = 0                   # fill points reached so far (with work to run or not)
_pair: _Pair | None = None  # the pair running now


class _Side:
    def __init__(self, fn: Callable[[], None], pair: _Pair, name: str):
        self.fn, self.pair = fn, pair
        self.go = threading.Event()
        self.done, self.error, self.seconds = False, None, 0.0
        self.thread = threading.Thread(target=self._main, daemon=True, name=name)

    def _main(self) -> None:
        self.go.wait()
        self.go.clear()
        try:
            with _entered(self.pair.state):
                self.fn()
        except BaseException as e:          # noqa: BLE001 - raised again by pair()
            self.error = e
        finally:
            self.done = True
            self.pair.back.set()


class _Pair:
    def __init__(self, first, second):
        self.state = _caller_state()
        self.back = threading.Event()       # the running side paused or ended
        self.sides = [_Side(first, self, "fastpar-pair-first"),
                      _Side(second, self, "fastpar-pair-second")]
        self.turn: int | None = None

    def resume(self, i: int) -> None:
        self.turn = i
        side, t0 = self.sides[i], time.perf_counter()
        side.go.set()
        self.back.wait()
        self.back.clear()
        side.seconds += time.perf_counter() - t0


def pair(first: Callable[[], None], second: Callable[[], None]) -> tuple[float, float]:
    """Run ``first`` and ``second`` as two coroutines taking turns at :func:`fill`: ``first``
    until its first fill point, ``second`` until its first, ``first`` again, and so on; one
    that has ended leaves the other to run to its end. Returns the seconds each side ran. An
    exception in either is raised here (the other side is abandoned where it paused)."""
    global _pair
    if _pair is not None:
        raise RuntimeError("fill.pair: a pair is already running on this process")
    p = _pair = _Pair(first, second)
    try:
        for s in p.sides:
            s.thread.start()
        i = 0
        while not all(s.done for s in p.sides):
            if p.sides[i].done:
                i = 1 - i
            p.resume(i)
            if p.sides[i].error is not None:
                raise p.sides[i].error
            i = 1 - i
    finally:
        _pair = None
    return p.sides[0].seconds, p.sides[1].seconds


def fill() -> bool:
    """A fill point: inside a :func:`pair` whose other side has not ended, pause the calling
    side and let the other run until its own next fill point; returns whether it ran."""
    global calls
    calls += 1
    p = _pair
    if p is None or p.turn is None or p.sides[1 - p.turn].done:
        return False
    side = p.sides[p.turn]
    p.back.set()
    side.go.wait()
    side.go.clear()
    return True


def _caller_state() -> dict:
    """The thread-local state a side's thread takes from the caller's."""
    state = {"grad": torch.is_grad_enabled(), "autocast": {}, "stream": None}
    for device in ("cpu", "cuda"):
        if torch.is_autocast_enabled(device):
            state["autocast"][device] = torch.get_autocast_dtype(device)
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["stream"] = torch.cuda.current_stream()
    return state


@contextlib.contextmanager
def _entered(state: dict):
    with contextlib.ExitStack() as stack:
        stack.enter_context(torch.set_grad_enabled(state["grad"]))
        for device, dtype in state["autocast"].items():
            stack.enter_context(torch.autocast(device, dtype))
        if state["stream"] is not None:
            stack.enter_context(torch.cuda.stream(state["stream"]))
        yield


def drain(steps) -> None:
    """Run what is left of the iterator ``steps``."""
    for _ in steps:
        pass
