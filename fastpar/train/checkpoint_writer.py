"""Writing checkpoints: atomically, with checksums, optionally off the training thread, keeping
the last N.

A save has three parts. (1) On the training thread each rank takes a :func:`snapshot` of its
files (with ``async_save`` a CPU copy of every tensor, so training can go on). (2) Each rank
writes its files into ``step_N.tmp-K`` (K: this save's number, the same on every rank), records
their sizes and sha256 and checks in to the store. (3) Rank 0 waits for every rank, writes
``manifest.json`` with all the checksums, renames the folder to ``step_N`` (atomic), points
``latest`` at it, deletes what retention drops and any partial folder, and checks in "committed";
the other ranks wait for that. Parts 2 and 3 coordinate through the TCP store, not through
collectives, so they can run on a background thread while the training thread runs its own
collectives. A save killed at any point leaves a ``.tmp-K`` folder that loading ignores and the
next commit deletes; the previous checkpoint is untouched.
"""
from __future__ import annotations

import json
import os
import shutil
import threading
from datetime import timedelta
from pathlib import Path

from safetensors.torch import save_file

from ..mesh.watchdog import CollectiveTimeoutError, default_store, run_prefix
from .checkpoint import complete_checkpoints, file_digest, snapshot


class CheckpointWriter:
    """Saves checkpoints under ``root`` for this rank (every rank holds one).

    ``keep_last``: keep only the newest N complete checkpoints (0 keeps all). ``async_save``:
    :meth:`save` returns once the tensors are copied; the files are written on a background
    thread, and the next save or :meth:`wait` waits for them. ``timeout``: seconds a rank waits
    for the others to finish writing. ``before_commit(step)`` runs on every rank after its files
    are written (a hook for the fault-injection tests).
    """

    def __init__(self, root, mesh, keep_last: int = 0, async_save: bool = False,
                 timeout: float = 600.0, before_commit=None):
        self.root, self.mesh = Path(root), mesh
        self.keep_last, self.async_save, self.timeout = keep_last, async_save, timeout
        self.before_commit = before_commit
        self.rank = mesh.rank if mesh is not None else 0
        self.world = mesh.world_size if mesh is not None else 1
        self.store = default_store() if self.world > 1 else None
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self.last: Path | None = None         # the newest checkpoint this writer committed

    def save(self, step: int, modules, optimizer, manifest: dict,
             rank_tensors: dict | None = None) -> Path:
        """Save the state of ``step``; returns the path it will have once complete."""
        self.wait()
        files = snapshot(modules, optimizer, self.mesh, rank_tensors, copy=self.async_save)
        key = self._key()
        # A sharded optimizer's state is saved as each rank's flat ranges of its parameters
        # (see checkpoint); "zero1" marked an older format of per-rank shard files.
        manifest = dict(manifest, step=step, zero1=False)
        if self.async_save:
            self._thread = threading.Thread(target=self._run, args=(step, files, manifest, key),
                                            name=f"fastpar-save-{step}", daemon=True)
            self._thread.start()
        else:
            self._write(step, files, manifest, key)
        return self.root / f"step_{step}"

    def wait(self) -> Path | None:
        """Wait for the save in flight (if any); re-raises its error. Returns the last path."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise error
        return self.last

    def _key(self) -> str:
        """Store keys of this save: the same on every rank (all ranks save in the same order)."""
        if self.store is None:
            return ""
        n = self.store.add(f"{run_prefix()}ckpt/count/{self.rank}", 1)
        return f"{run_prefix()}ckpt/{n}/"

    def _run(self, *args) -> None:
        try:
            self._write(*args)
        except BaseException as e:  # noqa: BLE001 - re-raised on the training thread
            self._error = e

    def _write(self, step: int, files: dict, manifest: dict, key: str) -> None:
        tmp = self.root / f"step_{step}.tmp-{key.split('/')[-2] if key else 0}"
        tmp.mkdir(parents=True, exist_ok=True)
        sums = {}
        for name, content in files.items():
            if isinstance(content, str):
                (tmp / name).write_text(content)
            else:
                save_file(content, str(tmp / name))
            sums[name] = file_digest(tmp / name)
        (tmp / f"sums_rank{self.rank}.json").write_text(json.dumps(sums))
        if self.before_commit is not None:
            self.before_commit(step)
        wait = timedelta(seconds=self.timeout)
        if self.store is not None:
            self.store.set(f"{key}written/{self.rank}", "1")
        if self.rank == 0:
            if self.store is not None:
                self._wait_for([f"{key}written/{r}" for r in range(self.world)], wait,
                               f"every rank to write its part of checkpoint step {step}")
            self._commit(step, tmp, manifest)
            if self.store is not None:
                self.store.set(f"{key}committed", "1")
        else:
            self._wait_for([f"{key}committed"], wait, f"rank 0 to commit checkpoint step {step}")
        self.last = self.root / f"step_{step}"

    def _wait_for(self, keys: list[str], timeout: timedelta, what: str) -> None:
        try:
            self.store.wait(keys, timeout)
        except Exception as e:  # noqa: BLE001 - a store timeout or a lost store host
            try:
                missing = [k.rsplit("/", 1)[-1] for k in keys if not self.store.check([k])]
            except Exception:  # noqa: BLE001 - the store's host is gone
                missing = "unknown, the store is unreachable"
            raise CollectiveTimeoutError(f"rank {self.rank}: waited {timeout.total_seconds():g}s "
                                         f"for {what}; still missing: {missing} ({e})") \
                from None

    def _commit(self, step: int, tmp: Path, manifest: dict) -> None:
        """Rank 0: the manifest with every file's checksum, the rename, retention, clean-up."""
        files = {}
        for r in range(self.world):
            part = tmp / f"sums_rank{r}.json"
            files.update(json.loads(part.read_text()))
            part.unlink()
        manifest["files"] = dict(sorted(files.items()))
        (tmp / "manifest.json").write_text(json.dumps(manifest, indent=2))
        final = self.root / f"step_{step}"
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        (self.root / "latest.tmp").write_text(final.name)
        os.replace(self.root / "latest.tmp", self.root / "latest")
        for partial in self.root.glob("step_*.tmp-*"):      # from saves that were killed
            shutil.rmtree(partial, ignore_errors=True)
        if self.keep_last:
            for old in complete_checkpoints(self.root)[:-self.keep_last]:
                if old != final:
                    shutil.rmtree(old, ignore_errors=True)


def save_checkpoint(root, step: int, modules, optimizer, mesh, manifest: dict,
                    rank_tensors: dict | None = None) -> Path:
    """Write ``root/step_{step}`` now (see :mod:`.checkpoint`); every rank calls it.
    ``rank_tensors``: this rank's own tensors (e.g. a ZeRO optimizer shard), kept per rank."""
    return CheckpointWriter(root, mesh).save(step, modules, optimizer, manifest, rank_tensors)
