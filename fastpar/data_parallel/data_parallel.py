"""DataParallel: torch DDP's semantics, gradients reduced in buckets while backward still runs.

    model = DataParallel(model, dp_group=mesh.dp_group)
    loss_fn(model(x), y).backward()      # every .grad is now the mean over the dp group
    optimizer.step()

Gradient accumulation: run the first micro-batches inside ``model.no_sync()`` (nothing is
communicated), the last one outside. A pipeline schedule, whose backwards are interleaved with
other work, calls ``set_requires_gradient_sync(i == last, wait_in_backward=False)`` before each
micro-batch's backward: the last micro-batch's backward (or its several input- and
weight-gradient calls) starts each bucket's reduction as soon as the bucket is complete, which
overlaps the cool-down, and ``finish_gradient_sync()`` after the schedule waits for them. What
counts is the setting while the backward runs. A schedule that sets ``.grad`` by hand (from
``torch.autograd.grad``) calls ``reduce_gradients()`` instead, after its last micro-batch.
"""
from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.distributed as dist
import torch.nn as nn

from .buckets import BucketSpec, assign_buckets, unit_buckets
from .checks import (broadcast_state, check_options, check_params, check_same_params,
                     empty_params, resolve_group)
from ..extension import EventLog
from ..mesh.groups import group_rank, group_size
from .reducer import GradReducer

# As torch DDP: the first bucket closes at 1 MiB, so the first reduction starts right away.
_FIRST_BUCKET_BYTES = 2**20


def bucket_specs(params: list[tuple[int, torch.dtype]], dp_size: int,
                 bucket_cap_mb: float | None = None, reduce_dtype: torch.dtype | None = None,
                 main_grads: bool = False,
                 unit_of: list[int | None] | None = None,
                 kinds: list | None = None) -> list[BucketSpec]:
    """The buckets :class:`DataParallel` makes for parameters given as ``(numel, dtype)`` in
    registration order (each flat buffer padded to ``dp_size`` equal ZeRO shards): what a dry
    run counts without building the wrapper. ``unit_of`` (each parameter's unit, or None):
    one bucket per unit and dtype instead of size-capped ones. ``kinds``: parameters of
    different kinds (expert-parallel or not) never share a bucket."""
    if unit_of is not None:
        return unit_buckets(params, unit_of, pad_to=dp_size, kinds=kinds)
    # torch DDP's rule: the 1 MiB first bucket only with the default cap (25 MiB).
    first_mb = None if bucket_cap_mb is not None else _FIRST_BUCKET_BYTES / 2**20
    bucket_cap_mb = 25.0 if bucket_cap_mb is None else bucket_cap_mb
    # Buckets close by the bytes that travel (the main gradients are fp32).
    wire = reduce_dtype or (torch.float32 if main_grads else None)
    return assign_buckets(params, int(bucket_cap_mb * 2**20), pad_to=dp_size, reduce_dtype=wire,
                          first_cap_bytes=int((first_mb or bucket_cap_mb) * 2**20), kinds=kinds)


def param_kinds(params) -> list | None:
    """Each parameter's bucket kind (parameters of different kinds never share a bucket), or
    None when all are plain: "expert" for expert-parallel ones (reduced over their replicas),
    "tied" and "tied-copy" for a pipeline's tied embedding and its last-stage copy (each alone
    in its bucket, also where a V puts both on one rank, so their ZeRO shards are the same
    slices, summed over the embedding group: :func:`fastpar.pipeline.tied.reduce_tied_grads`)."""
    kinds = ["expert" if getattr(p, "expert_parallel", False) else
             ("tied-copy" if getattr(p, "tied_copy", False) else "tied")
             if getattr(p, "tied_embedding", False) else None for p in params]
    return kinds if any(kinds) else None


def unit_index(module: nn.Module, units, params) -> list[int | None] | None:
    """Each parameter's unit (the innermost of ``units`` that holds it; None: the root)."""
    if units is None:
        return None
    units = list(units)
    inside = {id(m) for m in module.modules()}
    for k, u in enumerate(units):
        if not isinstance(u, nn.Module) or id(u) not in inside:
            raise ValueError(f"DataParallel: units[{k}] ({type(u).__name__}) is not a "
                             f"submodule of the wrapped module")
        if sum(1 for v in units if v is u) > 1:
            raise ValueError(f"DataParallel: units[{k}] ({type(u).__name__}) is listed twice")
    best: dict[int, tuple[int, int]] = {}         # id(param) -> (unit size, unit index)
    for k, u in enumerate(units):
        size = sum(p.numel() for p in u.parameters())
        for p in u.parameters():
            if id(p) not in best or size < best[id(p)][0]:
                best[id(p)] = (size, k)
    return [best[id(p)][1] if id(p) in best else None for p in params]


class DataParallel(nn.Module):
    """Replicate ``module`` over ``dp_group``; after backward each gradient is the group mean.

    Args:
        module: the replica (a plain, tensor-parallel or pipeline-stage module).
        dp_group: the data-parallel process group (``mesh.dp_group``). ``None``: the default
            group if torch.distributed is initialised, else a single process (no communication).
        bucket_cap_mb: a bucket closes as soon as it holds this many MiB. ``None``: 25, and the
            first bucket closes at 1 MiB already. torch DDP's rules, tested to give DDP's
            (rebuilt) buckets for the same parameters and cap. Buckets follow reverse
            registration order and are split by dtype.
        overlap: start each bucket's reduction as soon as its last gradient is ready (during
            backward). ``False``: reduce everything after backward. Same numbers either way.
        reduce_dtype: dtype of the communication, e.g. ``torch.float32`` for a bf16 model (the
            mean computed in fp32) or ``torch.bfloat16`` for an fp32 one (half the traffic).
            ``None``: the parameters' dtype, and then each ``.grad`` is a view into its bucket
            (nothing is packed).
        main_grads: Megatron's mixed precision: keep an fp32 main gradient per parameter,
            ``p.main_grad`` (a view of an fp32 flat bucket buffer), into which every backward
            adds the (bf16) ``.grad`` and frees it; micro-batches accumulate in fp32 and the
            reduction averages ``main_grad`` (in fp32, or in ``reduce_dtype`` on the wire).
            ``.grad`` stays ``None``: step with a :class:`DistributedOptimizer`, which keeps
            fp32 master weights (``shard=False`` for one copy per rank, as Megatron's
            Float16Optimizer; ``True`` for ZeRO-1).
        find_unused_parameters: allow parameters that get no gradient in a step (they count as
            zero; a parameter that no rank used keeps its ``.grad``); this costs a small
            all-reduce and a host sync per step, as in torch DDP. ``False``: no host sync, and
            such a parameter is an error raised after the step's reduction on the ranks where
            it got no gradient (the others cannot know without a sync).
        units: submodules whose parameters form one bucket each (per dtype), what ZeRO-3
            gathers and frees as one (FSDP's units, e.g. the Transformer blocks); the
            parameters outside every unit form the root bucket. A parameter in nested units
            belongs to the innermost. ``bucket_cap_mb`` is then not used, and each bucket's
            memory is taken at its first gradient (not all at once here).
        replicate_group: HSDP: ``dp_group`` is this rank's shard group (its ZeRO shards are cut
            over it) and ``replicate_group`` the ranks holding the same shard in the other
            groups (:func:`fastpar.mesh.hsdp_groups`); each reduction over ``dp_group`` is
            followed by an all-reduce of its result over the replicas, and the mean is over
            both. ``None``: plain data parallelism over ``dp_group``.
        device: where the parameters live; needed (and used) only for a module built on the
            meta device (``with torch.device("meta")``, or ``GPT(..., device="meta")``): its
            parameters become storage-less ones on ``device``, and ``DistributedOptimizer(stage=3)``
            gives each rank its shards with ``materialize`` (an init function, run a unit at a
            time) or ``load_shards`` (a reader of each parameter's flat ranges, e.g. a
            checkpoint's): no rank ever holds the whole model. Its buffers must be real.
        expert_group: expert parallelism: the parameters marked ``p.expert_parallel`` (an MoE
            layer's experts, :class:`fastpar.models.moe.MoE` with an ``ep_group``) differ
            between the ranks of an expert-parallel group; their gradients (already summed over
            that group by the all-to-all's backward) are summed over ``expert_group``, the
            ranks holding the same experts, in buckets of their own, and divided by the dp
            size as the others; under ZeRO their shards are cut over ``expert_group``.
            Broadcast at construction over ``expert_group`` only (built on the meta device:
            each rank fills its own). Under ZeRO-3 each unit has a bucket of its experts
            apart, gathered over ``expert_group``. With ``replicate_group`` (HSDP)
            ``expert_group`` is the experts' replicas inside the shard group
            (:func:`fastpar.mesh.hsdp_expert_group`), and the experts' shards are all-reduced
            over ``replicate_group`` as the others. Not with ``find_unused_parameters`` (yet).

    The constructor checks its arguments locally (``ValueError``), then compares the parameter
    shapes across the group with one small collective and broadcasts dp rank 0's parameters and
    buffers. Frozen parameters are not reduced.
    """

    def __init__(self, module: nn.Module, *, dp_group=None, bucket_cap_mb: float | None = None,
                 overlap: bool = True, reduce_dtype: torch.dtype | None = None,
                 main_grads: bool = False, find_unused_parameters: bool = False,
                 units: list[nn.Module] | None = None, replicate_group=None, device=None,
                 expert_group=None):
        super().__init__()
        check_options(module, bucket_cap_mb, reduce_dtype)
        group = resolve_group(dp_group)
        experts = {id(p) for p in module.parameters() if getattr(p, "expert_parallel", False)}
        if experts and (expert_group is None and group_size(group) > 1 or find_unused_parameters):
            raise ValueError(f"DataParallel: {len(experts)} expert-parallel parameters need "
                             f"expert_group= (the ranks holding the same experts), and are not "
                             f"supported with find_unused_parameters yet")
        if replicate_group is not None:
            if not isinstance(replicate_group, dist.ProcessGroup):
                raise ValueError(f"replicate_group must be a ProcessGroup or None, got "
                                 f"{type(replicate_group).__name__}")
            if find_unused_parameters:
                raise ValueError("find_unused_parameters=True is not supported with a "
                                 "replicate_group (HSDP)")
        check_params(module, reduce_dtype, device)
        # Built on the meta device: parameters on ``device`` without memory, until ZeRO-3's
        # optimizer gives them their shards (nothing to broadcast: every rank fills its own).
        self.deferred_init = next(module.parameters()).is_meta
        if self.deferred_init:
            if units is None:
                raise ValueError("DataParallel: a module built on the meta device needs units= "
                                 "(ZeRO-3 fills it a unit at a time)")
            bad = [n for n, b in module.named_buffers() if b.is_meta]
            if bad:
                raise ValueError(f"DataParallel: buffer {bad[0]!r} is on the meta device: give "
                                 f"the buffers their values on {device} first")
            empty_params(module, device)
            experts = {id(p) for p in module.parameters() if getattr(p, "expert_parallel", False)}
        named = check_params(module, reduce_dtype)
        unit_of = unit_index(module, units, [p for _, p in named])
        device = named[0][1].device
        # HSDP: over the replicas first, then inside the shard group: every rank gets the
        # state of dp rank 0 (shard rank 0 of replica 0).
        for g in (replicate_group, group):
            if group_size(g) > 1:
                check_same_params(module, g, device)
                broadcast_state(module, g, params=not self.deferred_init, skip=experts)
        if experts and group_size(expert_group) > 1 and not self.deferred_init:
            broadcast_state(module, expert_group, params=True, only=experts)
        self.module = module
        self.dp_group, self.dp_size, self.dp_rank = group, group_size(group), group_rank(group)
        self.bucket_cap_mb = 25.0 if bucket_cap_mb is None else bucket_cap_mb
        self.overlap, self.reduce_dtype = overlap, reduce_dtype
        self.find_unused_parameters, self.main_grads = find_unused_parameters, bool(main_grads)
        params = [p for _, p in named]
        self.bucket_specs: list[BucketSpec] = bucket_specs(
            [(p.numel(), p.dtype) for p in params], self.dp_size, bucket_cap_mb, reduce_dtype,
            self.main_grads, unit_of, param_kinds(params))
        self.units = list(units) if units is not None else None
        # Each bucket's unit (an index into ``units``; None: the root).
        self.bucket_units = [unit_of[s.indices[0]] if unit_of is not None else None
                             for s in self.bucket_specs]
        self.events = EventLog()    # "launch", "done" (index: bucket), "backward_end"
        self._reducer = GradReducer(params, [n for n, _ in named], self.bucket_specs, group,
                                    self.dp_size, reduce_dtype=reduce_dtype, overlap=overlap,
                                    find_unused=find_unused_parameters, events=self.events,
                                    device=device, main_grads=self.main_grads,
                                    lazy=units is not None,
                                    replicate_group=replicate_group,
                                    bucket_groups=[expert_group if id(params[s.indices[0]]) in
                                                   experts else None for s in self.bucket_specs])
        self.replicate_group, self.expert_group = replicate_group, expert_group

    def forward(self, *args, **kwargs):
        self._reducer.finish()        # a deferred reduction must land before the next step
        return self.module(*args, **kwargs)

    @contextmanager
    def no_sync(self):
        """Backwards inside only accumulate gradients locally: no communication at all."""
        before = self._reducer.sync
        self._reducer.sync = False
        try:
            yield
        finally:
            self._reducer.sync = before

    def set_requires_gradient_sync(self, requires: bool, *, wait_in_backward: bool = True) -> None:
        """Whether the next backwards reduce gradients (the last micro-batch) or only accumulate.

        ``wait_in_backward=False``: a reducing backward starts complete buckets and returns
        without waiting; buckets keep starting in later backward calls (split input/weight
        gradients) and :meth:`finish_gradient_sync` starts the rest and waits.
        """
        self._reducer.sync = bool(requires)
        self._reducer.wait_in_backward = bool(wait_in_backward)

    def finish_gradient_sync(self) -> None:
        """Start what is left of a reduction begun with ``wait_in_backward=False``, wait for it
        and deliver the averaged gradients (a no-op when no reduction is under way)."""
        self._reducer.finish()

    def reduce_gradients(self, *, wait: bool = True) -> None:
        """Average the gradients accumulated so far over the group, now, outside backward.

        For schedules that fill ``.grad`` themselves (no hooks fire), or that ran every
        micro-batch without sync. ``wait=False`` returns with the reductions in flight:
        :meth:`finish_gradient_sync` waits for them.
        """
        self._reducer.reduce_now(wait)

    def grads_accumulated(self, params) -> None:
        """Count the gradients of ``params`` as just accumulated, as their post-accumulate-grad
        hooks would: for a backward that adds to ``.grad`` by hand (``torch.autograd.grad``), so
        that their buckets can start before :meth:`finish_gradient_sync`. Others are ignored."""
        for p in params:
            i = self._reducer.index.get(id(p))
            if i is not None:
                self._reducer.on_grad(i)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear every ``.grad`` (as ``nn.Module.zero_grad``) and zero the main gradients."""
        super().zero_grad(set_to_none=set_to_none)
        self._reducer.zero_main_grads()
        if set_to_none:
            self._reducer.drop_shards()

    def mean_grad_views(self, params) -> list[torch.Tensor]:
        """Where the mean gradients of ``params`` live once synced, as views an in-place
        collective may update (e.g. the TP sum of partial gradients under sequence
        parallelism): each parameter's pieces of its bucket's mean gradient, which a
        DistributedOptimizer reads (under ZeRO-1 this rank's shard only), and, where the bucket
        only packed them, the ``.grad`` copies a torch optimizer reads."""
        reducer, want, out = self._reducer, {id(p) for p in params}, []
        if reducer.on_reduced is not None:
            raise ValueError("DistributedOptimizer(overlap_step=True) steps each bucket as its "
                             "reduction lands, before the partial gradients of the parameters "
                             "replicated over TP are summed (sequence parallelism): build it "
                             "with overlap_step=False")
        for b, bucket in enumerate(reducer.buckets):
            flat, spec = reducer.mean_grads(bucket), bucket.spec
            lo, hi = spec.shard(*reducer.place(b)[1:]) if reducer.sharded else \
                (0, spec.padded_numel)
            for p, off, n in zip(bucket.params, spec.offsets, spec.numels):
                if id(p) not in want:
                    continue
                a, z = max(off, lo), min(off + n, hi)
                if a < z:
                    out.append(flat[a - lo:z - lo])
                if not (reducer.sharded or bucket.in_buffer) and p.grad is not None:
                    out.append(p.grad)
        return out

    @property
    def requires_gradient_sync(self) -> bool:
        return self._reducer.sync

    def extra_repr(self) -> str:
        return (f"dp={self.dp_size}, buckets={len(self.bucket_specs)}, "
                f"bucket_cap_mb={self.bucket_cap_mb}, overlap={self.overlap}, "
                f"reduce_dtype={self.reduce_dtype}, main_grads={self.main_grads}")
