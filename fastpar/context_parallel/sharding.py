"""The load-balanced sequence layout of context parallelism, defined once.

A sequence of ``S`` tokens is cut into ``2 * cp`` chunks of ``c = S / (2 * cp)`` tokens; CP rank
``r`` holds chunks ``r`` and ``2 * cp - 1 - r``, in that order (Megatron-Core, Llama 3). Under a
causal mask an early chunk has little to attend to and a late one much; pairing them gives every
rank the same work. With ``cp = 2`` and ``S = 8`` (``c = 2``)::

    tokens   0 1 | 2 3 | 4 5 | 6 7
    chunk    0   | 1   | 2   | 3
    rank 0 holds chunks 0, 3 -> tokens 0 1 6 7;  rank 1 holds chunks 1, 2 -> tokens 2 3 4 5

:func:`visible_block` is what that layout means for attention: which of a rank's query rows see
which of another rank's keys.
"""
from __future__ import annotations

import torch


def check_seq_len(seq_len: int, cp: int) -> None:
    """Raise ValueError naming both numbers unless ``seq_len`` splits into ``2 * cp`` chunks."""
    if not isinstance(cp, int) or cp < 1:
        raise ValueError(f"context parallelism: cp = {cp!r} must be an integer >= 1")
    if seq_len % (2 * cp):
        raise ValueError(f"context parallelism: sequence length {seq_len} is not divisible by "
                         f"2 x cp = {2 * cp} (each of the {cp} CP ranks holds two equal chunks)")


def _check_rank(cp_rank: int, cp_size: int) -> None:
    if not 0 <= cp_rank < cp_size:
        raise ValueError(f"context parallelism: cp_rank = {cp_rank} is not in [0, {cp_size})")


def chunk_ids(cp_rank: int, cp_size: int) -> tuple[int, int]:
    """The two global chunk indices CP rank ``cp_rank`` holds, in its order."""
    _check_rank(cp_rank, cp_size)
    return cp_rank, 2 * cp_size - 1 - cp_rank


def shard_sequence(x: torch.Tensor, cp_rank: int, cp_size: int, dim: int) -> torch.Tensor:
    """This rank's two chunks of the full tensor ``x`` along ``dim``, concatenated (a copy)."""
    check_seq_len(x.shape[dim], cp_size)
    chunks = x.chunk(2 * cp_size, dim=dim)
    first, second = chunk_ids(cp_rank, cp_size)
    return torch.cat([chunks[first], chunks[second]], dim=dim)


def unshard_sequence(shards: list[torch.Tensor] | tuple[torch.Tensor, ...],
                     dim: int) -> torch.Tensor:
    """The inverse of :func:`shard_sequence`: the full tensor from every rank's shard, in rank
    order (for tests and for gathering a sequence back)."""
    cp = len(shards)
    if cp < 1:
        raise ValueError("context parallelism: unshard_sequence needs at least one shard")
    lengths = {s.shape[dim] for s in shards}
    if len(lengths) != 1 or next(iter(lengths)) % 2:
        raise ValueError(f"context parallelism: shards must have one even length along dim "
                         f"{dim}; got {[s.shape[dim] for s in shards]}")
    chunks: list[torch.Tensor | None] = [None] * (2 * cp)
    for r, s in enumerate(shards):
        first, second = chunk_ids(r, cp)
        chunks[first], chunks[second] = s.chunk(2, dim=dim)
    return torch.cat(chunks, dim=dim)


def positions(seq_len: int, cp_rank: int, cp_size: int, device=None) -> torch.Tensor:
    """The true positions (int64, shape ``(seq_len / cp,)``) of this rank's tokens, for rotary
    and learned position embeddings."""
    check_seq_len(seq_len, cp_size)
    c = seq_len // (2 * cp_size)
    first, second = chunk_ids(cp_rank, cp_size)
    return torch.cat([torch.arange(first * c, (first + 1) * c, device=device),
                      torch.arange(second * c, (second + 1) * c, device=device)])


def visible_block(src: int, cp_rank: int, chunk: int) -> tuple[slice, slice, bool]:
    """Which rows of this rank's queries see which columns of CP rank ``src``'s keys, and
    whether that block is causal on its diagonal: ``(rows, cols, causal)`` over the local
    ``2 * chunk`` tokens of each side. Every case is about ``2 * chunk**2`` query-key pairs:

    - ``src == cp_rank``: causal over the local sequence (the second chunk sees the first fully,
      each chunk is causal on its diagonal);
    - ``src < cp_rank``: both local chunks see ``src``'s first chunk fully, its second not at all;
    - ``src > cp_rank``: only the second local chunk sees anything, both of ``src``'s chunks fully.
    """
    if src == cp_rank:
        return slice(None), slice(None), True
    if src < cp_rank:
        return slice(None), slice(0, chunk), False
    return slice(chunk, None), slice(None), False


def document_blocks(starts: list[int], seq_len: int, src: int, cp_rank: int, cp_size: int,
                    layout: list[tuple[int, ...]] | None = None
                    ) -> list[tuple[slice, slice, bool]]:
    """:func:`visible_block` for one sequence of packed documents (each document's start index
    in ``starts``; a query sees the keys of its own document only): the (rows, cols, causal)
    sub-blocks of this rank's local queries and CP rank ``src``'s local keys that a document
    connects, in local indices. Empty: the pair is skipped. ``layout``: each rank's chunks
    (:func:`balanced_chunks`), default the zigzag pairs of :func:`chunk_ids`. A chunk pair holds
    at most one sub-block per document, and a pair of different chunks at most one (the
    document that runs from the key chunk into the query chunk)."""
    mine = layout[cp_rank] if layout else chunk_ids(cp_rank, cp_size)
    theirs = layout[src] if layout else chunk_ids(src, cp_size)
    c = seq_len // (len(mine) * cp_size)
    ends = starts[1:] + [seq_len]
    out = []
    for qi, qc in enumerate(mine):
        for ki, kc in enumerate(theirs):
            if kc > qc:
                continue
            q0, k0 = qc * c, kc * c
            if kc == qc:                          # the diagonal: each document's square
                for s, e in zip(starts, ends):
                    a, b = max(s, q0), min(e, q0 + c)
                    if a < b:
                        rows = slice(qi * c + a - q0, qi * c + b - q0)
                        out.append((rows, slice(ki * c + a - k0, ki * c + b - k0), True))
                continue
            last = k0 + c - 1                     # the document of the key chunk's last token
            d = max(i for i, s in enumerate(starts) if s <= last)
            if ends[d] > q0:
                rows = slice(qi * c, qi * c + min(ends[d], q0 + c) - q0)
                cols = slice(ki * c + max(starts[d], k0) - k0, ki * c + c)
                out.append((rows, cols, False))
    return out


def causal_pairs(cp_rank: int, src: int, cp_size: int,
                 layout: list[tuple[int, ...]] | None = None) -> int:
    """How many (query chunk, key chunk) pairs of this rank and ``src`` the causal mask leaves
    anything in: what a ring without documents computes."""
    mine = layout[cp_rank] if layout else chunk_ids(cp_rank, cp_size)
    theirs = layout[src] if layout else chunk_ids(src, cp_size)
    return sum(kc <= qc for qc in mine for kc in theirs)


def pair_work(rows: list[list[int]], seq_len: int, n_chunks: int) -> list[list[float]]:
    """``w[i][j]``: the query-key pairs of query chunk i and key chunk j (of ``n_chunks`` equal
    ones) that a document connects, causal, summed over the sequences whose document starts are
    ``rows``: the attention work of that block pair."""
    c = seq_len // n_chunks
    w = [[0.0] * n_chunks for _ in range(n_chunks)]
    for starts in rows:
        for s, e in zip(starts, starts[1:] + [seq_len]):
            for qc in range(s // c, (e - 1) // c + 1):
                q0, q1 = max(s, qc * c), min(e, (qc + 1) * c)
                w[qc][qc] += (q1 - q0) * (q1 - q0 + 1) / 2       # the diagonal: a triangle
                for kc in range(s // c, qc):
                    w[qc][kc] += (q1 - q0) * (min(e, (kc + 1) * c) - max(s, kc * c))
    return w


def ring_cost(layout: list[tuple[int, ...]], w) -> float:
    """The ring's critical path in query-key pairs: at step i rank r attends its chunks to the
    keys of rank r - i, and a step lasts as long as its busiest rank; summed over the steps."""
    cp = len(layout)
    return sum(max(sum(w[q][k] for q in layout[r] for k in layout[(r - i) % cp])
                   for r in range(cp)) for i in range(cp))


def balanced_chunks(w, cp_size: int) -> list[tuple[int, ...]]:
    """Each CP rank's chunks (ascending; ``len(w) / cp_size`` each) for the block-pair work
    ``w`` (:func:`pair_work`): the layout of least :func:`ring_cost` found by dealing the chunks
    out by their work, longest first, each to the least loaded rank with room, then swapping
    two chunks, or two ranks' whole sets (the ring's order matters), while that lowers the
    cost. The zigzag pairs are a candidate too, so
    the result is never worse than them. Deterministic: every rank computes the same layout."""
    n = len(w)
    if n % cp_size:
        raise ValueError(f"context parallelism: {n} chunks do not split over cp = {cp_size}")
    per, load = n // cp_size, [0.0] * cp_size
    total = [sum(w[i]) + sum(w[j][i] for j in range(n)) - w[i][i] for i in range(n)]
    ranks: list[list[int]] = [[] for _ in range(cp_size)]
    for i in sorted(range(n), key=lambda i: (-total[i], i)):
        r = min((r for r in range(cp_size) if len(ranks[r]) < per), key=lambda r: (load[r], r))
        ranks[r].append(i)
        load[r] += total[i]
    candidates = [ranks]
    if per == 2:
        candidates.append([list(chunk_ids(r, cp_size)) for r in range(cp_size)])
    best = min(candidates, key=lambda lay: ring_cost(lay, w))
    cost, improved = ring_cost(best, w), True
    while improved:                     # moves: swap two chunks, or two ranks' whole sets
        improved = False
        for a in range(cp_size):
            for b in range(a + 1, cp_size):
                for i in range(-1, per):
                    for j in range(per) if i >= 0 else [None]:
                        lay = [list(r) for r in best]
                        if i < 0:
                            lay[a], lay[b] = lay[b], lay[a]
                        else:
                            lay[a][i], lay[b][j] = lay[b][j], lay[a][i]
                        c = ring_cost(lay, w)
                        if c < cost - 1e-9:
                            best, cost, improved = lay, c, True
    return [tuple(sorted(r)) for r in best]


def shard_chunks(x: torch.Tensor, chunks: tuple[int, ...], n_chunks: int,
                 dim: int) -> torch.Tensor:
    """The given chunks (of ``n_chunks`` equal ones) of ``x`` along ``dim``, concatenated."""
    parts = x.chunk(n_chunks, dim=dim)
    return torch.cat([parts[i] for i in chunks], dim=dim)


def row_starts(bounds: list[int]) -> list[list[int]]:
    """Each row's document starts from their flattened form (per row: count, then starts)."""
    rows, i = [], 0
    while i < len(bounds):
        n = bounds[i]
        rows.append(list(bounds[i + 1:i + 1 + n]))
        i += 1 + n
    return rows
