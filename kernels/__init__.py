"""fastpar.kernels: Triton kernels for the hot paths, each beside its torch reference.

Every op picks its implementation through :func:`impl_for`: Triton for CUDA tensors, the torch
reference otherwise. ``FASTPAR_KERNEL_IMPL=triton`` forces Triton (on CPU that needs
``TRITON_INTERPRET=1``), ``FASTPAR_KERNEL_IMPL=torch`` forces the reference.
"""
from .dispatch import impl_for

__all__ = ["impl_for"]
