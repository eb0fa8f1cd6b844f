"""Gradient buckets: which parameters share one flat buffer and one collective.

Pure arithmetic, no tensors or processes. Parameters are taken in reverse registration order
(roughly the order backward produces their gradients), one open bucket per dtype, and a bucket is
closed as soon as it reaches the cap: it stays below the cap until its last parameter. This is
torch DDP's rule, so the same ``bucket_cap_mb`` gives the same buckets; as DDP does with its
default cap, the very first bucket can close earlier, at ``first_cap_bytes``, so that
communication starts as soon as the last layer's gradients exist. Buckets are listed in the order they become ready, which is the order
their collectives are launched in on every rank.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from ..mesh.layout import require_positive


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
                   first_cap_bytes: int | None = None,
                   kinds: Sequence | None = None) -> list[BucketSpec]:
    """Split parameters, given as ``(numel, dtype)`` in registration order, into buckets.

    A bucket closes once it holds ``cap_bytes`` (counted in elements of ``reduce_dtype``, or of
    the parameter's dtype); the first bucket of each dtype closes at ``first_cap_bytes`` if given.
    ``pad_to`` rounds every flat buffer up so it splits into that many equal shards.
    Deterministic: the same input always gives the same buckets. ``kinds`` (one per
    parameter): parameters of different kinds never share a bucket (as different dtypes),
    e.g. the experts of expert parallelism, reduced over another group.
    """
    if cap_bytes <= 0:
        raise ValueError(f"cap_bytes={cap_bytes} must be > 0")
    require_positive({"pad_to": pad_to})
    n = len(params)
    open_: dict[tuple, list[int]] = {}
    nbytes: dict[tuple, int] = {}
    done: dict[tuple, int] = {}                    # buckets closed so far, per dtype and kind
    closed: list[list[int]] = []
    for i in reversed(range(n)):
        numel, dtype = params[i]
        key = (dtype, None if kinds is None else kinds[i])
        if key not in open_:
            open_[key], nbytes[key] = [], 0
        open_[key].append(i)
        nbytes[key] += numel * (reduce_dtype or dtype).itemsize
        cap = first_cap_bytes if first_cap_bytes and not done.get(key) else cap_bytes
        if nbytes[key] >= cap:
            closed.append(open_.pop(key))
            done[key] = done.get(key, 0) + 1
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


def unit_buckets(params: Sequence[tuple[int, torch.dtype]], unit_of: Sequence[int | None],
                 pad_to: int = 1, kinds: Sequence | None = None) -> list[BucketSpec]:
    """One bucket per unit, dtype and kind (ZeRO-3's gather and reduce-scatter groups, FSDP's
    units): parameter i belongs to unit ``unit_of[i]`` (``None``: the root, every parameter
    outside a unit). Listed, as :func:`assign_buckets`'s, in the order backward completes
    them."""
    if len(unit_of) != len(params):
        raise ValueError(f"unit_of has {len(unit_of)} entries for {len(params)} parameters")
    require_positive({"pad_to": pad_to})
    n = len(params)
    groups: dict[tuple, list[int]] = {}
    for i in reversed(range(n)):
        kind = None if kinds is None else kinds[i]
        groups.setdefault((unit_of[i], params[i][1], kind), []).append(i)
    order = sorted(groups.values(), key=lambda idx: n - 1 - idx[-1])
    return [_spec(params, idx, pad_to) for idx in order]
