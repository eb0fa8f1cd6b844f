"""One block of attention (a rank's queries against one k/v block) by a fused kernel that returns
the log-sum-exp and never materialises the score matrix, its backward from the *final* out and
log-sum-exp, and the online-softmax merge.

Math, per head, with ``s = scale * q @ k^T`` (masked to -inf above the diagonal when causal):

    lse = log(sum_j exp(s_j))        out = softmax(s) @ v = exp(s - lse) @ v
    merge:  lse' = logaddexp(lse_a, lse_b)
            out' = out_a exp(lse_a - lse') + out_b exp(lse_b - lse')
    backward (with the *final* lse and out, FlashAttention-2 eq. 4):
      p = exp(s - lse),  dv = p^T @ do,  dp = do @ v^T,  ds = p * (dp - rowsum(do * out)),
      dq = scale * ds @ k,  dk = scale * ds^T @ q

A kernel's backward computes exactly this from (q, k, v, out, lse, do) of its block: given the
final out and lse instead of the block's own, it returns the block's exact share of dq, dk, dv
(torch's experimental ring attention, torch/distributed/tensor/experimental, does the same).

Kernels: torch's own SDPA ops, tiled, so a block holds O(S) memory, not O(S^2):

- CPU: ``aten._scaled_dot_product_flash_attention_for_cpu`` and its ``_backward``;
- CUDA, fp16/bf16 and head_dim a multiple of 8 up to 256:
  ``aten._scaled_dot_product_flash_attention`` and its ``_backward`` (FlashAttention-2);
- CUDA otherwise (fp32): ``aten._scaled_dot_product_efficient_attention`` and its ``_backward``.

Both flash kernels take GQA as it is (k/v with ``h_kv`` heads, query head ``i`` using k/v head
``i // (h / h_kv)``, SDPA's ``enable_gqa`` convention) and return dk/dv with ``h_kv`` heads; the
efficient kernel needs k/v repeated to ``h`` heads and its dk/dv summed back over each group.

A block computes in the inputs' dtype (bf16 under autocast or with bf16 activations; the kernels
accumulate in fp32 inside) and returns out in that dtype and lse in fp32; the ring merges the
blocks and accumulates dq/dk/dv in fp32.
"""
from __future__ import annotations

import torch

aten = torch.ops.aten

_LSE_ALIGN = 32       # the efficient kernel's lse rows are padded to a multiple of 32


def _use_flash_cuda(q: torch.Tensor) -> bool:
    hd = q.shape[-1]
    return q.dtype in (torch.float16, torch.bfloat16) and hd % 8 == 0 and hd <= 256


def _expand(t: torch.Tensor, groups: int) -> torch.Tensor:
    """(B, h_kv, S, hd) -> (B, h, S, hd): each k/v head repeated for its query heads."""
    return t if groups == 1 else t.repeat_interleave(groups, dim=1)


def _fold(t: torch.Tensor, groups: int) -> torch.Tensor:
    """(B, h, S, hd) -> (B, h_kv, S, hd): a gradient summed over each group of query heads."""
    return t if groups == 1 else t.unflatten(1, (-1, groups)).sum(2)


def block_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                  scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """q (B, h, Sq, hd), k/v (B, h_kv, Sk, hd) -> out (B, h, Sq, hd) in q's dtype and lse
    (B, h, Sq) fp32. ``causal`` needs Sq == Sk. Every row must see at least one key (true of
    every block ring attention computes)."""
    if q.device.type == "cuda":
        if _use_flash_cuda(q):
            out, lse = aten._scaled_dot_product_flash_attention(
                q, k, v, 0.0, causal, False, scale=scale)[:2]
            return out, lse
        g = q.shape[1] // k.shape[1]
        out, lse = aten._scaled_dot_product_efficient_attention(
            q, _expand(k, g), _expand(v, g), None, True, 0.0, causal, scale=scale)[:2]
        return out, lse[:, :, :q.shape[2]]
    return aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)


def merge_(out: torch.Tensor, lse: torch.Tensor, blk_out: torch.Tensor,
           blk_lse: torch.Tensor) -> None:
    """Fold one block's (out, lse) into the running fp32 (out, lse), in place (views allowed);
    ``blk_out`` may be low precision (its weighted sum is taken in fp32)."""
    new = torch.logaddexp(lse, blk_lse)
    out.mul_(torch.exp(lse - new).unsqueeze(-1))
    out.add_(blk_out.float() * torch.exp(blk_lse - new).unsqueeze(-1))
    lse.copy_(new)


def block_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor,
                   out: torch.Tensor, lse: torch.Tensor, causal: bool, scale: float
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The block's share of the gradients, in q's dtype: dq (B, h, Sq, hd), dk and dv
    (B, h_kv, Sk, hd).

    ``out`` (B, h, Sq, hd, q's dtype) and ``lse`` (B, h, Sq, fp32) are the final output and
    log-sum-exp of these rows over every block: with them the block's probabilities and softmax
    gradient are exact without the other blocks.
    """
    lse = lse.contiguous()          # a row slice of the final lse; the kernels read it densely
    if q.device.type == "cuda":
        if _use_flash_cuda(q):
            # Dense inputs: no cumulative lengths; dropout 0: the philox seed/offset are unread.
            seed = torch.empty(2, dtype=torch.uint64, device=q.device)
            offset = torch.empty((), dtype=torch.uint64, device=q.device)
            return aten._scaled_dot_product_flash_attention_backward(
                dout, q, k, v, out, lse, None, None, q.shape[2], k.shape[2], 0.0, causal,
                seed, offset, scale=scale)
        g = q.shape[1] // k.shape[1]
        b, h, sq = lse.shape
        padded = lse.new_zeros(b, h, -(-sq // _LSE_ALIGN) * _LSE_ALIGN)
        padded[:, :, :sq] = lse
        seed = torch.empty((), dtype=torch.long, device=q.device)
        dq, dk, dv, _ = aten._scaled_dot_product_efficient_attention_backward(
            dout, q, _expand(k, g), _expand(v, g), None, out, padded, seed, seed, 0.0,
            [True, True, True, False], causal, scale=scale)
        return dq, _fold(dk, g), _fold(dv, g)
    return aten._scaled_dot_product_flash_attention_for_cpu_backward(
        dout, q, k, v, out, lse, 0.0, causal, scale=scale)
