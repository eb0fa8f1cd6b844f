"""A watchdog for collectives: a rank that stops taking part makes the job fail with a message
that names the collective, its group and the ranks that did not arrive, on gloo and NCCL alike.

Two ways a stall is noticed:

- A thread of its own on each rank (:class:`.stall_monitor.StallMonitor`, with ``out=``): when
  the rank has issued no collective and begun no step region for ``timeout`` seconds, it dumps
  the rank's flight record (:mod:`fastpar.mesh.flight`) to ``out/hang/rank<N>.json``, has every
  other rank dump its own (through the store), prints the message below and ends the process
  with exit code :data:`STALL_EXIT`. It relies on nothing raising: NCCL collectives return at
  once and never raise in Python, and a rank that stopped (stuck in I/O, a sleep, a deadlock)
  raises nothing either. The process groups wait :func:`group_timeout` (``timeout`` plus a
  margin), so the thread acts before NCCL's own watchdog aborts the process.
- A collective that raises inside a :meth:`Watchdog.region` (on gloo a peer's socket closed,
  or the group's timeout) becomes a :class:`CollectiveTimeoutError`, after the same dump.

To say *who* is missing, before each named region of collectives every rank checks in to the
TCP store that torch.distributed already runs (a few bytes, one round trip): ``(sequence
number, step, region, time)``. All ranks pass the same regions in the same order, so the
sequence numbers line up; the message names the ranks behind this one (and any ahead of it).

    wd = Watchdog(mesh, timeout=60, out="runs/1")
    with wd.region(step, "loss all-reduce", ("dp",)):
        collectives.all_reduce(loss, group=mesh.dp_group)
"""
from __future__ import annotations

import os
import time
import weakref
from contextlib import contextmanager
from pathlib import Path

import torch.distributed as dist

from .flight import recorder
from .stall_monitor import STALL_EXIT, StallMonitor, stall_margin  # noqa: F401 (STALL_EXIT)

# What the collectives of a region over each group are, for the message.
_OPS = {"tp": "tensor-parallel collectives", "pp": "pipeline sends and receives",
        "dp": "gradient reduction", "cp": "context-parallel key/value ring",
        "world": "collective"}


class CollectiveTimeoutError(RuntimeError):
    """A collective did not complete: a peer is dead, stuck, or out of step."""


# How gloo, NCCL and the pipeline's p2p word a collective that timed out or lost its peer (gloo
# raises a plain RuntimeError); anything else (a shape error, a bug) passes through unchanged.
_COMM_WORDS = ("timed out", "timeout", "connection closed", "connection reset", "broken pipe",
               "nccl", "gloo", "did not complete", "peer")


def is_comm_error(e: BaseException) -> bool:
    """Whether ``e`` is a failed collective (not an error of the computation around it)."""
    text = str(e).lower()
    return isinstance(e, dist.DistError) or any(w in text for w in _COMM_WORDS)


def run_prefix() -> str:
    """A store key prefix unique to this attempt of the job (elastic restarts count up)."""
    return f"fastpar/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/"


def default_store() -> dist.Store | None:
    """The store of the default process group (None when torch.distributed is not running)."""
    if not dist.is_initialized():
        return None
    return dist.distributed_c10d._get_default_store()


def group_timeout(timeout: float) -> float:
    """The process groups' timeout for a watchdog of ``timeout`` seconds (see the module doc)."""
    return float(timeout) + stall_margin(timeout)


def dump_dir(out) -> Path:
    """Where the ranks of a run in folder ``out`` dump their flight records on a stall."""
    return Path(out) / "hang"


def nccl_debug_env(trace_prefix: str | None = None) -> dict[str, str]:
    """The environment that turns on NCCL's watchdog and flight recorder; set before the NCCL
    process group exists. On a timeout each rank dumps its last collectives to
    ``{trace_prefix}{rank}``; read them with ``torchfrtrace DIR --prefix NAME``."""
    env = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",     # abort the communicator, fail the job
           "TORCH_NCCL_TRACE_BUFFER_SIZE": "2000",     # collectives kept per rank
           "TORCH_NCCL_DUMP_ON_TIMEOUT": "1"}
    if trace_prefix:
        env["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"] = trace_prefix
    return env


class Watchdog:
    """Check-ins, failure messages and (with ``out``) the stall thread of one rank (see the
    module doc). The thread stops with :meth:`close`, when the watchdog is garbage-collected,
    or once an exception has left one of its regions."""

    def __init__(self, mesh, timeout: float, store: dist.Store | None = None, out=None):
        self.mesh, self.timeout = mesh, float(timeout)
        self.store = store if store is not None else default_store()
        self.prefix = run_prefix() + "checkin/"
        self.seq = 0
        self.enabled = self.store is not None and mesh.world_size > 1
        self.current: tuple | None = None       # (step, what, dims) of the region running
        self.last: tuple = (0, "the start")     # (step, what) of the last check-in
        self.armed = True
        self.monitor = None
        if dist.is_initialized():
            recorder.name_groups({"tp": mesh.tp_group, "cp": mesh.cp_group,
                                  "dp": mesh.dp_group, "pp": mesh.pp_group,
                                  "dp-cp": mesh.dp_cp_group})
        recorder.mark(0)
        if out is not None and self.enabled:
            self.monitor = StallMonitor(self, dump_dir(out), run_prefix() + "hang/")
            self.monitor.start()
            weakref.finalize(self, self.monitor.stop.set)

    def close(self) -> None:
        """Stop watching for stalls (the end of training)."""
        self.armed = False
        if self.monitor is not None:
            self.monitor.stop.set()

    def check_in(self, step: int, what: str) -> None:
        self.seq += 1
        self.last = (step, what)
        recorder.mark(step)
        if self.enabled:
            self.store.set(f"{self.prefix}{self.mesh.rank}",
                           f"{self.seq}|{step}|{what}|{time.time():.3f}")

    @contextmanager
    def region(self, step: int, what: str, dims: tuple[str, ...] = ("world",)):
        """Check in, run the body; a failed collective inside becomes a
        :class:`CollectiveTimeoutError` naming ``what``, the groups ``dims`` and the missing
        (after dumping this rank's record, with ``out``)."""
        self.check_in(step, what)
        self.current = (step, what, dims)
        try:
            yield
        except CollectiveTimeoutError:
            self.armed = False
            raise
        except RuntimeError as e:
            self.armed = False
            if not self.enabled or not is_comm_error(e):
                raise
            if self.monitor is not None and self.monitor.fired:
                # A peer left after this rank's stall thread said why, and the thread is
                # ending the process: one message, not two.
                self.monitor.join()
            message = self.describe(step, what, dims, e)
            if self.monitor is not None:
                self.monitor.dump("a collective failed", message, self.store)
                self.monitor.alarm(self.store)
            raise CollectiveTimeoutError(message) from None
        except BaseException:
            self.armed = False
            raise
        finally:
            self.current = None

    def _peers(self, store) -> dict[int, tuple[int, int, str, float] | None]:
        """Every rank's last check-in (None: none yet); raises if the store is unreachable."""
        out = {}
        for r in range(self.mesh.world_size):
            key = f"{self.prefix}{r}"
            if not store.check([key]):
                out[r] = None
                continue
            seq, step, what, t = store.get(key).decode().split("|", 3)
            out[r] = (int(seq), int(step), what, float(t))
        return out

    def _group(self, dim: str) -> list[int]:
        if dim == "world":
            return list(range(self.mesh.world_size))
        return self.mesh.group_ranks(dim)

    def describe(self, step: int, what: str, dims, error, store=None) -> str:
        """The message for region ``what`` of ``step`` stuck in the groups ``dims``; ``error``
        (an exception or a sentence) is its cause. ``store``: the one to read check-ins from
        (default: this watchdog's; a thread passes its own clone)."""
        text = str(error).strip()
        cause = text.splitlines()[0] if text else type(error).__name__
        groups = {d: self._group(d) for d in dims if len(self._group(d)) > 1} or \
            {"world": self._group("world")}
        head = (f"rank {self.mesh.rank}, step {step}: {what} did not complete within "
                f"{self.timeout:g}s")
        try:
            peers = self._peers(store or self.store)
        except Exception as e:  # noqa: BLE001 - the store's host may be the rank that died
            return (f"{head}, stuck in the {_name_groups(groups)}; the store that tracks "
                    f"the ranks is unreachable too ({e}), so its host (rank 0 or the launcher) "
                    f"is down. Cause: {cause}")
        now = time.time()
        behind = {r: c for r, c in peers.items() if r != self.mesh.rank
                  and (c is None or c[0] < self.seq)}
        ahead = {r: c for r, c in peers.items() if c is not None and c[0] > self.seq}
        stuck = {d: g for d, g in groups.items() if any(r in behind for r in g)}
        if stuck:
            missing = sorted({r for g in stuck.values() for r in g if r in behind})
            who = "; ".join(_last_seen(r, behind[r], now) for r in missing)
            tail = f"; rank(s) {missing} did not arrive ({who})"
        elif behind:
            stuck = groups
            who = "; ".join(_last_seen(r, c, now) for r, c in sorted(behind.items()))
            tail = f"; every rank of it arrived; behind elsewhere: {who}"
        elif ahead:
            stuck = groups
            who = "; ".join(_last_seen(r, c, now) for r, c in sorted(ahead.items()))
            tail = (f"; rank(s) {sorted(ahead)} went past it without completing it, so they "
                    f"skipped it or issued another collective ({who})")
        else:
            stuck = groups
            tail = ("; every rank checked in to it, so a peer is stuck, slow or dead inside "
                    "it (see that rank's log)")
        return f"{head}, stuck in the {_name_groups(stuck)}{tail}. Cause: {cause}"

    def stall_message(self, idle: float, store) -> str:
        """The message of the stall thread after ``idle`` seconds without progress."""
        cause = f"no collective issued for {idle:.1f}s (the stall watchdog)"
        if self.current is not None:
            step, what, dims = self.current
            return self.describe(step, what, dims, cause, store)
        step, what = self.last
        head = (f"rank {self.mesh.rank}, after step {step} ('{what}'): no collective issued "
                f"and no step begun for {idle:.1f}s (the limit is {self.timeout:g}s)")
        try:
            peers = self._peers(store)
        except Exception:  # noqa: BLE001 - the store's host is gone
            return head
        ahead = {r: c for r, c in peers.items() if c is not None and c[0] > self.seq}
        if not ahead:
            return f"{head}; no rank is past it"
        now = time.time()
        who = "; ".join(_last_seen(r, c, now) for r, c in sorted(ahead.items()))
        return f"{head}; rank(s) {sorted(ahead)} went on and wait for it ({who})"


def _name_groups(groups: dict[str, list[int]]) -> str:
    return ", ".join(f"{_OPS[d]} over the {d} group (ranks {g})" for d, g in groups.items())


def _last_seen(rank: int, checkin, now: float) -> str:
    if checkin is None:
        return f"rank {rank} never checked in"
    _, step, what, t = checkin
    return f"rank {rank} was last at step {step}, '{what}', {now - t:.1f}s ago"
