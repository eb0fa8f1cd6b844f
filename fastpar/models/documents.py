"""Packed documents: attention that stops at each document's start.

A packed row holds several documents; each token's position counts from its document's start
(:mod:`fastpar.data.packing`), so a document starts wherever the position is 0 (and at the
row's start). :class:`Documents` holds a micro-batch's positions and those boundaries, built on
the host from host positions (no device sync: the boundaries are host integers), and
:func:`document_attention` is causal attention inside each document:

- CUDA: one call of the variable-length flash kernel over the batch flattened to
  (tokens, heads, head_dim) with the documents' cumulative lengths (``cu_seqlens``), as
  Megatron's THD format and flash-attention's ``flash_attn_varlen_func`` do;
- elsewhere: one fused SDPA call per document (tiled: no S x S mask is ever built).

Under context parallelism the ring takes the boundaries of the whole sequence
(:func:`fastpar.context_parallel.ring_attention` with ``bounds``) and computes only the block
pairs a document connects. The sequence is still cut into ``2 x cp`` chunks, two per rank, but
with ``cp_balance="work"`` (the default) they are dealt out by attention work, not by the
zigzag: the work of each (query chunk, key chunk) pair is the query-key pairs its documents
connect, and the layout is the one whose ring steps, each as long as its busiest rank, add up
to the least (:func:`fastpar.context_parallel.sharding.balanced_chunks`). Every rank computes
the same layout from the same host positions; :meth:`Documents.shard` cuts inputs and targets
by it.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..context_parallel.sharding import (balanced_chunks, check_seq_len, chunk_ids, pair_work,
                                         ring_cost, shard_chunks)

CP_BALANCE = ("work", "zigzag")


class Documents:
    """The document structure of a (B, S) batch from its positions: ``positions`` (on the
    model's device), and per row the start index of each document (host ints)."""

    def __init__(self, positions: torch.Tensor, device=None, cp_balance: str = "work"):
        if cp_balance not in CP_BALANCE:
            raise ValueError(f"Documents: cp_balance={cp_balance!r} is not one of "
                             f"{', '.join(CP_BALANCE)}")
        self.cp_balance, self._layouts = cp_balance, {}
        if positions.dim() != 2:
            raise ValueError(f"Documents: positions must be (B, S), got {tuple(positions.shape)}")
        host = self._host = positions.cpu()
        B, S = host.shape
        new = host == 0
        new[:, 0] = True
        self.starts = [torch.nonzero(new[b]).flatten().tolist() for b in range(B)]
        self.shape = (B, S)
        self.positions = positions if device is None else _to(positions, device)
        self._cu = None

    def __repr__(self) -> str:
        return f"Documents(shape={self.shape}, documents={sum(map(len, self.starts))})"

    @property
    def bounds(self) -> list[int]:
        """Every row's document starts, flattened: per row its count, then the starts."""
        return [x for s in self.starts for x in (len(s), *s)]

    def spans(self, b: int) -> list[tuple[int, int]]:
        """Row ``b``'s documents as [start, end) token ranges."""
        s = self.starts[b]
        return list(zip(s, s[1:] + [self.shape[1]]))

    def cu_seqlens(self, device) -> tuple[torch.Tensor, int]:
        """(cumulative lengths (int32, documents + 1) of the flattened batch, longest length)."""
        if self._cu is None:
            S = self.shape[1]
            ends = [b * S + s for b in range(self.shape[0]) for s in self.starts[b]]
            cu = torch.tensor(ends + [self.shape[0] * S], dtype=torch.int32)
            self._cu = (_to(cu, device), int((cu[1:] - cu[:-1]).max()))
        return self._cu

    def cp_layout(self, cp_size: int) -> list[tuple[int, ...]]:
        """Each CP rank's two chunks (of ``2 x cp_size``), by work or zigzag (module
        docstring)."""
        if cp_size not in self._layouts:
            check_seq_len(self.shape[1], cp_size)
            if self.cp_balance == "zigzag":
                layout = [chunk_ids(r, cp_size) for r in range(cp_size)]
            else:
                layout = balanced_chunks(self.pair_work(cp_size), cp_size)
            self._layouts[cp_size] = layout
        return self._layouts[cp_size]

    def pair_work(self, cp_size: int) -> list[list[float]]:
        """The attention work of each (query chunk, key chunk) pair of the ``2 x cp_size``
        chunks, over this micro-batch (:func:`~fastpar.context_parallel.sharding.pair_work`)."""
        return pair_work(self.starts, self.shape[1], 2 * cp_size)

    def ring_balance(self, cp_size: int) -> float:
        """How long the ring's steps take against perfect balance, in query-key pairs: the sum
        over its steps of the busiest rank's work, over the total / cp."""
        w = self.pair_work(cp_size)
        return ring_cost(self.cp_layout(cp_size), w) * cp_size / sum(map(sum, w))

    def ring_chunks(self, cp_size: int) -> list[int]:
        """:meth:`cp_layout` flattened in rank order, as the ring takes it."""
        return [c for r in self.cp_layout(cp_size) for c in r]

    def shard(self, t: torch.Tensor, cp_rank: int, cp_size: int, dim: int = 1) -> torch.Tensor:
        """This CP rank's chunks of a (B, S, ...) tensor of this batch along ``dim``."""
        return shard_chunks(t, self.cp_layout(cp_size)[cp_rank], 2 * cp_size, dim)

    def local(self, cp_rank: int, cp_size: int) -> torch.Tensor:
        """This context-parallel rank's positions (its chunks of every row)."""
        return self.shard(self.positions, cp_rank, cp_size)


def document_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       docs: Documents) -> torch.Tensor:
    """Causal attention inside each document: q (B, h, S, hd), k and v (B, h_kv, S, hd) ->
    (B, h, S, hd)."""
    B, h, S, hd = q.shape
    if docs.shape != (B, S):
        raise ValueError(f"document_attention: documents of shape {docs.shape}, q of batch {B} "
                         f"and length {S}")
    if q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and hd % 8 == 0 and hd <= 256:
        return _varlen_flash(q, k, v, docs)

    def causal(b, s, e):                      # one document of row b
        return F.scaled_dot_product_attention(q[b:b + 1, :, s:e], k[b:b + 1, :, s:e],
                                              v[b:b + 1, :, s:e], is_causal=True,
                                              enable_gqa=k.shape[1] != h)
    return torch.cat([torch.cat([causal(b, s, e) for s, e in docs.spans(b)], dim=2)
                      for b in range(B)], dim=0)


def _to(t: torch.Tensor, device) -> torch.Tensor:
    """A host tensor onto ``device``, without a sync on CUDA (pinned, non-blocking)."""
    device = torch.device(device)
    if t.device == device:
        return t
    if device.type == "cuda" and not t.is_cuda:
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def _varlen_flash(q, k, v, docs: Documents) -> torch.Tensor:
    """The variable-length flash kernel over the flattened batch (FlashAttention-2's varlen)."""
    B, h, S, hd = q.shape
    cu, longest = docs.cu_seqlens(q.device)

    def flat(t):                                  # (B, h, S, hd) -> (B * S, h, hd)
        return t.transpose(1, 2).reshape(B * S, t.shape[1], hd)
    out = torch.ops.aten._flash_attention_forward(
        flat(q), flat(k), flat(v), cu, cu, longest, longest, 0.0, True, False)[0]
    return out.view(B, S, h, hd).transpose(1, 2)
