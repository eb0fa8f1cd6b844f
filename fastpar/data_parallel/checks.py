"""Wrap-time checks and replica sync for DataParallel.

Local checks raise ``ValueError`` before any collective, so a bad argument fails the same way on
every rank. Then one cheap collective compares a digest of every rank's parameter names, shapes
and dtypes (a second one, on mismatch only, names the difference), and rank 0 of the group
broadcasts its parameters and buffers so every replica starts identical, as torch DDP does.
"""
from __future__ import annotations

import hashlib
import math

import torch
import torch.distributed as dist
import torch.nn as nn

from .. import extension
from ..mesh.groups import Group, group_rank

_FLOAT = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


def resolve_group(dp_group) -> Group:
    """``None`` is the default (world) group when torch.distributed runs, else no group at all."""
    if dp_group is None:
        return dist.group.WORLD if dist.is_available() and dist.is_initialized() else None
    if not isinstance(dp_group, dist.ProcessGroup):
        raise ValueError(f"dp_group must be a torch.distributed ProcessGroup or None, got "
                         f"{type(dp_group).__name__}")
    if dist.get_rank(dp_group) < 0:
        raise ValueError(f"this rank ({dist.get_rank()}) is not a member of dp_group")
    return dp_group


def check_options(module, bucket_cap_mb, reduce_dtype) -> None:
    if not isinstance(module, nn.Module):
        raise ValueError(f"DataParallel wraps an nn.Module, got {type(module).__name__}")
    if bucket_cap_mb is not None and (
            isinstance(bucket_cap_mb, bool) or not isinstance(bucket_cap_mb, (int, float))
            or not math.isfinite(bucket_cap_mb) or bucket_cap_mb <= 0):
        raise ValueError(f"bucket_cap_mb={bucket_cap_mb!r} must be None or a finite number > 0")
    if reduce_dtype is not None and reduce_dtype not in _FLOAT:
        raise ValueError(f"reduce_dtype={reduce_dtype!r} must be None or one of "
                         f"{', '.join(str(d) for d in _FLOAT)}")


def check_params(module: nn.Module, reduce_dtype, device=None) -> list[tuple[str, nn.Parameter]]:
    """The trainable parameters, in registration order; raises on what cannot be bucketed.
    Parameters on the meta device (all or none of them) need ``device`` and ZeRO-3."""
    named = list(module.named_parameters())
    meta = [n for n, p in named if p.is_meta]
    if meta and len(meta) < len(named):
        raise ValueError(f"DataParallel: some parameters are on the meta device ({meta[0]!r}) "
                         f"and others are not ({next(n for n, p in named if not p.is_meta)!r})")
    if meta and device is None:
        raise ValueError("DataParallel: the module was built on the meta device: pass device= "
                         "(where its shards live) and shard it with DistributedOptimizer("
                         "stage=3), then materialize() or load_shards() it")
    if not named:
        raise ValueError(f"DataParallel: the module ({type(module).__name__}) has no parameters: "
                         f"there is nothing to synchronise")
    trainable = [(n, p) for n, p in named if p.requires_grad]
    if not trainable:
        raise ValueError(f"DataParallel: every parameter of the module ({type(module).__name__}) "
                         f"is frozen (requires_grad=False): there is nothing to synchronise")
    devices = {p.device for _, p in named}
    if len(devices) > 1:
        raise ValueError(f"DataParallel: parameters are on several devices "
                         f"{sorted(map(str, devices))}; one replica must live on one device")
    for n, p in trainable:
        if p.is_sparse:
            raise ValueError(f"DataParallel: parameter {n!r} is sparse")
        if p.dtype not in _FLOAT:
            raise ValueError(f"DataParallel: parameter {n!r} has dtype {p.dtype}; trainable "
                             f"parameters must be floating point")
        if reduce_dtype not in (None, p.dtype) and not p.is_contiguous():
            raise ValueError(f"DataParallel: parameter {n!r} is not contiguous, which "
                             f"reduce_dtype={reduce_dtype} (packed buckets) needs")
    return trainable


def _describe(module: nn.Module) -> list[str]:
    return [f"parameter {n}: {tuple(p.shape)} {p.dtype} requires_grad={p.requires_grad}"
            for n, p in module.named_parameters()] + \
        [f"buffer {n}: {tuple(b.shape)} {b.dtype}" for n, b in module.named_buffers()]


def check_same_params(module: nn.Module, group: Group, device) -> None:
    """One all-reduce of a digest of every parameter's and buffer's name, shape and dtype.

    On mismatch every rank raises the same way, naming the first difference.
    """
    lines = _describe(module)
    digest = int.from_bytes(hashlib.sha256("\n".join(lines).encode()).digest()[:7], "little")
    t = torch.tensor([digest, -digest], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    if t.tolist() == [digest, -digest]:
        return
    everyone: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, lines, group=group)
    for r, theirs in enumerate(everyone):
        if theirs != lines:
            diff = next((f"{a!r} here vs {b!r} on dp rank {r}" for a, b in zip(lines, theirs)
                         if a != b),
                        f"{len(lines)} parameters here vs {len(theirs)} on dp rank {r}")
            break
    raise ValueError(f"DataParallel: the module's parameters differ across data-parallel ranks "
                     f"(this is dp rank {group_rank(group)}): {diff}")


@torch.no_grad()
def broadcast_state(module: nn.Module, group: Group, params: bool = True, skip=(),
                    only=None) -> None:
    """Copy dp rank 0's parameters (unless not ``params``) and buffers to every rank: one packed
    broadcast per dtype. ``skip``: ids of parameters left out; ``only``: ids of the only
    parameters sent (and no buffers)."""
    src = dist.get_global_rank(group, 0)
    tensors = ([p.detach() for p in module.parameters() if id(p) not in skip and
                (only is None or id(p) in only)] if params else []) + \
        (list(module.buffers()) if only is None else [])
    if not tensors:
        return
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        if t.dtype in _FLOAT and t.is_contiguous():
            by_dtype.setdefault(t.dtype, []).append(t)
        else:
            c = t.contiguous()                        # rare: integer buffers, strided tensors
            dist.broadcast(c, src=src, group=group)
            t.copy_(c)
    for dtype, ts in by_dtype.items():
        flat = torch.empty(sum(t.numel() for t in ts), dtype=dtype, device=ts[0].device)
        extension.multi_tensor_pack(ts, flat)
        dist.broadcast(flat, src=src, group=group)
        extension.multi_tensor_unpack(flat, ts)


def empty_params(module: nn.Module, device) -> None:
    """Replace every parameter on the meta device by one of its shape and dtype on ``device``
    whose storage is freed (allocated one at a time, so the whole module never is): ZeRO-3
    makes them views of its gather buffers and fills them (``materialize``, ``load_shards``).
    A parameter shared by several modules stays shared; its attributes carry over."""
    done: dict[int, nn.Parameter] = {}
    for m in module.modules():
        for name, p in list(m.named_parameters(recurse=False)):
            if id(p) not in done:
                t = torch.empty(p.shape, dtype=p.dtype, device=device)
                t.untyped_storage().resize_(0)
                done[id(p)] = nn.Parameter(t, requires_grad=p.requires_grad)
                done[id(p)].__dict__.update(p.__dict__)     # its marks (expert_parallel)
            setattr(m, name, done[id(p)])
