"""Cross-entropy over vocabulary-parallel logits, without ever gathering them.

TP rank ``r`` of ``tp`` holds the logits ``z`` (..., V/tp) of the classes
``[r*V/tp, (r+1)*V/tp)``; the target ``t`` holds full vocabulary ids. Per token, each rank
computes with the kernel ``fastpar.kernels.cross_entropy`` the statistics of its shard (N, 4):
``m_r = max_j z_j``, ``s_r = sum_j exp(z_j - m_r)``, ``z_t`` (0 off the owner) and
``d_r = sum_j (z_j - m_r)``. One all-gather brings every shard's statistics to every rank, which
combines them (:func:`fastpar.kernels.cross_entropy.cross_entropy_combine`):

    M = max_r m_r,   S = sum_r s_r exp(m_r - M),   lse = M + log S
    nll  = (M - z_t) + log S
    loss = (1 - eps) * nll + eps * (log S - sum_r (d_r + V/tp (m_r - M)) / V)   (smoothing eps)

Why one all-gather of (N, 4) rather than an all-reduce MAX of (N,) followed by an all-reduce SUM
of the rescaled (N, 2-3) sums: the loss at a training step's end is latency-bound (N * 16 bytes
per rank is ~256 KB at 16K tokens), and one collective costs one latency where the MAX-then-SUM
pair costs two in sequence (the SUM needs the MAX). It moves (tp - 1) * N * 16 bytes into each
rank, tp / 2 times the ring all-reduces' 2 (tp - 1) / tp * N * 16: ~1.8 MB at tp = 8 and 16K
tokens, a few microseconds on NVLink, about one collective's latency. And every rank combines the
same gathered numbers in the same order, so the loss is bit-identical across ranks by construction.

Saved for backward: the logits themselves (no copy; low precision in training), the target and
``M``, ``log S`` (N,) fp32 - never an (N, V/tp) fp32 tensor. The gradient is local, recomputed
chunk by chunk in the kernel and written in the logits' dtype:

    dloss/dz_j = exp(z_j - M - log S) - (1 - eps) * 1[j == t] - eps / V

Tokens whose target is ``ignore_index`` get loss 0 and gradient 0, as in ``F.cross_entropy``.
Arithmetic is fp32 (fp64 for fp64 logits, on the torch reference), as is the loss.

No copy of the logits or of their gradient: the kernels read the rows where they lie (a transposed
view included: the model's (B, S, V/tp) logits over its sequence-first head output) and write
the one gradient tensor with the logits' strides, so the head's backward GEMM reads it as it is.
A padded vocabulary (``vocab_size`` real classes of the ``tp * V/tp`` columns) is handled here,
not by masking the logits with -inf first, which would copy them and then their gradient.
"""
from __future__ import annotations

import torch

from ..mesh.groups import Group, all_gather_tensor, group_rank, group_size
from fastpar.kernels.cross_entropy import (cross_entropy_combine, cross_entropy_shard_grad,
                                           cross_entropy_shard_stats)


def _gather_stats(stats: torch.Tensor, group: Group) -> torch.Tensor:
    """(N, k) on each rank -> (tp, N, k), in group-rank order."""
    tp = group_size(group)
    if tp == 1:
        return stats[None]
    n, k = stats.shape
    out = torch.empty((tp * n, k), dtype=stats.dtype, device=stats.device)
    all_gather_tensor(out, stats.contiguous(), group=group)
    return out.view(tp, n, k)


class VocabParallelCrossEntropy(torch.autograd.Function):
    """Forward: per-token loss from sharded logits (one all-gather of per-shard statistics).
    Backward: local ``softmax - (1-eps)*onehot - eps/V``, recomputed; no communication."""

    @staticmethod
    def forward(ctx, logits, target, group, ignore_index, label_smoothing, vocab_size):
        tp, rank = group_size(group), group_rank(group)
        v_local = logits.shape[-1]
        vocab, start = vocab_size or v_local * tp, v_local * rank
        stats = cross_entropy_shard_stats(logits, target, start, ignore_index, vocab)  # (N, 4)
        loss, row_max, log_sum = cross_entropy_combine(
            _gather_stats(stats, group), target, vocab, ignore_index, label_smoothing, v_local)
        ctx.save_for_backward(logits, target, row_max, log_sum)
        ctx.eps, ctx.vocab, ctx.start, ctx.ignore_index = label_smoothing, vocab, start, \
            ignore_index
        return loss.view(target.shape)

    @staticmethod
    def backward(ctx, grad_loss):
        logits, target, row_max, log_sum = ctx.saved_tensors
        grad = cross_entropy_shard_grad(logits, target, row_max, log_sum, grad_loss, ctx.start,
                                        ctx.ignore_index, ctx.eps, ctx.vocab)
        return grad, None, None, None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, *,
                                 tp_group: Group = None, ignore_index: int = -100,
                                 label_smoothing: float = 0.0,
                                 vocab_size: int | None = None) -> torch.Tensor:
    """Per-token cross-entropy (shape of ``target``, fp32) from vocab-sharded logits.

    ``logits`` (..., V/tp), any layout whose last dim is contiguous (a transposed view is read
    in place): rank r holds classes ``[r*V/tp, (r+1)*V/tp)``; ``target`` (...): full vocabulary
    ids. Equals ``F.cross_entropy(full_logits.view(-1, V), target.view(-1), reduction="none",
    ignore_index=..., label_smoothing=...)`` reshaped to ``target.shape``. ``vocab_size``: the
    real classes when the vocabulary is padded (columns from ``vocab_size`` on take no part, as
    if their logits were -inf, and get zero gradient); default all ``V``. With
    ``tp_group=None`` it is single-device cross-entropy. Ids outside ``[0, V)`` other than
    ``ignore_index`` are not checked (that would need a device sync).
    """
    if logits.dim() == 0 or target.shape != logits.shape[:-1]:
        raise ValueError(f"vocab_parallel_cross_entropy: target shape {tuple(target.shape)} "
                         f"does not match logits shape {tuple(logits.shape)} without its last "
                         "(vocab) dim")
    if target.is_floating_point() or target.is_complex() or target.dtype == torch.bool:
        raise ValueError(f"vocab_parallel_cross_entropy: target must be an integer tensor of "
                         f"class ids, got dtype {target.dtype}")
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"vocab_parallel_cross_entropy: label_smoothing={label_smoothing} "
                         "must be in [0, 1]")
    columns = logits.shape[-1] * group_size(tp_group)
    if vocab_size is not None and not 0 < vocab_size <= columns:
        raise ValueError(f"vocab_parallel_cross_entropy: vocab_size={vocab_size} must be in "
                         f"[1, {columns}] (the logits' {logits.shape[-1]} columns x "
                         f"tp={group_size(tp_group)})")
    return VocabParallelCrossEntropy.apply(logits, target.long(), tp_group, ignore_index,
                                           float(label_smoothing), vocab_size)
