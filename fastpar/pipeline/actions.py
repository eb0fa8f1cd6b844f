"""Schedules are data: an :class:`Action` list per pipeline rank, validated when it is built.

Stages and chunks. With ``pp`` ranks and ``v`` virtual stages the model is cut into ``pp * v``
stages; rank ``r`` holds chunks ``0..v-1``, and chunk ``c`` on rank ``r`` is stage ``c * pp + r``
(Megatron's interleaved layout: stage ``s`` feeds stage ``s + 1``, which lives on the next rank,
wrapping from the last rank to rank 0 between chunks).

Actions. ``F`` runs a stage's forward for a micro-batch, ``B`` its backward (only the input
gradient when the schedule also has ``W``), ``W`` the deferred weight gradient. ``SEND_F`` /
``RECV_F`` move the activation that enters a stage, ``SEND_B`` / ``RECV_B`` the gradient that leaves
it. Consecutive communication actions on a rank form one batch, posted together with
``batch_isend_irecv``. A send's ``chunk`` is the sender's chunk; a receive's is the receiver's.

Every :class:`Schedule` is checked in ``__post_init__`` (see :mod:`.validate`): each micro-batch's
F precedes its B precedes its W on every chunk, every stage receives what it consumes and sends what
it produces, sends and receives pair up across ranks in the same order, and the schedule cannot
deadlock even if every batch blocks its rank until all of its sends and receives have met their
peers (the strictest p2p model; gloo's and NCCL's async p2p are looser). The peak number of live
activations per rank comes out of the same pass.
"""
from __future__ import annotations

from dataclasses import dataclass, field

KINDS = ("F", "B", "W", "SEND_F", "RECV_F", "SEND_B", "RECV_B")
COMPUTE_KINDS = ("F", "B", "W")


class ScheduleError(ValueError):
    """A schedule that breaks an invariant (order, pairing, deadlock); the message says where."""


@dataclass(frozen=True)
class Action:
    """One step of one rank: ``kind`` on micro-batch ``microbatch`` of local chunk ``chunk``."""

    kind: str
    microbatch: int
    chunk: int = 0

    @property
    def is_compute(self) -> bool:
        return self.kind in COMPUTE_KINDS

    def __repr__(self) -> str:
        return f"{self.kind}{self.microbatch}" + (f".{self.chunk}" if self.chunk else "")


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
    split_backward: bool = field(init=False)
    peak_activations: tuple = field(init=False)     # per rank: most micro-batch chunks alive

    def __post_init__(self):
        from .validate import validate

        object.__setattr__(self, "actions", tuple(tuple(a) for a in self.actions))
        split, peaks = validate(self)
        object.__setattr__(self, "split_backward", split)
        object.__setattr__(self, "peak_activations", tuple(peaks))

    @property
    def num_stages(self) -> int:
        return self.pp_size * self.virtual_stages

    def stage_index(self, rank: int, chunk: int) -> int:
        """The model stage that ``chunk`` of ``rank`` holds."""
        return chunk * self.pp_size + rank

    def peer(self, rank: int, action: Action) -> int:
        """The rank a communication action talks to."""
        step = 1 if action.kind in ("SEND_F", "RECV_B") else -1
        return (self.stage_index(rank, action.chunk) + step) % self.pp_size

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

    def __repr__(self) -> str:
        return (f"Schedule({self.name!r}, pp_size={self.pp_size}, "
                f"num_microbatches={self.num_microbatches}, "
                f"virtual_stages={self.virtual_stages}, peak={list(self.peak_activations)})")

    def table(self) -> str:
        """The compute order of every rank, one line each (communication left out)."""
        return "\n".join(f"rank {r}: " + " ".join(map(repr, self.compute(r)))
                         for r in range(self.pp_size))
