"""Small helpers over process groups shared by the parallelisms (a group of None = one process)."""
from __future__ import annotations

import torch.distributed as dist

Group = dist.ProcessGroup | None

# torch 2.13 renamed the tensor-in, tensor-out collectives; keep working on either name.
all_gather_tensor = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_tensor = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def group_size(group: Group) -> int:
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group: Group) -> int:
    return 0 if group is None else dist.get_rank(group)
