"""The rows of a (..., V) tensor in the order they lie in memory, for row kernels to read in place.

A row kernel reads an (N, V) matrix whose rows are one stride apart (:func:`launch.rows`). A
(B, S, V) tensor that is the transposed view of a contiguous (S, B, V) one - a model's logits,
whose head computes sequence-first - has no such stride in its own row order, and
``reshape(-1, V)`` copies it: gigabytes at a 128K vocabulary. Taken in memory order (leading dims
sorted by stride, largest first) the same tensor is an (N, V) view. :func:`memory_order` finds
that order, :func:`memory_rows` makes the view, :func:`to_memory_rows` puts a per-row tensor
(targets, row statistics, upstream gradients: (...) in the tensor's own order) in memory order,
and :func:`from_memory_rows` brings an (N, ...) result back: an (N, V) gradient computed
contiguous in memory order comes back as a view with the strides of the input, the layout the
producer's backward (a matmul) reads without a copy.
"""
from __future__ import annotations

import torch


def _flattens(t: torch.Tensor) -> bool:
    """True if ``t``'s leading dims merge into one dim with a single stride (``view(-1, V)``
    works) and its last dim is contiguous."""
    if t.shape[-1] > 1 and t.stride(-1) != 1:
        return False
    dims = [d for d in range(t.dim() - 1) if t.shape[d] != 1]
    return all(t.stride(a) == t.stride(b) * t.shape[b] for a, b in zip(dims, dims[1:]))


def memory_order(t: torch.Tensor) -> tuple[int, ...]:
    """The leading dims of ``t`` (..., V), largest stride first (ties keep their order), when
    that order flattens to an (N, V) view; else the identity (:func:`memory_rows` copies then,
    as ``reshape`` would)."""
    lead = t.dim() - 1
    order = tuple(sorted(range(lead), key=lambda d: -t.stride(d)))
    return order if _flattens(t.permute(order + (lead,))) else tuple(range(lead))


def memory_rows(t: torch.Tensor, order: tuple[int, ...]) -> torch.Tensor:
    """``t`` (..., V) as (N, V) with its leading dims permuted by ``order``: a view for the
    order :func:`memory_order` gives whenever one exists."""
    return t.permute(order + (t.dim() - 1,)).reshape(-1, t.shape[-1])


def to_memory_rows(x: torch.Tensor, shape: torch.Size, order: tuple[int, ...]) -> torch.Tensor:
    """A per-row tensor of ``shape`` (the leading dims; any strides, broadcast included) as (N,)
    in the rows' memory order: a small copy unless ``order`` is the identity."""
    return x.reshape(shape).permute(order).reshape(-1)


def from_memory_rows(x: torch.Tensor, shape: torch.Size, order: tuple[int, ...]) -> torch.Tensor:
    """``x`` (N, ...) in memory order back to (*shape, ...), a view: the inverse of
    :func:`memory_rows` / :func:`to_memory_rows`."""
    rest = tuple(x.shape[1:])
    y = x.view(tuple(shape[d] for d in order) + rest)
    inverse = sorted(range(len(order)), key=order.__getitem__)
    return y.permute(tuple(inverse) + tuple(range(len(order), y.dim())))
