"""Megatron's tensor-parallel mappings, each a named autograd Function.

Activation layout: sequence-first, ``(S, B, H)`` like Megatron (or ``(T, H)`` for flat tokens), so
a sequence-parallel shard is a contiguous block of dim 0 and the hidden dim is the last. A mapping
given ``group=None`` (or a group of size 1) is the identity.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..mesh import collectives
from ..mesh.groups import Group, group_rank, group_size
from ..mesh.groups import all_gather_tensor as _all_gather_tensor
from ..mesh.groups import reduce_scatter_tensor as _reduce_scatter_tensor
from ..mesh.profiling import span


def check_divisible(size: int, tp: int, what: str) -> None:
    if size % tp:
        raise ValueError(f"{what} = {size} is not divisible by the tensor-parallel size tp={tp}")


def _all_reduce(x: torch.Tensor, group: Group) -> torch.Tensor:
    x = x.contiguous()
    with span("tp all-reduce"):
        collectives.all_reduce(x, group=group)
    return x


def _gather(x: torch.Tensor, group: Group, dim: int) -> torch.Tensor:
    """All-gather along ``dim``: shards in group-rank order."""
    tp, dim = group_size(group), dim % x.dim()
    x = x.movedim(dim, 0).contiguous()
    out = torch.empty((tp * x.shape[0],) + x.shape[1:], dtype=x.dtype, device=x.device)
    with span("tp all-gather"):
        _all_gather_tensor(out, x, group=group)
    return out if dim == 0 else out.movedim(0, dim).contiguous()


def _split(x: torch.Tensor, group: Group, dim: int, what: str) -> torch.Tensor:
    tp = group_size(group)
    check_divisible(x.shape[dim], tp, what)
    return x.chunk(tp, dim=dim)[group_rank(group)].contiguous()


def _reduce_scatter(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Sum over the group, keep this rank's block of dim 0."""
    tp = group_size(group)
    check_divisible(x.shape[0], tp, "sequence length (dim 0) for reduce-scatter")
    x = x.contiguous()
    out = torch.empty((x.shape[0] // tp,) + x.shape[1:], dtype=x.dtype, device=x.device)
    with span("tp reduce-scatter"):
        _reduce_scatter_tensor(out, x, group=group)
    return out


class CopyToTP(torch.autograd.Function):
    """Forward: identity. Backward: all-reduce the gradient over the TP group."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, g):
        return _all_reduce(g, ctx.group), None


class ReduceFromTP(torch.autograd.Function):
    """Forward: all-reduce over the TP group. Backward: identity."""

    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x.clone(), group)

    @staticmethod
    def backward(ctx, g):
        return g, None


class ScatterToTP(torch.autograd.Function):
    """Forward: keep this rank's slice of the last dim. Backward: all-gather the last dim."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _split(x, group, -1, "last dimension")

    @staticmethod
    def backward(ctx, g):
        return _gather(g, ctx.group, -1), None


class GatherFromTP(torch.autograd.Function):
    """Forward: all-gather the last dim. Backward: keep this rank's slice."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _gather(x, group, -1)

    @staticmethod
    def backward(ctx, g):
        return _split(g, ctx.group, -1, "last dimension"), None


class ScatterToSP(torch.autograd.Function):
    """Forward: keep this rank's block of the sequence (dim 0). Backward: all-gather dim 0."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _split(x, group, 0, "sequence length (dim 0)")

    @staticmethod
    def backward(ctx, g):
        return _gather(g, ctx.group, 0), None


class GatherFromSP(torch.autograd.Function):
    """Forward: all-gather the sequence (dim 0). Backward: reduce-scatter (or split if replicated)."""

    @staticmethod
    def forward(ctx, x, group, grad_reduce):
        ctx.group, ctx.grad_reduce = group, grad_reduce
        return _gather(x, group, 0)

    @staticmethod
    def backward(ctx, g):
        if ctx.grad_reduce:
            return _reduce_scatter(g, ctx.group), None, None
        return _split(g, ctx.group, 0, "sequence length (dim 0)"), None, None


class ReduceScatterToSP(torch.autograd.Function):
    """Forward: reduce-scatter along the sequence (dim 0). Backward: all-gather dim 0."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _reduce_scatter(x, group)

    @staticmethod
    def backward(ctx, g):
        return _gather(g, ctx.group, 0), None


def _apply(fn, x, group, *extra):
    return x if group_size(group) == 1 else fn.apply(x, group, *extra)


def copy_to_tp(x: torch.Tensor, group: Group) -> torch.Tensor:
    return _apply(CopyToTP, x, group)


def reduce_from_tp(x: torch.Tensor, group: Group) -> torch.Tensor:
    return _apply(ReduceFromTP, x, group)


def scatter_to_tp(x: torch.Tensor, group: Group) -> torch.Tensor:
    return _apply(ScatterToTP, x, group)


def gather_from_tp(x: torch.Tensor, group: Group) -> torch.Tensor:
    return _apply(GatherFromTP, x, group)


def scatter_to_sp(x: torch.Tensor, group: Group) -> torch.Tensor:
    return _apply(ScatterToSP, x, group)


def gather_from_sp(x: torch.Tensor, group: Group, grad_reduce: bool = True) -> torch.Tensor:
    """``grad_reduce=False`` when the consumer's gradient is replicated, not partial."""
    return _apply(GatherFromSP, x, group, grad_reduce)


def reduce_scatter_to_sp(x: torch.Tensor, group: Group) -> torch.Tensor:
    return _apply(ReduceScatterToSP, x, group)
