"""The rank layout, the mesh of process groups, the collective watchdog, profiler ranges."""
from .layout import Coords, Layout, layout
from .mesh import Mesh, ep_groups, ep_ranks, hsdp_expert_group, hsdp_groups, init

__all__ = ["Coords", "Layout", "Mesh", "ep_groups", "ep_ranks", "hsdp_expert_group", "hsdp_groups", "init", "layout"]
