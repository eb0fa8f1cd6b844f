"""The parallel Transformer block: norm, attention (heads split over TP), MLP (Column -> Row).

Activations are sequence-first: (S, B, D), or (S/tp, B, D) between blocks under sequence
parallelism (SP). Replicated parameters that see only a sequence shard under SP (the norms) are
marked (``mark_partial_grads``): their gradients are summed over the TP group once per step by
``reduce_replicated_grads``, not in every backward.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from .. import kernels
from ..context_parallel import ring_attention
from ..tensor_parallel import ColumnParallelLinear, RowParallelLinear, mark_partial_grads
from ..mesh.groups import group_rank, group_size
from .config import GPTConfig
from .documents import document_attention
from .moe import MoE


class Norm(nn.Module):
    """RMSNorm or LayerNorm over the last dim, replicated over TP."""

    def __init__(self, config: GPTConfig, tp_group=None, sequence_parallel=False):
        super().__init__()
        d = config.d_model
        self.kind, self.eps = config.norm, config.norm_eps
        self.tp_group, self.sequence_parallel = tp_group, sequence_parallel
        self.weight = nn.Parameter(torch.ones(d))
        self.bias = nn.Parameter(torch.zeros(d)) if config.norm == "layernorm" else None
        if sequence_parallel and group_size(tp_group) > 1:
            # This rank's tokens only: partial gradients, summed over TP once per step.
            mark_partial_grads(self, "weight", *(["bias"] if self.bias is not None else []))

    def forward(self, x):
        w, b = self.weight, self.bias
        # Fused Triton kernels on CUDA, their torch references elsewhere.
        if self.kind == "rmsnorm":
            return kernels.rms_norm(x, w, self.eps)
        return kernels.layer_norm(x, w, b, self.eps)


def rotary_tables(config: GPTConfig, device=None):
    """cos, sin of shape (max_seq_len, head_dim / 2)."""
    hd = config.head_dim
    inv = 1.0 / config.rotary_base ** (torch.arange(0, hd, 2, device=device).float() / hd)
    angles = torch.outer(torch.arange(config.max_seq_len, device=device).float(), inv)
    return angles.cos(), angles.sin()


class ParallelAttention(nn.Module):
    """Causal self-attention; query and key/value heads split over TP; torch SDPA, or ring
    attention over the sequence shards of ``cp_group`` (context parallelism).

    q, k and v come out of one column-parallel linear (parts "q", "k", "v", each sharded on its
    own, so a rank holds its query heads and its key/value heads): one GEMM and, under TP, one
    input all-gather / gradient reduction instead of three."""

    def __init__(self, config: GPTConfig, tp_group=None, sequence_parallel=False, overlap=True,
                 cp_group=None, regather_input=False):
        super().__init__()
        tp = group_size(tp_group)
        config.check_tp(tp)
        hd, self.config = config.head_dim, config
        self.cp_group = cp_group if group_size(cp_group) > 1 else None
        self.cp_overlap = True      # False: each k/v transfer waited at once (same numbers)
        self.heads, self.kv_heads = config.n_heads // tp, config.kv_heads // tp
        col = dict(bias=config.bias, tp_group=tp_group, sequence_parallel=sequence_parallel,
                   overlap=overlap, regather_input=regather_input)
        parts = [("q", config.n_heads * hd), ("k", config.kv_heads * hd),
                 ("v", config.kv_heads * hd)]
        self.qkv = ColumnParallelLinear(config.d_model, sum(n for _, n in parts), parts=parts,
                                        **col)
        self.o = RowParallelLinear(config.n_heads * hd, config.d_model, bias=config.bias,
                                   tp_group=tp_group, sequence_parallel=sequence_parallel,
                                   overlap=overlap, skip_bias_add=True)

    def core(self, q, k, v, start=0, docs=None):
        """softmax(q k^T / sqrt(hd)) v, causal; q (B, h, S, hd), k and v (B, h_kv, start + S, hd).
        The part selective recompute redoes. ``start``: keys before the queries (a KV cache).
        ``docs`` (:class:`~fastpar.models.documents.Documents`): causal inside each document."""
        if self.cp_group is not None:       # this rank's rows of the whole sequence's attention
            return ring_attention(q, k, v, self.cp_group, overlap=self.cp_overlap,
                                  bounds=None if docs is None else docs.bounds,
                                  chunks=None if docs is None else
                                  docs.ring_chunks(group_size(self.cp_group)))
        if docs is not None:
            return document_attention(q, k, v, docs)
        S, mask = q.shape[2], None
        if start and S > 1:     # a chunk after a prefix: query i sees keys 0 .. start + i
            mask = torch.ones(S, start + S, dtype=torch.bool, device=q.device).tril(start)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=start == 0,
                                              enable_gqa=self.kv_heads != self.heads)

    def forward(self, x, rope=None, recompute_core=False, kv=None, docs=None):
        """(output, bias): the output projection's bias is left for the caller's fused
        bias + dropout + residual add. ``kv`` (inference): this layer's ``LayerCache`` (see
        fastpar.models.generate); k and v are appended to it and q attends to all it holds,
        ``rope`` then being the tables' rows of these positions. ``docs``: attention stops at
        document starts (:mod:`fastpar.models.documents`)."""
        hd = self.config.head_dim
        q, k, v = self.qkv.split(self.qkv(x))                   # (S, B, heads/tp * hd) views
        S, B = q.shape[:2]
        q = q.view(S, B, self.heads, hd).transpose(0, 1)        # (B, S, h, hd) strided views
        k = k.view(S, B, self.kv_heads, hd).transpose(0, 1)
        if rope is not None:                                    # fastpar.kernels.rotary
            q, k = kernels.rotary(q, k, *rope)
        q, k = q.transpose(1, 2), k.transpose(1, 2)             # (B, h, S, hd)
        v = v.view(S, B, self.kv_heads, hd).permute(1, 2, 0, 3)
        if kv is not None:
            start = kv.length
            k, v = kv.append(k, v)                              # (B, h_kv, start + S, hd)
            y = self.core(q, k, v, start)
        elif recompute_core:
            y = torch.utils.checkpoint.checkpoint(self.core, q, k, v, 0, docs,
                                                  use_reentrant=False)
        else:
            y = self.core(q, k, v, 0, docs)
        y = y.permute(2, 0, 1, 3).reshape(S, B, self.heads * hd)   # (S, B, h/tp * hd)
        return self.o(y)


class ParallelMLP(nn.Module):
    """SwiGLU or GELU: fc1 (Column; parts "up" and, for SwiGLU, "gate" in one GEMM) -> down
    (Row)."""

    def __init__(self, config: GPTConfig, tp_group=None, sequence_parallel=False, overlap=True,
                 regather_input=False):
        super().__init__()
        d, f = config.d_model, config.ffn_dim
        col = dict(bias=config.bias, tp_group=tp_group, sequence_parallel=sequence_parallel,
                   overlap=overlap, regather_input=regather_input)
        self.swiglu = config.activation == "swiglu"
        parts = [("up", f)] + ([("gate", f)] if self.swiglu else [])
        self.fc1 = ColumnParallelLinear(d, f * len(parts), parts=parts,
                                        skip_bias_add=not self.swiglu, **col)
        self.down = RowParallelLinear(f, d, bias=config.bias, tp_group=tp_group,
                                      sequence_parallel=sequence_parallel, overlap=overlap,
                                      skip_bias_add=True)

    def forward(self, x):
        """(output, bias), the bias left for the caller's fused bias + dropout + residual add."""
        if self.swiglu:
            up, gate = self.fc1.split(self.fc1(x))              # (S, B, f/tp) views
            h = kernels.swiglu(gate, up)
        else:
            h = kernels.bias_gelu(*self.fc1(x), approximate="tanh")   # gelu(x W^T + b), fused
        return self.down(h)


class ParallelTransformerLayer(nn.Module):
    """Pre-norm block: x + dropout(attn(norm(x)) + b_o), then + dropout(mlp(norm(x)) + b_down),
    each residual branch closed by the fused ``kernels.bias_dropout_add``.

    The sum is in the branch's dtype, as Megatron keeps its residual stream: bf16 under bf16
    autocast, so the stream crosses pipeline stages and sequence-parallel collectives in bf16.
    Dropout masks are Philox streams fixed by (seed, offset); under sequence parallelism each
    rank's offset is where its sequence shard starts, so the shards' masks are the slices of the
    unsharded mask."""

    def __init__(self, config: GPTConfig, tp_group=None, sequence_parallel=False, overlap=True,
                 cp_group=None, regather_input=False, ep_group=None, ep_chunks=2):
        super().__init__()
        kw = dict(tp_group=tp_group, sequence_parallel=sequence_parallel)
        self.norm1, self.norm2 = Norm(config, **kw), Norm(config, **kw)
        self.attn = ParallelAttention(config, overlap=overlap, cp_group=cp_group,
                                      regather_input=regather_input, **kw)
        if config.n_experts:
            # Under TP without SP every TP rank holds the whole hidden state: each runs the
            # whole MoE layer on it (the same numbers; no reduction), as with its norms. Under
            # SP each runs it on its sequence shard (the layer replicated over TP, its
            # gradients partial: summed over TP once per step), as Megatron requires SP for
            # MoE with TP.
            self.mlp = MoE(config.d_model, config.n_experts, config.moe_top_k,
                           config.expert_ffn, n_shared=config.moe_shared_experts,
                           shared_gate=config.moe_shared_gate,
                           capacity_factor=config.moe_capacity_factor,
                           aux_loss_coef=config.moe_aux_loss, norm_topk=config.moe_norm_topk,
                           bias_update_rate=config.moe_bias_rate, ep_group=ep_group,
                           ep_chunks=ep_chunks, cp_group=cp_group,
                           sp_group=tp_group if sequence_parallel else None)
        else:
            self.mlp = ParallelMLP(config, overlap=overlap, regather_input=regather_input, **kw)
        self.dropout = config.dropout
        self.shard = group_rank(tp_group) if sequence_parallel else 0

    def _add(self, branch, bias, residual):
        # seed=None: drawn from torch's CPU generator (the same on every rank, and replayed by
        # activation recompute), only when dropout is on.
        return kernels.bias_dropout_add(branch, bias, residual.to(branch.dtype), self.dropout,
                                        self.training, None, self.shard * branch.numel())

    def forward(self, x, rope=None, recompute_core=False, kv=None, docs=None):
        x = self._add(*self.attn(self.norm1(x), rope, recompute_core, kv, docs), x)
        return self._add(*self.mlp(self.norm2(x)), x)

    def steps(self, x, rope=None, recompute_core=False, docs=None):
        """``forward`` as a generator that pauses after each branch's row-parallel projection,
        before its output is read (its all-reduce may still be in flight: see
        ``fastpar.models.gpt.interleave``); returns the block's output. The same ops as
        ``forward``, in the same order. Bypasses this module's own hooks (its children's run)."""
        branch = self.attn(self.norm1(x), rope, recompute_core, None, docs)
        yield
        x = self._add(*branch, x)
        branch = self.mlp(self.norm2(x))
        yield
        return self._add(*branch, x)
