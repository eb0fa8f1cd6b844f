"""What the kernel launchers share: argument checks, 2-D row views, block sizes, program counts,
and launch grids checked against CUDA's limits.

CUDA launches at most 2^31 - 1 programs on grid axis 0 and 65,535 on axes 1 and 2; the Triton
interpreter has no such limit, so every launcher builds its grid with :func:`checked_grid`, and the
elementwise kernels fold their (row block, column block) tiles into axis 0
(:func:`elementwise_grid`, :func:`tile_coords`).
"""
from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

# Programs per grid axis that CUDA accepts: (x, y, z).
MAX_GRID = (2**31 - 1, 65535, 65535)
INT32_MAX = 2**31 - 1

# Programs per SM that the norm backwards launch for their weight-gradient partial sums. A norm
# program holds whole rows (up to ROW_CHUNK columns, 8-16 warps at model widths), so one program
# per SM fills 8-16 of an H100's 64 warp slots and leaves the SM idle while that program waits on
# memory; four give the scheduler other programs to run, as registers allow. The fp32 partial rows
# (4 x 132 SMs = 528 rows of N) stay a small share of the bytes moved: 8.6 MB at N = 4096 against
# 134 MB of bf16 x and dy at 8192 rows.
ROW_REDUCTION_PROGRAMS_PER_SM = 4

# Widest row chunk (elements, a power of two) a row kernel holds in registers at once. Rows up to
# this width are one tile; wider rows loop over chunks of it (norms: one pass per row reduction,
# then the output pass). On sm_90 a whole bf16 row in registers spills above 8192 elements
# (16384: ~200 bytes a thread in the norm backwards; 65536: ~9 KB).
ROW_CHUNK = 8192

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


def row_blocks(n: int) -> tuple[int, int, int, bool]:
    """``(BLOCK_M, BLOCK_N, num_warps, chunked)`` for a row kernel (norms) over rows of ``n``
    elements: the whole row in one tile up to :data:`ROW_CHUNK`, else ``chunked`` with tiles of
    ROW_CHUNK columns that the kernel loops over."""
    BLOCK_N = min(block_n(n, limit=1 << 31), ROW_CHUNK)
    BLOCK_M = rows_per_block(BLOCK_N)
    return BLOCK_M, BLOCK_N, warps_for(BLOCK_M * BLOCK_N), n > BLOCK_N


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


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device; 1 elsewhere (the interpreter runs programs one
    after another, as a single SM would, and the norm backwards still get several programs)."""
    return _sm_count(device.index or 0) if device.type == "cuda" else 1


def reduction_programs(device: torch.device, blocks: int) -> int:
    """Programs for a two-stage reduction over ``blocks`` row blocks: one per SM (a few on CPU,
    so the interpreter still exercises several partial sums). The elementwise backwards
    (bias_gelu, bias_dropout_add) put these on grid axis 1 beside their column blocks on axis 0,
    so their grids already hold several programs per SM; the norms, whose programs hold whole
    rows, use :func:`row_reduction_programs`."""
    width = _sm_count(device.index or 0) if device.type == "cuda" else 4
    return max(1, min(blocks, width))


def check_rows(op: str, M: int, BLOCK_M: int) -> None:
    """One clear error unless the row kernels' int32 row indices hold ``M`` rows: a program's
    rows reach its block start + BLOCK_M - 1, and a row loop's counter one step past ``M - 1``."""
    if M > INT32_MAX + 1 - BLOCK_M:
        raise ValueError(f"{op}: {M} rows exceed the row kernels' int32 row index (at most "
                         f"{INT32_MAX + 1 - BLOCK_M} rows in blocks of {BLOCK_M})")


def row_grid(op: str, M: int, BLOCK_M: int) -> tuple[int]:
    """The grid of a row kernel's forward: one program per block of ``BLOCK_M`` rows."""
    check_rows(op, M, BLOCK_M)
    return checked_grid(op, triton.cdiv(M, BLOCK_M))


def row_reduction_programs(op: str, M: int, BLOCK_M: int, sms: int,
                           per_sm: int = ROW_REDUCTION_PROGRAMS_PER_SM) -> int:
    """Programs P of a norm backward over ``M`` rows in blocks of ``BLOCK_M`` on ``sms`` SMs:
    ``per_sm`` per SM, at most one per row block. Program p owns row blocks p, p + P, ... and
    one fp32 partial row of the weight gradients, so the partial buffer is (P, N). Its row loop
    counts in int32 (start += P * BLOCK_M, up to M - 1 + P * BLOCK_M), so P shrinks where that
    would pass 2^31 - 1."""
    if min(BLOCK_M, sms, per_sm) < 1 or M < 0:
        raise ValueError(f"{op}: a reduction grid needs M >= 0 and BLOCK_M, sms, per_sm >= 1; "
                         f"got M={M}, BLOCK_M={BLOCK_M}, sms={sms}, per_sm={per_sm}")
    check_rows(op, M, BLOCK_M)
    in_int32 = (INT32_MAX + 1 - M) // BLOCK_M
    return max(1, min(triton.cdiv(M, BLOCK_M), sms * per_sm, in_int32))


def elementwise_blocks(n: int) -> tuple[int, int, int]:
    """``(BLOCK_M, BLOCK_N, num_warps)`` for a 2-D elementwise grid over (M, n): column blocks of
    at most 1024, tiles of about :func:`tile_elements`."""
    BLOCK_N = min(block_n(n, limit=1 << 30), 1024)
    BLOCK_M = rows_per_block(BLOCK_N, cap=64)
    return BLOCK_M, BLOCK_N, warps_for(BLOCK_M * BLOCK_N)


def checked_grid(op: str, *programs: int) -> tuple[int, ...]:
    """``programs`` per axis as a launch grid; one clear error if CUDA would refuse it (axis 0
    above 2^31 - 1, axes 1 and 2 above 65,535), which the interpreter would not."""
    if not 1 <= len(programs) <= 3:
        raise ValueError(f"{op}: a launch grid has 1 to 3 axes, got {len(programs)}")
    for axis, (count, limit) in enumerate(zip(programs, MAX_GRID)):
        if count > limit:
            raise ValueError(f"{op}: grid {tuple(programs)} has {count} programs on axis {axis}; "
                             f"CUDA allows at most {limit} there (axis 0: 2^31 - 1, axes 1-2: "
                             "65,535)")
    return tuple(int(c) for c in programs)


def elementwise_grid(op: str, M: int, N: int, BLOCK_M: int, BLOCK_N: int) -> tuple[int]:
    """The 1-D grid of an elementwise kernel over (M, N): every (row block, column block) tile on
    axis 0, unpacked in the kernel by :func:`tile_coords`."""
    return checked_grid(op, triton.cdiv(M, BLOCK_M) * triton.cdiv(N, BLOCK_N))


@triton.jit
def tile_coords(N, BLOCK_N: tl.constexpr):
    """(row block, column block) of this program in an :func:`elementwise_grid` over N columns."""
    pid = tl.program_id(0)
    col_blocks = tl.cdiv(N, BLOCK_N)
    return pid // col_blocks, pid % col_blocks
