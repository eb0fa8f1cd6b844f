"""A gloo work that can be polled, for the overlap probes (tests/test_pp_progress.py,
tests/test_cp_attention.py): a gloo p2p work learns it is done only in a wait, and is waited
exactly once. The first poll starts a thread that waits for it, and ``wait`` then waits for that
thread; unpolled, ``wait`` waits for the work itself."""
import threading


class Pollable:
    def __init__(self, work):
        self.work, self.watch, self.done, self.error = work, None, threading.Event(), None

    def _wait(self):
        try:
            self.work.wait()
        except Exception as e:  # noqa: BLE001 - raised again by wait
            self.error = e
        self.done.set()

    def is_completed(self) -> bool:
        if self.watch is None and not self.done.is_set():
            self.watch = threading.Thread(target=self._wait, daemon=True)
            self.watch.start()
        return self.done.is_set()

    def wait(self, timeout=None) -> bool:
        if self.watch is None:
            self._wait()
        self.done.wait()
        if self.error is not None:
            raise self.error
        return True
