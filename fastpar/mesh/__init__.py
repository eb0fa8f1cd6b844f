"""The rank layout, the mesh of process groups, the collective watchdog, profiler ranges."""
from .layout import Coords, Layout, layout
from .mesh import Mesh, hsdp_groups, init

__all__ = ["Coords", "Layout", "Mesh", "hsdp_groups", "init", "layout"]
