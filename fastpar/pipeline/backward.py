"""The backward split of zero-bubble schedules: B computes the input gradient, W the weights'.

During F, forward hooks record the output of every leaf module that owns parameters (Linear,
LayerNorm, Embedding, the tensor-parallel linears). B asks autograd for the gradient of the stage
input *and* of those outputs, without the parameters: autograd then skips every weight-gradient
GEMM (each node computes only the edges asked for; the tensor-parallel linears' own Functions are
told through :mod:`fastpar.split_backward`) and keeps the graph. W runs, per recorded
module, a backward from its output, with the gradient B captured, to its own parameters only: the
weight half of exactly those nodes, and nothing upstream.

The stage's layers (``stage.layers``) cut the autograd graph in segments: each layer's input is
detached in F (a new leaf, same storage), so B runs one ``autograd.grad`` per segment, from its
output down to its input, and hands the input's gradient to the segment below. A W call then walks
only its own layer's graph: autograd's engine visits every node reachable from the root it is given
before it runs any, so from an uncut stage each W call would cost time in proportion to the graph
upstream of it, and a stage's W calls together grow as its layers squared.

A module whose output is not a tensor, that runs twice in one forward, that is not called (its
parameters used directly), or whose parameters are shared with another module cannot be split
this way, nor one that says so (``defer_weight_grad = False``: a backward that reads its weights,
which ZeRO-3 frees after B); its parameters get their gradients in B.
"""
from __future__ import annotations

from collections import Counter

import torch
import torch.nn as nn
from torch.autograd.graph import get_gradient_edge

from ..split_backward import backward_phase, input_done


def _own(module: nn.Module) -> list[nn.Parameter]:
    return [p for p in module.parameters(recurse=False) if p.requires_grad]


def deferrable(stage: nn.Module) -> tuple[list[nn.Module], list[nn.Parameter], list[nn.Module]]:
    """The leaf modules whose weight gradients can wait for W, the parameters that cannot, and the
    modules whose inputs cut the graph in segments (the stage's ``layers``, if it has them)."""
    uses = Counter(id(p) for m in stage.modules() for p in m.parameters(recurse=False))
    leaves = [m for m in stage.modules()
              if not any(True for _ in m.children()) and _own(m)
              and getattr(m, "defer_weight_grad", True)
              and all(uses[id(p)] == 1 for p in m.parameters(recurse=False))]
    late = {id(p) for m in leaves for p in _own(m)}
    eager = [p for p in stage.parameters() if p.requires_grad and id(p) not in late]
    layers = getattr(stage, "layers", None)
    cuts = list(layers.values() if isinstance(layers, nn.ModuleDict) else layers) \
        if isinstance(layers, (nn.ModuleDict, nn.ModuleList)) else []
    return leaves, eager, cuts


class Capture:
    """Records, while a forward runs inside it, ``(module, output, segment, parameters)`` for the
    given modules in ``outputs`` (the parameters W computes from that output; none for a module
    whose output is not one tensor, such as a row linear's ``(y, bias)`` for a fused bias add:
    deferring its weight through ``y`` would keep everything upstream of ``y`` until W, the
    attention core's and the MLP activation's saved tensors included), and cuts the graph at the input of each of ``cuts``: ``inputs`` holds
    ``(leaf, source)`` per cut, the detached input the module got and the tensor it replaced."""

    def __init__(self, modules: list[nn.Module], cuts: list[nn.Module] = ()):
        self.modules, self.cuts = modules, list(cuts)
        self.outputs, self.inputs, self._handles = [], [], []

    def _hook(self, module, args, output):
        ok = isinstance(output, torch.Tensor) and output.requires_grad
        self.outputs.append((module, output if ok else None, len(self.inputs),
                             _own(module) if ok else []))

    def _cut(self, module, args):
        if not args or not isinstance(args[0], torch.Tensor) or not args[0].requires_grad:
            return None
        leaf = args[0].detach().requires_grad_()
        self.inputs.append((leaf, args[0]))
        return (leaf,) + tuple(args[1:])

    def __enter__(self) -> "Capture":
        self._handles = [m.register_forward_hook(self._hook) for m in self.modules] + \
            [m.register_forward_pre_hook(self._cut) for m in self.cuts]
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
        # A module whose parameters the forward used without calling it (a slice of a learned
        # position table) has no output to defer from: its gradients are computed in B.
        called = {id(m) for m, *_ in self.outputs}
        self.outputs += [(m, None, 0, []) for m in self.modules if id(m) not in called]


def backward_input(out: torch.Tensor, grad: torch.Tensor | None, x: torch.Tensor,
                   captured: Capture, eager: list[nn.Parameter]):
    """B: the gradient of ``x`` (None if it needs none) and what W needs, as
    ``(dx, pending)`` with ``pending`` a list of ``(output's gradient edge, output gradient,
    parameters)``.
    Gradients of ``eager`` parameters (and of modules that cannot wait) are accumulated now.
    One ``autograd.grad`` per segment of ``captured``, the last first."""
    steps = backward_input_steps(out, grad, x, captured, eager)
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value


def backward_input_steps(out: torch.Tensor, grad: torch.Tensor | None, x: torch.Tensor,
                         captured: Capture, eager: list[nn.Parameter], full: bool = False):
    """:func:`backward_input` as a generator: it yields after each segment (a layer);
    returns ``(dx, pending)``. ``full=True``: a backward whose W
    would follow at once (DualPipeV's unsplit ones): one ``autograd.backward`` per segment
    computes every gradient into ``.grad`` (the parameters' hooks fire as autograd goes, as in
    an unsplit schedule) and frees the graph; ``pending`` is empty."""
    cuts = captured.inputs
    if full:
        for k in reversed(range(len(cuts) + 1)):
            top = out if k == len(cuts) else cuts[k][1]
            bottom = x if k == 0 else cuts[k - 1][0]
            if k < len(cuts) and grad is None:      # nothing reached the segment above
                grad = torch.zeros_like(top)
            if top.requires_grad:       # into .grad as autograd goes (hooks fire as usual)
                torch.autograd.backward(top, grad)
            input_done()
            grad = bottom.grad if bottom.requires_grad else None
            if k:
                yield
        return grad, []
    calls = Counter(id(m) for m, *_ in captured.outputs)
    late = [(y, k, ps) for m, y, k, ps in captured.outputs if y is not None and calls[id(m)] == 1]
    now = list(eager)
    seen = {id(p) for p in now} | {id(p) for _, _, ps in late for p in ps}
    for m, *_ in captured.outputs:
        for p in _own(m):
            if id(p) not in seen:
                now.append(p)
                seen.add(id(p))
    deferred = [p for _, _, ps in late for p in ps]
    pending, dx, sums = [], None, [None] * len(now)
    for k in reversed(range(len(cuts) + 1)):
        top = out if k == len(cuts) else cuts[k][1]
        bottom = x if k == 0 else cuts[k - 1][0]
        xs = [bottom] if bottom.requires_grad else []
        mine = [(y, ps) for y, seg, ps in late if seg == k]
        inputs = xs + [y for y, _ in mine] + now
        if k < len(cuts) and grad is None:      # nothing reached the segment above
            grad = torch.zeros_like(top)
        with backward_phase("input", deferred):
            grads = torch.autograd.grad(top, inputs, grad_outputs=grad, retain_graph=True,
                                        allow_unused=True) if inputs else ()
        input_done()                # (ZeRO-3 frees the layer's weights: W reads none)
        grad = grads[0] if xs else None
        n = len(xs)
        # W starts from each output's place in the graph, not the tensor: an output no
        # later operator saved (a row linear's, added into the residual) is freed now.
        pending += [(get_gradient_edge(y), g, ps)
                    for (y, ps), g in zip(mine, grads[n:n + len(mine)]) if g is not None]
        for i, g in enumerate(grads[n + len(mine):]):
            if g is not None:
                sums[i] = g if sums[i] is None else sums[i] + g
        if k:
            yield
    dx = grad
    with torch.no_grad():
        for p, g in zip(now, sums):
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
