"""Small helpers over process groups shared by the parallelisms (a group of None = one process)."""
from __future__ import annotations

import torch.distributed as dist

# The tensor-in, tensor-out collectives, recorded in the flight recorder (fastpar.mesh.collectives).
from .collectives import all_gather_into_tensor as all_gather_tensor  # noqa: F401
from .collectives import reduce_scatter_tensor  # noqa: F401

Group = dist.ProcessGroup | None


def group_size(group: Group) -> int:
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group: Group) -> int:
    return 0 if group is None else dist.get_rank(group)
