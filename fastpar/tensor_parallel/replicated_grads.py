"""Sum the partial gradients of TP-replicated parameters once per step, in one collective.

Under sequence parallelism each TP rank runs the norms, the row-parallel linears' bias add and
the learned positions on its own block of the sequence only, so these parameters, replicated
over TP, get on each rank the gradient of that rank's tokens: a partial sum. The modules mark
them (:func:`fastpar.tensor_parallel.sharding.mark_partial_grads`) and nothing is communicated
during backward: once per step, after the data-parallel gradient sync and before clipping, one
all-reduce over the TP group sums all of them together. That is Megatron-LM's
``finalize_model_grads`` (``_allreduce_layernorm_grads``); an all-reduce inside every backward
would cost 2 L + 1 tiny, latency-bound collectives per micro-batch for L layers (more
with norm and linear biases and learned positions).

A training loop of your own calls it once per step::

    for xm, ym in micro_batches:                 # DataParallel syncs on the last one
        loss_fn(model(xm), ym).backward()
    reduce_replicated_grads([model], mesh.tp_group)
    clip_grad_norm_(...); optimizer.step()

The sum is elementwise, so it commutes with the data-parallel mean: reducing after the DP sync
gives every rank the gradient of the whole global batch. Without sequence parallelism nothing is
marked and nothing is sent.
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch
import torch.nn as nn

from ..mesh import collectives
from ..mesh.groups import Group, group_size
from ..mesh.profiling import span
from .sharding import partial_grad_params

# Where a parameter's gradient lives: a function from the marked parameters to the tensors that
# hold their gradients (whole gradients, or pieces of them, in the same order on every TP rank).
GradsOf = Callable[[list[nn.Parameter]], Sequence[torch.Tensor]]


def param_grads(params: list[nn.Parameter]) -> list[torch.Tensor]:
    """Each parameter's ``main_grad`` (fp32 main gradients of a data-parallel wrapper) if it
    has one, else its ``.grad``; parameters without a gradient are left out."""
    out = []
    for p in params:
        g = getattr(p, "main_grad", None)
        g = p.grad if g is None else g
        if g is not None:
            out.append(g)
    return out


@torch.no_grad()
def reduce_replicated_grads(modules: nn.Module | list[nn.Module], tp_group: Group,
                            grads: GradsOf | None = None) -> int:
    """Sum over ``tp_group`` the gradients of the parameters of ``modules`` marked partial, in
    one all-reduce of one flat buffer; returns the number of elements reduced (0: nothing sent).

    Args:
        modules: the model, or this rank's model chunks (pipeline stages).
        tp_group: the tensor-parallel group; ``None`` or one rank: nothing to do.
        grads: where the gradients live (see ``GradsOf``); default :func:`param_grads`. Under
            fastpar's DataParallel with a DistributedOptimizer, which reads its own buckets
            (under ZeRO-1 this rank's shards of them), pass ``ddp.mean_grad_views``.

    The buffer is in the gradients' widest dtype, at least fp32, so bf16 gradients are summed in
    fp32 and rounded once.
    """
    modules = [modules] if isinstance(modules, nn.Module) else list(modules)
    bad = [type(m).__name__ for m in modules if not isinstance(m, nn.Module)]
    if bad:
        raise ValueError(f"reduce_replicated_grads: modules must be nn.Module(s), got {bad}")
    if group_size(tp_group) == 1:
        return 0
    params = partial_grad_params(modules)
    tensors = list((grads or param_grads)(params)) if params else []
    if not tensors:
        return 0
    dtype = torch.float32
    for t in tensors:
        dtype = torch.promote_types(dtype, t.dtype)
    flat = torch.cat([t.reshape(-1).to(dtype) for t in tensors])
    with span("tp all-reduce of replicated gradients"):
        collectives.all_reduce(flat, group=tp_group)
    pieces = flat.split([t.numel() for t in tensors])
    torch._foreach_copy_(tensors, [piece.view(t.shape) for piece, t in zip(pieces, tensors)])
    return flat.numel()
