"""Work to run while a transfer travels: DualPipe's overlapped forward and backward.

A pipeline rank that runs one micro-batch's forward and another's backward as a pair (DualPipeV's
overlapped F and B, :class:`fastpar.pipeline.Action` ``overlap``) runs them with :func:`pair`: two
coroutines that take turns, the F on the caller's thread and the B on a thread of its own. A layer that starts a transfer and would then wait for it (the MoE
layer's token dispatch and return, forward and backward) calls :func:`fill` first: the side that
called it pauses there and the other side runs until it reaches a fill point of its own (or ends);
then the first resumes and waits for a transfer that has travelled meanwhile. So the forward's
all-to-alls travel under the backward's compute and the backward's under the forward's. On a GPU
the transfers are on their own streams and the compute on the compute stream; on CPU gloo's
threads move the data while the running side computes.

Only one side runs at a time, each handing the turn straight to the other, and the turns change at
the fill points only, which the model and the schedule fix (never timing): the collectives of
both sides are issued in the same order on every rank of a group. The B's thread takes the
caller's thread-local state (grad mode, autocast, the CUDA stream).
"""
from __future__ import annotations

import contextlib
import threading
import time
from typing import Callable

import torch

calls = 0                   # fill points reached so far (with work to run or not)
_pair: _Pair | None = None  # the pair running now


class _Pair:
    """The forward side runs on the caller's thread, the backward side on a thread of its own;
    each hands the turn straight to the other (one wake-up per turn)."""

    def __init__(self, second: Callable[[], None]):
        self.second, self.state = second, _caller_state()
        self.go = (threading.Event(), threading.Event())     # the first's, the second's
        self.done = [False, False]
        self.turn = 0
        self.error: BaseException | None = None
        self.seconds = [0.0, 0.0]
        self.since = time.perf_counter()
        self.thread = threading.Thread(target=self._main, daemon=True, name="fastpar-pair")

    def _main(self) -> None:
        self.go[1].wait()
        self.go[1].clear()
        try:
            with _entered(self.state):
                self.second()
        except BaseException as e:          # noqa: BLE001 - raised again by pair()
            self.error = e
        finally:
            self.done[1] = True
            self._switch(0)

    def _switch(self, to: int) -> None:
        """Give the turn to side ``to`` (the running side's time counted)."""
        now = time.perf_counter()
        self.seconds[self.turn] += now - self.since
        self.since, self.turn = now, to
        self.go[to].set()

    def hand_over(self) -> None:
        """The running side pauses and the other runs until it hands the turn back."""
        me = self.turn
        self._switch(1 - me)
        self.go[me].wait()
        self.go[me].clear()


def pair(first: Callable[[], None], second: Callable[[], None]) -> tuple[float, float]:
    """Run ``first`` (on this thread) and ``second`` (on a thread of its own) as two coroutines
    taking turns at :func:`fill`: ``first`` until its first fill point, ``second`` until its
    first, ``first`` again, and so on; one that has ended leaves the other to run to its end.
    Returns the seconds each side ran. An exception in either is raised here (the second side
    is abandoned where it paused if the first raised)."""
    global _pair
    if _pair is not None:
        raise RuntimeError("fill.pair: a pair is already running on this process")
    p = _pair = _Pair(second)
    try:
        p.thread.start()
        first()
        p.done[0] = True
        if not p.done[1]:                   # the second runs to its end
            p.hand_over()
        p.seconds[0] += time.perf_counter() - p.since
    finally:
        _pair = None
    if p.error is not None:
        raise p.error
    return p.seconds[0], p.seconds[1]


def fill() -> bool:
    """A fill point: inside a :func:`pair` whose other side has not ended, pause the calling
    side and let the other run until its own next fill point; returns whether it ran."""
    global calls
    calls += 1
    p = _pair
    if p is None or p.done[1 - p.turn]:
        return False
    p.hand_over()
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
