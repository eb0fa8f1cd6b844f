"""Which phase of a split backward is running: B (input gradients) or W (weight gradients).

Built-in autograd nodes compute only the gradient edges a call asks for; custom Functions cannot
see that, so the split backward (:mod:`fastpar.pipeline.backward`) names the phase and its
weights with :func:`backward_phase`, and a Function's backward (the tensor-parallel overlapped
linears') asks :func:`phase_of` which half to skip.
"""
from __future__ import annotations

import weakref
from contextlib import contextmanager

# (phase, ids of the weights it applies to) while a split backward runs, else None. A global, not
# a thread-local: on CUDA the autograd engine runs backward on its own device thread.
_PHASE: tuple[str, set[int]] | None = None
# Told (``after_input()``) each time B has run through a segment of a stage (a layer): what
# holds weights for B only (ZeRO-3's gathered units) may let them go, since W reads no weight.
_LISTENERS: "weakref.WeakSet" = weakref.WeakSet()


def listen(obj) -> None:
    """Call ``obj.after_input()`` each time :func:`input_done` is called, while ``obj``
    lives."""
    _LISTENERS.add(obj)


def input_done() -> None:
    """B has run through a segment: every backward it began there is over but for W."""
    for obj in list(_LISTENERS):
        obj.after_input()


@contextmanager
def backward_phase(phase: str, weights):
    """Within: backward of Functions that read :func:`phase_of` for ``weights`` computes only
    the input gradients (``phase="input"``) or only the weight gradients (``phase="weight"``)."""
    global _PHASE
    if phase not in ("input", "weight"):
        raise ValueError(f"backward_phase: phase={phase!r} must be 'input' or 'weight'")
    before, _PHASE = _PHASE, (phase, {id(w) for w in weights})
    try:
        yield
    finally:
        _PHASE = before


def phase_of(weight_id: int) -> str | None:
    """``"input"`` or ``"weight"`` while a split backward runs for the weight of this ``id()``."""
    return _PHASE[0] if _PHASE is not None and weight_id in _PHASE[1] else None
