"""The schedules: one function per schedule, each giving one rank's compute order.

``build_schedule(name, pp_size, num_microbatches, virtual_stages)`` calls the schedule's function
for every rank, and :func:`make_schedule` adds the communication: each send right after the
compute that produced it, each receive in the same lockstep round as its send, so receives are
posted as early as possible and the batches of a round pair up (placing a receive right before
its consumer instead deadlocks the interleaved schedule when batches block, as NCCL's do).

References: GPipe (Huang et al. 2019); 1F1B (PipeDream-Flush, Narayanan et al. 2021); interleaved
1F1B (Megatron-LM, Narayanan et al. 2021, sec. 2.2); ZB-H1 and ZB-V (Qi et al. 2024, "Zero Bubble
Pipeline Parallelism", sec. 3 and 6).
"""
from __future__ import annotations

from ..mesh.layout import require_positive
from .actions import Action, Schedule, ScheduleError, rank_of, stage_of


def gpipe(rank: int, pp: int, m: int, v: int) -> list[Action]:
    """All forwards, then all backwards. Every micro-batch's activation is alive at once."""
    return [Action("F", i) for i in range(m)] + [Action("B", i) for i in range(m)]


def one_f_one_b(rank: int, pp: int, m: int, v: int) -> list[Action]:
    """Warm-up forwards, then one forward / one backward, then the cool-down backwards.

    Rank r runs min(pp - r - 1, m) warm-up forwards, so at most pp - r micro-batches are alive.
    """
    warmup = min(pp - rank - 1, m)
    order = [Action("F", i) for i in range(warmup)]
    for i in range(m - warmup):                    # steady state
        order += [Action("F", warmup + i), Action("B", i)]
    order += [Action("B", i) for i in range(m - warmup, m)]   # cool-down
    return order


def interleaved(rank: int, pp: int, m: int, v: int) -> list[Action]:
    """Megatron's interleaved 1F1B: v chunks per rank, micro-batches in rounds of pp.

    Virtual micro-batch k (0 <= k < m*v) is micro-batch (k // (pp*v)) * pp + k % pp on chunk
    (k % (pp*v)) // pp going forward; backwards visit the chunks in reverse. Warm-up is
    (pp - rank - 1) * 2 + (v - 1) * pp virtual forwards (capped at m*v), then 1F1B on virtual
    micro-batches, then the cool-down.
    """
    group = pp * v

    def act(kind: str, k: int) -> Action:
        chunk = (k % group) // pp
        return Action(kind, (k // group) * pp + k % pp, chunk if kind == "F" else v - 1 - chunk)

    total = m * v
    warmup = min((pp - rank - 1) * 2 + (v - 1) * pp, total)
    order = [act("F", k) for k in range(warmup)]
    for k in range(total - warmup):
        order += [act("F", warmup + k), act("B", k)]
    order += [act("B", k) for k in range(total - warmup, total)]
    return order


def zero_bubble_h1(rank: int, pp: int, m: int, v: int) -> list[Action]:
    """ZB-H1: 1F1B's F/B order with the weight gradient W split off and deferred.

    Rank r keeps up to r weight gradients waiting (rank 0 none, the last rank pp - 1): its B's
    return the input gradient upstream sooner, and the waiting W's fill the gaps of the
    cool-down. Live micro-batches (F run, W not yet) stay at most (pp - r) + r = pp per rank,
    1F1B's peak.
    """
    warmup = min(pp - rank - 1, m)
    lag = rank
    order = [Action("F", i) for i in range(warmup)]
    waiting: list[int] = []                        # micro-batches whose W has not run yet
    for i in range(m - warmup):                    # steady state: F, B, and W once r are waiting
        order += [Action("F", warmup + i), Action("B", i)]
        waiting.append(i)
        if len(waiting) > lag:
            order.append(Action("W", waiting.pop(0)))
    for i in range(m - warmup, m):                 # cool-down: each B followed by one W
        order.append(Action("B", i))
        waiting.append(i)
        order.append(Action("W", waiting.pop(0)))
    order += [Action("W", i) for i in waiting]     # the rest fill the tail
    return order


def zero_bubble_v(rank: int, pp: int, m: int, v: int) -> list[Action]:
    """ZB-V: two chunks per rank in a V (rank r holds stages r and 2 pp - 1 - r), B and W
    split; the order of the paper's section 6, as torch's ``ScheduleZBVZeroBubble`` runs it.

    Written for n = max(m, 2 pp - 1) micro-batches, the actions of micro-batches past m then
    dropped: warm-up, 2 (pp - r) - 1 forwards of chunk 0, then r pairs (F chunk 1, F chunk 0),
    then pp - r rounds of chunk 1's F, B, W; the steady state alternates chunk 0's (F), B, W
    with chunk 1's F, B, W; the cool-down runs r pairs of B (chunk 0, chunk 1), pp - r pairs of
    chunk 0's B and W, then the W's left (chunk 1's, then chunk 0's). At most 2 pp
    micro-batch chunks are alive on a rank: 1F1B's activation memory."""
    n = max(m, 2 * pp - 1)
    order: list[Action] = []
    nxt = {"F": [0, 0], "B": [0, 0], "W": [0, 0]}    # per kind and chunk: the next micro-batch

    def run(*steps: str) -> None:           # "F0": chunk 0's next F
        for kind, chunk in ((x[0], int(x[1])) for x in steps):
            order.append(Action(kind, nxt[kind][chunk], chunk))
            nxt[kind][chunk] += 1

    f, b, w = nxt["F"], nxt["B"], nxt["W"]
    for _ in range(2 * (pp - rank) - 1):
        run("F0")
    for _ in range(rank):
        run("F1", "F0")
    for _ in range(pp - rank):
        run("F1", "B1", "W1")
    while f[1] < f[0] or f[0] < n:
        if f[0] < n:
            run("F0")
        run("B0", "W0", "F1", "B1", "W1")
    for _ in range(rank):
        run("B0", "B1")
    for _ in range(pp - rank):
        run("B0", "W0")
    while w[1] < b[1]:
        run("W1")
    while w[0] < b[0]:
        run("W0")
    return [a for a in order if a.microbatch < m]


def dualpipe_v(rank: int, pp: int, m: int, v: int) -> list[Action]:
    """DualPipeV (DeepSeek-V3's DualPipe cut in half, as torch's ``ScheduleDualPipeV`` orders
    it): the V placement of ZB-V; in the steady state each F runs overlapped with the B of
    another micro-batch on the other chunk (``Action.overlap``: each computes while the
    other's transfers travel). A B not split off from its W is followed by that W at once; the
    split ones (the warm-up's chunk 1 and the cool-down's second half) queue their W, which
    fill the gaps later. Needs m >= 2 pp.

    Rank r: 2 (pp - r - 1) forwards of chunk 0; r + 1 pairs (F0, F1); pp - r - 1 rounds of
    (B1 split, a queued W, F1); m - 2 pp + r + 1 rounds of the overlapped pairs F0&B1 and
    F1&B0 (the last rank's first F0, B1 not overlapped); pp - r - 1 rounds of B1, F1&B0;
    r + 1 rounds of B1, B0 (split from the middle round on); pp - r - 1 rounds of a queued W
    and B0 (split); the queued W's."""
    order: list[Action] = []
    f_next, b_next, queued = [0, 0], [0, 0], []

    def fwd(chunk: int, overlap: bool = False) -> None:
        order.append(Action("F", f_next[chunk], chunk, overlap))
        f_next[chunk] += 1

    def bwd(chunk: int, split: bool = False) -> None:
        mb = b_next[chunk]
        b_next[chunk] += 1
        order.append(Action("B", mb, chunk))
        (queued.append if split else order.append)(Action("W", mb, chunk))

    def weight() -> None:
        if queued:
            order.append(queued.pop(0))

    for _ in range(2 * (pp - rank - 1)):
        fwd(0)
    for _ in range(rank + 1):
        fwd(0)
        fwd(1)
    for _ in range(pp - rank - 1):
        bwd(1, split=True)
        weight()
        fwd(1)
    for i in range(m - 2 * pp + rank + 1):
        fwd(0, overlap=not (i == 0 and rank == pp - 1))
        bwd(1)
        fwd(1, overlap=True)
        bwd(0)
    for _ in range(pp - rank - 1):
        bwd(1)
        fwd(1, overlap=True)
        bwd(0)
    rounds = rank + 1
    for i in range(rounds):                  # split from the middle round on (odd ranks: from
        bwd(1, split=i > rounds // 2 or (i == rounds // 2 and rank % 2 == 1))   # its B1)
        bwd(0, split=i >= rounds // 2)
    for _ in range(pp - rank - 1):
        weight()
        bwd(0, split=True)
    while queued:
        weight()
    return order


SCHEDULES = {"gpipe": gpipe, "1f1b": one_f_one_b, "interleaved": interleaved,
             "zb-h1": zero_bubble_h1, "zb-v": zero_bubble_v, "dualpipe-v": dualpipe_v}
# Where each schedule places its stages (fastpar.pipeline.actions.stage_of); "loop" otherwise.
PLACEMENT = {"zb-v": "v", "dualpipe-v": "v"}


def check_args(name: str, pp_size: int, num_microbatches: int, virtual_stages: int) -> None:
    """Raise ValueError, with the numbers, for a configuration no schedule can run."""
    if name not in SCHEDULES:
        raise ValueError(f"unknown schedule {name!r}; choose one of {sorted(SCHEDULES)}")
    require_positive({"pp_size": pp_size, "num_microbatches": num_microbatches,
                      "virtual_stages": virtual_stages}, f"{name}: ")
    if name == "interleaved":
        if num_microbatches < pp_size or num_microbatches % pp_size:
            raise ValueError(f"interleaved: num_microbatches={num_microbatches} must be a "
                             f"multiple of pp_size={pp_size} (micro-batches go in rounds of "
                             f"pp_size); use {max(1, -(-num_microbatches // pp_size)) * pp_size}")
        if pp_size == 1 and virtual_stages > 1:
            raise ValueError(f"interleaved: virtual_stages={virtual_stages} needs pp_size > 1 "
                             f"(chunks interleave across ranks); pp_size=1 takes virtual_stages=1")
    elif PLACEMENT.get(name) == "v":
        if virtual_stages != 2:
            raise ValueError(f"{name}: virtual_stages={virtual_stages}; a V-shape schedule "
                             f"holds exactly two stages per rank (virtual_stages=2)")
        if name == "dualpipe-v" and num_microbatches < 2 * pp_size:
            raise ValueError(f"dualpipe-v: num_microbatches={num_microbatches} must be at "
                             f"least 2 * pp_size = {2 * pp_size} (its steady state overlaps "
                             f"pairs of micro-batches on both stages of a rank)")
    elif virtual_stages != 1:
        raise ValueError(f"{name}: virtual_stages={virtual_stages} needs the 'interleaved' "
                         f"schedule; {name!r} runs one stage per rank (virtual_stages=1)")


def build_schedule(name: str, pp_size: int, num_microbatches: int,
                   virtual_stages: int = 1) -> Schedule:
    """The validated :class:`Schedule` ``name`` ("gpipe", "1f1b", "interleaved", "zb-h1",
    "zb-v", "dualpipe-v").

    ``schedule.actions[rank]`` is each rank's ordered action list; bad arguments raise
    ``ValueError`` naming the numbers.
    """
    check_args(name, pp_size, num_microbatches, virtual_stages)
    fn = SCHEDULES[name]
    compute = [fn(rank, pp_size, num_microbatches, virtual_stages) for rank in range(pp_size)]
    return make_schedule(name, compute, pp_size, num_microbatches, virtual_stages,
                         PLACEMENT.get(name, "loop"))


def forward_schedule(schedule: Schedule) -> Schedule:
    """The forward-only schedule of ``schedule`` (evaluation): each rank's forwards in the same
    order, with their sends and receives, no backward."""
    compute = [[Action("F", a.microbatch, a.chunk) for a in schedule.compute(r) if a.kind == "F"]
               for r in range(schedule.pp_size)]
    return make_schedule(schedule.name + "-forward", compute, schedule.pp_size,
                         schedule.num_microbatches, schedule.virtual_stages, schedule.placement)


def make_schedule(name: str, compute: list[list[Action]], pp_size: int, num_microbatches: int,
                  virtual_stages: int = 1, placement: str = "loop") -> Schedule:
    """A :class:`Schedule` from each rank's compute order (F / B / W), communication added.

    The communication is placed by playing the compute orders in lockstep rounds: in each round
    every rank runs its next compute action if its input has arrived, then every rank posts one
    batch holding the sends of what it just produced and the receives of what its neighbours just
    produced. A message is thus received in the round it is sent (receives are posted as early as
    they can be), and the batches of one round pair up exactly, so the schedule cannot deadlock
    even when each batch blocks until complete. A compute order that waits on itself raises
    :class:`ScheduleError`. ``placement`` (:func:`fastpar.pipeline.actions.stage_of`): where the
    stages sit; a neighbour on the same rank takes the output with no message. An overlapped F
    and the B after it are one unit: they run in the same round, once both inputs are there.
    """
    if len(compute) != pp_size:
        raise ValueError(f"{name}: compute orders for {len(compute)} ranks, pp_size={pp_size}")
    last = pp_size * virtual_stages - 1
    actions: list[list[Action]] = [[] for _ in range(pp_size)]
    pos, arrived = [0] * pp_size, set()
    while any(pos[r] < len(compute[r]) for r in range(pp_size)):
        produced, ran = [], False                  # (rank, action) whose output goes out now
        for rank in range(pp_size):
            if pos[rank] == len(compute[rank]):
                continue
            unit = compute[rank][pos[rank]:pos[rank] + 1]
            if unit[0].overlap:
                unit = compute[rank][pos[rank]:pos[rank] + 2]
            if not all(_has_input(a, stage_of(placement, pp_size, rank, a.chunk), last, arrived)
                       for a in unit):
                continue
            actions[rank] += unit
            pos[rank], ran = pos[rank] + len(unit), True
            for a in unit:
                stage = stage_of(placement, pp_size, rank, a.chunk)
                if (a.kind == "F" and stage < last) or (a.kind == "B" and stage > 0):
                    produced.append((rank, a))
        if not ran:
            raise ScheduleError(f"schedule {name!r} deadlocks: " + "; ".join(
                f"rank {r} waits at {compute[r][pos[r]]!r}" for r in range(pp_size)
                if pos[r] < len(compute[r])))
        for rank, a in produced:                   # the round's batches
            stage = stage_of(placement, pp_size, rank, a.chunk)
            to = stage + 1 if a.kind == "F" else stage - 1
            to_rank, to_chunk = rank_of(placement, pp_size, to)
            if to_rank != rank:                    # a local handoff needs no message
                actions[rank].append(Action("SEND_" + a.kind, a.microbatch, a.chunk))
                actions[to_rank].append(Action("RECV_" + a.kind, a.microbatch, to_chunk))
            arrived.add((a.kind, a.microbatch, to))
    return Schedule(name, pp_size, num_microbatches, virtual_stages, actions, placement)


def _has_input(a: Action, stage: int, last: int, arrived: set) -> bool:
    needs = (("F", a.microbatch, stage) if a.kind == "F" and stage > 0 else
             ("B", a.microbatch, stage) if a.kind == "B" and stage < last else None)
    return needs is None or needs in arrived
