"""Choose between a kernel's Triton implementation and its torch reference."""
from __future__ import annotations

import os

import torch

_CHOICES = ("auto", "triton", "torch")


def impl_for(*tensors: torch.Tensor) -> str:
    """``"triton"`` or ``"torch"`` for an op on ``tensors`` (see the package docstring)."""
    choice = os.environ.get("FASTPAR_KERNEL_IMPL", "auto").lower()
    if choice not in _CHOICES:
        raise ValueError(f"FASTPAR_KERNEL_IMPL={choice!r} must be one of {_CHOICES}")
    if choice == "torch":
        return "torch"
    if choice == "triton":
        on_cpu = any(not t.is_cuda for t in tensors)
        if on_cpu and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError("FASTPAR_KERNEL_IMPL=triton on CPU tensors needs TRITON_INTERPRET=1")
        return "triton"
    return "triton" if tensors and all(t.is_cuda for t in tensors) else "torch"
