"""Asynchronous bucket collectives and the stream they are issued on.

On CUDA every bucket collective (and the packing or scaling just before it) is issued on a
dedicated comm stream that first waits for the compute stream, so backward keeps computing while
the bucket travels; the compute stream waits for the comm stream again only when the reduced
gradients are used. On CPU the collectives run on gloo's worker threads and the stream is a
no-op. A group of size 1 (or ``None``) communicates nothing.
"""
from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.distributed as dist

from ..mesh import collectives
from ..mesh.groups import Group, group_rank, group_size
from ..mesh.groups import all_gather_tensor as _all_gather_tensor
from ..mesh.groups import reduce_scatter_tensor as _reduce_scatter_tensor


def all_reduce_async(buf: torch.Tensor, group: Group):
    """Start a sum all-reduce of ``buf`` in place; returns the work (None without peers)."""
    if group_size(group) == 1:
        return None
    return collectives.all_reduce(buf, group=group, async_op=True)


def reduce_scatter_async(out: torch.Tensor, buf: torch.Tensor, group: Group,
                         scratch: torch.Tensor | None = None):
    """Start a sum reduce-scatter: ``out`` gets this rank's 1/size block of ``buf``.

    gloo reduce-scatters through a whole all-reduce (the time of an all-reduce of ``buf``;
    bench/RESULTS.md, "gloo's collectives"). There (:func:`pairwise`) each rank instead sends
    block r of ``buf`` to rank r and receives its own block from every peer, the (size-1)/size
    of ``buf`` that a ring moves: the first peer's block straight into ``out``, the others into
    ``scratch`` (room for size-2 blocks: none at size 2); they are summed with its own block on
    wait, in the order own + first peer + the rest.
    """
    if group_size(group) == 1:
        out.copy_(buf[: out.numel()])
        return None
    if pairwise(group):
        size, me = group_size(group), group_rank(group)
        blocks, n = buf.view(size, -1), out.numel()
        extra = scratch[: (size - 2) * n].view(size - 2, -1) if size > 2 else None
        peers = [r for r in range(size) if r != me]
        got = [out] + ([] if extra is None else list(extra))
        works = _exchange(group, [(r, blocks[r], got[k]) for k, r in enumerate(peers)])
        return _SumBlocks(works, blocks[me], got[1:], out)
    return _reduce_scatter_tensor(out, buf, group=group, async_op=True)


class _SumBlocks:
    """Pairwise transfers: ``out`` holds the first peer's block; on wait ``own`` and the other
    received blocks are added to it."""

    def __init__(self, works, own: torch.Tensor, rest: list[torch.Tensor], out: torch.Tensor):
        self.works, self.own, self.rest, self.out = works, own, rest, out

    def wait(self) -> None:
        for w in self.works:
            w.wait()
        self.out.add_(self.own)            # peer + own: the same bits as own + peer
        for block in self.rest:
            self.out.add_(block)


class _Works:
    """Several works waited for as one."""

    def __init__(self, works):
        self.works = works

    def wait(self) -> None:
        for w in self.works:
            w.wait()

    def is_completed(self) -> bool:
        return all(w.is_completed() for w in self.works)


def _exchange(group: Group, pairs) -> list:
    """For each (group rank r, send, recv): send ``send`` to r and receive ``recv`` from r, all
    posted at once; every rank posts its pairs in group-rank order, so the transfers between
    two ranks match in the order they were posted."""
    ops = []
    for r, send, recv in pairs:
        peer = dist.get_global_rank(group, r)
        ops += [dist.P2POp(dist.isend, send, peer, group), dist.P2POp(dist.irecv, recv, peer, group)]
    return collectives.batch_isend_irecv(ops)


def pairwise(group: Group) -> bool:
    """Whether collectives over ``group`` are built from pairwise transfers: gloo, whose
    own reduce-scatter costs an all-reduce and whose all-gather is slower than an all-reduce
    (bench/RESULTS.md, "gloo's collectives")."""
    return group_size(group) > 1 and dist.get_backend(group) == "gloo"


def all_gather_async(out: torch.Tensor, shard: torch.Tensor, group: Group):
    """Start an all-gather of every rank's ``shard`` into ``out``, in group-rank order (on gloo
    as pairwise transfers; ``shard`` may be this rank's block of ``out`` itself)."""
    if group_size(group) == 1:
        if out.data_ptr() != shard.data_ptr():
            out[: shard.numel()].copy_(shard)
        return None
    if pairwise(group):
        size, me = group_size(group), group_rank(group)
        blocks = out.view(size, -1)
        if blocks[me].data_ptr() != shard.data_ptr():
            blocks[me].copy_(shard)
        return _Works(_exchange(group, [(r, shard, blocks[r]) for r in range(size) if r != me]))
    return _all_gather_tensor(out, shard, group=group, async_op=True)


class _Then:
    """A work followed by an all-reduce started only once it is waited for (on gloo, whose
    pairwise reduce-scatter sums its blocks on the host in ``wait``)."""

    def __init__(self, first, tensor: torch.Tensor, group: Group):
        self.first, self.tensor, self.group = first, tensor, group

    def wait(self) -> None:
        if self.first is not None:
            self.first.wait()
        work = all_reduce_async(self.tensor, self.group)
        if work is not None:
            work.wait()


def then_all_reduce(first, tensor: torch.Tensor, group: Group, host_waits: bool):
    """HSDP's second stage: sum ``tensor`` over ``group`` (the replicas) after ``first`` (the
    reduction inside the shard group) has produced it. ``host_waits`` (gloo): chained at wait
    time; else (NCCL) the device stream waits for ``first`` and the all-reduce is issued now,
    the host never blocking."""
    if host_waits:
        return _Then(first, tensor, group)
    if first is not None:
        first.wait()
    return all_reduce_async(tensor, group)


class CommStream:
    """Where bucket collectives are issued: a side CUDA stream on GPU, nothing special on CPU."""

    def __init__(self, device: torch.device):
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    @contextmanager
    def issue(self):
        """Run the block on the comm stream, after everything queued so far on compute."""
        if self.stream is None:
            yield
            return
        self.stream.wait_stream(torch.cuda.current_stream(self.stream.device))
        with torch.cuda.stream(self.stream):
            yield

    def join(self) -> None:
        """Make the compute stream wait for everything issued on the comm stream."""
        if self.stream is not None:
            torch.cuda.current_stream(self.stream.device).wait_stream(self.stream)

