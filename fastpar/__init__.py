"""fastpar: 3D-parallel (tensor, pipeline, data) Transformer training that hides communication.

The package imports torch and the extension on first use of what needs them (``fastpar.init``,
``fastpar._C``, ...), not on ``import fastpar``: the ``fastpar`` command installs its signal
handling before anything heavy loads, so Ctrl-C during start-up is one line, not a traceback."""
import importlib

__version__ = "0.1.0"
__all__ = ["Coords", "Layout", "Mesh", "__version__", "init", "layout", "_C"]

_FROM_MESH = ("Coords", "Layout", "Mesh", "init", "layout")


def __getattr__(name: str):
    if name in ("_C", "extension"):
        import torch  # noqa: F401  (the extension links against torch: import it first)

        # extension.py loads _C and registers the fake implementations of its torch ops
        module = importlib.import_module(".extension", __name__)
        return module if name == "extension" else importlib.import_module("._C", __name__)
    if name in _FROM_MESH:
        importlib.import_module(".extension", __name__)     # the ops, as an eager import had
        return getattr(importlib.import_module(".mesh", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
