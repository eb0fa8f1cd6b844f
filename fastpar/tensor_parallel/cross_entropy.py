"""Cross-entropy over vocabulary-parallel logits, without ever gathering them.

TP rank ``r`` of ``tp`` holds the logits ``z`` (..., V/tp) of the classes
``[r*V/tp, (r+1)*V/tp)``; the target ``t`` holds full vocabulary ids. Per token, with
``m = max_j z_j`` (an all-reduce MAX) and ``s_j = z_j - m`` (numerically stable):

    lse  = log sum_j exp(s_j)                         (all-reduce SUM of local sums)
    nll  = lse - s_t                                  (s_t: all-reduce SUM, 0 off the owner)
    loss = (1 - eps) * nll + eps * (lse - sum_j s_j / V)   (label smoothing eps; sum_j s_j
                                                             is one more all-reduce SUM)

The three sums travel in one (N, 2 or 3) all-reduce, so a call costs two small collectives.
The gradient is local, with ``p = softmax(z)`` kept from the forward:

    dloss/dz_j = p_j - (1 - eps) * 1[j == t] - eps / V

Tokens whose target is ``ignore_index`` get loss 0 and gradient 0, as in ``F.cross_entropy``.
Arithmetic is fp32 (fp64 for fp64 logits), as is the loss; the gradient has the logits' dtype.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from fastpar.tensor_parallel.mappings import Group, group_rank, group_size


def _all_reduce(x: torch.Tensor, group: Group, op=dist.ReduceOp.SUM) -> torch.Tensor:
    if group_size(group) > 1:
        dist.all_reduce(x, op=op, group=group)
    return x


class VocabParallelCrossEntropy(torch.autograd.Function):
    """Forward: per-token loss from sharded logits (all-reduce max, then sums).
    Backward: local ``softmax - (1-eps)*onehot - eps/V``, no communication."""

    @staticmethod
    def forward(ctx, logits, target, group, ignore_index, label_smoothing):
        tp, rank = group_size(group), group_rank(group)
        v_local = logits.shape[-1]
        vocab, start = v_local * tp, v_local * rank
        # (N, V/tp) in fp32 (fp64 stays fp64); may alias logits, so never written in place.
        z = logits.reshape(-1, v_local).to(torch.promote_types(logits.dtype, torch.float32))
        t = target.reshape(-1)                           # (N,)

        m = z.max(dim=-1).values                         # (N,)
        _all_reduce(m, group, dist.ReduceOp.MAX)
        s = z - m.unsqueeze(-1)                          # (N, V/tp), <= 0
        exp_s = s.exp()

        owned = (t >= start) & (t < start + v_local)     # target in this rank's range
        t_local = (t - start).masked_fill(~owned, 0)
        s_t = s.gather(-1, t_local.unsqueeze(-1)).squeeze(-1).masked_fill(~owned, 0.0)
        sums = [exp_s.sum(-1), s_t] + ([s.sum(-1)] if label_smoothing > 0 else [])
        sums = _all_reduce(torch.stack(sums, dim=-1), group)  # (N, 2 or 3)

        lse = sums[:, 0].log()
        loss = lse - sums[:, 1]
        if label_smoothing > 0:
            loss = (1 - label_smoothing) * loss + label_smoothing * (lse - sums[:, 2] / vocab)
        valid = t != ignore_index
        loss = loss.masked_fill(~valid, 0.0)

        softmax = exp_s.div_(sums[:, :1])                # exp_s is ours: reuse its memory
        ctx.save_for_backward(softmax, t_local, owned, valid)
        ctx.eps, ctx.vocab = label_smoothing, vocab
        ctx.dtype, ctx.shape = logits.dtype, logits.shape
        return loss.view(target.shape)

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, t_local, owned, valid = ctx.saved_tensors
        eps = ctx.eps
        grad = softmax - eps / ctx.vocab if eps > 0 else softmax.clone()  # (N, V/tp)
        rows = torch.arange(grad.shape[0], device=grad.device)
        grad[rows, t_local] -= (1 - eps) * owned.to(grad.dtype)
        g = grad_loss.reshape(-1).to(grad.dtype).masked_fill(~valid, 0.0)
        grad.mul_(g.unsqueeze(-1))
        return grad.to(ctx.dtype).view(ctx.shape), None, None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, *,
                                 tp_group: Group = None, ignore_index: int = -100,
                                 label_smoothing: float = 0.0) -> torch.Tensor:
    """Per-token cross-entropy (shape of ``target``, fp32) from vocab-sharded logits.

    ``logits`` (..., V/tp): rank r holds classes ``[r*V/tp, (r+1)*V/tp)``; ``target`` (...):
    full vocabulary ids. Equals ``F.cross_entropy(full_logits.view(-1, V), target.view(-1),
    reduction="none", ignore_index=..., label_smoothing=...)`` reshaped to ``target.shape``.
    With ``tp_group=None`` it is single-device cross-entropy. Ids outside ``[0, V)`` other than
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
    return VocabParallelCrossEntropy.apply(logits, target.long(), tp_group, ignore_index,
                                           float(label_smoothing))
