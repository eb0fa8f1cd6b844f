"""The stall thread of a :class:`~fastpar.mesh.watchdog.Watchdog`: one daemon thread per rank
that ends a rank which stopped progressing, after dumping its flight record.

Every ``poll`` seconds (a tenth of the timeout, at most one second) it reads when the flight
recorder last advanced (a collective issued, or a step region begun). After ``timeout`` seconds
without progress it

1. writes this rank's record (the last entries of each group, :mod:`fastpar.mesh.flight`) to
   ``<out>/hang/rank<N>.json``, atomically;
2. sets an alarm key in the store: every other rank's thread sees it at its next poll and dumps
   its own record (the ranks that wait for this one have issued more, and only together do the
   records say who diverged where);
3. prints one line (the watchdog's message: the region, its group, the ranks behind or ahead);
4. waits a few seconds for the other ranks' dumps, then ends the process with exit code
   ``STALL_EXIT`` (the launcher then reads the dumps: :mod:`fastpar.mesh.flight_report`).

The thread needs the GIL only while it runs, which it gets whenever the main thread sleeps or
waits in torch: ``time.sleep``, a gloo wait, a CUDA synchronisation and NCCL calls all release
it. It talks to the store through a clone of its own (a store object is not shared across
threads), so the main thread's store calls never wait for it.
"""
from __future__ import annotations

import os
import sys
import threading
import time
import weakref
from datetime import timedelta
from pathlib import Path

from .flight import recorder, write_dump

STALL_EXIT = 124        # a rank's exit code when its watchdog ended it (as timeout(1)'s)


def stall_margin(timeout: float) -> float:
    """Seconds the process groups wait beyond ``timeout``: the stall thread's time to notice
    (one poll), dump, and wait for the other ranks' dumps, before NCCL would abort."""
    return 15.0 + 0.1 * float(timeout)


class StallMonitor(threading.Thread):
    """The stall thread of one watchdog (see the module doc); holds it weakly. ``folder``: where
    to dump; ``prefix``: the store keys of this attempt of the job."""

    def __init__(self, watchdog, folder: Path, prefix: str):
        super().__init__(name=f"fastpar-stall-{watchdog.mesh.rank}", daemon=True)
        self._watchdog = weakref.ref(watchdog)
        self.rank, self.world = watchdog.mesh.rank, watchdog.mesh.world_size
        self.timeout = watchdog.timeout
        self.poll = min(1.0, self.timeout / 10)
        self.path = Path(folder) / f"rank{self.rank}.json"
        self.prefix = prefix
        self.store = watchdog.store.clone()
        self.store.set_timeout(timedelta(seconds=max(self.poll * 4, 2.0)))
        self.stop = threading.Event()
        self.dumped = False
        self.fired = False          # set once this thread is ending the process
        self._lock = threading.Lock()

    def run(self) -> None:
        while not self.stop.wait(self.poll):
            wd = self._watchdog()
            if wd is None:
                return
            if wd.armed:
                idle = time.time() - recorder.last
                if idle >= self.timeout:
                    self._stalled(wd, idle)
                elif not self.dumped and self._alarm_set():
                    try:
                        self.dump("another rank stalled", wd.stall_message(idle, self.store),
                                  self.store)
                    except Exception:  # noqa: BLE001 - keep watching this rank regardless
                        self.dumped = True
            del wd

    def _alarm_set(self) -> bool:
        try:
            return self.store.check([self.prefix + "alarm"])
        except Exception:  # noqa: BLE001 - the store's host is gone: nothing to coordinate
            return False

    def alarm(self, store) -> None:
        """Have every other rank dump its record (``store``: the calling thread's)."""
        try:
            store.set(self.prefix + "alarm", str(self.rank))
        except Exception:  # noqa: BLE001 - the store's host is gone: nobody else will dump
            pass

    def dump(self, reason: str, message: str, store) -> str:
        """Write this rank's record (``reason``: why; ``message``: the watchdog's line) and
        count it in ``store`` the first time (the store of the calling thread). Returns where
        it is, or why it is not (a dump that cannot be written must not stop the rest)."""
        with self._lock:
            try:
                where = str(write_dump(self.path, {
                    "rank": self.rank, "world_size": self.world,
                    "run_id": os.environ.get("TORCHELASTIC_RUN_ID"),
                    "attempt": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
                    "reason": reason, "message": message, "time": time.time(),
                    "idle_s": round(time.time() - recorder.last, 3), "timeout_s": self.timeout,
                    "step": recorder.step, **recorder.snapshot()}))
            except (OSError, TypeError, ValueError) as e:
                where = f"not written ({e})"
            first, self.dumped = not self.dumped, True
        if first:
            try:
                store.add(self.prefix + "dumped", 1)
            except Exception:  # noqa: BLE001 - the store's host is gone
                pass
        return where

    def _stalled(self, wd, idle: float) -> None:
        """Dump, raise the alarm, say why, wait for the others' dumps, end the process (whatever
        of that fails)."""
        self.fired = True
        try:
            message = wd.stall_message(idle, self.store)
            where = self.dump("stalled", message, self.store)
            # One write: the lines of ranks failing together must not interleave on stderr.
            sys.stderr.flush()
            os.write(2, f"fastpar: error: {message}. This rank's record: {where}\n".encode())
            self.alarm(self.store)
            deadline = time.time() + min(10.0, stall_margin(self.timeout) / 2)
            while time.time() < deadline and \
                    self.store.add(self.prefix + "dumped", 0) < self.world:
                time.sleep(0.05)
        except Exception:  # noqa: BLE001 - e.g. the store's host is gone: nobody else will dump
            pass
        finally:
            sys.stderr.flush()
            os._exit(STALL_EXIT)
