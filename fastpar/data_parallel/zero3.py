"""ZeRO-3: each parameter is whole on a rank only around the forward and backward of its unit.

``DataParallel(model, units=blocks)`` makes one bucket per unit (and one for the root: the
parameters outside every unit, such as embeddings and the head); ``DistributedOptimizer(model,
..., stage=3)`` then keeps, between uses, only this rank's 1/dp shard of each unit: the fp32
master and its optimizer state (as ZeRO-1), the reduced gradient shard (as ZeRO-2), and nothing
of the whole parameters. Each unit's parameters are views of one flat gather buffer whose
storage exists only while the unit is gathered:

- forward: a unit's pre-hook starts its all-gather (if a prefetch has not), starts the next
  ``prefetch`` units' all-gathers, and waits for its own; its post-hook frees the buffer again
  (``reshard_after_forward``) and hooks the unit's outputs, whose gradients mark the start of its
  backward;
- backward: that output hook gathers the unit again and prefetches the ``prefetch`` units before
  it; the unit's gradients stay autograd's (``.grad``) until every parameter of the unit has
  its gradient. Then, in FSDP2's order, the unit's parameters are freed, the reduce-scatter
  before it is waited for (its whole gradients freed), and only then is the unit's bucket
  taken, its gradients packed into it (and freed) and reduce-scattered while the unit before
  it computes: one reduce-scatter in flight, so at most two units' whole gradients exist at
  once, and never beside the unit's bucket and its parameters together.
- the root is gathered at its first use and kept until its gradients are in (the last unit's
  outputs need the head right away, as FSDP keeps its root).

With ``reshard_after_forward=False`` a unit stays gathered from its forward to the backward of
the step's last micro-batch (FSDP2's setting of that name: one gather per step instead of two
per micro-batch, at the memory of the whole unit). Gradient accumulation (``no_sync``) keeps the
whole gradients over the micro-batches and reduce-scatters once, at the last.

The gathers are issued on their own stream (on a GPU; gloo's worker threads on a CPU), separate
from the reduce-scatters', into the buffer the parameters already view, so the parameters keep
their identity (optimizer, autograd's saved tensors and hooks see the same tensors) and memory
is taken from the allocator once per unit and gather. After a step every unit is stale and is
gathered again at its next use. The reduced gradient shards live from their reduce-scatter to
``zero_grad()`` (as FSDP2's sharded gradients): between steps a rank holds the fp32 master shard
and its optimizer state only.
"""
from __future__ import annotations

import weakref

import torch
import torch.nn as nn

from .. import split_backward
from ..mesh.profiling import span


def _weak(obj, method: str, *bound):
    """A hook calling ``obj.method(*bound, *args)`` that does not keep ``obj`` alive (hooks on
    parameters and tensors are held from C++, where the garbage collector cannot see cycles)."""
    ref = weakref.ref(obj)

    def hook(*args):
        o = ref()
        if o is not None:
            return getattr(o, method)(*bound, *args)
    return hook


def _tensors(out):
    if torch.is_tensor(out):
        yield out
    elif isinstance(out, (tuple, list)):
        for o in out:
            yield from _tensors(o)
    elif isinstance(out, dict):
        for o in out.values():
            yield from _tensors(o)


class UnitGather:
    """The gather, free and prefetch logic of ZeRO-3 for one DistributedOptimizer."""

    def __init__(self, opt, *, prefetch: int, reshard_after_forward: bool):
        model, reducer = opt.model, opt._reducer
        self.opt, self.reducer, self.events = opt, reducer, model.events
        self.prefetch, self.reshard_after_forward = prefetch, reshard_after_forward
        units, owner = model.units or [], model.bucket_units
        keys = ([None] if None in owner else []) + sorted({u for u in owner if u is not None})
        # Groups of buckets in forward order: the root first, then the units as listed.
        self.groups = [[b for b, u in enumerate(owner) if u == key] for key in keys]
        self.root = 0 if keys and keys[0] is None else None
        self.group_of = {id(p): g for g, bs in enumerate(self.groups) for b in bs
                         for p in reducer.buckets[b].params}
        self.sizes = [sum(len(reducer.buckets[b].params) for b in bs) for bs in self.groups]
        self.in_backward = [False] * len(self.groups)
        self.arrived = [0] * len(self.groups)
        self.gathers = 0                             # all-gathers started (for tests, stats)
        self.hold = False            # everything gathered and kept: the hooks do nothing
        self.split = False           # a split backward's B ran this step: units freed after B
        self._hooks = []
        modules = list(model.module.modules())
        unit_ids = {id(u) for u in units}
        first_unit = next((i for i, m in enumerate(modules) if id(m) in unit_ids), len(modules))
        for g, key in enumerate(keys):
            if key is None:           # the root: the modules that hold its parameters directly
                mine = {id(p) for b in self.groups[g] for p in reducer.buckets[b].params}
                for i, m in enumerate(modules):
                    if any(id(p) in mine for p in m.parameters(recurse=False)):
                        # Only a root module before the units (an embedding) prefetches the
                        # first unit; one after them (a head) has nothing left to prefetch.
                        self._hooks.append(m.register_forward_pre_hook(
                            _weak(self, "_pre_forward_root", g, i < first_unit)))
                continue
            unit = units[key]
            self._hooks.append(unit.register_forward_pre_hook(_weak(self, "_pre_forward", g)))
            self._hooks.append(unit.register_forward_hook(_weak(self, "_post_forward", g)))
        for p in reducer.params:
            if id(p) in self.group_of:
                # After the reducer's own hook (registered first): the gradient is in its bucket.
                self._hooks.append(p.register_post_accumulate_grad_hook(_weak(self, "_on_grad")))
        # Storage held (gathered or in flight) per bucket: built whole, freed right here.
        self.live = [True] * len(reducer.buckets)
        self.reshard_all()
        split_backward.listen(self)

    # -- the buffers ---------------------------------------------------------------------------
    def unshard(self, g: int) -> None:
        """Start group g's all-gathers (a no-op for buckets gathered or in flight)."""
        if self.opt._uninitialized:
            raise RuntimeError("ZeRO-3: the model was built on the meta device and has no values "
                               "yet: call DistributedOptimizer.materialize() or load_shards() "
                               "first")
        for b in self.groups[g]:
            if self.live[b]:
                continue
            full = self.opt._full[b]
            full.untyped_storage().resize_(full.numel() * full.element_size())
            self.opt._launch_gather(b)
            self.live[b] = True
            self.gathers += 1
            self.events.record("gather", g)

    def wait(self, g: int) -> None:
        self.opt.finish_param_sync(self.groups[g])

    def reshard(self, g: int) -> None:
        """Free group g's whole parameters (a gather in flight lands first)."""
        for b in self.groups[g]:
            if not self.live[b]:
                continue
            self.opt.finish_param_sync([b])
            self.opt._full[b].untyped_storage().resize_(0)
            self.live[b] = False
            self.events.record("free", g)

    def reshard_all(self) -> None:
        for g in range(len(self.groups)):
            self.reshard(g)
            self.in_backward[g], self.arrived[g] = False, 0
        self.split = False

    def unshard_all(self) -> None:
        for g in range(len(self.groups)):
            self.unshard(g)
        self.opt.finish_param_sync()

    # -- hooks ---------------------------------------------------------------------------------
    def _pre_forward(self, g, _module, _args):
        self.before_forward(g)

    def _pre_forward_root(self, g, before_units, _module, _args):
        self.before_forward(g, prefetch=before_units)

    def _post_forward(self, g, _module, _args, out):
        self.after_forward(g, out)

    def _pre_backward(self, g, _grad):
        self.before_backward(g)

    def before_forward(self, g: int, prefetch: bool = True) -> None:
        # (a recomputed forward inside backward: gathered already)
        if self.hold or self.in_backward[g]:
            return
        # The root prefetches the first unit at its first use only, and only from a module
        # that runs before the units.
        ahead = self.prefetch if prefetch and (g != self.root or not self._is_live(g)) else 0
        with span("zero-3 gather for forward of unit", g):
            self.unshard(g)
            for nxt in range(g + 1, min(g + 1 + ahead, len(self.groups))):
                self.unshard(nxt)
            self.wait(g)

    def _is_live(self, g: int) -> bool:
        return all(self.live[b] for b in self.groups[g])

    def after_forward(self, g: int, out) -> None:
        if self.hold or self.in_backward[g]:
            return
        if torch.is_grad_enabled():
            for t in _tensors(out):
                if t.requires_grad:
                    t.register_hook(_weak(self, "_pre_backward", g))
        if self.reshard_after_forward and g != self.root:
            self.reshard(g)

    def before_backward(self, g: int) -> None:
        if self.hold or self.in_backward[g]:
            return
        self.in_backward[g] = True
        with span("zero-3 gather for backward of unit", g):
            self.unshard(g)
            for prev in range(g - 1, max(g - 1 - self.prefetch, -1), -1):
                if prev != self.root:
                    self.unshard(prev)
            self.wait(g)

    def after_input(self) -> None:
        """A split backward's B has run through a layer (:mod:`fastpar.split_backward`): the
        units whose backward it began are done with their weights, since W reads none (each
        deferred module's weight gradient is its output gradient against its saved input), so
        they are freed now rather than at their last gradient, which W brings later."""
        if self.hold:
            return
        self.split = True
        for g in range(len(self.groups)):
            if self.in_backward[g] and g != self.root:
                self.in_backward[g], self.arrived[g] = False, 0
                if self.reshard_after_forward or self.reducer.sync:
                    self.reshard(g)

    def _on_grad(self, p: nn.Parameter) -> None:
        if self.split:      # W's gradients: the unit was freed after its B
            if self.reducer.sync and self.reducer.overlap:
                self.reducer._launch_ready()
            return
        g = self.group_of[id(p)]
        self.arrived[g] += 1
        if self.arrived[g] < self.sizes[g]:
            return
        # Every parameter of the unit has its gradient: its backward is over.
        self.arrived[g], self.in_backward[g] = 0, False
        if self.reshard_after_forward or self.reducer.sync:
            self.reshard(g)
        if self.reducer.sync and self.reducer.overlap:   # pack_at_launch: after the free
            self.reducer._launch_ready()
