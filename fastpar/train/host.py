"""Environment for ranks that share one host's CPUs, set before they start.

- ``OMP_NUM_THREADS``: each rank gets its share of the cores, as torchrun does; ranks that each
  spin a full thread pool on shared cores run a tiny model's step many times slower.
- glibc's allocator: by default it hands freed memory at the top of the heap back to the OS once
  more than a few MB are free there, so the next step touches fresh pages again (thousands of
  page faults a step, a visible share of a CPU step), and whether that
  happens depends on where each tensor happens to sit in the heap. ``MALLOC_TRIM_THRESHOLD_``
  keeps freed memory in the process (a training step reuses it at once) and
  ``MALLOC_MMAP_THRESHOLD_`` fixes the size from which blocks are mapped one by one at glibc's
  own upper limit (32 MiB). Other allocators ignore both.

A variable that is already set is left as it is.
"""
from __future__ import annotations

import os

_MALLOC = {"MALLOC_TRIM_THRESHOLD_": str(2 ** 30), "MALLOC_MMAP_THRESHOLD_": str(2 ** 25)}


def worker_env(nproc: int) -> dict[str, str]:
    """The variables to add for ``nproc`` ranks on this host (those not set already)."""
    want = {"OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // max(1, nproc))), **_MALLOC}
    return {k: v for k, v in want.items() if k not in os.environ}
