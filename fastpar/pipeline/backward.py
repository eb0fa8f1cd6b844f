"""The backward split of zero-bubble schedules: B computes the input gradient, W the weights'.

During F, forward hooks record the output of every leaf module that owns parameters (Linear,
LayerNorm, Embedding, the tensor-parallel linears). B asks autograd for the gradient of the stage
input *and* of those outputs, without the parameters: autograd then skips every weight-gradient
GEMM (each node computes only the edges asked for; the tensor-parallel linears' own Functions are
told through :mod:`fastpar.split_backward`) and keeps the graph. W runs, per recorded
module, a backward from its output, with the gradient B captured, to its own parameters only: the
weight half of exactly those nodes, and nothing upstream.

A module whose output is not a tensor, that runs twice in one forward, that is not called (its
parameters used directly), or whose parameters are shared with another module cannot be split
this way; its parameters get their gradients in B.
"""
from __future__ import annotations

from collections import Counter

import torch
import torch.nn as nn

from ..split_backward import backward_phase


def _own(module: nn.Module) -> list[nn.Parameter]:
    return [p for p in module.parameters(recurse=False) if p.requires_grad]


def deferrable(stage: nn.Module) -> tuple[list[nn.Module], list[nn.Parameter]]:
    """The leaf modules whose weight gradients can wait for W, and the parameters that cannot."""
    uses = Counter(id(p) for m in stage.modules() for p in m.parameters(recurse=False))
    leaves = [m for m in stage.modules()
              if not any(True for _ in m.children()) and _own(m)
              and all(uses[id(p)] == 1 for p in m.parameters(recurse=False))]
    late = {id(p) for m in leaves for p in _own(m)}
    eager = [p for p in stage.parameters() if p.requires_grad and id(p) not in late]
    return leaves, eager


class Capture:
    """Records ``(module, output)`` for the given modules while a forward runs inside it."""

    def __init__(self, modules: list[nn.Module]):
        self.modules, self.outputs, self._handles = modules, [], []

    def _hook(self, module, args, output):
        ok = isinstance(output, torch.Tensor) and output.requires_grad
        self.outputs.append((module, output if ok else None))

    def __enter__(self) -> "Capture":
        self._handles = [m.register_forward_hook(self._hook) for m in self.modules]
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
        # A module whose parameters the forward used without calling it (a slice of a learned
        # position table) has no output to defer from: its gradients are computed in B.
        called = {id(m) for m, _ in self.outputs}
        self.outputs += [(m, None) for m in self.modules if id(m) not in called]


def backward_input(out: torch.Tensor, grad: torch.Tensor | None, x: torch.Tensor,
                   captured: list, eager: list[nn.Parameter]):
    """B: the gradient of ``x`` (None if it needs none) and what W needs, as
    ``(dx, pending)`` with ``pending`` a list of ``(output, output gradient, parameters)``.
    Gradients of ``eager`` parameters (and of modules that cannot wait) are accumulated now."""
    calls = Counter(id(m) for m, _ in captured)
    late = [(m, y) for m, y in captured if y is not None and calls[id(m)] == 1]
    now = list(eager)
    seen = {id(p) for p in now}
    for m, y in captured:
        if y is None or calls[id(m)] > 1:
            for p in _own(m):
                if id(p) not in seen:
                    now.append(p)
                    seen.add(id(p))
    xs = [x] if x.requires_grad else []
    inputs = xs + [y for _, y in late] + now
    if not inputs:
        return None, []
    with backward_phase("input", [p for m, _ in late for p in _own(m)]):
        grads = torch.autograd.grad(out, inputs, grad_outputs=grad, retain_graph=True,
                                    allow_unused=True)
    dx = grads[0] if xs else None
    k = len(xs)
    pending = [(y, g, _own(m)) for (m, y), g in zip(late, grads[k:k + len(late)])
               if g is not None]
    with torch.no_grad():
        for p, g in zip(now, grads[k + len(late):]):
            if g is not None:
                if p.grad is None:
                    p.grad = g
                else:
                    p.grad.add_(g)
    return dx, pending


def backward_weight(pending: list) -> None:
    """W: each recorded module's parameter gradients, from its output gradient, into ``.grad``."""
    with backward_phase("weight", [p for _, _, params in pending for p in params]):
        for y, g, params in pending:
            torch.autograd.backward(y, g, inputs=params)
