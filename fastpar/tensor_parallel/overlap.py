"""Autograd Functions for the linear layers' overlapped paths, built on the extension's ops.

Inputs are 2-D ``(rows, features)``: rows are the flattened sequence-first tokens, so a
sequence-parallel shard is a contiguous block of rows. ``w`` is an nn.Linear weight shard, or
its autocast copy; ``weight_id`` is ``id()`` of the parameter itself, which names it to
:mod:`fastpar.split_backward` (the copy is a new tensor at every forward): in B of a split
backward they skip the weight-gradient GEMM, in W the input-gradient GEMM and its collective.
"""
from __future__ import annotations

import contextlib
import os
from concurrent.futures import ThreadPoolExecutor

import torch

from .. import extension
from ..mesh import collectives
from ..mesh.groups import all_gather_tensor
from ..mesh.profiling import span
from ..split_backward import phase_of

# A chunked GEMM + all-reduce cuts its (rows, cols) result into at most the layer's ``chunks``
# row chunks, and each chunk's all-reduce moves at least this many bytes: below it a collective's
# fixed cost (a gloo round trip, an NCCL launch) exceeds what overlapping one chunk can hide.
# bench/RESULTS.md has the measurement behind it: the tiny preset's tp=2 step (256 x 128 fp32 per
# all-reduce) at 1 Gbit/s, in 4 chunks and in one.
MIN_CHUNK_BYTES = 1 << 20


def row_chunks(chunks: int, rows: int, cols: int, itemsize: int) -> int:
    """Row chunks of an all-reduced (rows, cols) GEMM result: at most ``chunks``, each chunk's
    all-reduce at least :data:`MIN_CHUNK_BYTES` (one chunk when the whole is smaller)."""
    return max(1, min(chunks, rows, rows * cols * itemsize // max(MIN_CHUNK_BYTES, 1)))


# Where a row-parallel forward (no SP) leaves its all-reduce in flight: the works list of the
# innermost deferred_reductions, or None (the all-reduce is waited inside the op, as usual).
_deferred: list | None = None
# Whether a column linear called inside it leaves its backward's all-reduce to a WaitGrad.
_late_grads = False
# What a column linear's backward (no SP) runs while its input-gradient all-reduce is in flight:
# the innermost filling()'s function, or None (only its own weight-gradient GEMM).
_filler = None


@contextlib.contextmanager
def deferred_reductions(works: list, late_grads: bool = True):
    """Inside, a :class:`RowParallelLinear` without SP whose output its caller reads only
    later (``skip_bias_add``, or no bias) starts its output's all-reduce and returns at once; the
    work is appended to ``works``, and whoever reads that output waits it first; and a
    :class:`ColumnParallelLinear` without SP leaves its backward's input-gradient all-reduce in
    flight for a :class:`WaitGrad` that autograd runs late (see :func:`wait_grad_later`). This is
    what lets the trainer interleave micro-batches (``fastpar.models.gpt.interleave``): one
    micro-batch's reduction travels while the next one computes, in the forward and in the
    backward. Not under torch.compile. ``late_grads=False``: the forward's all-reduces only
    (the backward waits its own, as outside)."""
    global _deferred, _late_grads
    outer, _deferred, outer_late, _late_grads = _deferred, works, _late_grads, late_grads
    try:
        yield works
    finally:
        _deferred, _late_grads = outer, outer_late


@contextlib.contextmanager
def filling(fn):
    """Inside, the backward of a column linear without SP starts its input-gradient all-reduce,
    computes its weight gradient, then calls ``fn()`` before it waits: work that does not
    depend on this backward (the next micro-batch's forward, a step at a time:
    ``fastpar.models.gpt.overlap_forward_backward``) runs while the all-reduce travels. ``fn``
    runs with the filler unset (nothing it calls fills in turn)."""
    global _filler
    outer, _filler = _filler, fn
    try:
        yield
    finally:
        _filler = outer


def _fill() -> None:
    global _filler
    fn, _filler = _filler, None
    try:
        fn()
    finally:
        _filler = fn


def defers() -> bool:
    """Whether a linear layer called now may leave its all-reduce in flight (inside
    :func:`deferred_reductions`, not compiling)."""
    return _deferred is not None and not torch.compiler.is_compiling()


def defers_grads() -> bool:
    """Whether a column linear called now leaves its backward's all-reduce to a late
    :class:`WaitGrad` (inside :func:`deferred_reductions` with ``late_grads``)."""
    return _late_grads and defers()


class ReduceLater(torch.autograd.Function):
    """Forward: start ``x``'s all-reduce over ``group`` in place and leave it in flight, in the
    works of :func:`deferred_reductions` (whoever reads ``x`` waits it first). Backward:
    identity, as Megatron's reduce-from-TP."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.mark_dirty(x)
        _deferred.append(collectives.all_reduce(x, group=group, async_op=True))
        return x

    @staticmethod
    def backward(ctx, g):
        return g, None


class Pending:
    """The input-gradient all-reduce a column linear's backward leaves in flight, waited by the
    :class:`WaitGrad` in front of it."""

    __slots__ = ("work",)

    def __init__(self):
        self.work = None


class WaitGrad(torch.autograd.Function):
    """Identity. Its backward waits for ``pending``'s all-reduce (writing the gradient in
    place) before the gradient goes on to whatever made the input (a norm)."""

    @staticmethod
    def forward(ctx, x, pending):
        ctx.pending = pending
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        work, ctx.pending.work = ctx.pending.work, None
        if work is not None:
            with span("tp wait for a deferred input-grad all-reduce"):
                work.wait()
        return g, None


# Autograd's engine runs, of the nodes ready, the one created last (the highest sequence number,
# a per-thread counter). A WaitGrad made on this thread, whose counter is far behind the
# training thread's, runs only once nothing else is ready: after the other micro-batches'
# backward has reached its own waits. Of the waits, the one made last runs first, so the
# micro-batches take turns, each one's all-reduce travelling while another computes.
_late: tuple[int, ThreadPoolExecutor] | None = None      # (its process, the one thread)


def wait_grad_later(x: torch.Tensor) -> tuple[torch.Tensor, Pending]:
    """``x`` through a :class:`WaitGrad` that autograd runs as late as it can (see above), and
    the :class:`Pending` that the layer taking ``x`` hands its input-gradient all-reduce to."""
    global _late
    if _late is None or _late[0] != os.getpid():    # (a forked child has no such thread)
        _late = (os.getpid(), ThreadPoolExecutor(1, thread_name_prefix="fastpar-late-node"))
    pending = Pending()
    return _late[1].submit(WaitGrad.apply, x, pending).result(), pending


def _needs(ctx) -> tuple[bool, bool]:
    """(input gradient wanted, weight gradient wanted) for this backward call."""
    need_x, need_w = ctx.needs_input_grad[:2]
    phase = phase_of(ctx.weight_id)
    return need_x and phase != "weight", need_w and phase != "input"


class ColumnLinearOverlap(torch.autograd.Function):
    """Forward: x @ w.T (under SP: ring all-gather fused with the GEMM). Backward: the input-grad
    all-reduce (in row chunks) / reduce-scatter overlaps the weight-grad GEMM.

    Under SP the weight gradient needs the whole gathered input: ``regather=False`` keeps the
    one the forward gathered (tp times the shard's memory, as autograd keeps it on the plain
    path); ``regather=True`` keeps the shard and gathers it again in backward, under the
    input-gradient GEMM (Megatron's choice: one more all-gather per call for less memory)."""

    @staticmethod
    def forward(ctx, x, w, group, sequence_parallel, chunks, weight_id, regather=True,
                pending=None):
        ctx.group, ctx.sp, ctx.chunks, ctx.weight_id = group, sequence_parallel, chunks, weight_id
        ctx.pending = pending
        if sequence_parallel:
            with span("tp all-gather + GEMM (column forward)"):
                out, gathered = extension.allgather_matmul(x, w, group)
            ctx.save_for_backward(x if regather else gathered, w)
            return out
        ctx.save_for_backward(x, w)
        return x @ w.t()

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        need_x, need_w = _needs(ctx)
        if ctx.pending is not None and need_x:
            # Interleaved micro-batches: the input grad's all-reduce is left in flight for
            # the WaitGrad in front of this layer, which autograd runs once the other
            # micro-batches' backward has computed up to its own.
            g = g.contiguous()
            gx = g @ w
            with span("tp column backward: start the input-grad all-reduce"):
                ctx.pending.work = collectives.all_reduce(gx, group=ctx.group, async_op=True)
            gw = g.t() @ x if need_w else None
            return gx, gw, None, None, None, None, None, None
        if _filler is not None and need_x and not ctx.sp and not torch.compiler.is_compiling():
            # A forward of another micro-batch runs here, while the all-reduce travels.
            g = g.contiguous()
            gx = g @ w
            with span("tp column backward: start the input-grad all-reduce"):
                work = collectives.all_reduce(gx, group=ctx.group, async_op=True)
            gw = g.t() @ x if need_w else None
            with span("tp column backward: the next micro-batch's forward under the all-reduce"):
                _fill()
            with span("tp column backward: wait for the input-grad all-reduce"):
                work.wait()
            return gx, gw, None, None, None, None, None, None
        chunks = row_chunks(ctx.chunks, g.shape[0], x.shape[1], g.element_size())
        # The GEMMs read g (rows, out/tp) row-major. For the output head g is the loss's
        # gradient, made in the head output's own layout, so g.contiguous() copies nothing
        # there (tests/test_loss_memory.py counts copies); only a transposed g would be copied.
        with span("tp column backward:", "reduce-scatter" if ctx.sp else "all-reduce",
                  "of the input grad under the weight-grad GEMM"):
            gx, gw = extension.column_linear_backward(g.contiguous(), x, w, ctx.group, ctx.sp,
                                                      need_x, need_w, chunks)
        return (gx if need_x else None), (gw if need_w else None), None, None, None, None, None, \
            None


class RowLinearOverlap(torch.autograd.Function):
    """Forward: chunked GEMM + all-reduce (under SP: GEMM + ring reduce-scatter). Backward: no
    communication (under SP: ring all-gather of the output grad fused with the input-grad GEMM)."""

    @staticmethod
    def forward(ctx, x, w, group, sequence_parallel, chunks, weight_id, may_defer=False):
        ctx.group, ctx.sp, ctx.weight_id = group, sequence_parallel, weight_id
        ctx.save_for_backward(x, w)
        if sequence_parallel:
            with span("tp GEMM + reduce-scatter (row forward)"):
                return extension.matmul_reducescatter(x, w, group)
        if may_defer and defers():
            # The output is not saved for backward and its caller reads it only after waiting
            # the work: the all-reduce may write it in place while other work runs.
            y = x @ w.t()
            _deferred.append(collectives.all_reduce(y, group=group, async_op=True))
            return y
        with span("tp GEMM + all-reduce (row forward)"):
            return extension.matmul_allreduce(
                x, w, group, row_chunks(chunks, x.shape[0], w.shape[0], x.element_size()))

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        need_x, need_w = _needs(ctx)
        g = g.contiguous()
        gx = None
        if ctx.sp and need_x:
            with span("tp all-gather + GEMM (row backward)"):
                gx, g = extension.allgather_matmul(g, w.t(), group=ctx.group)   # g: gathered
        elif ctx.sp and need_w:                     # W of a split backward: the gather only
            full = g.new_empty((g.shape[0] * ctx.group.size(),) + tuple(g.shape[1:]))
            with span("tp all-gather (row backward, weight grad)"):
                all_gather_tensor(full, g, group=ctx.group)
            g = full
        elif need_x:
            gx = g @ w
        gw = g.t() @ x if need_w else None
        return gx, gw, None, None, None, None, None
