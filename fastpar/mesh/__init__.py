"""The rank layout, the mesh of process groups, the collective watchdog, profiler ranges."""
from .layout import Coords, Layout, layout
from .mesh import Mesh, init

__all__ = ["Coords", "Layout", "Mesh", "init", "layout"]
