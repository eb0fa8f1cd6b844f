"""fastpar: 3D-parallel (tensor, pipeline, data) Transformer training that hides communication."""
import torch  # noqa: F401  (the extension links against torch: import it first)

from . import _C
from . import extension  # noqa: F401  (registers the fake implementations of the torch ops)
from .mesh import Coords, Layout, Mesh, init, layout

__version__ = "0.1.0"
__all__ = ["Coords", "Layout", "Mesh", "__version__", "init", "layout", "_C"]
