"""The rank layout and parallel configuration, the mesh of process groups, the collective watchdog."""
from .layout import Coords, Layout, ParallelConfig, layout
from .mesh import Mesh, init

__all__ = ["Coords", "Layout", "Mesh", "ParallelConfig", "init", "layout"]
