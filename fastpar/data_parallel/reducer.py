"""The gradient reducer behind DataParallel: flat bucket buffers, hooks, launch order, waiting.

Life of one synchronised backward:
  1. a parameter's gradient is accumulated -> its post-accumulate-grad hook marks it ready (and,
     on the first hook of the backward, queues ``_on_backward_end`` with the autograd engine);
  2. the bucket's last gradient arrives -> its collective is started asynchronously, in bucket
     order (the same order on every rank); with ``overlap=False`` nothing starts before step 3;
  3. the engine has finished -> ``finish``: buckets not started yet (parameters that got no
     gradient) are started; then everything is waited for, the averaged gradients are handed to
     ``.grad``, and unused parameters are checked. With ``on_reduced`` set (a distributed
     optimizer's ``overlap_step``), each bucket is handed to it the moment its wait returns,
     while the later buckets are still in flight.
The hot path never waits for the device on the host (no ``.item()``, ``.tolist()``, tensors
built from Python lists or timed waits): on CUDA, waiting only makes the compute stream wait for
the comm stream. As in torch DDP, only ``find_unused_parameters`` pays for a host sync: a small
all-reduce of which parameters each rank used, read back on the host. Without it, a parameter
that got no gradient is an error on the ranks where it got none, found from host-side state.
With ``wait_in_backward=False`` (pipeline schedules) step 3 is skipped: buckets keep starting
from hooks across any number of backward calls, and the schedule calls ``finish`` itself.
``reduce_now`` starts everything at once, for gradients computed outside hooks.

When the bucket dtype is the parameters' dtype, each ``.grad`` is a view into the bucket's flat
buffer: nothing is packed and the average is computed in place. With another ``reduce_dtype``
the gradients are packed into (and unpacked from) the buffer by the extension's multi-tensor ops.
Sharded (ZeRO-1) buckets are reduce-scattered into ``shard`` instead of all-reduced. ZeRO-2
(``enable_sharding(release=True)``) also frees each bucket's whole-model gradient memory (the
flat buffer, the main gradients, packed ``.grad``) once its shard has landed, and takes it back,
zeroed where it accumulates, when the next backward's first gradient for the bucket arrives: a
rank holds whole gradients only from its step's first backward to its reduction.

Main gradients (Megatron's mixed precision, ``main_grads=True``): each bucket also owns an fp32
flat buffer and each parameter a view of it, ``p.main_grad``. Every backward's hook adds the
low-precision ``.grad`` into ``main_grad`` and frees it at once, so micro-batches accumulate in
fp32 and no bf16 gradient outlives its hook. The reduction runs on the fp32 buffer in place, or,
with ``reduce_dtype=torch.bfloat16``, on a bf16 copy whose mean is written back into it.
"""
from __future__ import annotations

import weakref

import torch
import torch.nn as nn
from torch.autograd import Variable

from .. import extension
from ..mesh.groups import group_rank, group_size
from ..mesh.profiling import span
from .buckets import BucketSpec
from .comm import (CommStream, all_reduce_async, pairwise, reduce_scatter_async,
                   then_all_reduce)


class _Bucket:
    """One bucket's parameters, flat buffer and in-flight work."""

    def __init__(self, spec: BucketSpec, params: list[nn.Parameter], reduce_dtype, device,
                 main_grads: bool = False, lazy: bool = False):
        self.spec = spec
        self.params = [params[i] for i in spec.indices]
        self.main: torch.Tensor | None = None     # fp32 main gradients (main_grads=True)
        if main_grads:
            self.main = torch.zeros(spec.padded_numel, dtype=torch.float32, device=device)
            for o, n, p in zip(spec.offsets, spec.numels, self.params):
                p.main_grad = self.main[o:o + n].view(p.shape)
        dtype = reduce_dtype or (torch.float32 if main_grads else spec.dtype)
        self.as_views = not main_grads and dtype == spec.dtype
        self.buffer = self.main if main_grads and dtype == torch.float32 else \
            torch.zeros(spec.padded_numel, dtype=dtype, device=device)
        self.views = [self.buffer[o:o + n].view(p.shape) for o, n, p in
                      zip(spec.offsets, spec.numels, self.params)] if self.as_views else None
        self.shard: torch.Tensor | None = None    # reduce-scatter output when sharded
        self.scratch: torch.Tensor | None = None  # on gloo: the blocks its peers send it
        self.missing: list[tuple[int, bool]] = []  # (position, had no .grad) of unused params
        self.released = False                     # ZeRO-2: the whole-gradient memory is freed
        self.reset()
        for k, p in enumerate(self.params):       # keep gradients that exist already
            if p.grad is not None and self.in_buffer:
                self.adopt(k)
        if lazy and all(p.grad is None for p in self.params):
            self.release()          # taken by the first gradient: one bucket's memory at a time

    @property
    def in_buffer(self) -> bool:
        """Whether gradients live in this bucket's memory (``.grad`` views or ``main_grad``),
        rather than being packed into it at launch."""
        return self.as_views or self.main is not None

    def _flats(self) -> list[torch.Tensor]:
        """The whole-model-sized memory ZeRO-2 frees: the flat buffers and gloo's scratch."""
        return [t for t in {id(t): t for t in (self.main, self.buffer, self.scratch)
                            if t is not None}.values()]

    def release(self) -> None:
        """ZeRO-2: free the whole gradients (the flat buffers' storage; the views keep it and see
        it again after :meth:`acquire`); ``.grad`` is None until the next backward."""
        if self.released:
            return
        for p in self.params:
            p.grad = None
        for t in self._flats():
            t.untyped_storage().resize_(0)
        self.released = True

    def acquire(self) -> None:
        """Take the memory :meth:`release` freed back: the main gradients zeroed (every backward
        adds into them), else the padding (the first gradient of each parameter is copied in)."""
        if not self.released:
            return
        for t in self._flats():
            if t is not self.scratch:        # gloo's scratch: taken at the launch
                t.untyped_storage().resize_(t.numel() * t.element_size())
        if self.main is not None:
            self.main.zero_()
        if self.buffer is not self.main:
            self.buffer[self.spec.numel:].zero_()
        self.released = False

    def reset(self) -> None:
        self.pending = len(self.params)
        self.arrived = [False] * len(self.params)
        self.divided = [False] * len(self.params)  # view already holds .grad / world
        self.work = None
        self.missing = []

    def adopt(self, k: int, world: int = 1) -> None:
        """Make parameter k's ``.grad`` the view into the buffer (copying it in if it is not;
        with ``world`` > 1 dividing it by ``world`` on the way, as torch DDP does, so that the
        launch need not divide that part of the bucket again); with main gradients, add
        ``.grad`` into ``main_grad`` and free it."""
        p = self.params[k]
        if self.main is not None:
            if p.grad is not None:
                p.main_grad.add_(p.grad)
                p.grad = None
            return
        view = self.views[k]
        if p.grad is not view:
            if world > 1:
                torch.div(p.grad, world, out=view)
                self.divided[k] = True
            else:
                view.copy_(p.grad)
            p.grad = view

    def divide(self, world: int) -> None:
        """Divide what the launch sends by ``world``, except the views that ``adopt`` divided."""
        if all(self.divided):
            return
        if not any(self.divided):
            self.buffer.div_(world)
            return
        for view, done in zip(self.views, self.divided):
            if not done:
                view.div_(world)

    def fill_missing(self, k: int) -> None:
        """Parameter k got no gradient since the last reduction: contribute what .grad holds."""
        p = self.params[k]
        self.missing.append((k, p.grad is None))
        if self.main is not None:
            self.adopt(k)                         # a gradient set by hand; else it holds zeros
        elif self.as_views:
            view = self.views[k]
            if p.grad is None:
                view.zero_()
            elif p.grad is not view:
                view.copy_(p.grad)
        elif p.grad is None:
            p.grad = torch.zeros_like(p)


class GradReducer:
    """Reduces the gradients of ``params`` over ``group`` in buckets; see the module doc."""

    def __init__(self, params: list[nn.Parameter], names: list[str], specs: list[BucketSpec],
                 group, world: int, *, reduce_dtype, overlap: bool, find_unused: bool,
                 events: extension.EventLog, device: torch.device, main_grads: bool = False,
                 lazy: bool = False, replicate_group=None, bucket_groups=None):
        self.params, self.names, self.group, self.world = params, names, group, world
        # Expert parallelism: a bucket's own group (its experts' replicas), None: ``group``;
        # it is also the group the bucket's ZeRO shards are cut over.
        self.bucket_groups = bucket_groups or [None] * len(specs)
        # HSDP: the reduction over ``group`` is followed by an all-reduce of its result over the
        # replicas (the same shard on other groups); the mean is over both.
        self.replicate_group = replicate_group
        self.mean_world = world * group_size(replicate_group)
        self.overlap, self.find_unused, self.events = overlap, find_unused, events
        self.stream = CommStream(device)
        self.main_grads = main_grads
        self.buckets = [_Bucket(s, params, reduce_dtype, device, main_grads, lazy) for s in specs]
        self.where = {i: (b, k) for b, s in enumerate(specs) for k, i in enumerate(s.indices)}
        self.index = {id(p): i for i, p in enumerate(params)}
        self.sync = True              # False inside no_sync(): gradients only accumulate
        self.wait_in_backward = True  # False: a pipeline schedule calls finish() itself
        self.sharded = False
        self.release_grads = False    # ZeRO-2: free whole gradients once reduced
        # ZeRO-3: at most this many buckets' reduce-scatters in flight; launching another waits
        # for the oldest and frees its whole gradients there, during backward (None: at the end)
        self.max_in_flight: int | None = None
        # ZeRO-3: the reduced gradient shards too exist only from a reduction to zero_grad()
        self.free_shards = False
        # ZeRO-3: a unit's gradients stay autograd's until the unit's backward is over; the
        # unit gather then frees the unit's parameters and launches (FSDP2's order: the bucket
        # is taken once the parameters are gone and the reduction before has landed)
        self.pack_at_launch = False
        self.optimizer = None         # the DistributedOptimizer stepping these buckets, if any
        self.on_reduced = None        # on_reduced(b): bucket b's mean gradient is in place
        self.in_flight = False        # started and not yet finished
        self.reduced = False          # a reduction finished since the optimizer last stepped
        self.unused: set[int] = set()  # parameters no rank used in the last reduction
        self._touched = [False] * len(params)
        self._armed = False
        self._next = 0
        self._used_counts = None
        self._used_work = None
        for i, p in enumerate(params):
            p.register_post_accumulate_grad_hook(_hook(self, i))

    def place(self, b: int) -> tuple:
        """``(group, rank, size)`` bucket b is reduced (and its ZeRO shards cut) over."""
        g = self.bucket_groups[b]
        return (self.group, group_rank(self.group), self.world) if g is None else \
            (g, group_rank(g), group_size(g))

    def mean_grads(self, bucket: _Bucket) -> torch.Tensor:
        """The flat tensor that holds ``bucket``'s mean gradient after a reduction: this rank's
        shard when sharded, else the main-gradient buffer or the bucket buffer."""
        if self.sharded:
            return bucket.shard
        return bucket.main if bucket.main is not None else bucket.buffer

    def drop_shards(self) -> None:
        """Free the reduced gradient shards (``free_shards``: zero_grad(set_to_none=True));
        each comes back when its bucket's next reduction starts."""
        if self.free_shards and not self.in_flight:
            for bucket in self.buckets:
                bucket.shard.untyped_storage().resize_(0)

    def zero_main_grads(self) -> None:
        for bucket in self.buckets:
            if bucket.main is not None and not bucket.released:
                bucket.main.zero_()

    def enable_sharding(self, release: bool = False) -> None:
        """Reduce-scatter every bucket into a 1/world shard instead of all-reducing it; with
        ``release`` (ZeRO-2) free the whole gradients once reduced."""
        if self.in_flight:
            raise RuntimeError("cannot switch to sharded reduction while a reduction is running")
        self.release_grads = bool(release)
        for b, bucket in enumerate(self.buckets):
            if release:             # until the first backward, whole gradients are not needed
                bucket.release()
            group, _, world = self.place(b)
            bucket.shard = bucket.buffer.new_zeros(bucket.spec.padded_numel // world)
            if pairwise(group) and world > 2:   # the blocks not received into shard
                bucket.scratch = bucket.buffer.new_empty(bucket.shard.numel() * (world - 2))
                if bucket.released:             # comes and goes with the whole gradients
                    bucket.scratch.untyped_storage().resize_(0)
        self.sharded = True

    # -- 1, 2: hooks --------------------------------------------------------------------------
    def on_grad(self, i: int) -> None:
        b, k = self.where[i]
        bucket = self.buckets[b]
        if b < self._next:
            raise RuntimeError(
                f"DataParallel: the gradient of {self.names[i]!r} was accumulated after its "
                f"bucket's reduction had started, so this step's gradients are not valid; with "
                f"wait_in_backward=False call finish_gradient_sync() (or run the wrapper's "
                f"forward) before backwards that are not part of the reduction")
        if not (self.pack_at_launch and self.sync and bucket.released and bucket.as_views):
            bucket.acquire()
            if bucket.in_buffer:
                # A fresh gradient of a reducing backward is divided as it is copied in (one
                # pass over it, not two). Not across several backward calls
                # (wait_in_backward=False): a later call would add undivided gradients into the
                # divided view.
                divide = self.sync and self.wait_in_backward and not bucket.arrived[k]
                bucket.adopt(k, self.mean_world if divide else 1)
        self._touched[i] = True
        if not self.sync:
            return
        self.in_flight = True
        if self.wait_in_backward and not self._armed:
            self._armed = True
            Variable._execution_engine.queue_callback(self._on_backward_end)
        if bucket.arrived[k]:
            return
        bucket.arrived[k] = True
        bucket.pending -= 1
        if bucket.pending == 0 and self.overlap and not self.pack_at_launch:
            self._launch_ready()

    def _launch_ready(self) -> None:
        while self._next < len(self.buckets) and self.buckets[self._next].pending == 0:
            self._launch(self._next)

    def _launch(self, b: int) -> None:
        bucket = self.buckets[b]
        if bucket.released and bucket.as_views:    # pack_at_launch: .grad holds the gradients
            self._retire(b)
            bucket.acquire()
            divide = self.sync and self.wait_in_backward
            for k, p in enumerate(bucket.params):
                if p.grad is not None:
                    bucket.adopt(k, self.mean_world if divide else 1)
        with self.stream.issue(), span("dp start", "reduce-scatter" if self.sharded else
                                       "all-reduce", "of bucket", b):
            if bucket.main is not None and bucket.buffer is not bucket.main:
                torch.mul(bucket.main, 1.0 / self.mean_world, out=bucket.buffer)   # bf16 wire
            elif bucket.in_buffer:
                if self.mean_world > 1:
                    bucket.divide(self.mean_world)   # the sum is then the mean, as in DDP
            else:
                extension.multi_tensor_pack([p.grad for p in bucket.params], bucket.buffer,
                                      1.0 / self.mean_world)
            self.events.record("launch", b)
            if self.sharded:
                for t in (bucket.shard, bucket.scratch):     # freed since the last launch
                    if t is not None and t.untyped_storage().nbytes() == 0:
                        t.untyped_storage().resize_(t.numel() * t.element_size())
                bucket.work = reduce_scatter_async(bucket.shard, bucket.buffer,
                                                   self.place(b)[0], bucket.scratch)
            else:
                bucket.work = all_reduce_async(bucket.buffer, self.place(b)[0])
            if group_size(self.replicate_group) > 1:
                bucket.work = then_all_reduce(bucket.work, bucket.shard if self.sharded else
                                              bucket.buffer, self.replicate_group,
                                              host_waits=pairwise(self.group))
        self._next = b + 1
        self._retire(b)

    def _retire(self, b: int) -> None:
        """``max_in_flight``: wait for the reductions of the buckets before b but the last
        max_in_flight - 1 of them, and free their whole gradients (called before and after
        bucket b's launch)."""
        if self.max_in_flight is None or not self.release_grads:
            return
        for old in self.buckets[:max(0, b + 1 - self.max_in_flight)]:
            if old.work is not None:
                with span("dp wait for bucket", self.buckets.index(old)):
                    old.work.wait()
                old.work = None
                self.stream.join()
                old.release()

    # -- 3: the autograd engine has finished ---------------------------------------------------
    def _on_backward_end(self) -> None:
        self.events.record("backward_end")
        self._armed = False
        self.finish()

    def launch_all(self) -> None:
        """Start every bucket not started yet, whatever its gradients (and, to find unused
        parameters, the used-map)."""
        for b in range(self._next, len(self.buckets)):
            bucket = self.buckets[b]
            bucket.acquire()
            for k, i in enumerate(bucket.spec.indices):
                p = bucket.params[k]
                if not self._touched[i] or (p.grad is None and bucket.main is None):
                    bucket.fill_missing(k)
                elif bucket.in_buffer:
                    bucket.adopt(k)          # a gradient assigned to .grad by hand
            self._launch(b)
        if self.find_unused and self.world > 1 and self._used_counts is None:
            self._used_counts = torch.tensor(self._touched, dtype=torch.int32,
                                             device=self.buckets[0].buffer.device)
            with self.stream.issue():
                self._used_work = all_reduce_async(self._used_counts, self.group)

    def reduce_now(self, wait: bool) -> None:
        """Reduce what the gradients hold now (set by hooks or by hand), outside any backward."""
        if self._armed:
            raise RuntimeError("reduce_gradients() cannot run inside a backward")
        for i, p in enumerate(self.params):
            self._touched[i] = self._touched[i] or p.grad is not None
        self.in_flight = True
        self.launch_all()
        if wait:
            self.finish()

    # -- 4 ------------------------------------------------------------------------------------
    def finish(self) -> None:
        """Start what is left, wait for every bucket, give each parameter its mean gradient."""
        if not self.in_flight or self._armed:
            return
        self.launch_all()
        # Without the used-map every rank knows on the host which gradients it has, so a bucket
        # can be handed on (``on_reduced``, e.g. to step its optimizer) as soon as it lands.
        early = self.on_reduced if not self.find_unused else None
        delivered = set()
        for b, bucket in enumerate(self.buckets):
            if bucket.work is not None:
                with span("dp wait for bucket", b):
                    bucket.work.wait()
            self.events.record("done", b)
            if early is not None and not bucket.missing:
                self.stream.join()
                self._deliver(bucket)
                delivered.add(b)
                early(b)
        if self._used_work is not None:
            self._used_work.wait()
        self.stream.join()
        # Ranks that used each parameter: the used-map's host sync only to find unused ones.
        counts = (self._used_counts.tolist() if self._used_counts is not None
                  else [int(t) for t in self._touched])
        self.unused = {i for i, c in enumerate(counts) if c == 0} if self.find_unused else set()
        for b, bucket in enumerate(self.buckets):
            if b not in delivered:
                self._deliver(bucket)
            bucket.reset()
        self._touched = [False] * len(self.params)
        self._next, self._used_counts, self._used_work = 0, None, None
        self.in_flight, self.reduced = False, True
        missing = [i for i, c in enumerate(counts) if c == 0]
        if missing and not self.find_unused:
            raise RuntimeError(_unused_message(self.names, missing))

    def _deliver(self, bucket: _Bucket) -> None:
        """Point .grad at the reduced values; globally unused parameters keep what they had."""
        idx = bucket.spec.indices
        if self.sharded:                             # the optimizer reads bucket.shard
            if self.release_grads:
                bucket.release()
            return
        if bucket.main is not None:
            if bucket.buffer is not bucket.main:
                bucket.main.copy_(bucket.buffer)
            return
        if bucket.as_views:
            for k, had_none in bucket.missing:
                if idx[k] not in self.unused:
                    bucket.params[k].grad = bucket.views[k]
            return
        extension.multi_tensor_unpack(bucket.buffer, [p.grad for p in bucket.params], 1.0)
        for k, had_none in bucket.missing:
            if had_none and idx[k] in self.unused:
                bucket.params[k].grad = None


def _hook(reducer: GradReducer, i: int):
    """A post-accumulate-grad hook that does not keep the reducer alive."""
    ref = weakref.ref(reducer)

    def hook(_param):
        r = ref()
        if r is not None:
            r.on_grad(i)
    return hook


def _unused_message(names, missing) -> str:
    shown = ", ".join(repr(names[i]) for i in missing[:8])
    more = f" and {len(missing) - 8} more" if len(missing) > 8 else ""
    return (f"DataParallel: parameters got no gradient in this step on this data-parallel rank: "
            f"{shown}{more}. Every trainable parameter must get a gradient in each step; pass "
            f"find_unused_parameters=True to allow this, or freeze them (requires_grad_(False)). "
            f"The step's reduction completed; ranks that had every gradient do not raise.")
