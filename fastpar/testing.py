"""Run a function on N ranks for tests: fresh processes, gloo, a free loopback port each time.

``run_ranks(fn, world_size, *args)`` starts ``world_size`` processes, sets torchrun's environment
(RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT) in each, gives each rank its share of the
cores and the allocator settings of :mod:`fastpar.train.host` (where not set), optionally
initialises a gloo process group, and calls ``fn(rank, world_size, *args)``. It returns the ranks'
return values in rank order (tensors in them come back detached, on the CPU). A rank that raises
fails the run with :class:`RankError`, which carries that rank's number and traceback; ranks that
do not finish within ``timeout`` seconds are killed and fail the run with :class:`RankTimeout`,
naming them. No rank outlives the call. Ranks are forked from a server process started once,
which has imported torch and fastpar (see ``_PRELOAD``).

``count_host_syncs()`` records the calls that would make the host wait for a GPU (``.item()``,
``.tolist()``, ...), for tests that a hot path makes none.
"""
from __future__ import annotations

import contextlib
import ctypes
import multiprocessing as mp
import os
import pickle
import socket
import sys
import time
import traceback
from typing import Any, Callable

from .mesh.layout import require_positive
from .train.host import worker_env

# After one rank fails, the others usually wait on it inside a collective: give them this long to
# report (their own errors are shown too), then kill them.
_GRACE_S = 3.0


class RankError(AssertionError):
    """One or more ranks raised; the message holds each failing rank's traceback."""

    def __init__(self, failures: dict[int, str], pids: list[int]):
        self.failures, self.pids = failures, pids
        parts = [f"--- rank {r} raised ---\n{tb}" for r, tb in sorted(failures.items())]
        super().__init__(f"rank(s) {sorted(failures)} failed:\n" + "\n".join(parts))


class RankTimeout(AssertionError):
    """Ranks did not finish within the timeout; they were killed."""

    def __init__(self, stuck: list[int], timeout: float, pids: list[int]):
        self.stuck, self.pids = stuck, pids
        super().__init__(f"rank(s) {stuck} did not finish within {timeout:g}s and were killed")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# Ranks are forked from one server process that has imported torch and fastpar already (the
# trainer and the plotting its metrics do included, and torch._dynamo, which torch.optim imports
# when the first optimizer is built: 1.3 s of CPU per rank otherwise): a fresh interpreter
# spends seconds of CPU importing them, more than most tests' ranks then compute. The server imports and runs nothing
# else (no thread pool exists to be forked). Its environment is the one it started with, so each
# rank takes the caller's whole environment and applies what is read only at start: the thread
# count and glibc's allocator thresholds (mallopt); fastpar reads its own variables when called.
_PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "fastpar.extension", "fastpar.mesh",
            "fastpar.train.trainer", "matplotlib.pyplot"]
_context = None


def _mp_context():
    global _context
    if _context is None:
        _context = mp.get_context("forkserver")
        _context.set_forkserver_preload(_PRELOAD)
    return _context


def _apply_malloc_env() -> None:
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:                                  # not glibc: the variables mean nothing
        return
    for name, param in (("MALLOC_TRIM_THRESHOLD_", -1), ("MALLOC_MMAP_THRESHOLD_", -3)):
        if os.environ.get(name, "").isdigit():       # M_TRIM_THRESHOLD, M_MMAP_THRESHOLD
            libc.mallopt(param, int(os.environ[name]))


def _child(fn, rank, world_size, port, init_pg, args, queue, env):
    os.environ.clear()
    os.environ.update(env)
    _apply_malloc_env()
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    try:
        import torch
        import torch.distributed as dist

        if os.environ.get("OMP_NUM_THREADS", "").isdigit():
            torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

        if init_pg:
            dist.init_process_group("gloo", rank=rank, world_size=world_size)
        result = fn(rank, world_size, *args)
        if dist.is_initialized():
            # Barrier before destroy: p2p-heavy ranks can abort at exit otherwise.
            dist.barrier()
            dist.destroy_process_group()
        queue.put((rank, "ok", _portable(result)))
    except BaseException:  # noqa: BLE001 - every failure must reach the parent
        queue.put((rank, "error", traceback.format_exc()))
        os._exit(1)
    os._exit(0)  # skip interpreter teardown, which can abort after gloo p2p


def _portable(result) -> bytes:
    """The result as plain pickle bytes, tensors moved to the CPU and detached: the queue's own
    pickler would pass a tensor as shared memory, which is gone once this process has exited."""
    import torch

    def cpu(x):
        if isinstance(x, torch.Tensor):
            return x.detach().cpu().clone()
        if isinstance(x, (list, tuple)):
            return type(x)(cpu(v) for v in x) if not hasattr(x, "_fields") else \
                type(x)(*(cpu(v) for v in x))
        if isinstance(x, dict):
            return {k: cpu(v) for k, v in x.items()}
        return x
    return pickle.dumps(cpu(result))


def _each(rank: int, world_size: int, fn: Callable[..., Any], runs: list) -> dict:
    return {name: fn(rank, world_size, *args) for name, args in runs}


def run_each(fn: Callable[..., Any], world_size: int, runs, timeout: float = 45.0,
             **kwargs: Any) -> dict:
    """``fn(rank, world_size, *args)`` for each ``(name, args)`` of ``runs``, one after another
    on one launch of ``world_size`` ranks (spawned once, not per run): rank 0's results by
    name. ``kwargs`` go to :func:`run_ranks`."""
    return run_ranks(_each, world_size, fn, list(runs), timeout=timeout, **kwargs)[0]


def run_ranks(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 45.0,
              init_pg: bool = True, env: dict[str, str] | None = None) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` spawned ranks; see the module doc.

    ``fn`` and ``args`` must be picklable (a module-level function). ``init_pg=False`` leaves
    torch.distributed uninitialised so ``fn`` can call ``fastpar.init`` itself. ``env`` adds
    environment variables to every rank. The ranks see no GPU (``CUDA_VISIBLE_DEVICES=""``,
    unless ``env`` sets it): they are gloo ranks, and ``fastpar.init`` would otherwise pick NCCL
    on a machine with a GPU per rank.
    """
    require_positive({"world_size": world_size})
    ctx = _mp_context()
    queue = ctx.SimpleQueue()  # unbuffered: a put is on the pipe before the child exits
    port = free_port()
    # As `fastpar train` does: the cores shared out among the ranks, and an allocator that
    # keeps freed memory (fastpar.train.host).
    env = {**worker_env(world_size), "CUDA_VISIBLE_DEVICES": "", **(env or {})}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    procs = []
    try:
        for rank in range(world_size):
            p = ctx.Process(target=_child,
                            args=(fn, rank, world_size, port, init_pg, args, queue,
                                  dict(os.environ)),
                            daemon=True, name=f"fastpar-rank{rank}")
            p.start()
            procs.append(p)
    finally:
        for k, v in saved.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
    pids = [p.pid for p in procs]
    results: dict[int, Any] = {}
    failures: dict[int, str] = {}
    deadline = time.monotonic() + timeout
    first_failure = None
    try:
        while len(results) + len(failures) < world_size:
            now = time.monotonic()
            if now > deadline or (first_failure is not None and now > first_failure + _GRACE_S):
                break
            if queue.empty():
                _note_silent_deaths(procs, results, failures)
                if failures and first_failure is None:
                    first_failure = now
                time.sleep(0.01)
                continue
            rank, status, payload = queue.get()
            if status == "ok":
                results[rank] = pickle.loads(payload)
            else:
                failures[rank] = payload
                first_failure = first_failure or now
    finally:
        _reap(procs)
    if failures:
        raise RankError(failures, pids)
    stuck = [r for r in range(world_size) if r not in results]
    if stuck:
        raise RankTimeout(stuck, timeout, pids)
    return [results[r] for r in range(world_size)]


def _note_silent_deaths(procs, results, failures):
    """A rank that died without reporting (killed, segfault) is a failure too."""
    for rank, p in enumerate(procs):
        if rank not in results and rank not in failures and p.exitcode not in (None, 0):
            failures[rank] = f"process exited with code {p.exitcode} without reporting"


def _reap(procs):
    """Kill whatever is still running and wait for every process, so none is left behind."""
    for p in procs:
        p.join(timeout=0.5 if p.is_alive() else 0)
    for p in procs:
        if p.is_alive():
            p.kill()
    for p in procs:
        p.join()
        p.close()


# Calls that make the host wait for the device on a GPU: reading a value (item, bool(t),
# float(t), int(t), an index, a format, tolist, numpy, a copy to the CPU), data-dependent
# shapes (nonzero, masked_select), comparisons answered on the host (equal, allclose), and
# tensors built from Python lists (copied from pageable memory).
_SYNC_CALLS = {"item", "tolist", "numpy", "cpu", "__bool__", "__float__", "__int__",
               "__index__", "__format__", "equal", "allclose", "nonzero", "masked_select"}
_FROM_LISTS = {"tensor", "as_tensor"}


def _caller() -> str:
    """``file:line`` of the innermost frame outside torch and this file."""
    frame = sys._getframe(2)
    while frame is not None:
        name = frame.f_code.co_filename
        if f"{os.sep}torch{os.sep}" not in name and name != __file__:
            return f"{name}:{frame.f_lineno}"
        frame = frame.f_back
    return "?"


@contextlib.contextmanager
def count_host_syncs():
    """Record every call made in the block (this thread) that would make the host wait for the
    device on a GPU; yields the list, one ``"what at file:line"`` per call.

    On a CPU these calls cost nothing, so a test counts them instead: a hot path that makes
    none never stalls a GPU's launch queue. Python-level calls are seen (through a
    ``torch.overrides.TorchFunctionMode``, which sees torch's own Python code too, e.g. a
    foreach optimizer reading its CPU step counts) and ``Work.wait(timeout)``; every call is
    counted, whatever its tensor's device (on a CPU all are). A C++ kernel's own reads are not
    seen (CPU kernels read their scalars on the host, which is no sync there)."""
    import torch
    from torch.overrides import TorchFunctionMode

    seen: list[str] = []

    class _Count(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            name = getattr(func, "__name__", "")
            if name in _SYNC_CALLS or (name in _FROM_LISTS and args and
                                       isinstance(args[0], (list, tuple))):
                seen.append(f"{name if name not in _FROM_LISTS else name + '(list)'} at "
                            f"{_caller()}")
            return func(*args, **(kwargs or {}))

    work = torch._C._distributed_c10d.Work
    wait = work.wait

    def timed_wait(self, *args, **kwargs):
        if args or kwargs:
            seen.append(f"Work.wait(timeout) at {_caller()}")
        return wait(self, *args, **kwargs)

    work.wait = timed_wait
    try:
        with _Count():
            yield seen
    finally:
        work.wait = wait
