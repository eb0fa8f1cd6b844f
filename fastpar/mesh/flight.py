"""fastpar's flight recorder: the last collectives this process issued, kept in a ring.

Every collective fastpar issues goes through :mod:`fastpar.mesh.collectives` (or a wrapper of a
``fastpar._C`` op in :mod:`fastpar.extension`), which calls :meth:`FlightRecorder.collective`
or :meth:`FlightRecorder.p2p` first. An entry is a tuple: the group's name (torch's
``group_name``, the same on every rank), a sequence number per group, the op, the number of
elements and dtype of the tensor it sends, the time it was issued (``time.time()``, comparable
across the ranks of a host) and the step of the last check-in. Point-to-point batches count
on a sequence of their own (two pipeline stages post different batches), with their peers.

Recording reads tensor metadata only (``numel``, ``dtype``): no device sync, no store round
trip, a few Python operations (about 0.5-1 us on a CPU core). It is the record the stall watchdog
(:mod:`fastpar.mesh.watchdog`) dumps, and :mod:`fastpar.mesh.flight_report` compares across
ranks. One recorder per process (:data:`recorder`), as torch's own NCCL flight recorder: a log of
what was issued, not parallel state; groups are still passed explicitly to every collective.
"""
from __future__ import annotations

import json
import os
import time
from collections import deque
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _get_default_group as _default_group
from torch.distributed.distributed_c10d import _world

from .. import extension

RING = 2000             # entries kept per process
PER_GROUP = 50          # entries per group and kind written to a dump

_compiling = torch.compiler.is_compiling      # a constant True while torch.compile traces

_SHORT = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16",
          torch.float64: "fp64"}


def dtype_name(dtype: torch.dtype) -> str:
    return _SHORT.get(dtype) or str(dtype).removeprefix("torch.")


class _Done:
    """The work of a skipped asynchronous collective (fault injection): already complete."""

    def wait(self, timeout=None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


class FlightRecorder:
    """The ring of this process's collectives (see the module doc)."""

    def __init__(self, size: int = RING):
        self.entries: deque = deque(maxlen=size)
        self.seq: dict[str, int] = {}       # group name -> its last collective's number
        self.p2p_seq: dict[str, int] = {}   # group name -> its last p2p batch's number
        self.names: dict[str, str] = {}     # group name -> its dimension ("tp", "dp", ...)
        self._groups: dict = {}             # id(group) -> (group, name, ranks); holds the group
        self.last = time.time()             # when the record last advanced (or a step began)
        self.step = 0                       # the step of the last check-in
        self.skips = 0                      # collectives still to skip (fault injection only)

    def _name(self, group) -> str:
        """The group's name (None: the default group), its ranks looked up once."""
        g = group if group is not None else (_world.default_pg or _default_group())
        info = self._groups.get(id(g))
        if info is None or info[0] is not g:
            info = self._groups[id(g)] = (g, g.group_name,
                                          tuple(dist.get_process_group_ranks(g)))
        return info[1]

    def collective(self, op: str, group, tensor: torch.Tensor) -> bool:
        """Record collective ``op`` over ``group`` (None: the world) sending ``tensor``. Returns
        True when the caller must skip it instead (a ``skip@`` fault; then nothing is
        recorded). Inside torch.compile nothing is recorded (the trace would run it once)."""
        if _compiling():
            return False
        if self.skips:
            self.skips -= 1
            return True
        name = self._name(group)
        n = self.seq[name] = self.seq.get(name, 0) + 1
        self.last = t = time.time()
        self.entries.append((name, n, op, tensor.numel(), tensor.dtype, t, self.step, None))
        return False

    def record_op(self, op: str, group, tensor: torch.Tensor) -> None:
        """Record ``op`` as :meth:`collective` does, never skipping it (the extension's ops)."""
        if not _compiling():
            name = self._name(group)
            n = self.seq[name] = self.seq.get(name, 0) + 1
            self.last = t = time.time()
            self.entries.append((name, n, op, tensor.numel(), tensor.dtype, t, self.step, None))

    def p2p(self, op: str, ops) -> bool:
        """Record a batch of point-to-point ``ops`` (``dist.P2POp``), all of one group; True:
        skip it (as :meth:`collective`)."""
        if _compiling() or not ops:
            return False
        if self.skips:
            self.skips -= 1
            return True
        name = self._name(ops[0].group)
        n = self.p2p_seq[name] = self.p2p_seq.get(name, 0) + 1
        self.last = t = time.time()
        peers = tuple(("send" if o.op is dist.isend else "recv", o.peer) for o in ops)
        self.entries.append((name, n, op, sum(o.tensor.numel() for o in ops), ops[0].tensor.dtype,
                             t, self.step, peers))
        return False

    def mark(self, step: int) -> None:
        """Progress without a collective: a step region began (the watchdog's check-in)."""
        self.step, self.last = step, time.time()

    def name_groups(self, groups: dict[str, object]) -> None:
        """Label groups by the dimension they serve (``{"tp": mesh.tp_group, ...}``); the
        default group is "world". A group serving two dimensions keeps the first name given."""
        named = {self._name(None): "world"}
        for dim, g in groups.items():
            if g is not None:
                named.setdefault(self._name(g), dim)
        self.names.update(named)

    def snapshot(self, per_group: int = PER_GROUP) -> dict:
        """The last ``per_group`` entries of each group and kind, oldest first, and the groups
        they belong to, as plain data (JSON)."""
        entries = list(self.entries)            # one C call: atomic for other Python threads
        kept, count = [], {}
        for e in reversed(entries):
            kind = (e[0], e[7] is not None)
            count[kind] = count.get(kind, 0) + 1
            if count[kind] <= per_group:
                kept.append(e)
        ranks = {name: list(r) for _, name, r in list(self._groups.values())}
        groups = {name: {"name": self.names.get(name, f"group {name}"), "ranks": ranks[name]}
                  for name in {e[0] for e in kept}}
        return {"groups": groups, "entries": [_entry(e) for e in reversed(kept)]}


def _entry(e) -> dict:
    name, seq, op, numel, dtype, t, step, peers = e
    out = {"group": name, "seq": seq, "op": op, "numel": numel, "dtype": dtype_name(dtype),
           "time": round(t, 6), "step": step}
    if peers is not None:
        out["peers"] = [list(p) for p in peers]
    return out


def write_dump(path: Path, record: dict) -> Path:
    """Write ``record`` as JSON to ``path`` atomically (a reader never sees half a file)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(record, indent=1))
    os.replace(tmp, path)
    return path


def read_dumps(folder, run_id: str | None = None) -> dict[int, dict]:
    """Every rank's dump in ``folder`` (``rank<N>.json``), by rank; with ``run_id`` only those
    of that run, and of its last attempt. Unreadable files are skipped."""
    dumps = {}
    for path in sorted(Path(folder).glob("rank*.json")):
        try:
            d = json.loads(path.read_text())
            rank = int(d["rank"])
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if run_id is None or d.get("run_id") == run_id:
            dumps[rank] = d
    if dumps:
        last = max(d.get("attempt", 0) for d in dumps.values())
        dumps = {r: d for r, d in dumps.items() if d.get("attempt", 0) == last}
    return dumps


recorder = FlightRecorder()     # this process's record
extension.record_collectives(recorder.record_op)    # the C++ ops that issue collectives
