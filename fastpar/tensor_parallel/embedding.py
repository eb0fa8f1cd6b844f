"""Vocabulary-parallel embedding (Megatron's ``VocabParallelEmbedding``).

The table ``W`` (V, D) is cut along the vocabulary: TP rank ``r`` of ``tp`` holds the rows
``[r*V/tp, (r+1)*V/tp)``. For ids ``x``, every rank looks up the ids it owns and writes zeros
for the others, so the full lookup is the sum over ranks:

    E[x] = sum_r  1[x in range_r] * W_r[x - r*V/tp]

Forward sums with an all-reduce (output replicated, ``(..., D)``) or, under sequence parallelism,
with a reduce-scatter along the sequence (ids ``(S, B)`` or ``(T,)`` -> output ``(S/tp, B, D)``
or ``(T/tp, D)``). Backward is the identity (resp. an all-gather), and each rank's weight
gradient is the scatter-add of its own rows only: no communication for the weight.

Initialisation consumes the RNG exactly as ``nn.Embedding(V, D)`` does (the full table is drawn
on every rank and sliced), so under the same seed the shards are slices of that embedding.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..mesh.groups import all_gather_tensor
from fastpar.tensor_parallel.mappings import (
    Group, group_rank, group_size, reduce_from_tp, reduce_scatter_to_sp)
from . import overlap
from .linear import TPSharded


class VocabParallelEmbedding(TPSharded):
    """An embedding whose vocabulary is sharded over ``tp_group``; see the module doc.

    With ``tp_group=None`` (or a group of size 1) it computes exactly ``nn.Embedding``.
    ``sequence_parallel=True`` reduce-scatters the output along dim 0 (sequence-first ids).
    """

    tp_shard_dims = {"weight": 0}  # the vocabulary rows

    def __init__(self, num_embeddings: int, embedding_dim: int, *, tp_group: Group = None,
                 sequence_parallel: bool = False, dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None, _weight: torch.Tensor | None = None):
        super().__init__()
        tp, rank = group_size(tp_group), group_rank(tp_group)
        if num_embeddings % tp:
            raise ValueError(f"VocabParallelEmbedding: num_embeddings={num_embeddings} "
                             f"is not divisible by tp={tp}")
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.tp_group, self.tp_size, self.tp_rank = tp_group, tp, rank
        self.sequence_parallel = sequence_parallel
        per_rank = num_embeddings // tp
        self.vocab_start, self.vocab_end = rank * per_rank, (rank + 1) * per_rank
        if _weight is None:  # draw the full table as nn.Embedding does: same seed -> same slice
            full, requires_grad = torch.empty(num_embeddings, embedding_dim, dtype=dtype,
                                              device=device), True
            nn.init.normal_(full)
        else:  # the (V, D) table to slice, like nn.Embedding's private `_weight`
            full, requires_grad = _weight.detach(), _weight.requires_grad
            if full.shape != (num_embeddings, embedding_dim):
                raise ValueError(f"VocabParallelEmbedding: _weight shape {tuple(full.shape)} "
                                 f"!= ({num_embeddings}, {embedding_dim})")
        shard = full[self.vocab_start:self.vocab_end].clone()  # (V/tp, D)
        self.weight = nn.Parameter(shard, requires_grad=requires_grad)

    @classmethod
    def from_embedding(cls, module: nn.Embedding, tp_group: Group = None,
                       sequence_parallel: bool = False) -> "VocabParallelEmbedding":
        """Shard an existing ``nn.Embedding``: copy this rank's rows, keep ``requires_grad``."""
        unsupported = {k: getattr(module, k) for k in ("padding_idx", "max_norm")
                       if getattr(module, k) is not None}
        unsupported.update({k: True for k in ("scale_grad_by_freq", "sparse")
                            if getattr(module, k)})
        if unsupported:
            raise ValueError(f"VocabParallelEmbedding.from_embedding: {unsupported} "
                             "is not supported")
        w = module.weight
        return cls(w.shape[0], w.shape[1], tp_group=tp_group,
                   sequence_parallel=sequence_parallel, _weight=w)

    @torch.no_grad()
    def full_weight(self) -> torch.Tensor:
        """All-gather the shards: the full (V, D) table on every rank, without grad."""
        w = self.weight.detach().contiguous()
        if self.tp_size == 1:
            return w.clone()
        out = w.new_empty((self.num_embeddings, self.embedding_dim))
        all_gather_tensor(out, w, group=self.tp_group)  # shards in group-rank order
        return out

    def forward(self, ids: torch.Tensor, defer: bool = False) -> torch.Tensor:
        """ids (S, B) or (T,), any shape without SP -> (..., D); under SP (S/tp, ..., D).
        ``defer`` (no SP, inside ``overlap.deferred_reductions``): the output's all-reduce is
        left in flight in its works; the caller reads the output only after waiting them."""
        self._check(ids)
        if ids.dtype not in (torch.int32, torch.int64):
            ids = ids.long()
        if self.tp_size == 1:
            return F.embedding(ids, self.weight)
        outside = (ids < self.vocab_start) | (ids >= self.vocab_end)
        local = (ids - self.vocab_start).masked_fill(outside, 0)
        out = F.embedding(local, self.weight).masked_fill(outside.unsqueeze(-1), 0)  # (..., D)
        if self.sequence_parallel:
            return reduce_scatter_to_sp(out, self.tp_group)
        if defer and overlap.defers():
            return overlap.ReduceLater.apply(out, self.tp_group)
        return reduce_from_tp(out, self.tp_group)

    def _check(self, ids: torch.Tensor) -> None:
        """Raise on every rank, before any collective, so a bad batch cannot hang the group."""
        if ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
            raise ValueError(f"VocabParallelEmbedding: ids must be an integer tensor, "
                             f"got dtype {ids.dtype}")
        if self.sequence_parallel and self.tp_size > 1:
            if ids.dim() == 0 or ids.shape[0] % self.tp_size:
                seq = ids.shape[0] if ids.dim() else "none (0-d ids)"
                raise ValueError(f"VocabParallelEmbedding: sequence length={seq} (dim 0 of ids) "
                                 f"is not divisible by tp={self.tp_size} under sequence "
                                 "parallelism")

    def extra_repr(self) -> str:
        return (f"{self.num_embeddings}, {self.embedding_dim}, tp={self.tp_size}, "
                f"vocab=[{self.vocab_start}, {self.vocab_end}), "
                f"sequence_parallel={self.sequence_parallel}")
