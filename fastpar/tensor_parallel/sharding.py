"""Which tensors of a model are split over tensor parallelism, and how: what the TP layers
declare (``tp_shard_dims``, :class:`fastpar.tensor_parallel.linear.TPSharded`), read by
checkpoints, Hugging Face conversion and gradient clipping."""
from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn as nn


class ShardSpec(NamedTuple):
    """One tensor of a checkpoint as this TP rank holds it."""

    tensor: torch.Tensor            # this rank's slice (of one part, for a fused parameter)
    shape: list[int]                # the whole tensor's shape, over every TP rank
    dim: int | None                 # the dim split over TP; None: replicated
    start: int                      # this rank's slice of ``dim``: [start, stop)
    stop: int
    param: nn.Parameter             # the parameter it is (part of)
    rows: tuple[int, int] | None    # (offset, count) of the parameter's first dim for one
    #                                 part of a fused parameter, else None


def tp_params(modules: list[nn.Module]) -> list[tuple[nn.Parameter, bool]]:
    """Every parameter once, with whether it is split over TP (else replicated)."""
    out = []
    for root in modules:
        for module in root.modules():
            # Declared by the tensor-parallel layers; none: replicated.
            dims, tp = getattr(module, "tp_shard_dims", {}), getattr(module, "tp_size", 1)
            out += [(p, dims.get(pname) is not None and tp > 1)
                    for pname, p in module.named_parameters(recurse=False)]
    return out


def shard_specs(modules: list[nn.Module], tp_size: int, tp_rank: int) -> dict[str, ShardSpec]:
    """name -> :class:`ShardSpec` for every tensor of ``modules`` as a checkpoint holds them.
    A column-parallel linear of several parts (q, k, v fused) gives one tensor per part, named
    after the part (``attn.q.weight``), ``tensor`` being this rank's rows of it: the files do
    not depend on the fusion, and separate q / k / v weights load into it."""
    out = {}
    for root in modules:
        for mname, module in root.named_modules():
            dims = getattr(module, "tp_shard_dims", {})      # see tp_params
            named = bool(dims) and getattr(module, "parts", (("", 0),))[0][0] != ""
            for pname, p in module.named_parameters(recurse=False):
                pieces = [(f"{mname}.{pname}" if mname else pname, p, None)]
                if named:   # one tensor per part, each split as the whole parameter is
                    parent = mname.rsplit(".", 1)[0] + "." if "." in mname else ""
                    pieces = [(f"{parent}{part}.{pname}", p.narrow(0, offset, rows),
                               (offset, rows)) for part, offset, rows in module.local_parts()]
                for name, t, part_rows in pieces:
                    dim = dims.get(pname) if tp_size > 1 else None
                    shape, start, stop = list(t.shape), 0, 0
                    if dim is not None:
                        start, stop = t.shape[dim] * tp_rank, t.shape[dim] * (tp_rank + 1)
                        shape[dim] *= tp_size
                    out[name] = ShardSpec(t, shape, dim, start, stop, p, part_rows)
    return out
