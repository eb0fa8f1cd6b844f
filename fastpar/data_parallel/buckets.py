"""Gradient buckets: which parameters share one flat buffer and one collective.

Pure arithmetic, no tensors or processes. Parameters are taken in reverse registration order
(roughly the order backward produces their gradients), one open bucket per dtype; a bucket is
closed before the parameter that would take it past the cap, so every bucket fits the cap unless
it holds a single parameter larger than the cap. As in torch DDP, the very first bucket may be
closed early, once it holds ``first_cap_bytes``, so that communication starts as soon as the last
layer's gradients exist. Buckets are listed in the order they become ready, which is the order
their collectives are launched in on every rank.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch


@dataclass(frozen=True)
class BucketSpec:
    """One bucket: its parameters and where each one's gradient sits in the flat buffer."""

    dtype: torch.dtype            # the parameters' (and gradients') dtype
    indices: tuple[int, ...]      # positions in the list given to assign_buckets, descending
    offsets: tuple[int, ...]      # element offset of each parameter in the flat buffer
    numels: tuple[int, ...]
    numel: int                    # elements that hold gradients: sum(numels)
    padded_numel: int             # numel rounded up to a multiple of pad_to (ZeRO shards)

    def shard(self, rank: int, world: int) -> tuple[int, int]:
        """[lo, hi) of the flat buffer owned by ``rank`` of ``world`` (reduce-scatter's split)."""
        size = self.padded_numel // world
        return rank * size, (rank + 1) * size


def assign_buckets(params: Sequence[tuple[int, torch.dtype]], cap_bytes: int, pad_to: int = 1,
                   reduce_dtype: torch.dtype | None = None,
                   first_cap_bytes: int | None = None) -> list[BucketSpec]:
    """Split parameters, given as ``(numel, dtype)`` in registration order, into buckets.

    ``cap_bytes`` bounds the bytes each bucket communicates (elements of ``reduce_dtype``, or of
    the parameter's dtype). ``pad_to`` rounds every flat buffer up so it splits into that many
    equal shards. ``first_cap_bytes``: close the first bucket as soon as it holds that many
    bytes. Deterministic: the same input always gives the same buckets.
    """
    if cap_bytes <= 0:
        raise ValueError(f"cap_bytes={cap_bytes} must be > 0")
    if pad_to < 1:
        raise ValueError(f"pad_to={pad_to} must be >= 1")
    n = len(params)
    open_: dict[torch.dtype, list[int]] = {}
    sizes: dict[torch.dtype, int] = {}
    closed: list[list[int]] = []
    first = None                                   # the first bucket, while it is still open
    for i in reversed(range(n)):
        numel, dtype = params[i]
        item = (reduce_dtype or dtype).itemsize
        if open_.get(dtype) and (sizes[dtype] + numel) * item > cap_bytes:
            closed.append(open_.pop(dtype))
        if dtype not in open_:
            open_[dtype], sizes[dtype] = [], 0
            first = open_[dtype] if i == n - 1 else first
        open_[dtype].append(i)
        sizes[dtype] += numel
        if first_cap_bytes and open_[dtype] is first and sizes[dtype] * item >= first_cap_bytes:
            closed.append(open_.pop(dtype))
            first = None
    closed += open_.values()
    # A bucket is ready when its last parameter is, i.e. at reverse position n - 1 - index.
    closed.sort(key=lambda idx: n - 1 - idx[-1])
    return [_spec(params, idx, pad_to) for idx in closed]


def _spec(params, indices: list[int], pad_to: int) -> BucketSpec:
    numels = tuple(params[i][0] for i in indices)
    offsets = tuple(sum(numels[:k]) for k in range(len(numels)))
    numel = sum(numels)
    padded = -(-numel // pad_to) * pad_to
    return BucketSpec(dtype=params[indices[0]][1], indices=tuple(indices), offsets=offsets,
                      numels=numels, numel=numel, padded_numel=max(padded, pad_to))
