"""ZeRO-1, 2 and 3: each data-parallel rank keeps the optimizer state (and, at stage 2, the
reduced gradients between steps; at stage 3 the parameters too) of its 1/dp shard of the
parameters.

    model = DataParallel(model, dp_group=mesh.dp_group)
    opt = DistributedOptimizer(model, torch.optim.AdamW, lr=3e-4, weight_decay=0.1)
    loss.backward(); opt.step(); opt.zero_grad()

Every bucket's flat buffer (padded to a multiple of dp) is cut into dp equal shards. Backward
reduce-scatters each bucket, so rank r receives the mean gradient of shard r only. The optimizer
(torch's own, e.g. AdamW) steps 1-D pieces of that shard, one per parameter it overlaps; its
state is therefore about 1/dp of the plain optimizer's. For half/bf16 parameters the pieces live
in a flat fp32 master buffer per bucket; other parameters are made views of one flat buffer per
bucket whose shard is the master itself, so they are stepped in place and gathered into. The updated shards are then all-gathered and unpacked into the
parameters with the extension's multi-tensor op; with ``overlap_param_gather=True`` that waits,
bucket by bucket, until a module's forward first needs its parameters. The optimizer updates
elementwise, so the result equals plain data parallelism with the same optimizer.

``step()`` calls the wrapped optimizer once over all of this rank's pieces, whatever the number
of buckets: one fused (or foreach) launch per parameter group, where stepping bucket by bucket
cost one per bucket and group, and on a GPU the host must stay ahead of every launch. The buckets'
gathers start right after it (the first layers' bucket first: the next forward needs it first).
``found_inf`` skips a step on the device, as torch.amp.GradScaler does: no host sync.
``overlap_step=True`` is the exception, an explicit opt-in: each bucket is stepped (one call per
bucket) the moment its reduction lands at the end of backward, while the later buckets are still
reduced, and its gather starts right there; ``step()`` then has nothing left to do. The global
gradient norm is not known before the first bucket steps, so it rules out ``clip_grad_norm_``
and ``found_inf`` (as torch's optimizer-in-backward does), and it needs
``find_unused_parameters=False``.

``stage=2`` (ZeRO-2) also frees each bucket's whole gradients once its reduce-scatter has landed:
between a step's reduction and the next backward a rank holds only its gradient shard, and
whole gradients come back bucket by bucket as the next backward produces them. Gradient
accumulation keeps whole gradients over the micro-batches (one reduce-scatter per step, as at
stage 1), so the peak falls only where the step's first backward would have found them
allocated: one micro-batch per step, where activations and whole gradients now peak apart.

``stage=3`` (ZeRO-3, FSDP) also shards the parameters: a rank holds each unit's parameters whole
only around that unit's forward and backward (units: ``DataParallel(..., units=...)``); the
gathering, freeing and prefetching live in :mod:`fastpar.data_parallel.zero3`.

``shard=False`` keeps the whole optimizer state on every rank (the buckets are all-reduced, each
rank steps every parameter): with a bf16 model wrapped as ``DataParallel(..., main_grads=True)``
this is Megatron's mixed precision without ZeRO: bf16 parameters (2 bytes each), fp32 main
gradients (4), fp32 master weights (4) and Adam's two fp32 moments (8), 18 bytes per parameter;
with ``shard=True`` the last 12 are divided by dp. The masters of an unsharded optimizer are
shaped like their parameters, and ``state`` / ``master_of`` look them up by model parameter, so
checkpoints store the fp32 masters and their moments per parameter. A sharded optimizer's
checkpoint is its shards as they are: each rank saves its pieces (``shard_pieces``) and loads
the flat ranges of each parameter its new shard covers (``load_state_shards``), from a
checkpoint of any layout and ZeRO stage.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn

from .. import extension
from ..mesh import collectives
from ..mesh.profiling import span
from .comm import CommStream, all_gather_async
from .data_parallel import DataParallel
from .zero_state import StateByParam, group_index, group_options

_LOW = (torch.float16, torch.bfloat16)
_MOMENTS = ("exp_avg", "exp_avg_sq")


@dataclass(frozen=True)
class _Piece:
    """The part of one parameter inside this rank's shard of bucket ``bucket``."""

    param: int         # index among the model's trainable parameters
    bucket: int
    lo: int            # [lo, hi) in the shard
    hi: int
    start: int         # the piece's first element within the flattened parameter


class DistributedOptimizer:
    """Shard ``optimizer_class``'s state over ``model``'s dp group (ZeRO-1); see the module doc.

    ``param_groups``: like a torch optimizer's, a list of dicts with ``"params"`` (parameters of
    the model) and per-group options; parameters left out go to a last group with the defaults.
    ``defaults`` are passed to ``optimizer_class``. The wrapped torch optimizer is
    ``.optimizer`` (give it to an LR scheduler).
    """

    def __init__(self, model: DataParallel, optimizer_class=torch.optim.AdamW,
                 param_groups: list[dict] | None = None, *, overlap_param_gather: bool = False,
                 shard: bool = True, overlap_step: bool = False, stage: int = 1,
                 prefetch: int = 1, reshard_after_forward: bool = True, **defaults):
        if not isinstance(model, DataParallel):
            raise ValueError(f"DistributedOptimizer needs a fastpar DataParallel model, got "
                             f"{type(model).__name__}")
        if not (isinstance(optimizer_class, type) and
                issubclass(optimizer_class, torch.optim.Optimizer)):
            raise ValueError(f"optimizer_class must be a torch.optim.Optimizer subclass, got "
                             f"{optimizer_class!r}")
        reducer = model._reducer
        for name, p in zip(reducer.names, reducer.params):
            if not p.is_contiguous():
                raise ValueError(f"DistributedOptimizer: parameter {name!r} is not contiguous")
        if getattr(reducer, "optimizer", None) is not None:
            raise ValueError("this DataParallel model already has a DistributedOptimizer")
        if stage not in (1, 2, 3):
            raise ValueError(f"DistributedOptimizer: stage={stage!r} must be 1 (optimizer "
                             f"state sharded), 2 (gradients too) or 3 (parameters too)")
        if stage >= 2 and not shard:
            raise ValueError(f"DistributedOptimizer: stage={stage} shards gradients, which "
                             f"needs shard=True")
        if model.deferred_init and stage != 3:
            raise ValueError(f"DistributedOptimizer: the model was built on the meta device, "
                             f"which needs stage=3 (got stage={stage}, shard={shard})")
        if stage == 3 and (overlap_step or overlap_param_gather):
            raise ValueError("DistributedOptimizer: stage=3 gathers each unit's parameters when "
                             "it is used; overlap_step and overlap_param_gather do not apply")
        if isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 0:
            raise ValueError(f"DistributedOptimizer: prefetch={prefetch!r} must be an int >= 0 "
                             f"(units gathered ahead of the one computing)")
        if overlap_param_gather and not shard:
            raise ValueError("overlap_param_gather=True needs shard=True: an unsharded "
                             "optimizer gathers no parameters")
        if overlap_step and reducer.find_unused:
            raise ValueError("overlap_step=True needs find_unused_parameters=False: with it, "
                             "which parameters got no gradient is known only after every "
                             "bucket's reduction")
        group_of = group_index(reducer.params, param_groups)
        self.model, self.overlap_param_gather, self.shard = model, overlap_param_gather, shard
        self._reducer, self._world, self._rank = reducer, model.dp_size, model.dp_rank
        reducer.optimizer = self
        self.stage = stage if shard else 0
        if shard:
            reducer.enable_sharding(release=stage >= 2)
        self._pieces = [pc for b in range(len(reducer.buckets)) for pc in self._cut(b)]
        # Every bucket with a gather buffer (all, sharded) makes its parameters views of it
        # (values copied in): the all-gather of the updated shards lands in the parameters, no
        # unpack, and a sharded bf16 model holds its weights once. Where the parameters need no
        # separate master (not half/bf16) this rank's shard of that buffer (all of it,
        # unsharded) is the master too, so the optimizer steps the parameters in place.
        # Unsharded bf16 buckets cast their masters into the parameters instead.
        # At stage 3 the gather buffers come and go: the masters are kept apart.
        self._in_place = [b.spec.dtype not in _LOW and stage != 3 for b in reducer.buckets]
        self._full, self._views, self._master, self._grads = [], [], [], []
        self._piece_grads: list[torch.Tensor] = []
        self._uninitialized = model.deferred_init    # no values yet: materialize / load_shards
        for b, (bucket, fits) in enumerate(zip(reducer.buckets, self._in_place)):
            # One bucket at a time: its parameters' old memory goes as the buffer comes (and
            # at stage 3 the buffer goes again once the master shard is packed from it).
            self._full.append(bucket.buffer.new_empty(bucket.spec.padded_numel,
                                                      dtype=bucket.spec.dtype)
                              if shard or fits else None)
            self._views.append(self._adopt_params(b) if self._full[b] is not None else None)
            master, grads = self._shard_buffer(b)
            self._master.append(master)
            self._grads.append(grads)
            self._piece_grads += [grads[pc.lo:pc.hi] for pc in self._pieces if pc.bucket == b]
            if stage == 3:
                # The whole parameters and the gradient shard come back when used (a view of
                # freed storage cannot be made: the shard's are made just above).
                self._full[b].untyped_storage().resize_(0)
                reducer.buckets[b].shard.untyped_storage().resize_(0)
        # Unsharded, each piece is a whole parameter: its master (and so its optimizer state)
        # takes the parameter's shape.
        self._shard_params = [nn.Parameter(self._master[pc.bucket][pc.lo:pc.hi].view(
            self._reducer.params[pc.param].shape) if not shard else
            self._master[pc.bucket][pc.lo:pc.hi]) for pc in self._pieces]
        self._by_param = {id(self._reducer.params[pc.param]): sp
                          for pc, sp in zip(self._pieces, self._shard_params)}
        self._held = {id(p) for p in self._reducer.params}
        groups = [{**opts, "params": []} for opts in group_options(param_groups)]
        for pc, sp in zip(self._pieces, self._shard_params):
            groups[group_of[pc.param]]["params"].append(sp)
        self.optimizer = optimizer_class([g for g in groups if g["params"]], **defaults)
        # Each bucket's shard parameters per optimizer group: what one bucket's step sees.
        in_bucket = [{id(sp) for pc, sp in zip(self._pieces, self._shard_params) if pc.bucket == b}
                     for b in range(len(reducer.buckets))]
        self._bucket_groups = [[[p for p in g["params"] if id(p) in mine]
                                for g in self.optimizer.param_groups] for mine in in_bucket]
        self.overlap_step = overlap_step
        self._stepped: set[int] = set()  # buckets stepped by overlap_step in this reduction
        if overlap_step:
            reducer.on_reduced = self._on_reduced
        self._gathers: dict[int, object] = {}
        self._prepared = False          # shard pieces hold this reduction's gradients
        self._gather_stream = reducer.stream
        self._units = None
        if self.stage == 3:
            from .zero3 import UnitGather
            self._gather_stream = CommStream(self._master[0].device)
            reducer.max_in_flight = 1
            # the reduced gradient shards too exist only from a reduction to zero_grad()
            reducer.free_shards = True
            reducer.pack_at_launch = True
            self._units = UnitGather(self, prefetch=prefetch,
                                     reshard_after_forward=reshard_after_forward)
        model.module.register_state_dict_pre_hook(lambda *_a, **_kw: self.unshard_all())
        if overlap_param_gather:
            self._register_gather_hooks()

    # -- layout -------------------------------------------------------------------------------
    def _cut(self, b: int) -> list[_Piece]:
        spec = self._reducer.buckets[b].spec
        lo, hi = spec.shard(*self._reducer.place(b)[1:]) if self.shard else \
            (0, spec.padded_numel)
        out = []
        for i, off, n in zip(spec.indices, spec.offsets, spec.numels):
            a, z = max(off, lo), min(off + n, hi)
            if a < z:
                out.append(_Piece(param=i, bucket=b, lo=a - lo, hi=z - lo, start=a - off))
        return out

    @torch.no_grad()
    def _adopt_params(self, b: int) -> list[int]:
        """Make bucket b's parameters views of its gather buffer (their values copied in);
        returns their data pointers, to tell later whether they are still views."""
        full, spec = self._full[b], self._reducer.buckets[b].spec
        full.zero_()                              # the padding
        for o, n, p in zip(spec.offsets, spec.numels, self._reducer.buckets[b].params):
            view = full[o:o + n].view(p.shape)
            if not self._uninitialized:
                view.copy_(p.detach())
            p.data = view
        return [p.data_ptr() - full.data_ptr() for p in self._reducer.buckets[b].params]

    @torch.no_grad()
    def _shard_buffer(self, b: int):
        """Bucket b's master shard (packed from the parameters, or this rank's block of the
        gather buffer for in-place buckets), and the optimizer's gradient shard."""
        bucket = self._reducer.buckets[b]
        dtype = torch.float32 if bucket.spec.dtype in _LOW else bucket.spec.dtype
        src = self._reducer.mean_grads(bucket)
        if self._in_place[b]:
            lo, hi = bucket.spec.shard(*self._reducer.place(b)[1:]) if self.shard else \
                (0, bucket.spec.padded_numel)
            master = self._full[b][lo:hi]
        else:
            master = src.new_zeros(src.numel(), dtype=dtype)
            self._pack_master(b, master)
        return master, (src if src.dtype == dtype else torch.zeros_like(master))

    def _pack_master(self, b: int, master: torch.Tensor) -> None:
        extension.multi_tensor_pack([self._flat(pc) for pc in self._pieces if pc.bucket == b],
                                    master)

    # -- a model built on the meta device (stage 3) ----------------------------------------------
    @torch.no_grad()
    def materialize(self, fill) -> None:
        """Give a model built on the meta device its values, a unit at a time: each unit's
        parameters get memory (the whole unit, on this rank), ``fill(params)`` writes their
        values in place (every rank the same: a seeded init such as
        :meth:`fastpar.models.GPT.init_weights_`, or values read from a file), this rank's
        shard of them becomes its master, and the memory goes again. At most one unit is
        whole at a time. Call it before training (the optimizer state is not touched)."""
        self._check_deferred("materialize")
        units = self._units
        units.reshard_all()
        for buckets in units.groups:
            params = []
            for b in buckets:
                full = self._full[b]
                full.untyped_storage().resize_(full.numel() * full.element_size())
                full.zero_()                               # the padding
                params += self._reducer.buckets[b].params
            fill(params)
            for b in buckets:
                self._pack_master(b, self._master[b])
                self._full[b].untyped_storage().resize_(0)
        self._uninitialized = False

    @torch.no_grad()
    def load_shards(self, read) -> None:
        """Fill this rank's master shards from ``read(param, start, count)``: the ``count``
        elements from ``start`` of ``param``'s flattened value (any float dtype; rounded to
        the parameter's dtype on the way, as a parameter holding it would be). Only what this
        rank keeps is asked for: about 1/dp of the model, nothing ever whole."""
        self._check_deferred("load_shards")
        self._units.reshard_all()
        for pc in self._pieces:
            p = self._reducer.params[pc.param]
            x = read(p, pc.start, pc.hi - pc.lo)
            if tuple(x.shape) != (pc.hi - pc.lo,):
                raise ValueError(f"load_shards: read gave shape {tuple(x.shape)} for "
                                 f"{self._reducer.names[pc.param]!r}, expected "
                                 f"({pc.hi - pc.lo},)")
            self._master[pc.bucket][pc.lo:pc.hi].copy_(x.to(p.dtype))
        self._uninitialized = False

    def _check_deferred(self, what: str) -> None:
        if self.stage != 3:
            raise ValueError(f"DistributedOptimizer.{what} needs stage=3 (this is stage "
                             f"{self.stage})")

    def _flat(self, pc: _Piece) -> torch.Tensor:
        p = self._reducer.params[pc.param]
        return p.detach().view(-1)[pc.start:pc.start + pc.hi - pc.lo]

    # -- stepping -----------------------------------------------------------------------------
    def step(self, closure=None, *, found_inf: torch.Tensor | None = None):
        """One optimizer step on this rank's shard: one call of the wrapped optimizer over every
        piece, then each bucket's parameters all-gathered (with ``overlap_step``, all done
        during backward, bucket by bucket).

        ``found_inf``: a one-element tensor on the parameters' device, nonzero to skip this
        step (e.g. a NaN loss): an optimizer that supports it as torch.amp.GradScaler's does
        (``fused=True``) skips on the device, leaving weights, moments and step counts as
        they were, and the host never waits; any other optimizer reads it on the host."""
        if found_inf is not None and self.overlap_step:
            raise ValueError("found_inf cannot skip a step with overlap_step=True: each bucket "
                             "was stepped during backward already")
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.model.finish_gradient_sync()
        if not self._stepped:
            self._prepare_grads()
            self._step_all(found_inf)
            self._launch_gathers()
        elif len(self._stepped) < len(self._master):
            raise RuntimeError(f"DistributedOptimizer.step: overlap_step stepped buckets "
                               f"{sorted(self._stepped)} of {len(self._master)} in backward; "
                               f"the others got no reduced gradient")
        self._reducer.reduced, self._prepared, self._stepped = False, False, set()
        if not self.overlap_param_gather:
            self.finish_param_sync()
        return loss

    def _on_reduced(self, b: int) -> None:
        """overlap_step: bucket b's mean gradient has landed; step it and start its gather."""
        self.finish_param_sync([b])          # the previous step's gather into the same buffer
        self._bucket_grads(b)
        self._step_bucket(b)
        self._stepped.add(b)

    @torch.no_grad()
    def _step_all(self, found_inf: torch.Tensor | None) -> None:
        """The wrapped optimizer over every piece at once, skipped where ``found_inf`` is set."""
        opt = self.optimizer
        if found_inf is None:
            opt.step()
        elif getattr(opt, "_step_supports_amp_scaling", False) and \
                all(g.get("fused") for g in opt.param_groups):
            opt.found_inf = found_inf.reshape(()).float()   # read by torch's fused step
            try:
                opt.step()
            finally:
                del opt.found_inf
        elif not found_inf.any().item():    # host sync: this optimizer cannot skip on device
            opt.step()

    @torch.no_grad()
    def _step_bucket(self, b: int) -> None:
        """overlap_step: the optimizer on bucket b's pieces only, then the bucket's gather."""
        groups = self.optimizer.param_groups
        keep = [g["params"] for g in groups]
        try:
            for g, mine in zip(groups, self._bucket_groups[b]):
                g["params"] = mine
            self.optimizer.step()
        finally:
            for g, ps in zip(groups, keep):
                g["params"] = ps
        self._launch_gather(b)

    @torch.no_grad()
    def _prepare_grads(self) -> None:
        """Wait for the reduce-scatters and hand each shard piece its mean gradient."""
        self.model.finish_gradient_sync()
        self.finish_param_sync()
        if self._prepared:
            return
        if not self._reducer.reduced:
            raise RuntimeError("DistributedOptimizer.step: no gradient reduction since the last "
                               "step (did backward run outside no_sync()?)")
        for b in range(len(self._grads)):
            self._bucket_grads(b)
        self._prepared = True

    @torch.no_grad()
    def _bucket_grads(self, b: int) -> None:
        """Hand each of bucket b's shard pieces its mean gradient (None: no rank used it)."""
        g, src = self._grads[b], self._reducer.mean_grads(self._reducer.buckets[b])
        if g is not src:
            g.copy_(src)
        unused = self._reducer.unused
        for pc, sp in zip(self._pieces, self._shard_params):
            if pc.bucket == b:
                sp.grad = None if pc.param in unused else g[pc.lo:pc.hi].view(sp.shape)

    def _intact(self, b: int) -> bool:
        """Whether bucket b's parameters are (still) views of its flat buffer."""
        full = self._full[b]
        return self._views[b] is not None and \
            [p.data_ptr() - full.data_ptr() for p in self._reducer.buckets[b].params] == \
            self._views[b]

    @torch.no_grad()
    def _launch_gather(self, b: int) -> None:
        bucket = self._reducer.buckets[b]
        if not self.shard:          # every rank stepped every parameter: cast the masters back
            if not self._intact(b):
                extension.multi_tensor_unpack(self._master[b], [p.detach() for p in bucket.params])
            return
        with self._gather_stream.issue(), span("zero start all-gather of bucket", b):
            shard = self._master[b].to(self._full[b].dtype)
            work = all_gather_async(self._full[b], shard, self._reducer.place(b)[0])
        self._gathers[b] = (work, shard)         # the shard must live until the gather ends

    @torch.no_grad()
    def _launch_gathers(self) -> None:
        if self._units is not None:      # stage 3: every unit is gathered again when next used
            self._units.reshard_all()
            return
        # Last bucket first: it holds the first layers, which the next forward needs first.
        for b in reversed(range(len(self._master))):
            self._launch_gather(b)

    @torch.no_grad()
    def finish_param_sync(self, buckets=None) -> None:
        """Wait for the parameter all-gathers (of ``buckets``, default all) and unpack them."""
        for b in list(self._gathers) if buckets is None else buckets:
            item = self._gathers.pop(b, None)
            if item is None:
                continue
            if item[0] is not None:
                with span("zero wait for the all-gather of bucket", b):
                    item[0].wait()
            self._gather_stream.join()
            if self._intact(b):
                continue                     # the gather landed in the parameters themselves
            extension.multi_tensor_unpack(self._full[b],
                                    [p.detach() for p in self._reducer.buckets[b].params])

    @contextmanager
    def gathered(self):
        """Every parameter whole inside the block (ZeRO-3: gathered, held while forwards run
        on some ranks only, e.g. a sample, then freed at its end); a collective over the dp
        group: every rank enters it."""
        self.unshard_all()
        units, held = self._units, self._units is not None and self._units.hold
        if units is not None:
            units.hold = True
        try:
            yield
        finally:
            if units is not None:
                units.hold = held
                if not held:
                    units.reshard_all()

    @torch.no_grad()
    def unshard_all(self) -> None:
        """Make every parameter whole now (e.g. to read or load the model's weights): at stage
        3 every unit is gathered and stays so until the step after its next use; else this
        waits for the parameter gathers in flight."""
        if self._units is not None:
            self._units.unshard_all()
        else:
            self.finish_param_sync()

    def _register_gather_hooks(self) -> None:
        where = {id(p): b for b, bucket in enumerate(self._reducer.buckets) for p in bucket.params}
        for module in self.model.module.modules():
            mine = sorted({where[id(p)] for p in module.parameters(recurse=False)
                           if id(p) in where})
            if mine:
                module.register_forward_pre_hook(
                    lambda _m, _a, mine=mine: self.finish_param_sync(mine))

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the model's gradients (as ``model.zero_grad``)."""
        self.model.zero_grad(set_to_none=set_to_none)

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0, *, groups=(),
                        counted=None, ep_group=None, ep_counted: bool = True) -> torch.Tensor:
        """Clip the mean gradient by its global norm; returns that norm (before clipping) as
        a 0-dim tensor, computed and applied on the device (no host sync).

        Call after backward, before :meth:`step`. The shards are reduced over the dp group and
        then over each of ``groups`` (e.g. the tp and pp groups of a 3D layout); ``counted(p)``
        says whether this rank counts parameter ``p`` (e.g. parameters replicated over TP only
        on tp rank 0). Without them the norm is that of this model replica. ``ep_group``:
        the expert-parallel parameters' part is first summed over it (each rank holds other
        experts; the rest of the model is the same on all of them); ``ep_counted`` False: this
        rank does not add that sum (the ep group spans a group of ``groups``, whose sum adds
        it once from another rank).
        """
        if self.overlap_step:
            raise RuntimeError("clip_grad_norm_ cannot run with overlap_step=True: each bucket "
                               "is stepped as its reduction lands, before the global norm "
                               "exists; build the DistributedOptimizer with overlap_step=False "
                               "to clip")
        self._prepare_grads()
        params = self._reducer.params
        keep = [pc.param not in self._reducer.unused and
                (counted is None or counted(params[pc.param])) for pc in self._pieces]
        expert = [getattr(params[pc.param], "expert_parallel", False) and ep_group is not None
                  for pc in self._pieces]
        inf = norm_type == float("inf")
        op = dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM

        def norm(which):
            grads = [g for g, k, e in zip(self._piece_grads, keep, expert) if k and e == which]
            if not grads:
                return torch.zeros((), dtype=torch.float32, device=self._master[0].device)
            norms = torch.stack(torch._foreach_norm(grads, norm_type)).float()
            return norms.max() if inf else norms.pow(norm_type).sum()
        sharded = self._world > 1 and self.shard
        local = norm(False)
        if sharded:         # the dp shards of the rest of the model
            collectives.all_reduce(local, op=op, group=self.model.dp_group)
        if any(expert):     # the experts' shards (over their replicas), then the ep group's
            mine = norm(True)
            if sharded and self.model.expert_group is not None:
                collectives.all_reduce(mine, op=op, group=self.model.expert_group)
            collectives.all_reduce(mine, op=op, group=ep_group)
            if not ep_counted:
                mine.zero_()
            local = torch.maximum(local, mine) if inf else local + mine
        for group in groups:
            collectives.all_reduce(local, op=op, group=group)
        total = local if inf else local.pow(1.0 / norm_type)
        if max_norm != float("inf") and self._piece_grads:
            # On the device, as torch's clip_grad_norm_: the host never waits for the norm.
            # Only the pieces: a NaN coefficient must not reach the buckets' padding.
            coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
            torch._foreach_mul_(self._piece_grads, coef)
        return total

    # -- introspection ------------------------------------------------------------------------
    @property
    def state(self) -> StateByParam:
        """The optimizer state by model parameter (unsharded only): ``state[p]`` is the dict of
        ``p``'s fp32 master, with tensors shaped like ``p`` (what checkpoints save and load)."""
        if self.shard:
            raise AttributeError("a sharded DistributedOptimizer has no per-parameter state; "
                                 "use state_dict()")
        return StateByParam(self)

    def master_of(self, p: torch.Tensor) -> torch.Tensor:
        """The fp32 master weight of model parameter ``p``, shaped like it (unsharded only)."""
        return self._by_param[id(p)]

    def state_bytes(self) -> int:
        """Bytes of optimizer state on this rank (moments, step counters, fp32 master copies)."""
        state = sum(t.numel() * t.element_size() for s in self.optimizer.state.values()
                    for t in s.values() if torch.is_tensor(t))
        masters = sum(m.numel() * m.element_size() for m, b in
                      zip(self._master, self._reducer.buckets) if m.dtype != b.spec.dtype)
        return state + masters

    def state_dict(self) -> dict:
        """This rank's shard of the optimizer state (load it on the same layout)."""
        return {"optimizer": self.optimizer.state_dict(), "dp_rank": self._rank,
                "dp_size": self._world, "master": [m.clone() for m in self._master]}

    def load_state_dict(self, state: dict) -> None:
        if self.shard and (state.get("dp_rank"), state.get("dp_size")) != (self._rank,
                                                                            self._world):
            raise ValueError(f"state of dp rank {state.get('dp_rank')} of {state.get('dp_size')} "
                             f"cannot load on dp rank {self._rank} of {self._world}")
        self.optimizer.load_state_dict(state["optimizer"])
        with torch.no_grad():
            for m, saved in zip(self._master, state["master"]):
                m.copy_(saved)
        self._launch_gathers()
        self.finish_param_sync()

    @property
    def saves_shards(self) -> bool:
        """Whether this rank writes its shard to a checkpoint: under HSDP only the first
        replica's shard group does (the others hold the same shards)."""
        group = self.model.replicate_group
        return group is None or dist.get_rank(group) == 0

    def holds(self, p: torch.Tensor) -> bool:
        """Whether ``p``'s master (and optimizer state) is this optimizer's."""
        return id(p) in self._held

    @torch.no_grad()
    def shard_pieces(self):
        """This rank's shard, piece by piece, as a checkpoint saves it: ``(param, start,
        tensors)``, ``tensors`` holding the fp32 ``master`` of the elements ``start`` on of
        ``param``'s flattened value (1-D, a view: copy it before training on) and, once the
        optimizer has stepped it, its ``exp_avg``, ``exp_avg_sq`` and ``step``. Every dp rank
        holds its own pieces: nothing is gathered."""
        self.finish_param_sync()
        for pc, sp in zip(self._pieces, self._shard_params):
            out = {"master": self._master[pc.bucket][pc.lo:pc.hi]}
            st = self.optimizer.state.get(sp, {})
            if all(k in st for k in _MOMENTS):
                out.update({k: st[k].reshape(-1) for k in _MOMENTS})
                out["step"] = torch.as_tensor(st["step"]).reshape(()).float().cpu()
            yield self._reducer.params[pc.param], pc.start, out

    @torch.no_grad()
    def load_state_shards(self, read) -> None:
        """Fill this rank's masters and optimizer state from ``read(param, start, count,
        key)``: for ``key`` "master", "exp_avg" and "exp_avg_sq" the ``count`` elements from
        ``start`` of ``param``'s flattened value (None: no state saved), for "step" a scalar.
        Only this rank's shard is asked for (from a checkpoint of any layout and ZeRO stage),
        then the parameters are gathered from the masters."""
        self.finish_param_sync()
        placed = StateByParam(self)
        for pc, sp in zip(self._pieces, self._shard_params):
            p, n = self._reducer.params[pc.param], pc.hi - pc.lo
            self._master[pc.bucket][pc.lo:pc.hi].copy_(read(p, pc.start, n, "master"))
            moments = {k: read(p, pc.start, n, k) for k in _MOMENTS}
            if any(v is None for v in moments.values()):
                continue
            target = placed._wrap(sp)
            for key, v in moments.items():
                target[key] = v.to(sp.device, sp.dtype).reshape(sp.shape).clone()
            target["step"] = torch.as_tensor(read(p, pc.start, n, "step")).reshape(()).clone()
        self._uninitialized = False
        self._launch_gathers()
        self.finish_param_sync()

    @property
    def param_groups(self):
        return self.optimizer.param_groups
