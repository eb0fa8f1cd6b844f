"""Floor 2: the rank layout, the mesh of process groups, and (later) collectives and p2p."""
from .layout import Coords, Layout, layout
from .mesh import Mesh, init

__all__ = ["Coords", "Layout", "Mesh", "init", "layout"]
