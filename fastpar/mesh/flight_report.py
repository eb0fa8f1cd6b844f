"""Compare the ranks' flight records after a stall: one line naming the first rank and
collective that differ.

A dump (:class:`~fastpar.mesh.stall_monitor.StallMonitor`) holds the last collectives of each
group a rank belongs to, numbered per group. A group's members issue its collectives in the same
order, so entry ``#n`` of a group must be the same collective (op, size, dtype) on every member.
For each rank :func:`first_divergence` finds the first entry of its record that a member of the
group did not issue (the member's record of that group stops before ``#n``) or issued
differently; then

- starting at the entry most ranks are held at (ties: the one holding the lowest rank), the
  member missing from it is named: a rank that *stopped* (its record ends there), or one that
  issued *another* collective under that number. A member that
  is itself held at another entry (it went on) leads there, and so on, until one of those
  is found or the walk comes round to an entry seen (a deadlock: two ranks each issued a
  collective the other did not; the entry the walk started from is named, with both);
- if no entry differs, every rank issued every collective of its groups and the stall is inside
  the last ones, or outside collectives (or in a rank that left no record, named first).

Point-to-point batches are left out (two pipeline stages post different batches); entries older
than a member's record of the group count as matched. A pure function of the dumps: the launcher
calls it, the tests hand it dumps made up by hand.
"""
from __future__ import annotations

_UNKNOWN = {"name": "?", "ranks": []}


def _describe(e: dict, groups: dict, with_ranks: bool = False) -> str:
    g = groups.get(e["group"], _UNKNOWN)
    text = f"{g['name']} {e['op']} #{e['seq']} ({e['numel']} x {e['dtype']})"
    return f"{text} over ranks {g['ranks']}" if with_ranks else text


class _Records:
    """The collectives of every dumped rank, indexed by (group, sequence number)."""

    def __init__(self, dumps: dict[int, dict]):
        self.dumps = dumps
        self.groups: dict[str, dict] = {}
        for d in dumps.values():
            for name, g in d.get("groups", {}).items():
                self.groups.setdefault(name, g)
        self.entries = {r: [e for e in d.get("entries", []) if "peers" not in e]
                        for r, d in dumps.items()}
        self.at = {r: {(e["group"], e["seq"]): e for e in es} for r, es in self.entries.items()}
        self.span: dict[int, dict[str, tuple[int, int]]] = {}    # rank -> group -> (first, last)
        for r, es in self.entries.items():
            spans = self.span[r] = {}
            for e in es:
                lo, hi = spans.get(e["group"], (e["seq"], e["seq"]))
                spans[e["group"]] = (min(lo, e["seq"]), max(hi, e["seq"]))

    def members(self, group: str) -> list[int]:
        return list(self.groups.get(group, _UNKNOWN)["ranks"])

    def differ(self, rank: int, e: dict) -> list[tuple[int, str, dict | None]]:
        """The dumped members of ``e``'s group that did not issue ``e`` as ``rank`` did:
        (member, "behind" | "other", the member's own entry #n if any)."""
        out = []
        for m in self.members(e["group"]):
            if m == rank or m not in self.dumps:
                continue
            first, last = self.span[m].get(e["group"], (0, 0))
            if e["seq"] > last:
                out.append((m, "behind", None))
            elif e["seq"] >= first:
                theirs = self.at[m].get((e["group"], e["seq"]))
                if theirs is not None and _signature(theirs) != _signature(e):
                    out.append((m, "other", theirs))
        return out

    def first_differing(self, rank: int) -> dict | None:
        return next((e for e in self.entries[rank] if self.differ(rank, e)), None)

    def last_on(self, rank: int, group: str) -> dict | None:
        return next((e for e in reversed(self.entries[rank]) if e["group"] == group), None)


def _signature(e: dict) -> tuple:
    return (e["op"], e["dtype"]) + ((e["numel"],) if e["op"] != "all_to_all_single" else ())


def first_divergence(dumps: dict[int, dict], world_size: int | None = None) -> str:
    """One line: where the ranks' records (``{rank: dump}``) first differ (see the module
    doc). ``world_size``: the job's, to name ranks that left no dump at all."""
    if not dumps:
        return "no rank left a flight record"
    rec = _Records(dumps)
    world = world_size or max(d.get("world_size", 0) for d in dumps.values()) or \
        max(dumps) + 1
    silent = [r for r in range(world) if r not in dumps]
    first = {r: rec.first_differing(r) for r in sorted(dumps)}
    held = {}                                       # (group, #n) -> the ranks held there
    for r, e in first.items():
        if e is not None:
            held.setdefault((e["group"], e["seq"]), []).append(r)
    if not held:
        return (f"rank(s) {silent} left no record; " if silent else "") + _agreeing(rec)
    # Start where most ranks are held; a rank missing there that is itself held elsewhere
    # (it went on to another collective) leads on, until a rank that stopped or issued another
    # collective under the same number, or round a loop (a deadlock).
    def at(key):
        ref = first[min(held[key])]
        same = [r for r in held[key] if _signature(first[r]) == _signature(ref)]
        differ = sorted(rec.differ(min(same), ref), key=lambda d: (_elsewhere(d, first), d[0]))
        return ref, same, differ

    start = key = max(held, key=lambda k: (len(held[k]), -min(held[k])))
    seen = set()
    while True:
        seen.add(key)
        ref, same, differ = at(key)
        if not _elsewhere(differ[0], first):
            break
        key = (first[differ[0][0]]["group"], first[differ[0][0]]["seq"])
        if key in seen:                             # a loop: name where the walk began
            ref, same, differ = at(start)
            break
    rank, how, theirs = differ[0]
    head = f"hang at step {ref['step']}: "
    where = _describe(ref, rec.groups, with_ranks=True)
    more = [d[0] for d in differ[1:]]
    also = (f" (rank(s) {more} differ too)" if more else "") + \
        (f"; rank(s) {silent} left no record" if silent else "")
    if how == "other":
        return (head + f"rank {rank} issued {_describe(theirs, rec.groups)} where ranks {same} "
                f"issued {where}{also}")
    own_last = rec.last_on(rank, ref["group"])
    label = rec.groups.get(ref["group"], _UNKNOWN)["name"]
    if first.get(rank) is not None:                 # it went on: skipped, or issued another
        before = f"{own_last['op']} #{own_last['seq']}" if own_last else "none"
        return (head + f"rank {rank} issued {_describe(first[rank], rec.groups)} where ranks "
                f"{same} issued {where} (rank {rank}'s last {label} collective: {before})"
                f"{also}")
    after = f"after {_describe(own_last, rec.groups)}" if own_last else \
        f"before any collective of the {label} group"
    return head + f"rank {rank} stopped {after}; ranks {same} wait in {where}{also}"


def _elsewhere(d: tuple, first: dict) -> bool:
    """Whether member ``d`` (of :meth:`_Records.differ`) is behind because it is held at
    another collective of its own."""
    return d[1] == "behind" and first.get(d[0]) is not None


def _agreeing(rec: _Records) -> str:
    last = {}
    for r, es in sorted(rec.entries.items()):
        if es:
            last.setdefault(_describe(es[-1], rec.groups, with_ranks=True), []).append(r)
    if not last:
        return "no rank issued a collective before it stopped"
    where = "; ".join(f"ranks {rs}: {d}" for d, rs in last.items())
    return (f"every collective in the records was issued alike by every rank of its group "
            f"(the last ones: {where}): the ranks stopped inside them or outside collectives")
