"""Tied embeddings across pipeline stages (Megatron's embedding group).

A model whose output head is its input embedding (GPT-2, Llama 3.2 1B / 3B) needs that weight on
the first stage (the lookup) and on the last (the logits). :class:`fastpar.models.GPT` builds a
copy on the last stage, drawn as the first stage's (the same values), and marks both
``tied_embedding`` (the copy also ``tied_copy``). Each step, once the data-parallel reduction
is done, :func:`reduce_tied_grads` sums their gradients over the embedding group (each first
stage rank with the last stage rank of the same tp, cp and dp coordinates), so both copies
take the same optimizer step and stay equal. The copy is not saved (the first stage's is the
checkpoint's tensor) and not counted twice in the gradient norm. Under a V placement (ZB-V) the
first and the last stage are both on pipeline rank 0: the two copies are summed there, with no
collective.
"""
from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

from ..mesh import collectives
from ..mesh.groups import group_size


def embedding_group(mesh, timeout: float | timedelta = 600.0):
    """The first and the last pipeline stage's ranks of this rank's pipeline (None at pp = 1,
    and on the stages between). Collective: every rank creates every group, in order."""
    if mesh.pp_size == 1:
        return None
    timeout = timeout if isinstance(timeout, timedelta) else timedelta(seconds=float(timeout))
    mine = None
    for ranks in mesh.layout.groups("pp"):
        group = dist.new_group([ranks[0], ranks[-1]], timeout=timeout)
        if mesh.rank in (ranks[0], ranks[-1]):
            mine = group
    return mine


def _own_grads(params) -> list[torch.Tensor]:
    """Each parameter's ``main_grad`` if it has one, else its ``.grad`` (present ones)."""
    out = [getattr(p, "main_grad", None) for p in params]
    return [g if g is not None else p.grad for g, p in zip(out, params)
            if g is not None or p.grad is not None]


def tied_params(modules) -> list[torch.nn.Parameter]:
    """The parameters of ``modules`` marked ``tied_embedding``, in module order."""
    return [p for m in modules for p in m.parameters() if getattr(p, "tied_embedding", False)]


@torch.no_grad()
def reduce_tied_grads(modules, group, grads=None) -> int:
    """Sum over ``group`` (:func:`embedding_group`) the gradients of the tied embedding
    copies of ``modules`` (``grads``: where they live, as for
    :func:`fastpar.tensor_parallel.reduce_replicated_grads`, default each ``main_grad`` or
    ``.grad``; under ZeRO each rank's shard,
    the same slice on both stages since the weight has a bucket of its own); returns the
    elements reduced (0: nothing to do)."""
    params = tied_params(modules)
    if not params:
        return 0
    tensors = [t for t in (grads or _own_grads)(params) if t.numel()]
    if len(params) == 2:        # a V placement: both copies on this rank, summed here
        if len(tensors) == 2:
            tensors[0].add_(tensors[1])
            tensors[1].copy_(tensors[0])
        return sum(t.numel() for t in tensors[:1])
    if group is None or group_size(group) == 1:
        return 0
    for t in tensors:
        collectives.all_reduce(t, group=group)
    return sum(t.numel() for t in tensors)
