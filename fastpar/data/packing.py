"""Documents in the global batch: packed windows, padded rows, loss masks.

A prepared token file records where each document starts. :class:`DocumentSampler` uses it:

- **packed** (``fastpar train``'s default for such data): each row is a window of ``seq_len + 1``
  tokens that starts where a document (or a *piece* of one) starts and runs on through the next
  documents. A piece: a document longer than a window is cut every ``seq_len`` tokens, so each
  of its targets is in exactly one piece. Positions restart at 0 at every document start (and at
  the row's start), and attention stops at those starts (the model reads them from the positions:
  :mod:`fastpar.models.documents`). The target that would be predicted across a boundary (the
  next document's first token) is masked (-100), as Megatron's ``eod_mask_loss`` does: each
  document trains as if it ran alone.
- **padded** (the baseline): each row is one piece from its start, padded with token 0 past its
  end; the padding's targets are masked. Plain causal attention is exact for it.
- **stream**: windows at any token offset, as :class:`~fastpar.data.sources.BatchSampler`
  draws them (the same rows), documents ignored: for sources without document offsets.

The window is drawn as :class:`~fastpar.data.sources.BatchSampler` draws it: ``rng((seed, step))``
picks a token offset, which snaps back to the start of the piece that holds it (so a piece is
picked with probability proportional to its length), and every rank draws the whole global
batch's offsets and reads only its share of rows.

A loss mask (``prepare-data`` on prompt / response pairs writes one: ``fastpar.data.masks``)
masks the targets whose mask value is 0 as well. Every step's global count of trained targets is
computed on the host from the offsets (and the mask's values over the global batch's windows),
so the trainer divides the loss by it before any collective: :attr:`Batch.trained`
(:meth:`DocumentSampler.trained`: two binary searches per window, no window built).
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

IGNORE = -100                   # a target the loss skips (torch's ignore_index)
MODES = ("packed", "padded", "stream")


class Batch(NamedTuple):
    """One data-parallel rank's share of a step's global batch."""

    inputs: torch.Tensor            # (B_local, S) int64
    targets: torch.Tensor           # (B_local, S) int64, IGNORE where not trained
    positions: torch.Tensor | None  # (B_local, S) int64 positions in their documents; None: 0..S-1
    trained: int                    # targets trained in the whole global batch (every rank's)


def piece_starts(doc_starts: np.ndarray, n_tokens: int, seq_len: int) -> np.ndarray:
    """Where a window may start: each document's start, and every ``seq_len`` tokens into a
    document longer than that, except at a document's last token (no target inside); a
    one-token document still starts a piece (packed, its window trains the documents after it;
    padded, it trains nothing)."""
    starts = np.asarray(doc_starts, dtype=np.int64)
    ends = np.append(starts[1:], n_tokens)
    n = np.maximum((ends - starts - 2) // seq_len + 1, 1)     # pieces with >= 1 target inside
    first = np.repeat(starts, n)
    k = np.arange(len(first)) - np.repeat(np.cumsum(n) - n, n)
    return first + k * seq_len


def attention_span(doc_starts: np.ndarray, n_tokens: int, seq_len: int) -> float:
    """The keys a token's document holds on average, token-weighted, a document longer than a
    sequence counted as its pieces (at most ``seq_len`` each): sum(l^2) / sum(l) over the
    pieces. What attention inside packed documents costs per token, against ``seq_len`` for
    whole sequences (:meth:`fastpar.models.GPTConfig.layer_flops`'s ``span``); an upper bound,
    as a window also cuts its last document."""
    starts = np.asarray(doc_starts, dtype=np.int64)
    lengths = np.diff(np.append(starts, n_tokens)).astype(np.float64)
    full, rest = np.divmod(lengths, seq_len)
    return float((full * seq_len ** 2 + rest ** 2).sum() / lengths.sum())


class DocumentSampler:
    """Like :class:`~fastpar.data.sources.BatchSampler`, over documents (module docstring):
    :meth:`batch` gives a :class:`Batch`."""

    def __init__(self, tokens: np.ndarray, doc_starts: np.ndarray, seq_len: int,
                 global_batch: int, seed: int = 0, dp_rank: int = 0, dp_size: int = 1,
                 mode: str = "packed", mask: np.ndarray | None = None):
        if mode not in MODES:
            raise ValueError(f"DocumentSampler: mode={mode!r} is not one of {', '.join(MODES)}")
        if global_batch % dp_size:
            raise ValueError(f"global batch {global_batch} is not divisible by dp={dp_size}")
        if len(tokens) < seq_len + 2:
            raise ValueError(f"data has {len(tokens)} tokens, fewer than seq_len + 2 = "
                             f"{seq_len + 2}")
        if mask is not None and len(mask) != len(tokens):
            raise ValueError(f"loss mask has {len(mask)} values for {len(tokens)} tokens")
        self.tokens, self.mask, self.mode = tokens, mask, mode
        self.doc_starts = np.asarray(doc_starts, dtype=np.int64) if len(doc_starts) else \
            np.zeros(1, np.int64)
        self.pieces = piece_starts(self.doc_starts, len(tokens), seq_len)
        self.seq_len, self.global_batch = seq_len, global_batch
        self.seed, self.dp_rank, self.dp_size = seed, dp_rank, dp_size

    def attention_span(self) -> float | None:
        """:func:`attention_span` of the data when packed; None otherwise (whole sequences)."""
        if self.mode != "packed":
            return None
        return attention_span(self.doc_starts, len(self.tokens), self.seq_len)

    def windows(self, step: int) -> np.ndarray:
        """Start offsets of the whole global batch of ``step`` (identical on every rank)."""
        rng = np.random.default_rng((self.seed, step))
        o = rng.integers(0, len(self.tokens) - self.seq_len - 1, size=self.global_batch)
        if self.mode == "stream":
            return o
        return self.pieces[np.searchsorted(self.pieces, o, side="right") - 1]

    def _layout(self, w: int) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """The window at ``w``: which of its S + 1 tokens are real (not padding), which of its
        S targets are trained, and the S inputs' positions (None: 0 .. S-1). Reads the mask,
        not the tokens."""
        S = self.seq_len
        keep = np.ones(S, bool) if self.mask is None else \
            np.asarray(self.mask[w + 1:w + S + 1]) != 0
        if self.mode == "stream":
            return np.ones(S + 1, bool), keep, None
        idx = np.arange(w, w + S + 1)
        doc = np.maximum(self.doc_starts[np.searchsorted(self.doc_starts, idx, "right") - 1], w)
        keep &= doc[1:] == doc[:-1]                 # the target is in its input's document
        if self.mode == "padded":                   # the row's first document only
            real = doc == w
            return real, keep & real[1:], None
        return np.ones(S + 1, bool), keep, idx[:-1] - doc[:-1]

    def trained(self, ws: np.ndarray) -> int:
        """The trained targets of the windows ``ws``: what :meth:`_layout` keeps, counted from
        the document offsets (two binary searches per window) and the mask's sums, without
        building the windows: cheap for a global batch of thousands of sequences."""
        S, starts = self.seq_len, self.doc_starts
        ws = np.asarray(ws, dtype=np.int64)
        if self.mode == "padded":       # the targets inside the row's first document
            end = np.append(starts, len(self.tokens))[np.searchsorted(starts, ws, "right")]
            lengths = np.minimum(end - ws - 1, S)
            return int(lengths.sum() if self.mask is None else
                       sum(int(np.count_nonzero(self.mask[w + 1:w + 1 + n]))
                           for w, n in zip(ws, lengths)))
        kept = len(ws) * S if self.mask is None else \
            sum(int(np.count_nonzero(self.mask[w + 1:w + S + 1])) for w in ws)
        if self.mode == "stream":
            return kept
        lo, hi = np.searchsorted(starts, ws, "right"), np.searchsorted(starts, ws + S, "right")
        if self.mask is None:           # a boundary's target (a document's first token) is out
            return int(kept - (hi - lo).sum())
        first = np.concatenate([starts[a:b] for a, b in zip(lo, hi)] or [np.zeros(0, np.int64)])
        return int(kept - np.count_nonzero(np.asarray(self.mask)[first]))

    def batch(self, step: int) -> Batch:
        """This rank's rows of ``step`` and the global batch's trained-target count."""
        ws = self.windows(step)
        per = self.global_batch // self.dp_size
        mine = ws[self.dp_rank * per:(self.dp_rank + 1) * per]
        layouts = [self._layout(w) for w in mine]
        S = self.seq_len
        toks = torch.from_numpy(np.stack([
            np.where(real, np.asarray(self.tokens[w:w + S + 1], np.int64), 0)
            for w, (real, _, _) in zip(mine, layouts)]))
        keep = torch.from_numpy(np.stack([k for _, k, _ in layouts]))
        positions = torch.from_numpy(np.stack([p for _, _, p in layouts])) \
            if self.mode == "packed" else None
        return Batch(toks[:, :-1], toks[:, 1:].masked_fill(~keep, IGNORE), positions,
                     self.trained(ws))
