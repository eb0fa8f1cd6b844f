"""The Python face of the C++/CUDA extension fastpar._C: its torch ops (``torch.ops.fastpar.*``).

Registers fake (meta) implementations so torch.compile can trace through them, and gives each op
a typed wrapper that takes a ProcessGroup instead of its name. :class:`EventLog`: the one event
log type, of the ops (:data:`events`) and of data parallelism (``DataParallel.events``).
"""
from __future__ import annotations

import heapq
import time

import torch
import torch.distributed as dist

from . import _C  # noqa: F401  (loading the library registers the ops)

_ops = torch.ops.fastpar


def _size(group_name: str) -> int:
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(group_name).size()


@torch.library.register_fake("fastpar::matmul_allreduce")
def _(x, w, group, chunks):
    return x.new_empty(x.shape[0], w.shape[0])


@torch.library.register_fake("fastpar::allgather_matmul")
def _(x, w, group):
    tp = _size(group)
    return x.new_empty(tp * x.shape[0], w.shape[0]), x.new_empty(tp * x.shape[0], x.shape[1])


@torch.library.register_fake("fastpar::matmul_reducescatter")
def _(x, w, group):
    return x.new_empty(x.shape[0] // _size(group), w.shape[0])


@torch.library.register_fake("fastpar::column_linear_backward")
def _(grad_out, x, w, group, sequence_parallel, need_input_grad, need_weight_grad, chunks):
    rows = grad_out.shape[0] // (_size(group) if sequence_parallel else 1)
    gi = x.new_empty(rows, x.shape[1]) if need_input_grad else x.new_empty(0)
    gw = x.new_empty(w.shape) if need_weight_grad else x.new_empty(0)
    return gi, gw


def _no_record(op: str, group, tensor: torch.Tensor) -> None:
    pass


# Each op below issues collectives inside C++: the wrapper reports it once, with its group and
# input, to the flight recorder, which fastpar.mesh.flight installs here (this floor knows
# nothing of the mesh).
_record = _no_record


def record_collectives(fn) -> None:
    """Have each collective op call ``fn(op_name, group, input)`` before it runs."""
    global _record
    _record = fn


def matmul_allreduce(x: torch.Tensor, w: torch.Tensor, group: dist.ProcessGroup,
                     chunks: int = 4) -> torch.Tensor:
    """all_reduce(x @ w.T) over ``group``, computed and reduced in ``chunks`` row chunks."""
    _record("matmul_allreduce", group, x)
    return _ops.matmul_allreduce(x, w, group.group_name, chunks)


def allgather_matmul(x: torch.Tensor, w: torch.Tensor, group: dist.ProcessGroup):
    """(all_gather(x) @ w.T, all_gather(x)) over ``group``, gathered along rows by a ring."""
    _record("allgather_matmul", group, x)
    return _ops.allgather_matmul(x, w, group.group_name)


def matmul_reducescatter(x: torch.Tensor, w: torch.Tensor,
                         group: dist.ProcessGroup) -> torch.Tensor:
    """reduce_scatter(x @ w.T) over ``group`` along rows, by a ring."""
    _record("matmul_reducescatter", group, x)
    return _ops.matmul_reducescatter(x, w, group.group_name)


def column_linear_backward(grad_out, x, w, group: dist.ProcessGroup, sequence_parallel: bool,
                           need_input_grad: bool = True, need_weight_grad: bool = True,
                           chunks: int = 4):
    """(grad_input, grad_weight) of a column-parallel linear, reductions overlapped; None if unneeded."""
    _record("column_linear_backward", group, grad_out)
    gi, gw = _ops.column_linear_backward(grad_out, x, w, group.group_name, sequence_parallel,
                                         need_input_grad, need_weight_grad, chunks)
    return (gi if need_input_grad else None), (gw if need_weight_grad else None)


class EventLog:
    """(event, index, nanoseconds) tuples recorded while enabled, on one clock for all logs
    (``time.perf_counter_ns``; C++'s ``steady_clock`` on Linux). ``native=True`` (only
    :data:`events`) adds the C++ ops' ``comm_start/pending/ready/done`` of a chunk's collective,
    ``gemm_begin/end`` of its GEMM and ``coll:<op>`` (index: bytes)."""

    def __init__(self, native: bool = False):
        self.native, self.enabled, self._events = native, False, []

    def enable(self, on: bool = True) -> None:
        """Clear the log and switch recording on or off."""
        self._events, self.enabled = [], on
        if self.native:
            _C.trace_enable(on)

    def record(self, name: str, index: int = -1) -> None:
        if self.enabled:
            self._events.append((name, index, time.perf_counter_ns()))

    def take(self) -> list[tuple[str, int, int]]:
        """The recorded events since the last take, oldest first."""
        out, self._events = self._events, []
        return list(heapq.merge(out, _C.trace_take(), key=lambda e: e[2])) if self.native else out


events = EventLog(native=True)          # the C++ ops' overlap log


# Multi-tensor pack / unpack / scale: in-place ops (they return nothing), so the fakes do nothing.
@torch.library.register_fake("fastpar::multi_tensor_pack")
def _(tensors, out, scale):
    return None


@torch.library.register_fake("fastpar::multi_tensor_unpack")
def _(flat, tensors, scale):
    return None


@torch.library.register_fake("fastpar::multi_tensor_scale")
def _(tensors, scale):
    return None


def multi_tensor_pack(tensors: list[torch.Tensor], out: torch.Tensor, scale: float = 1.0) -> None:
    """Write ``tensors`` one after another into the flat ``out``, converted and times ``scale``."""
    _ops.multi_tensor_pack(list(tensors), out, float(scale))


def multi_tensor_unpack(flat: torch.Tensor, tensors: list[torch.Tensor],
                        scale: float = 1.0) -> None:
    """Fill ``tensors`` from consecutive slices of ``flat``, converted and times ``scale``."""
    _ops.multi_tensor_unpack(flat, list(tensors), float(scale))


def multi_tensor_scale(tensors: list[torch.Tensor], scale: float) -> None:
    """Multiply every tensor of the list by ``scale`` in place."""
    _ops.multi_tensor_scale(list(tensors), float(scale))


class CPUMemory:
    """Allocator-level CPU tensor memory, the CPU analogue of ``torch.cuda.memory_allocated`` and
    ``max_memory_allocated``. :meth:`install` puts a counting allocator in place of c10's CPU
    allocator for the rest of the process; every CPU tensor allocated after it is counted until it
    is freed, on whichever thread frees it (gloo's and autograd's too), which the profiler's
    per-thread memory events cannot do. Tensors allocated before the install are not counted.

        CPUMemory.install(); CPUMemory.reset_peak()
        ...; CPUMemory.peak() - base                # bytes
    """

    @staticmethod
    def install() -> None:
        _C.cpu_memory_install()

    @staticmethod
    def installed() -> bool:
        return _C.cpu_memory_installed()

    @staticmethod
    def allocated() -> int:
        return _C.cpu_memory_allocated()

    @staticmethod
    def peak() -> int:
        return _C.cpu_max_memory_allocated()

    @staticmethod
    def reset_peak() -> None:
        _C.cpu_reset_peak_memory()
