"""One block of attention (a rank's queries against one k/v block), forward with its
log-sum-exp and backward from the final log-sum-exp, and the online-softmax merge.

Math, per head, with ``s = scale * q @ k^T`` (masked to -inf above the diagonal when causal):

    lse = log(sum_j exp(s_j))        out = softmax(s) @ v = exp(s - lse) @ v
    merge:  lse' = logaddexp(lse_a, lse_b)
            out' = out_a exp(lse_a - lse') + out_b exp(lse_b - lse')
    backward (with the *final* lse and out, FlashAttention-2 eq. 4):
      p = exp(s - lse),  dv = p^T @ do,  dp = do @ v^T,  ds = p * (dp - rowsum(do * out)),
      dq = scale * ds @ k,  dk = scale * ds^T @ q

GQA without copying k/v: the ``h`` query heads are viewed as ``(h_kv, h / h_kv)`` groups, query
head ``i`` using k/v head ``i // (h / h_kv)`` (SDPA's ``enable_gqa`` convention); dk and dv sum
over each group. Everything is plain torch math in fp32 (low-precision inputs are upcast, so bf16
accumulates in fp32), on CPU and GPU alike: the scores of one block are materialised, which is
fine for correctness and for blocks of a few thousand tokens; a fused kernel returning the lse
(FlashAttention) would replace these two functions on GPU without changing the ring.
"""
from __future__ import annotations

import torch


def _grouped(q: torch.Tensor, h_kv: int) -> torch.Tensor:
    """(B, h, S, hd) -> (B, h_kv, h / h_kv, S, hd), fp32."""
    b, h, s, hd = q.shape
    return q.float().reshape(b, h_kv, h // h_kv, s, hd)


def _scores(qg: torch.Tensor, k: torch.Tensor, causal: bool, scale: float) -> torch.Tensor:
    """(B, h_kv, g, Sq, Sk) fp32 scores, -inf above the diagonal when causal (Sq == Sk)."""
    s = torch.matmul(qg, k.float().unsqueeze(2).transpose(-1, -2)) * scale
    if causal:
        n = s.shape[-1]
        above = torch.ones(n, n, dtype=torch.bool, device=s.device).triu_(1)
        s = s.masked_fill_(above, float("-inf"))
    return s


def block_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                  scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """q (B, h, Sq, hd), k/v (B, h_kv, Sk, hd) -> out (B, h, Sq, hd) and lse (B, h, Sq), fp32.
    Every row must see at least one key (true of every block ring attention computes)."""
    b, h, sq, hd = q.shape
    s = _scores(_grouped(q, k.shape[1]), k, causal, scale)
    lse = torch.logsumexp(s, dim=-1)                                # (B, h_kv, g, Sq)
    p = torch.exp(s.sub_(lse.unsqueeze(-1)))
    out = torch.matmul(p, v.float().unsqueeze(2))                   # (B, h_kv, g, Sq, hd)
    return out.reshape(b, h, sq, hd), lse.reshape(b, h, sq)


def merge_(out: torch.Tensor, lse: torch.Tensor, blk_out: torch.Tensor,
           blk_lse: torch.Tensor) -> None:
    """Fold one block's (out, lse) into the running fp32 (out, lse), in place (views allowed)."""
    new = torch.logaddexp(lse, blk_lse)
    out.mul_(torch.exp(lse - new).unsqueeze(-1))
    out.add_(blk_out * torch.exp(blk_lse - new).unsqueeze(-1))
    lse.copy_(new)


def block_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor,
                   lse: torch.Tensor, delta: torch.Tensor, causal: bool, scale: float
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The block's share of the gradients, fp32: dq (B, h, Sq, hd), dk and dv (B, h_kv, Sk, hd).

    ``lse`` (B, h, Sq) is the final log-sum-exp of these rows over every block, ``delta``
    (B, h, Sq) is ``rowsum(dout * out)`` of the final output: with them the block's
    probabilities and softmax gradient are exact without the other blocks.
    """
    b, h, sq, hd = q.shape
    h_kv = k.shape[1]
    qg, dog = _grouped(q, h_kv), _grouped(dout, h_kv)
    s = _scores(qg, k, causal, scale)
    p = torch.exp(s.sub_(lse.reshape(b, h_kv, h // h_kv, sq, 1)))   # (B, h_kv, g, Sq, Sk)
    vf = v.float().unsqueeze(2)
    dv = torch.matmul(p.transpose(-1, -2), dog).sum(2)              # (B, h_kv, Sk, hd)
    dp = torch.matmul(dog, vf.transpose(-1, -2))
    ds = p.mul_(dp.sub_(delta.reshape(b, h_kv, h // h_kv, sq, 1)))
    dq = torch.matmul(ds, k.float().unsqueeze(2)).mul_(scale)
    dk = torch.matmul(ds.transpose(-1, -2), qg).sum(2).mul_(scale)
    return dq.reshape(b, h, sq, hd), dk, dv
