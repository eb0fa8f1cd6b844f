"""Ring attention: causal attention over a sequence split across the CP group.

Each CP rank holds its queries, keys and values in the load-balanced layout of
:mod:`.sharding`. Forward runs ``cp`` steps; at step ``i`` a rank holds the k/v of CP rank
``src = (r - i) mod cp``, attends its queries to the part of that block the causal mask lets
through (:func:`.sharding.visible_block`: the same amount of work at every step), and folds the
result into a running (out, lse) in fp32. The k/v for step ``i + 1`` (sent to ``r + 1``, received
from ``r - 1``: one ``batch_isend_irecv`` of an isend and an irecv) is posted before step ``i``
computes and waited right before step ``i + 1`` uses it.

Backward walks the same ring again from this rank's own k/v, with the final out and lse: dq
accumulates here, and each k/v block's dk/dv accumulator (fp32) travels one hop behind its block
(posted after the block's gradient is added, in flight during the next step's compute); after the
last step one more hop brings every accumulator to the rank that owns that k/v. Only this rank's
q, k, v, out and lse are saved.

Each block is one call of torch's fused SDPA kernel that returns the log-sum-exp (:mod:`.blocks`:
flash attention on CPU and on CUDA, memory-efficient attention for fp32 on CUDA), in the
activations' dtype: a block holds O(S_local) memory, never its score matrix, so the lengths CP
exists for fit. Only the merge and the gradient accumulators are fp32.

The ring is two custom ops, ``fastpar::ring_attention_fwd`` (q, k, v -> out, lse) and
``fastpar::ring_attention_bwd``, tied by ``register_autograd``, the process group passed by its
name: ``torch.compile`` sees one opaque op with fake shapes and no graph break. On CUDA the
batches are issued from a side stream that first waits for the compute stream; a wait makes the
compute stream wait for the transfer.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.distributed_c10d import _resolve_process_group

from ..mesh import collectives
from ..mesh.groups import Group, group_rank, group_size
from ..mesh.profiling import span
from . import blocks
from .sharding import causal_pairs, document_blocks, row_starts, visible_block

# Block pairs (one sequence's query chunk x key chunk the causal mask leaves anything in) the
# ring computed and skipped with packed documents, forward and backward each counted: what the
# documents save.
BLOCK_PAIRS = {"computed": 0, "skipped": 0}

_KV_TAG, _DKV_TAG = 11, 12          # gloo matches on (source, tag); NCCL ignores tags


def _check_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cp: int) -> None:
    """One clear error, naming the values, before any collective."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 4:
            raise ValueError(f"ring_attention: {name} must be (B, heads, S_local, head_dim); "
                             f"got shape {tuple(t.shape)}")
    if k.shape != v.shape:
        raise ValueError(f"ring_attention: k {tuple(k.shape)} and v {tuple(v.shape)} differ")
    (b, h, s, hd), (bk, h_kv, sk, hdk) = q.shape, k.shape
    if (b, s, hd) != (bk, sk, hdk):
        raise ValueError(f"ring_attention: q {tuple(q.shape)} and k/v {tuple(k.shape)} must "
                         "agree on batch, local sequence length and head_dim")
    if h % h_kv:
        raise ValueError(f"ring_attention: {h} query heads are not a multiple of {h_kv} k/v "
                         "heads (GQA needs h % h_kv == 0)")
    if not q.dtype == k.dtype == v.dtype:
        raise ValueError(f"ring_attention: q, k, v dtypes differ ({q.dtype}, {k.dtype}, "
                         f"{v.dtype})")
    if cp > 1 and s % 2:
        raise ValueError(f"ring_attention: {s} local tokens (sequence length {cp * s} over cp = "
                         f"{cp}) are not two equal chunks: the sequence length must be divisible "
                         f"by 2 x cp = {2 * cp}")


def _start_ring(send: torch.Tensor, recv: torch.Tensor, group: dist.ProcessGroup, tag: int,
                overlap: bool, stream) -> list[dist.Work]:
    """Post ``send`` to CP rank r + 1 and ``recv`` from r - 1 as one batch; returns its works.
    ``overlap=False`` waits here (the transfer then overlaps nothing) and returns no works: a
    gloo p2p work must be waited exactly once (a second wait blocks for a second message)."""
    r, cp = group_rank(group), group_size(group)
    ops = [dist.P2POp(dist.isend, send, group=group, group_peer=(r + 1) % cp, tag=tag),
           dist.P2POp(dist.irecv, recv, group=group, group_peer=(r - 1) % cp, tag=tag)]
    if stream is None:
        works = collectives.batch_isend_irecv(ops)
    else:
        stream.wait_stream(torch.cuda.current_stream(stream.device))   # send ready, recv free
        with torch.cuda.stream(stream):
            works = collectives.batch_isend_irecv(ops)
        send.record_stream(stream)
        recv.record_stream(stream)
    if not overlap:
        _wait(works)
        return []
    return works


def _wait(works: list[dist.Work]) -> None:
    for w in works:
        w.wait()


def _comm_stream(device: torch.device):
    return torch.cuda.Stream(device) if device.type == "cuda" else None


def _sub_blocks(src: int, r: int, cp: int, local_len: int, docs) -> list:
    """(batch rows, query rows, key cols, causal) of step ``src``: the whole batch's one block
    (:func:`visible_block`), or with packed documents (``docs``: each sequence's starts, and
    the ranks' chunks) each sequence's sub-blocks (:func:`document_blocks`)."""
    if docs is None:
        return [(slice(None), *visible_block(src, r, local_len // 2))]
    starts, layout = docs
    c = local_len // len(layout[r])
    out = []
    for b, row in enumerate(starts):
        found = document_blocks(row, local_len * cp, src, r, cp, layout)
        pairs = {(rows.start // c, cols.start // c) for rows, cols, _ in found}
        BLOCK_PAIRS["computed"] += len(pairs)
        BLOCK_PAIRS["skipped"] += causal_pairs(r, src, cp, layout) - len(pairs)
        out += [(slice(b, b + 1), rows, cols, causal) for rows, cols, causal in found]
    return out


def _ring_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: dist.ProcessGroup,
                  overlap: bool, docs: list | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention of the local queries over every CP rank's k/v, passed around the ring:
    out (B, h, S_local, hd) in q's dtype and its lse (B, h, S_local) fp32, both contiguous.
    ``docs``: each sequence's document starts and the ranks' chunks (packed documents), or
    None."""
    cp, r = group_size(group), group_rank(group)
    n, scale = q.shape[2], 1.0 / math.sqrt(q.shape[-1])
    stream = _comm_stream(q.device)
    kv = torch.stack([k, v])                      # (2, B, h_kv, S_local, hd): one message
    out = lse = None
    if docs is not None:                          # merged into from nothing, block by block
        out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        lse = torch.full(q.shape[:3], -math.inf, dtype=torch.float32, device=q.device)
    for i in range(cp):
        src = (r - i) % cp
        if i + 1 < cp:                            # the next step's k/v moves during this one
            nxt = torch.empty_like(kv)
            works = _start_ring(kv, nxt, group, _KV_TAG, overlap, stream)
        for bs, rows, cols, causal in _sub_blocks(src, r, cp, n, docs):
            with span("cp attention block", i):
                blk_out, blk_lse = blocks.block_forward(
                    q[bs, :, rows], kv[0][bs, :, cols], kv[1][bs, :, cols], causal, scale)
            if out is None:                       # step 0 is causal: it covers every row
                out = blk_out.to(torch.float32, memory_format=torch.contiguous_format)
                lse = blk_lse.to(torch.float32, memory_format=torch.contiguous_format)
            else:
                blocks.merge_(out[bs, :, rows], lse[bs, :, rows], blk_out, blk_lse)
        if i + 1 < cp:
            with span("cp wait k/v", i + 1):
                _wait(works)
            kv = nxt
    return out.to(q.dtype), lse


def _ring_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   out: torch.Tensor, lse: torch.Tensor, group: dist.ProcessGroup,
                   overlap: bool, docs: list | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq here; dk/dv ride the ring behind their k/v back to their owner. Returns dq, dk, dv
    in the dtypes of q, k, v (accumulated in fp32)."""
    cp, r = group_size(group), group_rank(group)
    n, scale = q.shape[2], 1.0 / math.sqrt(q.shape[-1])
    stream = _comm_stream(q.device)
    dout = dout.to(q.dtype)
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    kv = torch.stack([k, v])
    dkv_in, dkv_works = None, []                  # src's dk/dv accumulator, arriving from r - 1
    for i in range(cp):
        src = (r - i) % cp
        if i + 1 < cp:
            nxt = torch.empty_like(kv)
            kv_works = _start_ring(kv, nxt, group, _KV_TAG, overlap, stream)
        grads = []
        for bs, rows, cols, causal in _sub_blocks(src, r, cp, n, docs):
            with span("cp attention block backward", i):
                dq_b, dk_b, dv_b = blocks.block_backward(
                    q[bs, :, rows], kv[0][bs, :, cols], kv[1][bs, :, cols], dout[bs, :, rows],
                    out[bs, :, rows], lse[bs, :, rows], causal, scale)
            dq[bs, :, rows] += dq_b
            grads.append((bs, cols, dk_b, dv_b))
        if dkv_in is None:                        # step 0: src is this rank, a fresh one
            dkv = torch.zeros((2,) + k.shape, dtype=torch.float32, device=k.device)
        else:                                     # src's, one hop behind its k/v
            with span("cp wait dk/dv", i):
                _wait(dkv_works)
            dkv = dkv_in
        for bs, cols, dk_b, dv_b in grads:
            dkv[0][bs, :, cols] += dk_b
            dkv[1][bs, :, cols] += dv_b
        # On to r + 1: the next rank that sees src's k/v, or, after the last step, src.
        dkv_in = torch.empty_like(dkv)
        dkv_works = _start_ring(dkv, dkv_in, group, _DKV_TAG, overlap, stream)
        if i + 1 < cp:
            with span("cp wait k/v", i + 1):
                _wait(kv_works)
            kv = nxt
    with span("cp wait dk/dv home"):
        _wait(dkv_works)                          # dkv_in: the gradient of this rank's k and v
    # Copies: the outputs of an op may not alias one another (dk and dv share dkv_in).
    return (dq.to(q.dtype), dkv_in[0].to(k.dtype, copy=True),
            dkv_in[1].to(v.dtype, copy=True))


# -- the ring as custom ops: opaque to torch.compile -----------------------------------------

@torch.library.custom_op("fastpar::ring_attention_fwd", mutates_args=())
def ring_attention_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group_name: str,
                       overlap: bool, bounds: list[int] | None = None,
                       chunks: list[int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Ring attention forward over the process group named ``group_name``: (out, lse).
    ``bounds``, ``chunks``: packed documents (:func:`ring_attention`)."""
    group = _resolve_process_group(group_name)
    with torch.autocast(q.device.type, enabled=False):
        return _ring_forward(q, k, v, group, overlap, _docs(bounds, chunks, q.shape[0], group))


def _docs(bounds: list[int] | None, chunks: list[int] | None, batch: int, group):
    """(each sequence's document starts, each rank's chunks) from the ops' flat lists."""
    if bounds is None:
        return None
    starts = row_starts(list(bounds))
    if len(starts) != batch:
        raise ValueError(f"ring_attention: bounds describe {len(starts)} sequences, q holds "
                         f"{batch}")
    cp = group_size(group)
    chunks = list(chunks) if chunks else [i for r in range(cp) for i in (r, 2 * cp - 1 - r)]
    per = len(chunks) // cp
    return starts, [tuple(chunks[r * per:(r + 1) * per]) for r in range(cp)]


@ring_attention_fwd.register_fake
def _ring_attention_fwd_fake(q, k, v, group_name, overlap, bounds=None, chunks=None):
    """Shapes and dtypes only (torch.compile's tracing): out like q, contiguous; lse fp32."""
    return q.new_empty(q.shape), q.new_empty(q.shape[:3], dtype=torch.float32)


@torch.library.custom_op("fastpar::ring_attention_bwd", mutates_args=())
def ring_attention_bwd(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       out: torch.Tensor, lse: torch.Tensor, group_name: str,
                       overlap: bool, bounds: list[int] | None = None,
                       chunks: list[int] | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Ring attention backward from the final (out, lse): (dq, dk, dv)."""
    group = _resolve_process_group(group_name)
    with torch.autocast(q.device.type, enabled=False):
        return _ring_backward(dout, q, k, v, out, lse, group, overlap,
                              _docs(bounds, chunks, q.shape[0], group))


@ring_attention_bwd.register_fake
def _ring_attention_bwd_fake(dout, q, k, v, out, lse, group_name, overlap, bounds=None,
                             chunks=None):
    """Shapes and dtypes only: dq, dk, dv like q, k, v, contiguous."""
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup_context(ctx, inputs, output):
    q, k, v, group_name, overlap, bounds, chunks = inputs
    ctx.save_for_backward(q, k, v, *output)
    ctx.group_name, ctx.overlap, ctx.bounds, ctx.chunks = group_name, overlap, bounds, chunks


def _backward(ctx, dout, _dlse):
    # lse is an output for the backward's sake only: its gradient is never used.
    q, k, v, out, lse = ctx.saved_tensors
    dq, dk, dv = ring_attention_bwd(dout, q, k, v, out, lse, ctx.group_name, ctx.overlap,
                                    ctx.bounds, ctx.chunks)
    return dq, dk, dv, None, None, None, None


ring_attention_fwd.register_autograd(_backward, setup_context=_setup_context)


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cp_group: Group,
                   overlap: bool = True, bounds: list[int] | None = None,
                   chunks: list[int] | None = None) -> torch.Tensor:
    """Causal attention over the global sequence, split over ``cp_group`` in the load-balanced
    layout (:func:`.sharding.shard_sequence` along dim 2).

    q: (B, h, S_local, hd); k, v: (B, h_kv, S_local, hd) with ``h % h_kv == 0`` (only the h_kv
    heads travel). Returns (B, h, S_local, hd): causal SDPA of the full sequence, this rank's
    rows. ``cp_group`` None or of size 1 is plain causal SDPA. ``overlap=False`` waits for each
    transfer as soon as it is posted (same numbers, no overlap). Under autocast q, k, v are cast
    to the autocast dtype first, as SDPA's are, and the blocks compute in it; the merge and the
    gradient accumulators are fp32 either way.

    ``bounds`` (packed documents): each sequence's document starts in the whole sequence,
    flattened (per sequence its count, then the starts: :attr:`fastpar.models.documents.
    Documents.bounds`); a query then sees the keys of its own document only, and the block
    pairs no document connects are skipped (:func:`.sharding.document_blocks`). ``chunks``
    (with ``bounds``): the chunks each rank holds, flattened in rank order, the same number per
    rank (:func:`.sharding.balanced_chunks`); default the zigzag pairs.
    """
    if cp_group is not None and group_rank(cp_group) < 0:
        raise ValueError(f"ring_attention: rank {dist.get_rank()} is not in cp_group")
    cp = group_size(cp_group)
    _check_inputs(q, k, v, cp)
    device = q.device.type
    if torch.is_autocast_enabled(device):
        dtype = torch.get_autocast_dtype(device)
        q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    with torch.autocast(device, enabled=False):
        if cp == 1 and bounds is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                  enable_gqa=q.shape[1] != k.shape[1])
        if cp == 1:
            raise ValueError("ring_attention: bounds need a CP group of 2 or more ranks "
                             "(one rank: fastpar.models.documents.document_attention)")
        return ring_attention_fwd(q, k, v, cp_group.group_name, overlap, bounds, chunks)[0]
