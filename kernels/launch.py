"""What the kernel launchers share: argument checks, 2-D row views, block sizes, program counts."""
from __future__ import annotations

import functools
import os

import torch
import triton

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def interpreting() -> bool:
    """True when Triton runs its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def check_float(op: str, **tensors: torch.Tensor | None) -> None:
    """Raise one clear error unless every given tensor is fp16, bf16 or fp32 on one device."""
    devices = set()
    for name, t in tensors.items():
        if t is None:
            continue
        if t.dtype not in FLOAT_DTYPES:
            raise ValueError(f"{op}: {name} has dtype {t.dtype}; the Triton kernel takes "
                             "float16, bfloat16 or float32")
        devices.add(t.device)
    if len(devices) > 1:
        raise ValueError(f"{op}: tensors are on different devices {sorted(map(str, devices))}")


def rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` as an (M, N) matrix over its last dim whose rows may be strided but whose last dim
    is contiguous: a view when torch can make one, else a copy."""
    t2 = t.reshape(-1, t.shape[-1]) if t.dim() != 2 else t
    if t2.shape[-1] > 1 and t2.stride(-1) != 1:
        t2 = t2.contiguous()
    return t2


def row_stride(t2: torch.Tensor) -> int:
    """Stride between rows of a matrix from :func:`rows` (any value works for a single row)."""
    return t2.stride(0) if t2.shape[0] > 1 else t2.shape[1]


def block_n(n: int, limit: int = 65536) -> int:
    """A power-of-two block that covers a row of ``n`` elements (at least 16)."""
    b = max(16, triton.next_power_of_2(n))
    if b > limit:
        raise ValueError(f"rows of {n} elements exceed the kernel's limit of {limit}")
    return b


def tile_elements() -> int:
    """Elements per tile of the row and elementwise kernels: 4096 on a GPU; more under the
    interpreter, whose cost is per program and per op rather than per element."""
    return 16384 if interpreting() else 4096


def rows_per_block(block: int, cap: int = 16) -> int:
    """Rows handled together so a tile holds about :func:`tile_elements` elements."""
    return max(1, min(cap, tile_elements() // block))


def warps_for(elements: int) -> int:
    """num_warps for a tile of ``elements``: about 16 elements per thread, 1 to 16 warps."""
    return max(1, min(16, triton.next_power_of_2(max(1, elements // 512))))


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def reduction_programs(device: torch.device, blocks: int) -> int:
    """Programs for a two-stage reduction over ``blocks`` row blocks: one per SM (a few on CPU,
    so the interpreter still exercises several partial sums)."""
    width = _sm_count(device.index or 0) if device.type == "cuda" else 4
    return max(1, min(blocks, width))


def elementwise_blocks(n: int) -> tuple[int, int, int]:
    """``(BLOCK_M, BLOCK_N, num_warps)`` for a 2-D elementwise grid over (M, n): column blocks of
    at most 1024, tiles of about :func:`tile_elements`."""
    BLOCK_N = min(block_n(n, limit=1 << 30), 1024)
    BLOCK_M = rows_per_block(BLOCK_N, cap=64)
    return BLOCK_M, BLOCK_N, warps_for(BLOCK_M * BLOCK_N)
