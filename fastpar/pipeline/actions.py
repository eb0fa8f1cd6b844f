"""Schedules are data: an :class:`Action` list per pipeline rank, validated when it is built.

Stages and chunks. With ``pp`` ranks and ``v`` virtual stages the model is cut into ``pp * v``
stages; rank ``r`` holds chunks ``0..v-1``. The placement says which stage a chunk is
(:func:`stage_of`, :func:`rank_of`): ``"loop"``, chunk ``c`` on rank ``r`` is stage
``c * pp + r`` (Megatron's interleaved layout: stage ``s`` feeds stage ``s + 1``, which lives on
the next rank, wrapping from the last rank to rank 0 between chunks); ``"v"`` (two chunks, the
V-shape schedules ZB-V and DualPipeV), rank ``r`` holds stages ``r`` and ``2 pp - 1 - r``: the
activations go down the ranks and back up, and the last rank hands its first chunk's output to
its second chunk itself (a local handoff: no message; the consumer's compute follows the
producer's on that rank).

Actions. ``F`` runs a stage's forward for a micro-batch, ``B`` its backward (only the input
gradient when the schedule also has ``W``), ``W`` the deferred weight gradient. ``SEND_F`` /
``RECV_F`` move the activation that enters a stage, ``SEND_B`` / ``RECV_B`` the gradient that leaves
it. Consecutive communication actions on a rank form one batch, posted together with
``batch_isend_irecv``. A send's ``chunk`` is the sender's chunk; a receive's is the receiver's.

Every :class:`Schedule` is checked in ``__post_init__`` (:func:`validate`): each micro-batch's
F precedes its B precedes its W on every chunk, every stage receives what it consumes and sends what
it produces, sends and receives pair up across ranks in the same order, and the schedule cannot
deadlock even if every batch blocks its rank until all of its sends and receives have met their
peers (the strictest p2p model; gloo's and NCCL's async p2p are looser). The peak number of live
activations per rank comes out of the same pass.

The checks (:func:`validate`) return ``(split_backward, peak_activations)`` or raise
``ScheduleError`` naming the rank, the action and what is wrong. The deadlock check runs the comm
batches under the strictest model: a rank that reaches a batch of sends and receives stays there
until every one of them has met its peer, and its peer's op counts as posted once the peer has
reached that op's batch. If the schedule finishes under that model it finishes under any looser
one (async sends, early receives).
"""
from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass, field

from ..mesh.layout import require_positive

KINDS = ("F", "B", "W", "SEND_F", "RECV_F", "SEND_B", "RECV_B")
COMPUTE_KINDS = ("F", "B", "W")
PLACEMENTS = ("loop", "v")


def stage_of(placement: str, pp: int, rank: int, chunk: int) -> int:
    """The model stage chunk ``chunk`` of pipeline rank ``rank`` holds."""
    if placement == "v":
        return rank if chunk == 0 else 2 * pp - 1 - rank
    return chunk * pp + rank


def rank_of(placement: str, pp: int, stage: int) -> tuple[int, int]:
    """(pipeline rank, chunk) holding model stage ``stage``: :func:`stage_of`'s inverse."""
    if placement == "v":
        return (stage, 0) if stage < pp else (2 * pp - 1 - stage, 1)
    return stage % pp, stage // pp


class ScheduleError(ValueError):
    """A schedule that breaks an invariant (order, pairing, deadlock); the message says where."""


@dataclass(frozen=True)
class Action:
    """One step of one rank: ``kind`` on micro-batch ``microbatch`` of local chunk ``chunk``.

    ``overlap`` (an F only): the F runs together with the B that follows it (another
    micro-batch, the other chunk; DualPipe's overlapped forward and backward): the two take
    turns at their transfers' waits, each computing while the other's travel
    (:mod:`fastpar.mesh.fill`)."""

    kind: str
    microbatch: int
    chunk: int = 0
    overlap: bool = False

    @property
    def is_compute(self) -> bool:
        return self.kind in COMPUTE_KINDS

    def __repr__(self) -> str:
        return f"{self.kind}{self.microbatch}" + (f".{self.chunk}" if self.chunk else "") + \
            ("&" if self.overlap else "")


@dataclass(frozen=True, eq=False)
class Schedule:
    """Per-rank action lists for ``pp_size`` ranks, ``num_microbatches`` and ``virtual_stages``.

    ``actions[rank]`` is that rank's ordered tuple of :class:`Action`. Built by
    :func:`fastpar.pipeline.build_schedule` (or :func:`fastpar.pipeline.make_schedule` for a
    custom order); constructing one directly validates it and raises :class:`ScheduleError`.
    """

    name: str
    pp_size: int
    num_microbatches: int
    virtual_stages: int
    actions: tuple
    placement: str = "loop"
    split_backward: bool = field(init=False)
    peak_activations: tuple = field(init=False)     # per rank: most micro-batch chunks alive
    # Per rank: the (alive, awaiting W) counts the peak memory can be at, the pairs no other
    # point of the rank's order exceeds in both; ((peak, 0),) unless the backward is split.
    in_flight: tuple = field(init=False)

    def __post_init__(self):
        object.__setattr__(self, "actions", tuple(tuple(a) for a in self.actions))
        split, frontier = validate(self)
        object.__setattr__(self, "split_backward", split)
        object.__setattr__(self, "in_flight", tuple(frontier))
        object.__setattr__(self, "peak_activations",
                           tuple(max(alive for alive, _ in f) for f in frontier))

    @property
    def num_stages(self) -> int:
        return self.pp_size * self.virtual_stages

    def stage_index(self, rank: int, chunk: int) -> int:
        """The model stage that ``chunk`` of ``rank`` holds."""
        return stage_of(self.placement, self.pp_size, rank, chunk)

    def place(self, stage: int) -> tuple[int, int]:
        """(rank, chunk) holding model stage ``stage``."""
        return rank_of(self.placement, self.pp_size, stage)

    def neighbour(self, rank: int, chunk: int, kind: str) -> tuple[int, int] | None:
        """(rank, chunk) of the stage a communication ``kind`` of ``chunk`` talks to: the next
        stage for F's output (``SEND_F``) and B's input (``RECV_B``), the previous one for F's
        input (``RECV_F``) and B's output (``SEND_B``); None past either end of the model."""
        stage = self.stage_index(rank, chunk) + (1 if kind in ("SEND_F", "RECV_B") else -1)
        return self.place(stage) if 0 <= stage < self.num_stages else None

    def peer(self, rank: int, action: Action) -> int:
        """The rank a communication action talks to."""
        return self.neighbour(rank, action.chunk, action.kind)[0]

    def message(self, rank: int, action: Action) -> tuple[str, int, int]:
        """What a communication action moves: (F or B, micro-batch, stage it is for).

        An activation is named by the stage that consumes it, a gradient by the stage whose
        output it is the gradient of, so a send and its receive name the same message.
        """
        s = self.stage_index(rank, action.chunk)
        target = {"SEND_F": s + 1, "RECV_F": s, "SEND_B": s - 1, "RECV_B": s}[action.kind]
        return action.kind[-1], action.microbatch, target

    def compute(self, rank: int) -> list[Action]:
        """``rank``'s F, B and W actions in order, without the communication."""
        return [a for a in self.actions[rank] if a.is_compute]

    def early_sends(self, rank: int) -> dict[int, int]:
        """Overlapped pairs whose F's output goes to another rank, posted as soon as the F
        has run instead of after the pair's B (which needs none of it), so the next stage
        starts a B earlier: {index of the pair's F: index of that ``SEND_F``}. Only a send
        that is the first to its peer in the run of messages right after the pair, so every
        channel keeps this order (NCCL matches a pair of ranks' messages in order)."""
        acts, out = self.actions[rank], {}
        for i, a in enumerate(acts[:-1]):
            if not (a.overlap and a.kind == "F"):
                continue
            peers = set()
            for k in range(i + 2, len(acts)):
                c = acts[k]
                if c.is_compute:
                    break
                if not c.kind.startswith("SEND"):
                    continue
                peer = self.peer(rank, c)
                if c.kind == "SEND_F" and (c.microbatch, c.chunk) == (a.microbatch, a.chunk) \
                        and peer not in peers:
                    out[i] = k
                peers.add(peer)
        return out

    def early_sends_block_safely(self) -> bool:
        """Whether the order with :meth:`early_sends` (:meth:`issued`) finishes under the
        strictest model too (every batch blocks its rank until all of it has met its peers:
        NCCL's, whose sends on one stream wait for their receives in order). At pp=2 it does;
        deeper, a send posted before its pair's B can wait for a receive the peer posts only
        after that B's gradient has reached it. Backends whose sends do not wait (gloo) can
        post them early regardless."""
        if not any(a.overlap for acts in self.actions for a in acts):
            return True
        cached = self.__dict__.get("_early_safe")
        if cached is not None:
            return cached
        from types import SimpleNamespace
        view = SimpleNamespace(name=self.name, pp_size=self.pp_size, peer=self.peer,
                               message=self.message,
                               actions=[self.issued(r) for r in range(self.pp_size)])
        try:
            _check_deadlock(view)
            safe = True
        except ScheduleError:
            safe = False
        object.__setattr__(self, "_early_safe", safe)
        return safe

    def issue_plan(self, rank: int, pairs: bool = True, early: bool = True,
                   recv_ahead: int = 0) -> list[tuple]:
        """How an executor issues ``rank``'s actions, as steps over their indices:
        ``("post", [k, ...], None)`` one batch of messages, ``("run", i, None)`` a compute action,
        ``("pair", i, k)`` an overlapped F (``i``) with the B after it (``pairs``; else each
        runs alone), ``k`` the index of the F's send posted between the two or None.

        ``early``: each of :meth:`early_sends` leaves right after its pair's F. ``recv_ahead``:
        each batch also posts the receives of the next ``recv_ahead`` batches (in order, so
        every channel's receives keep theirs): a receive posted before its message is sent
        takes the data as it comes, where gloo holds a message whose receive is not posted
        until the receiver posts it and asks the sender for it (a round trip through both
        ranks' transport threads). Only for a backend whose receives match by tag (gloo):
        under NCCL a posted receive holds the stream its later sends go out on."""
        acts = self.actions[rank]
        sends = self.early_sends(rank) if early and pairs else {}
        moved = set(sends.values())
        steps, i = [], 0
        while i < len(acts):
            if not acts[i].is_compute:
                j = i
                while j < len(acts) and not acts[j].is_compute:
                    j += 1
                steps.append(("post", [k for k in range(i, j) if k not in moved], None))
                i = j
            elif pairs and acts[i].overlap:
                steps.append(("pair", i, sends.get(i)))
                i += 2
            else:
                steps.append(("run", i, None))
                i += 1
        if recv_ahead > 0:
            posts = [st[1] for st in steps if st[0] == "post"]
            taken: set = set()
            for q, own in enumerate(posts):
                later = [k for ks in posts[q + 1:q + 1 + recv_ahead] for k in ks
                         if acts[k].kind.startswith("RECV") and k not in taken]
                own[:] = [k for k in own if k not in taken] + later
                taken.update(own)
        return [st for st in steps if st[0] != "post" or st[1]]

    def issued(self, rank: int, recv_ahead: int = 0) -> list[Action]:
        """``rank``'s actions in the order the executor issues them when communication runs
        behind compute (:meth:`issue_plan`): each of :meth:`early_sends` right after its
        pair's F."""
        out = []
        for kind, x, send in self.issue_plan(rank, recv_ahead=recv_ahead):
            if kind == "post":
                out += [self.actions[rank][k] for k in x]
            else:
                out.append(self.actions[rank][x])
                if send is not None:
                    out.append(self.actions[rank][send])
                if kind == "pair":
                    out.append(self.actions[rank][x + 1])
        return out

    def __repr__(self) -> str:
        return (f"Schedule({self.name!r}, pp_size={self.pp_size}, "
                f"num_microbatches={self.num_microbatches}, "
                f"virtual_stages={self.virtual_stages}, peak={list(self.peak_activations)})")

    def table(self) -> str:
        """The compute order of every rank, one line each (communication left out)."""
        return "\n".join(f"rank {r}: " + " ".join(map(repr, self.compute(r)))
                         for r in range(self.pp_size))


_PRODUCES = {"F": "SEND_F", "B": "SEND_B"}     # what a compute action sends after it
_NEEDS = {"F": "RECV_F", "B": "RECV_B"}        # what it must have received before it


def validate(s) -> tuple[bool, list[tuple]]:
    _check_shape(s)
    split = _check_compute(s)
    _check_dataflow(s)
    _check_channels(s)
    _check_deadlock(s)
    return split, _peaks(s, split)


def _check_shape(s) -> None:
    require_positive({k: getattr(s, k) for k in ("pp_size", "num_microbatches",
                                                 "virtual_stages")}, error=ScheduleError)
    if len(s.actions) != s.pp_size:
        raise ScheduleError(f"schedule {s.name!r} has action lists for {len(s.actions)} ranks, "
                            f"pp_size={s.pp_size}")
    if s.placement not in PLACEMENTS or (s.placement == "v" and s.virtual_stages != 2):
        raise ScheduleError(f"schedule {s.name!r}: placement {s.placement!r} (one of "
                            f"{PLACEMENTS}; 'v' holds two chunks per rank) with virtual_stages="
                            f"{s.virtual_stages}")
    for rank, acts in enumerate(s.actions):
        for i, a in enumerate(acts):
            if not isinstance(a, Action) or a.kind not in KINDS:
                raise ScheduleError(f"rank {rank} action {i}: {a!r} is not an Action with a kind "
                                    f"in {KINDS}")
            if not (0 <= a.microbatch < s.num_microbatches and 0 <= a.chunk < s.virtual_stages):
                raise ScheduleError(f"rank {rank} action {i} {a!r}: micro-batch {a.microbatch} "
                                    f"or chunk {a.chunk} out of range (num_microbatches="
                                    f"{s.num_microbatches}, virtual_stages={s.virtual_stages})")
            if a.overlap:
                b = acts[i + 1] if i + 1 < len(acts) else None
                if a.kind != "F" or b is None or b.kind != "B" or \
                        (b.microbatch, b.chunk) == (a.microbatch, a.chunk):
                    raise ScheduleError(f"rank {rank} action {i} {a!r}: an overlapped action "
                                        f"is an F directly followed by the B of another "
                                        f"micro-batch or chunk it runs with, got {b!r}")


def _check_compute(s) -> bool:
    """Each (micro-batch, chunk) runs F, B (and W) exactly once each, in that order; or only F
    on every rank (a forward-only schedule, for evaluation)."""
    kinds = {a.kind for acts in s.actions for a in acts if a.is_compute}
    split = "W" in kinds
    expected = ("F", "B", "W") if split else ("F", "B") if "B" in kinds else ("F",)
    for rank, acts in enumerate(s.actions):
        seen = defaultdict(list)
        for a in acts:
            if a.is_compute:
                seen[(a.microbatch, a.chunk)].append(a.kind)
        for m in range(s.num_microbatches):
            for c in range(s.virtual_stages):
                got = tuple(seen.get((m, c), ()))
                if got != expected:
                    raise ScheduleError(
                        f"rank {rank}, micro-batch {m}, chunk {c}: compute actions in order "
                        f"{list(got)}, expected {list(expected)}"
                        + (" (W appears on some ranks, so every B needs its W)" if split else ""))
    return split


def _check_dataflow(s) -> None:
    """Every stage receives its input before F / its output gradient before B, and sends after;
    where the neighbour stage is on the same rank (V placement), no message: the neighbour's
    F (for F) or B (for B) must have run before on this rank."""
    last = s.num_stages - 1
    for rank, acts in enumerate(s.actions):
        done: set = set()
        counts = Counter((a.kind, a.microbatch, a.chunk) for a in acts if not a.is_compute)
        for key, n in counts.items():
            if n > 1:
                raise ScheduleError(f"rank {rank}: {Action(*key)!r} appears {n} times")
        for i, a in enumerate(acts):
            stage = s.stage_index(rank, a.chunk)
            key = (a.microbatch, a.chunk)
            if a.kind in _NEEDS:
                # F needs the previous stage's output, B the next stage's input gradient.
                nb = s.neighbour(rank, a.chunk, "RECV_F" if a.kind == "F" else "RECV_B")
                if nb is not None and nb[0] == rank:
                    if (a.kind, a.microbatch, nb[1]) not in done:
                        raise ScheduleError(f"rank {rank} action {i} {a!r} (stage {stage}) "
                                            f"runs before {a.kind}{a.microbatch} of the stage "
                                            f"it takes from on this rank (chunk {nb[1]})")
                elif nb is not None and (_NEEDS[a.kind], *key) not in done:
                    raise ScheduleError(f"rank {rank} action {i} {a!r} (stage {stage}) runs "
                                        f"before its {_NEEDS[a.kind]}{a.microbatch}")
            elif not a.is_compute:
                fwd = a.kind.endswith("F")
                nb = s.neighbour(rank, a.chunk, a.kind)
                if nb is None or nb[0] == rank:
                    raise ScheduleError(f"rank {rank} action {i} {a!r}: stage {stage} of "
                                        f"{s.num_stages} has no such neighbour on another rank")
                if a.kind.startswith("SEND") and ("F" if fwd else "B", *key) not in done:
                    raise ScheduleError(f"rank {rank} action {i} {a!r} sends before "
                                        f"{'F' if fwd else 'B'}{a.microbatch} computed it")
            done.add((a.kind, *key))
        for a in acts:
            if a.kind in _PRODUCES:
                stage = s.stage_index(rank, a.chunk)
                nb = s.neighbour(rank, a.chunk, _PRODUCES[a.kind])
                if nb is not None and nb[0] != rank and \
                        (_PRODUCES[a.kind], a.microbatch, a.chunk) not in done:
                    raise ScheduleError(f"rank {rank}: {a!r} (stage {stage}) is never followed "
                                        f"by its {_PRODUCES[a.kind]}")


def _check_channels(s) -> None:
    """Between any two ranks, messages are received in the order they are sent."""
    sent, received = defaultdict(list), defaultdict(list)
    for rank, acts in enumerate(s.actions):
        for a in acts:
            if a.kind.startswith("SEND"):
                sent[(rank, s.peer(rank, a))].append(s.message(rank, a))
            elif a.kind.startswith("RECV"):
                received[(s.peer(rank, a), rank)].append(s.message(rank, a))
    for pair in sorted(set(sent) | set(received)):
        a, b = sent.get(pair, []), received.get(pair, [])
        if a != b:
            i = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            raise ScheduleError(
                f"rank {pair[0]} -> rank {pair[1]}: message {i} sent is "
                f"{_fmt(a[i]) if i < len(a) else 'nothing'} but received as "
                f"{_fmt(b[i]) if i < len(b) else 'nothing'} ({len(a)} sent, {len(b)} received)")


def _fmt(msg) -> str:
    kind, m, stage = msg
    return (f"activation of micro-batch {m} into stage {stage}" if kind == "F"
            else f"gradient of micro-batch {m} out of stage {stage}")


def _steps(acts) -> list[list[Action]]:
    """A rank's list as steps: each compute action alone, each run of comm actions as a batch."""
    steps: list[list[Action]] = []
    for a in acts:
        if not a.is_compute and steps and not steps[-1][0].is_compute:
            steps[-1].append(a)
        else:
            steps.append([a])
    return steps


def _check_deadlock(s) -> None:
    steps = [_steps(acts) for acts in s.actions]
    where = {}                                  # (rank, message) -> index of the step that has it
    for rank, rank_steps in enumerate(steps):
        for i, step in enumerate(rank_steps):
            for a in step:
                if not a.is_compute:
                    where[(rank, a.kind[:4], s.message(rank, a))] = i
    pos = [0] * s.pp_size
    progress = True
    while progress:
        progress = False
        for rank in range(s.pp_size):
            while pos[rank] < len(steps[rank]) and _ready(s, rank, steps, pos, where):
                pos[rank] += 1
                progress = True
    stuck = [r for r in range(s.pp_size) if pos[r] < len(steps[r])]
    if stuck:
        lines = [f"rank {r} waits at {steps[r][pos[r]]} (step {pos[r]})" for r in stuck]
        raise ScheduleError(f"schedule {s.name!r} deadlocks: " + "; ".join(lines))


def _ready(s, rank, steps, pos, where) -> bool:
    """Can ``rank`` finish its current step: is every op's peer op posted?"""
    step = steps[rank][pos[rank]]
    if step[0].is_compute:
        return True
    for a in step:
        peer = s.peer(rank, a)
        other = "RECV" if a.kind.startswith("SEND") else "SEND"
        j = where.get((peer, other, s.message(rank, a)))
        if j is None or pos[peer] < j:
            return False
    return True


def _peaks(s, split: bool) -> list[tuple]:
    """Per rank, after each compute action: the (micro-batch, chunk) pairs whose F has run and
    whose backward has not finished (B, or W when the schedule splits it off), and of those the
    ones whose B has run and whose W has not (they hold their weights' output gradients too).
    A B whose W follows it directly is one pass (the executor runs both at once): done at B.
    Returns the pairs of counts not dominated by another point of the rank's order."""
    frontier = []
    for acts in s.actions:
        live = waiting = 0
        points = {(0, 0)}
        order = [a for a in acts if a.is_compute]
        full = {i for i, (a, b) in enumerate(zip(order, order[1:])) if a.kind == "B" and
                b.kind == "W" and (a.microbatch, a.chunk) == (b.microbatch, b.chunk)}
        for i, a in enumerate(order):
            if a.kind == "F":
                live += 1
            elif a.kind == "B" and i in full:       # its W right after: one pass does both
                live -= 1
            elif a.kind == "B":
                live, waiting = (live, waiting + 1) if split else (live - 1, waiting)
            elif a.kind == "W" and i - 1 not in full:
                live, waiting = live - 1, waiting - 1
            points.add((live, waiting))
        frontier.append(tuple(sorted(p for p in points if not any(
            q != p and q[0] >= p[0] and q[1] >= p[1] for q in points))))
    return frontier
