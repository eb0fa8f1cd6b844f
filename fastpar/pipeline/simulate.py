"""Time a schedule's action lists with a cost model: step time, bubble, a Gantt chart, a trace.

The simulator reads the same :class:`~fastpar.pipeline.actions.Schedule` the executor runs. Each
rank runs its compute actions in order; an F or B that needs a neighbour's activation or gradient
starts when that message has arrived, ``comm`` after the neighbour's compute that produced it
ended. Communication runs beside compute (its own stream / gloo's threads), so sends cost the
sender nothing.

Costs are per micro-batch per stage: a scalar, or a sequence indexed by stage (``pp * v`` stages;
with interleaving a stage is one chunk, so its cost is a rank's cost divided by ``v``). In a
schedule that does not split off W, a backward costs ``b + w``.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple, Sequence

from .actions import Action, Schedule

_COLORS = {"F": "#4c72b0", "B": "#dd8452", "W": "#8172b3"}


class Event(NamedTuple):
    """One compute action on one rank, from ``start`` to ``end`` (simulated or measured)."""

    rank: int
    action: Action
    start: float
    end: float


def _per_stage(name: str, value, num_stages: int) -> list[float]:
    if isinstance(value, (int, float)):
        values = [float(value)] * num_stages
    else:
        values = [float(x) for x in value]
        if len(values) != num_stages:
            raise ValueError(f"simulate: {name} has {len(values)} per-stage costs, the schedule "
                             f"has {num_stages} stages (pp_size * virtual_stages)")
    if any(x < 0 for x in values):
        raise ValueError(f"simulate: {name}={value!r} must be >= 0")
    return values


@dataclass
class Simulation:
    """What :func:`simulate` found: times, bubble and the timeline of every compute action."""

    schedule: Schedule
    step_time: float
    busy: list[float]                      # compute time per rank
    bubble_fraction: float                 # idle / step time, averaged over ranks
    peak_activations: list[int]            # per rank
    events: list[Event] = field(repr=False)

    def gantt(self, path: str | Path, title: str | None = None) -> Path:
        """Draw the timeline as a PNG (needs matplotlib)."""
        return plot_gantt(self.events, path, self.schedule.pp_size,
                          title or f"{self.schedule!r}: bubble {self.bubble_fraction:.1%}")

    def chrome_trace(self, path: str | Path | None = None, unit_us: float = 1000.0) -> dict:
        """The timeline as a Chrome-trace dict (opens in Perfetto); one cost unit = ``unit_us``."""
        return chrome_trace(self.events, path, unit_us, name=self.schedule.name)


def simulate(schedule: Schedule, f=1.0, b=1.0, w=1.0, comm=0.0, waits=None,
             shared=None, post=0.0, fillable=None, early: bool = True) -> Simulation:
    """Time ``schedule`` with forward ``f``, input-gradient ``b``, weight-gradient ``w`` and
    per-message ``comm`` costs (see the module doc). Returns a :class:`Simulation`.

    ``waits``: optional (f, b, w) costs of the same shapes, the part of each action spent
    waiting (on collectives) rather than computing; included in its time. An overlapped F
    (DualPipeV's pairs, :class:`~fastpar.pipeline.actions.Action` ``overlap``) and its B take
    turns at their waits (:func:`fastpar.mesh.fill.pair`): the pair takes both's compute and
    waits, less min(F's waits, B's compute) and min(B's waits, F's compute), B's part starting
    no sooner than B's input has arrived (only F's compute after that hides B's waits).
    ``fillable``: ``(f, b)``, each a number or one per stage: the part of F's and of B's
    waits the pair can hide (the waits with a fill point: the MoE dispatch's); all if None.
    (With ``shared`` the pairs run one after the other: gloo's transfers share the cores.)
    A pair's F that feeds another rank sends its output as soon as it has run, before the
    pair's B (:meth:`~fastpar.pipeline.actions.Schedule.early_sends`), as the executor does
    on gloo and, under NCCL, where the order allows it; ``early=False``: with the pair's batch.
    ``post``: the host time a rank spends issuing each send and each receive (gloo's isend /
    irecv take a few hundred us of the calling thread; a message leaves once its send is posted).
    ``shared``: (processes per pipeline rank, cores) when the ranks' processes share fewer CPU
    cores than there are processes: then a computing process runs at ``min(1, cores / busy)``
    of its speed, ``busy`` being the processes computing at that moment (processor sharing, as
    the operating system's scheduler shares the cores), while one waiting uses no core. The
    costs are each action's time on a core of its own."""
    s = schedule
    cost = {"F": _per_stage("f", f, s.num_stages), "B": _per_stage("b", b, s.num_stages),
            "W": _per_stage("w", w, s.num_stages)}
    idle = {k: [0.0] * s.num_stages for k in "FBW"} if waits is None else {
        k: _per_stage(k.lower() + " waits", v, s.num_stages) for k, v in zip("FBW", waits)}
    if not s.split_backward:
        for d in (cost, idle):
            d["B"] = [x + y for x, y in zip(d["B"], d["W"])]
    for name, value in (("comm", comm), ("post", post)):
        if not isinstance(value, (int, float)) or value < 0:
            raise ValueError(f"simulate: {name}={value!r} must be a number >= 0")
    if shared is not None:
        return _simulate_shared(s, cost, idle, comm, post, *shared, early=early)
    compute = cost
    if fillable is not None and (not isinstance(fillable, (tuple, list)) or
                                 len(fillable) != 2):
        raise ValueError(f"simulate: fillable={fillable!r} must be (f, b), each a number or "
                         f"one per stage")
    fills = {k: idle[k] if fillable is None else [
        min(x, y) for x, y in zip(_per_stage(f"fillable {k}", v, s.num_stages), idle[k])]
        for k, v in zip("FB", fillable or (None, None))}
    cost = {k: [x + y for x, y in zip(cost[k], idle[k])] for k in cost}
    clock = [0.0] * s.pp_size
    pos = [0] * s.pp_size
    arrival: dict = {}                     # message -> time it is at its receiver
    events: list[Event] = []
    after_f = [s.early_sends(r) if early else {} for r in range(s.pp_size)]
    posted = [set(e.values()) for e in after_f]
    while True:
        moved = False
        for rank in range(s.pp_size):
            acts = s.actions[rank]
            while pos[rank] < len(acts):
                a = acts[pos[rank]]
                if pos[rank] in posted[rank]:
                    pass                   # went out with its pair's F
                elif not a.is_compute:     # posted; a receive's compute waits for it below
                    clock[rank] += post
                    if a.kind.startswith("SEND"):
                        arrival[s.message(rank, a)] = clock[rank] + comm
                elif a.overlap:            # the pair: B's compute fills F's waits
                    b = acts[pos[rank] + 1]
                    need, need_b = _needs(s, rank, a), _needs(s, rank, b)
                    if any(n is not None and n not in arrival for n in (need, need_b)):
                        break
                    i, j = s.stage_index(rank, a.chunk), s.stage_index(rank, b.chunk)
                    fc, fw, bc, bw = compute["F"][i], idle["F"][i], compute["B"][j], idle["B"][j]
                    start = max(clock[rank], arrival.get(need, 0.0))
                    ready = max(start, arrival.get(need_b, 0.0))
                    hidden = min(fills["F"][i], bc, max(0.0, start + fc + fw - ready))
                    hidden_b = min(fills["B"][j], max(0.0, start + fc - ready))
                    mid = start + fc + fw - hidden
                    if pos[rank] in after_f[rank]:  # F's output leaves before B runs
                        arrival[s.message(rank, acts[after_f[rank][pos[rank]]])] = \
                            mid + post + comm
                        mid += post
                    end = max(mid, ready) + bc + bw - hidden_b
                    events += [Event(rank, a, start, mid), Event(rank, b, mid, end)]
                    clock[rank] = end
                    pos[rank] += 1
                else:
                    need = _needs(s, rank, a)
                    if need is not None and need not in arrival:
                        break              # its sender has not got that far yet
                    start = max(clock[rank], arrival.get(need, 0.0))
                    end = start + cost[a.kind][s.stage_index(rank, a.chunk)]
                    events.append(Event(rank, a, start, end))
                    clock[rank] = end
                pos[rank] += 1
                moved = True
        if all(pos[r] == len(s.actions[r]) for r in range(s.pp_size)):
            break
        if not moved:                      # validated schedules never get here
            raise RuntimeError(f"simulate: {s!r} made no progress")
    step = max(clock) if clock else 0.0
    busy = [sum(e.end - e.start for e in events if e.rank == r) for r in range(s.pp_size)]
    bubble = sum((step - x) / step for x in busy) / len(busy) if step > 0 else 0.0
    return Simulation(s, step, busy, bubble, list(s.peak_activations), events)


def _simulate_shared(s: Schedule, cost: dict, idle: dict, comm: float, post: float,
                     procs: float, cores: float, early: bool = True) -> Simulation:
    """:func:`simulate` with processor sharing: event by event, each computing process at
    ``min(1, cores / busy processes)`` of a core; an action computes, then waits its ``idle``;
    posting a send or a receive computes ``post``."""
    if procs <= 0 or cores <= 0:
        raise ValueError(f"simulate: shared=({procs}, {cores}) must be positive")
    n = s.pp_size
    # In issue order (pairs one after the other: F, its send, B).
    orders = [s.issued(r) if early else list(s.actions[r]) for r in range(n)]
    pos, now = [0] * n, 0.0
    arrival: dict = {}
    running: list = [None] * n      # [action, start, work left, wait left] of each rank
    events: list[Event] = []
    while True:
        started = True
        while started:              # start what can start now (a send may free a receiver)
            started = False
            for rank in range(n):
                started |= _start(s, orders[rank], rank, pos, running, arrival, now, cost,
                                  idle, comm, post)
        if all(r is None for r in running):
            if all(pos[r] == len(s.actions[r]) for r in range(n)):
                break
            later = [t for t in arrival.values() if t > now]
            if not later:
                raise RuntimeError(f"simulate: {s!r} made no progress")
            now = min(later)
            continue
        computing = [r for r in running if r is not None and r[2] > 0]
        rate = min(1.0, cores / (len(computing) * procs)) if computing else 1.0
        step = min([r[2] / rate for r in computing] + [r[3] for r in running
                                                         if r is not None and r[2] <= 0]
                   + [t - now for t in arrival.values() if t > now])
        now += step
        for rank, r in enumerate(running):
            if r is None:
                continue
            if r[2] > 0:
                r[2] = max(0.0, r[2] - step * rate) if r[2] > step * rate * (1 + 1e-12) else 0.0
            else:
                r[3] = max(0.0, r[3] - step) if r[3] > step * (1 + 1e-12) else 0.0
            if r[2] <= 0 and r[3] <= 0:
                if r[0].is_compute:
                    events.append(Event(rank, r[0], r[1], now))
                elif r[0].kind.startswith("SEND"):
                    arrival[s.message(rank, r[0])] = now + comm
                running[rank] = None
    busy = [sum(e.end - e.start for e in events if e.rank == r) for r in range(n)]
    bubble = sum((now - x) / now for x in busy) / len(busy) if now > 0 else 0.0
    return Simulation(s, now, busy, bubble, list(s.peak_activations), events)


def _start(s: Schedule, acts: list, rank: int, pos: list, running: list, arrival: dict,
           now: float, cost: dict, idle: dict, comm: float, post: float) -> bool:
    """Move ``rank`` through its actions (``acts``, in issue order) up to one that must run or
    wait; whether it moved."""
    moved = False
    while running[rank] is None and pos[rank] < len(acts):
        a = acts[pos[rank]]
        if not a.is_compute:
            if post > 0:
                running[rank] = [a, now, post, 0.0]
            elif a.kind.startswith("SEND"):
                arrival[s.message(rank, a)] = now + comm
        else:
            need = _needs(s, rank, a)
            if need is not None and arrival.get(need, float("inf")) > now:
                break
            i = s.stage_index(rank, a.chunk)
            running[rank] = [a, now, cost[a.kind][i], idle[a.kind][i]]
        pos[rank] += 1
        moved = True
    return moved


def _needs(s: Schedule, rank: int, a: Action):
    """The message a compute action waits for, or None (none, or a handoff from a stage on
    this rank, whose compute ran before it)."""
    if a.kind not in ("F", "B"):
        return None
    nb = s.neighbour(rank, a.chunk, "RECV_" + a.kind)
    if nb is None or nb[0] == rank:
        return None
    return (a.kind, a.microbatch, s.stage_index(rank, a.chunk))


def chrome_trace(events: Sequence[Event], path: str | Path | None = None,
                 unit_us: float = 1000.0, name: str = "pipeline") -> dict:
    """Chrome-trace JSON (the ``traceEvents`` format Perfetto and chrome://tracing open):
    one row per pipeline rank, one slice per compute action. Written to ``path`` if given."""
    trace = [{"name": "process_name", "ph": "M", "pid": 0, "args": {"name": name}}]
    ranks = sorted({e.rank for e in events})
    trace += [{"name": "thread_name", "ph": "M", "pid": 0, "tid": r,
               "args": {"name": f"pp rank {r}"}} for r in ranks]
    for e in events:
        a = e.action
        trace.append({"name": repr(a), "cat": a.kind, "ph": "X", "pid": 0, "tid": e.rank,
                      "ts": e.start * unit_us, "dur": (e.end - e.start) * unit_us,
                      "args": {"microbatch": a.microbatch, "chunk": a.chunk}})
    out = {"traceEvents": trace, "displayTimeUnit": "ms"}
    if path is not None:
        Path(path).write_text(json.dumps(out))
    return out


def plot_gantt(events: Sequence[Event], path: str | Path, pp_size: int,
               title: str = "") -> Path:
    """One row per rank, one box per compute action (F blue, B orange, W purple), as a PNG."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise ImportError("the Gantt chart needs matplotlib: pip install matplotlib") from e
    end = max((e.end for e in events), default=1.0)
    fig, ax = plt.subplots(figsize=(min(24.0, 4 + 0.25 * len(events) / max(pp_size, 1)),
                                    0.6 * pp_size + 1.2))
    for e in events:
        a = e.action
        ax.barh(e.rank, e.end - e.start, left=e.start, height=0.8, color=_COLORS[a.kind],
                edgecolor="white", linewidth=0.5)
        label = f"{a.microbatch}" + (f".{a.chunk}" if a.chunk else "")
        ax.text((e.start + e.end) / 2, e.rank, label, ha="center", va="center", fontsize=6,
                color="white")
    ax.set_yticks(range(pp_size), [f"rank {r}" for r in range(pp_size)])
    ax.invert_yaxis()
    ax.set_xlim(0, end)
    ax.set_xlabel("time")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in _COLORS.values()]
    ax.legend(handles, list(_COLORS), loc="upper right", fontsize=7, ncol=3)
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return Path(path)
