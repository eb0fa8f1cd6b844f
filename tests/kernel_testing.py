"""Helpers for the kernel tests: the device they run on, per-dtype tolerances against a float64
reference, random and strided inputs, and poisoned output buffers."""
from __future__ import annotations

import contextlib

import torch

from fastpar.kernels.launch import interpreting

# Kernel tests run the real Triton path on a CUDA device when the interpreter is off
# (TRITON_INTERPRET=0 on a GPU machine), else the interpreter on CPU tensors.
DEVICE = torch.device("cuda" if torch.cuda.is_available() and not interpreting() else "cpu")


@contextlib.contextmanager
def triton_path(monkeypatch):
    """Force the Triton implementation and make :data:`DEVICE` torch's default device."""
    monkeypatch.setenv("FASTPAR_KERNEL_IMPL", "triton")
    previous = torch.get_default_device()
    torch.set_default_device(DEVICE)
    try:
        yield
    finally:
        torch.set_default_device(previous)

# (rtol, atol): atol is scaled by the reference's largest magnitude (at least 1). Kernels compute in
# fp32 and round once to the output dtype, so half an ulp of the dtype plus fp32 noise bounds them.
TOLERANCES = {
    torch.float32: (2e-5, 2e-5),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (1.6e-2, 1.6e-2),
}


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype,
                 name: str = "output", scale: float = 1.0) -> None:
    """Assert ``actual`` (any dtype) matches the float64 ``expected`` within ``dtype``'s
    tolerance (times ``scale``); NaN anywhere fails, matching infinities pass."""
    rtol, atol = TOLERANCES[dtype]
    a, e = actual.detach().double(), expected.detach().double()
    assert a.shape == e.shape, f"{name}: shape {tuple(a.shape)} != {tuple(e.shape)}"
    assert not a.isnan().any(), f"{name}: NaN in the kernel's result"
    finite = e.isfinite()
    assert torch.equal(a[~finite], e[~finite]), f"{name}: non-finite values differ"
    a, e = a[finite], e[finite]
    if e.numel() == 0:
        return
    bound = scale * (rtol * e.abs() + atol * max(e.abs().max().item(), 1.0))
    err = (a - e).abs()
    worst = (err - bound).argmax()
    assert (err <= bound).all(), (f"{name} ({dtype}): max error {err.max().item():.3g}, at "
                                  f"{a[worst].item():.6g} vs {e[worst].item():.6g}")


def randn(*shape: int, dtype: torch.dtype, strided: bool = False, scale: float = 1.0,
          requires_grad: bool = False, generator: torch.Generator | None = None) -> torch.Tensor:
    """Random normal tensor; with ``strided`` it is a view into a wider buffer whose rows are
    padded (last dim contiguous, rows not), so kernels must honour row strides."""
    full = list(shape)
    if strided:
        full[-1] += 7
    t = torch.randn(*full, generator=generator, dtype=torch.float32).mul_(scale).to(dtype)
    if strided:
        t = t[..., : shape[-1]]
    return t.requires_grad_(requires_grad)


def leaf64(t: torch.Tensor) -> torch.Tensor:
    """A float64 leaf copy of ``t`` that requires grad, for the reference."""
    return t.detach().double().requires_grad_(True)


def _poison(t: torch.Tensor) -> torch.Tensor:
    if t.is_floating_point():
        t.fill_(float("nan"))
    elif t.dtype != torch.bool and t.numel():
        t.fill_(-7 if t.is_signed() else 7)
    return t


@contextlib.contextmanager
def poisoned_outputs():
    """Inside the block ``torch.empty`` and ``torch.empty_like`` return NaN-filled tensors (ints:
    -7), so a kernel that leaves part of an output unwritten fails its test."""
    empty, empty_like = torch.empty, torch.empty_like
    torch.empty = lambda *a, **k: _poison(empty(*a, **k))
    torch.empty_like = lambda *a, **k: _poison(empty_like(*a, **k))
    try:
        yield
    finally:
        torch.empty, torch.empty_like = empty, empty_like
