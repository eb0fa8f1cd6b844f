"""A watchdog for collectives: a rank that stops taking part makes the others fail with a message
that names the collective, its group and the ranks that did not arrive, instead of hanging.

The process groups carry the timeout (``fastpar.init(timeout=...)``): on gloo a collective that
waits longer raises, on NCCL the watchdog thread aborts the communicator (see
:func:`nccl_debug_env`). What neither says is *who* is missing. So before each named region of
collectives every rank checks in to the TCP store that torch.distributed already runs (a few
bytes, one round trip): ``(sequence number, step, region, time)``. All ranks pass the same
regions in the same order, so the sequence numbers line up; when a collective of a region
fails, this rank reads its peers' check-ins and names those behind it.

    wd = Watchdog(mesh, timeout=60)
    with wd.region(step, "loss all-reduce", ("dp",)):
        dist.all_reduce(loss, group=mesh.dp_group)
"""
from __future__ import annotations

import os
import time
from contextlib import contextmanager

import torch.distributed as dist

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
    """Check-ins and failure messages for the collectives of one rank (see the module doc)."""

    def __init__(self, mesh, timeout: float, store: dist.Store | None = None):
        self.mesh, self.timeout = mesh, float(timeout)
        self.store = store if store is not None else default_store()
        self.prefix = run_prefix() + "checkin/"
        self.seq = 0
        self.enabled = self.store is not None and mesh.world_size > 1

    def check_in(self, step: int, what: str) -> None:
        self.seq += 1
        if self.enabled:
            self.store.set(f"{self.prefix}{self.mesh.rank}",
                           f"{self.seq}|{step}|{what}|{time.time():.3f}")

    @contextmanager
    def region(self, step: int, what: str, dims: tuple[str, ...] = ("world",)):
        """Check in, run the body; a failed collective inside becomes a
        :class:`CollectiveTimeoutError` naming ``what``, the groups ``dims`` and the missing."""
        self.check_in(step, what)
        try:
            yield
        except CollectiveTimeoutError:
            raise
        except RuntimeError as e:
            if not self.enabled or not is_comm_error(e):
                raise
            raise CollectiveTimeoutError(self.describe(step, what, dims, e)) from None

    def _peers(self) -> dict[int, tuple[int, int, str, float] | None]:
        """Every rank's last check-in (None: none yet); raises if the store is unreachable."""
        out = {}
        for r in range(self.mesh.world_size):
            key = f"{self.prefix}{r}"
            if not self.store.check([key]):
                out[r] = None
                continue
            seq, step, what, t = self.store.get(key).decode().split("|", 3)
            out[r] = (int(seq), int(step), what, float(t))
        return out

    def _group(self, dim: str) -> list[int]:
        if dim == "world":
            return list(range(self.mesh.world_size))
        return self.mesh.group_ranks(dim)

    def describe(self, step: int, what: str, dims, error: BaseException) -> str:
        cause = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        groups = {d: self._group(d) for d in dims if len(self._group(d)) > 1} or \
            {"world": self._group("world")}
        head = (f"rank {self.mesh.rank}, step {step}: {what} did not complete within "
                f"{self.timeout:g}s")
        try:
            peers = self._peers()
        except Exception as e:  # noqa: BLE001 - the store's host may be the rank that died
            return (f"{head}, stuck in the {_name_groups(groups)}; the store that tracks "
                    f"the ranks is unreachable too ({e}), so its host (rank 0 or the launcher) "
                    f"is down. Cause: {cause}")
        now = time.time()
        behind = {r: c for r, c in peers.items() if r != self.mesh.rank
                  and (c is None or c[0] < self.seq)}
        stuck = {d: g for d, g in groups.items() if any(r in behind for r in g)}
        if stuck:
            missing = sorted({r for g in stuck.values() for r in g if r in behind})
            who = "; ".join(_last_seen(r, behind[r], now) for r in missing)
            tail = f"; rank(s) {missing} did not arrive ({who})"
        elif behind:
            stuck = groups
            who = "; ".join(_last_seen(r, c, now) for r, c in sorted(behind.items()))
            tail = f"; every rank of it arrived; behind elsewhere: {who}"
        else:
            stuck = groups
            tail = ("; every rank checked in to it, so a peer is stuck, slow or dead inside "
                    "it (see that rank's log)")
        return f"{head}, stuck in the {_name_groups(stuck)}{tail}. Cause: {cause}"


def _name_groups(groups: dict[str, list[int]]) -> str:
    return ", ".join(f"{_OPS[d]} over the {d} group (ranks {g})" for d, g in groups.items())


def _last_seen(rank: int, checkin, now: float) -> str:
    if checkin is None:
        return f"rank {rank} never checked in"
    _, step, what, t = checkin
    return f"rank {rank} was last at step {step}, '{what}', {now - t:.1f}s ago"

