"""Which tensors of a model are split over tensor parallelism, and how: what the TP layers
declare (``tp_shard_dims``, :class:`fastpar.tensor_parallel.linear.TPSharded`), read by
checkpoints, Hugging Face conversion and gradient clipping; and which replicated parameters get
only a partial gradient on each TP rank (:func:`mark_partial_grads`), read by
:func:`fastpar.tensor_parallel.reduce_replicated_grads`."""
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


# The module attribute naming which of its own parameters are replicated over TP but get, on each
# TP rank, only a partial sum of their gradient: under sequence parallelism, parameters applied to
# this rank's block of the sequence (norms, a row-parallel linear's bias, learned positions).
# Megatron's ``param.sequence_parallel``. It sits on the module, as ``tp_shard_dims`` does,
# because building on the meta device and ``to_empty`` (``from_linear``) replace the parameter
# objects, and any attribute set on them with them.
PARTIAL_GRADS = "tp_partial_grads"


def mark_partial_grads(module: nn.Module, *names: str) -> None:
    """Declare ``module``'s own parameters ``names`` replicated over TP with partial gradients:
    :func:`fastpar.tensor_parallel.reduce_replicated_grads` sums them over the TP group once per
    step. Under sequence parallelism, for every replicated parameter that sees the sequence
    shard; never otherwise (the gradient is then whole on every rank already)."""
    own = dict(module.named_parameters(recurse=False))
    bad = [n for n in names if n not in own]
    if bad:
        raise ValueError(f"mark_partial_grads: {type(module).__name__} has no parameter(s) "
                         f"{bad}; its own parameters are {sorted(own)}")
    marked = tuple(getattr(module, PARTIAL_GRADS, ()))
    setattr(module, PARTIAL_GRADS, marked + tuple(n for n in names if n not in marked))


def partial_grad_params(modules: list[nn.Module]) -> list[nn.Parameter]:
    """Every parameter of ``modules`` marked by :func:`mark_partial_grads`, once each, in module
    order (the same order on every rank of a TP group)."""
    out, seen = [], set()
    for root in modules:
        for module in root.modules():
            own = dict(module.named_parameters(recurse=False))
            for name in getattr(module, PARTIAL_GRADS, ()):
                p = own.get(name)
                if p is not None and id(p) not in seen:
                    seen.add(id(p))
                    out.append(p)
    return out


def shard_specs(modules: list[nn.Module], tp_size: int, tp_rank: int,
                only=None) -> dict[str, ShardSpec]:
    """name -> :class:`ShardSpec` for every tensor of ``modules`` as a checkpoint holds them.
    A column-parallel linear of several parts (q, k, v fused) gives one tensor per part, named
    after the part (``attn.q.weight``), ``tensor`` being this rank's rows of it: the files do
    not depend on the fusion, and separate q / k / v weights load into it. ``only``: the ids of
    the parameters to describe (default: all)."""
    out = {}
    for root in modules:
        for mname, module in root.named_modules():
            dims = getattr(module, "tp_shard_dims", {})      # see tp_params
            named = bool(dims) and getattr(module, "parts", (("", 0),))[0][0] != ""
            # Expert parallelism: a stack of experts [start, stop) of ``total`` (dim 0).
            experts = getattr(module, "expert_slice", None)
            for pname, p in module.named_parameters(recurse=False):
                if only is not None and id(p) not in only:
                    continue
                # A parameter without memory (ZeRO-3 between uses) is described by a meta
                # stand-in of its shape: its values are the optimizer's masters.
                whole = p if p.untyped_storage().nbytes() or not p.numel() else \
                    torch.empty(p.shape, dtype=p.dtype, device="meta")
                pieces = [(f"{mname}.{pname}" if mname else pname, whole, None)]
                if named:   # one tensor per part, each split as the whole parameter is
                    parent = mname.rsplit(".", 1)[0] + "." if "." in mname else ""
                    pieces = [(f"{parent}{part}.{pname}", whole.narrow(0, offset, rows),
                               (offset, rows)) for part, offset, rows in module.local_parts()]
                for name, t, part_rows in pieces:
                    dim = dims.get(pname) if tp_size > 1 else None
                    shape, start, stop = list(t.shape), 0, 0
                    if dim is not None:
                        start, stop = t.shape[dim] * tp_rank, t.shape[dim] * (tp_rank + 1)
                        shape[dim] *= tp_size
                    elif experts is not None:
                        dim, (start, stop), shape[0] = 0, experts, module.total
                    out[name] = ShardSpec(t, shape, dim, start, stop, p, part_rows)
    return out
