"""Asynchronous bucket collectives, the stream they are issued on, and an opt-in event log.

On CUDA every bucket collective (and the packing or scaling just before it) is issued on a
dedicated comm stream that first waits for the compute stream, so backward keeps computing while
the bucket travels; the compute stream waits for the comm stream again only when the reduced
gradients are used. On CPU the collectives run on gloo's worker threads and the stream is a
no-op. A group of size 1 (or ``None``) communicates nothing.
"""
from __future__ import annotations

import time
from contextlib import contextmanager

import torch
import torch.distributed as dist

from ..dist.groups import Group, group_rank, group_size  # noqa: F401  (re-exported)
from ..dist.groups import all_gather_tensor as _all_gather_tensor
from ..dist.groups import reduce_scatter_tensor as _reduce_scatter_tensor


def all_reduce_async(buf: torch.Tensor, group: Group):
    """Start a sum all-reduce of ``buf`` in place; returns the work (None without peers)."""
    if group_size(group) == 1:
        return None
    return dist.all_reduce(buf, group=group, async_op=True)


def reduce_scatter_async(out: torch.Tensor, buf: torch.Tensor, group: Group,
                         scratch: torch.Tensor | None = None):
    """Start a sum reduce-scatter: ``out`` gets this rank's 1/size block of ``buf``.

    gloo reduce-scatters through a whole all-reduce (measured here: the same time as an
    all-reduce of ``buf``, twice an all-gather's). With ``scratch`` (``buf``'s size) it is done as
    an all-to-all, which moves only the (size-1)/size of ``buf`` that a ring would, followed by
    a local sum when waited for.
    """
    if group_size(group) == 1:
        out.copy_(buf[: out.numel()])
        return None
    if scratch is not None:
        work = dist.all_to_all_single(scratch, buf, group=group, async_op=True)
        return _SumBlocks(work, scratch.view(group_size(group), -1), out)
    return _reduce_scatter_tensor(out, buf, group=group, async_op=True)


class _SumBlocks:
    """The work of an all-to-all whose received blocks are summed into ``out`` on wait."""

    def __init__(self, work, blocks: torch.Tensor, out: torch.Tensor):
        self.work, self.blocks, self.out = work, blocks, out

    def wait(self) -> None:
        self.work.wait()
        torch.sum(self.blocks, dim=0, out=self.out)


def needs_scratch(group: Group) -> bool:
    """Whether reduce-scatter over ``group`` should go through an all-to-all (gloo)."""
    return group_size(group) > 1 and dist.get_backend(group) == "gloo"


def all_gather_async(out: torch.Tensor, shard: torch.Tensor, group: Group):
    """Start an all-gather of every rank's ``shard`` into ``out``, in group-rank order."""
    if group_size(group) == 1:
        out[: shard.numel()].copy_(shard)
        return None
    return _all_gather_tensor(out, shard, group=group, async_op=True)


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


class EventLog:
    """(event, bucket, nanoseconds) tuples of one wrapper, recorded only while enabled.

    Events: ``launch`` (a bucket's collective is started), ``done`` (its wait returned),
    ``backward_end`` (the autograd engine finished computing gradients).
    """

    def __init__(self):
        self.enabled = False
        self._events: list[tuple[str, int, int]] = []

    def enable(self, on: bool = True) -> None:
        """Clear the log and switch recording on or off."""
        self._events = []
        self.enabled = on

    def record(self, name: str, index: int = -1) -> None:
        if self.enabled:
            self._events.append((name, index, time.perf_counter_ns()))

    def take(self) -> list[tuple[str, int, int]]:
        """The recorded events since the last take, oldest first."""
        out, self._events = self._events, []
        return out
