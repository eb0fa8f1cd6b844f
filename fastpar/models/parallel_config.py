"""ParallelConfig: how one training step is laid out and run, checked in one place.

It names the pipeline schedule and the recomputation, so it lives on the model's floor, above the
parallelisms whose names it checks; the trainer's config extends it and the planner searches it.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..mesh.layout import Layout, require_positive
from ..context_parallel import check_seq_len
from ..pipeline.schedules import SCHEDULES, check_args
from .gpt import RECOMPUTE


@dataclass(frozen=True)
class ParallelConfig:
    """How one training step is laid out and run: the sizes of the three dimensions, the
    pipeline schedule, micro-batching, recomputation, sequence parallelism and ZeRO-1.

    ``fastpar.train.TrainConfig`` is one (plus the run's other settings); the planner searches
    them. :meth:`check` is the one place their combination with a model and a world is checked.
    """

    tp: int = 1                         # tensor-parallel size
    pp: int = 1                         # pipeline-parallel size
    dp: int | None = None               # data-parallel size; None = world / (tp * pp)
    virtual_stages: int = 1             # model chunks per pipeline rank (interleaved)
    micro_batch_size: int = 1           # sequences per micro-batch
    schedule: str = "1f1b"              # pipeline schedule when pp > 1: gpipe | 1f1b |
                                        # interleaved | zb-h1 | zb-v | dualpipe-v (the V
                                        # shapes: two stages per rank)
    recompute: str = "none"             # activation recomputation: none | selective | full
    sequence_parallel: bool = False     # sequence parallelism inside TP
    zero: int = 0                       # ZeRO stage over the DP group: 1 shards the optimizer
                                        # state, 2 the gradients as well, 3 the parameters too
                                        # (0: none)
    cp: int = 1                         # context-parallel size: each sequence split over cp
                                        # ranks, attention by a key/value ring
    dp_shard: int = 0                   # HSDP: shard the ZeRO state over groups of this many
                                        # dp ranks (a node), replicate across the groups
                                        # (0: over the whole dp group)
    interleave: int = 1                 # micro-batches run forward together, interleaved block
                                        # by block, so one's TP all-reduces travel while the
                                        # next one computes (tp > 1, no SP or pipeline); their
                                        # activations are all held until backward (1: off)
    fb_overlap: bool = True             # run each micro-batch's forward inside the previous
                                        # one's backward, so the forward's TP all-reduces and
                                        # the backward's travel under each other's compute, at
                                        # one micro-batch's activations (where it applies: tp >
                                        # 1 without SP, pp, cp, full recompute, ZeRO-3 or
                                        # --interleave, 2 or more micro-batches per step)
    ep: int = 1                         # expert-parallel size: each MoE layer's experts split
                                        # over groups of this many data-parallel ranks, tokens
                                        # sent to them by all-to-all (1: every rank all experts)
    ep_chunks: int = 2                  # dispatch each MoE layer's tokens in this many chunks,
                                        # each chunk's all-to-all travelling while another's
                                        # experts compute (1: one blocking all-to-all each way)
    ep_fold_tp: bool = False            # fold TP into expert parallelism (Megatron's MoE
                                        # parallel folding, expert TP 1): an ep group is whole
                                        # TP groups of ep / tp data-parallel ranks, so each TP
                                        # rank holds other experts instead of the same ones
                                        # (needs --sequence-parallel; ep a multiple of tp)

    @property
    def ep_dp(self) -> int:
        """Data- (and context-) parallel ranks in an ep group: ``ep``, or ``ep / tp`` when TP
        is folded into it."""
        return self.ep // self.tp if self.ep_fold_tp else self.ep

    def num_microbatches(self, global_batch: int, dp: int | None = None) -> int:
        return global_batch // (self.micro_batch_size * (dp or self.dp))

    def check_fields(self, flags: bool = False) -> None:
        """The checks that need no model or world: sizes >= 1, known schedule and recompute."""
        require_positive({k: getattr(self, k) for k in ("tp", "pp", "cp", "virtual_stages",
                                                        "micro_batch_size", "interleave",
                                                        "ep", "ep_chunks")},
                         flags=flags)
        if self.dp is not None:
            require_positive({"dp": self.dp}, flags=flags)
        if isinstance(self.dp_shard, bool) or not isinstance(self.dp_shard, int) or \
                self.dp_shard < 0:
            shown = "--dp-shard" if flags else "dp_shard"
            raise ValueError(f"{shown}={self.dp_shard!r} must be an int >= 0 (0: shard over "
                             f"the whole dp group)")
        if self.zero not in (0, 1, 2, 3):
            shown = "--zero" if flags else "zero"
            raise ValueError(f"{shown}={self.zero!r} is not one of (0, 1, 2, 3): 1 shards the "
                             f"optimizer state over the DP group, 2 the gradients as well, 3 "
                             f"the parameters too")
        for name, allowed in (("schedule", tuple(SCHEDULES)), ("recompute", RECOMPUTE)):
            if getattr(self, name) not in allowed:
                shown = "--" + name if flags else name
                raise ValueError(f"{shown}={getattr(self, name)!r} is not one of {allowed}")

    def check(self, model, world: int, global_batch: int, seq_len: int,
              world_name: str = "world size ") -> Layout:
        """The :class:`~fastpar.mesh.Layout` of ``world`` ranks, once this layout is checked to
        run ``model`` (a ``GPTConfig``) with ``global_batch`` sequences of ``seq_len`` tokens per
        step; raises ValueError naming the numbers if it cannot."""
        self.check_fields()
        lay = Layout(world, self.tp, self.pp, self.dp, cp=self.cp, world_name=world_name)
        dp = lay.dp
        if self.dp_shard:
            if not self.zero:
                raise ValueError(f"--dp-shard={self.dp_shard} shards ZeRO state: it needs "
                                 f"--zero 1, 2 or 3")
            if dp % self.dp_shard:
                raise ValueError(f"--dp-shard={self.dp_shard} must divide dp={dp}")
        if self.cp > 1:
            check_seq_len(seq_len, self.cp)
        model.check_tp(self.tp)
        if self.ep > 1 or self.ep_fold_tp:
            k = self.ep_dp
            fold = self.ep_fold_tp
            bad = [why for wrong, why in (
                (not model.n_experts, "the model has no experts (n_experts=0)"),
                (model.n_experts % self.ep, f"n_experts={model.n_experts} is not a multiple "
                                            f"of ep={self.ep}"),
                (fold and (self.tp < 2 or not self.sequence_parallel),
                 f"folding TP into ep needs tp > 1 and --sequence-parallel (each TP rank routes "
                 f"its own tokens; got tp={self.tp}, sequence_parallel="
                 f"{self.sequence_parallel})"),
                (fold and self.ep % self.tp, f"ep={self.ep} is not a multiple of tp={self.tp} "
                                             f"(folded, an ep group is whole TP groups)"),
                (not (fold and self.ep % self.tp) and (dp * self.cp) % k,
                 f"ep={self.ep}" + (f" / tp = {k}" if fold else "") +
                 f" does not divide dp x cp = {dp} x {self.cp}"),
                (0 < self.dp_shard < dp and not (fold and self.ep % self.tp) and
                 (self.dp_shard * self.cp) % k,
                 f"ep={self.ep}" + (f" / tp = {k}" if fold else "") +
                 f" does not divide an HSDP shard group of dp_shard x cp = "
                 f"{self.dp_shard} x {self.cp} ranks (the experts' replicas are sharded "
                 f"inside it)"))
                   if wrong]
            if bad:
                raise ValueError(f"--ep={self.ep}" + (" --ep-fold-tp" if fold else "") + ": " +
                                 "; ".join(bad))
        if model.n_layers < self.pp * self.virtual_stages:
            raise ValueError(f"the model has {model.n_layers} layers, fewer than pp x virtual "
                             f"stages = {self.pp} x {self.virtual_stages}")
        if global_batch % (self.micro_batch_size * dp):
            raise ValueError(f"global batch {global_batch} is not divisible by micro-batch "
                             f"size x dp = {self.micro_batch_size} x {dp}")
        if self.sequence_parallel and (seq_len // self.cp) % self.tp:
            shards = f"the {seq_len // self.cp} tokens per CP rank are" if self.cp > 1 else \
                f"--seq-len={seq_len} is"
            raise ValueError(f"{shards} not divisible by tp={self.tp} under sequence "
                             f"parallelism")
        check_args(self.schedule, self.pp, self.num_microbatches(global_batch, dp),
                   self.virtual_stages)
        self._check_interleave(self.num_microbatches(global_batch, dp), model.dropout)
        return lay

    def fb_overlapped(self, micro_batches: int) -> bool:
        """Whether steps run each micro-batch's forward inside the previous one's backward
        (``fb_overlap``, where the layout has TP all-reduces for it to hide and runs its
        micro-batches one after another)."""
        return (self.fb_overlap and self.tp > 1 and not self.sequence_parallel
                and self.pp == 1 and self.cp == 1 and self.recompute != "full"
                and self.zero != 3 and self.interleave == 1 and micro_batches >= 2)

    def _check_interleave(self, micro_batches: int, dropout: float) -> None:
        """Interleaved micro-batches hide the TP all-reduces of the blocks' forwards; where
        there are none, or the step runs its micro-batches its own way, refuse."""
        if self.interleave == 1:
            return
        why = [why for bad, why in (
            (self.tp == 1, "tp=1 (no all-reduce to hide)"),
            (self.sequence_parallel, "sequence parallelism (its reduce-scatters overlap the "
                                     "GEMMs already)"),
            (self.pp > 1, f"pp={self.pp} (the pipeline schedule orders the micro-batches)"),
            (self.cp > 1, f"cp={self.cp}"),
            (self.recompute == "full", "recompute 'full'"),
            (self.zero == 3, "zero 3 (its gathers run in block hooks)"),
            (micro_batches < 2, f"{micro_batches} micro-batch per step"),
            (dropout > 0, f"dropout={dropout} (its masks would be drawn in another order)"))
               if bad]
        if why:
            raise ValueError(f"interleave={self.interleave} needs tp > 1 and 2 or more "
                             f"micro-batches per step, without sequence parallelism, pp, cp, "
                             f"full recompute, zero 3 or dropout; got " + "; ".join(why))
