"""The DTensor tensor-parallel peer as torchtitan builds it: its Llama layout and its TP plan.

``TitanLlama.from_gpt(gpt)`` is the same network as a fastpar GPT built at tp=1 (RMSNorm,
SwiGLU, rotary on the first and second half of each head, no biases, untied head), written the
way torchtitan writes its Llama: batch-first (B, S, D) activations, separate ``wq``, ``wk``,
``wv``, ``wo`` and ``w1`` (gate), ``w3`` (up), ``w2`` (down) linears, plain torch ops, SDPA.
``parallelize(model, mesh, sequence_parallel=True)`` applies torchtitan's plan
(``parallelize_llama``'s ``apply_tp``): the embedding ``RowwiseParallel`` with a sequence-sharded
output, ``SequenceParallel`` norms, ``PrepareModuleInput`` gathering the sequence before
attention and the MLP, ``ColwiseParallel`` q/k/v/gate/up, ``RowwiseParallel`` o/down back to
sequence shards, and the head ``ColwiseParallel`` with vocabulary-sharded logits for
``loss_parallel``. Without sequence parallelism the same plan keeps activations replicated.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class _RMSNorm(nn.Module):
    def __init__(self, d, eps):
        super().__init__()
        self.eps, self.weight = eps, nn.Parameter(torch.ones(d))

    def forward(self, x):
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) \
            * self.weight


def _rotate(x, cos, sin):
    """x (B, S, h, hd): the first half of each head rotated with the second (fastpar's rotary)."""
    r = x.shape[-1] // 2
    c, s = cos[None, :, None, :], sin[None, :, None, :]
    x1, x2 = x[..., :r].float(), x[..., r:].float()
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], -1).to(x.dtype)


class _Attention(nn.Module):
    def __init__(self, d, heads, kv_heads, hd):
        super().__init__()
        self.hd, self.gqa = hd, heads != kv_heads
        self.wq = nn.Linear(d, heads * hd, bias=False)
        self.wk = nn.Linear(d, kv_heads * hd, bias=False)
        self.wv = nn.Linear(d, kv_heads * hd, bias=False)
        self.wo = nn.Linear(heads * hd, d, bias=False)

    def forward(self, x, cos, sin):
        B, S = x.shape[:2]
        # -1: the heads this rank holds (torchtitan's view after ColwiseParallel).
        q = self.wq(x).view(B, S, -1, self.hd)
        k = self.wk(x).view(B, S, -1, self.hd)
        v = self.wv(x).view(B, S, -1, self.hd)
        q, k = _rotate(q, cos[:S], sin[:S]), _rotate(k, cos[:S], sin[:S])
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                           v.transpose(1, 2), is_causal=True,
                                           enable_gqa=self.gqa)
        return self.wo(y.transpose(1, 2).reshape(B, S, -1))


class _FeedForward(nn.Module):
    def __init__(self, d, f):
        super().__init__()
        self.w1, self.w3 = nn.Linear(d, f, bias=False), nn.Linear(d, f, bias=False)
        self.w2 = nn.Linear(f, d, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class _Block(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.attention_norm = _RMSNorm(c.d_model, c.norm_eps)
        self.attention = _Attention(c.d_model, c.n_heads, c.kv_heads, c.head_dim)
        self.ffn_norm = _RMSNorm(c.d_model, c.norm_eps)
        self.feed_forward = _FeedForward(c.d_model, c.ffn_dim)

    def forward(self, x, cos, sin):
        x = x + self.attention(self.attention_norm(x), cos, sin)
        return x + self.feed_forward(self.ffn_norm(x))


class TitanLlama(nn.Module):
    """forward(tokens (B, S)) -> logits (B, S, V); see the module doc."""

    def __init__(self, config, cos, sin):
        super().__init__()
        c = config
        self.tok_embeddings = nn.Embedding(c.padded_vocab, c.d_model)
        self.layers = nn.ModuleDict({str(i): _Block(c) for i in range(c.n_layers)})
        self.norm = _RMSNorm(c.d_model, c.norm_eps)
        self.output = nn.Linear(c.d_model, c.padded_vocab, bias=False)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def forward(self, tokens):
        h = self.tok_embeddings(tokens)
        for layer in self.layers.values():
            h = layer(h, self.cos, self.sin)
        return self.output(self.norm(h))

    @classmethod
    @torch.no_grad()
    def from_gpt(cls, gpt) -> "TitanLlama":
        """The same weights as ``gpt`` (a fastpar GPT built at tp=1)."""
        c = gpt.config
        if (c.norm, c.activation, c.rotary, c.bias, c.tie_embeddings, c.dropout) != \
                ("rmsnorm", "swiglu", True, False, False, 0.0) or c.padded_vocab != c.vocab_size:
            raise ValueError(f"TitanLlama mirrors RMSNorm / SwiGLU / rotary models without "
                             f"biases, tying, dropout or vocabulary padding, not {c}")
        model = cls(c, gpt.rope_cos, gpt.rope_sin).to(gpt.rope_cos.device)
        model.tok_embeddings.weight.copy_(gpt.embed.weight)
        model.output.weight.copy_(gpt.head.weight)
        model.norm.weight.copy_(gpt.norm.weight)
        for i, src in gpt.layers.items():
            dst = model.layers[i]
            q, k, v = _rows(src.attn.qkv)
            up, gate = _rows(src.mlp.fc1)
            for lin, w in ((dst.attention.wq, q), (dst.attention.wk, k), (dst.attention.wv, v),
                           (dst.attention.wo, src.attn.o.weight), (dst.feed_forward.w1, gate),
                           (dst.feed_forward.w3, up), (dst.feed_forward.w2, src.mlp.down.weight)):
                lin.weight.copy_(w)
            dst.attention_norm.weight.copy_(src.norm1.weight)
            dst.ffn_norm.weight.copy_(src.norm2.weight)
        return model


def _rows(fused):
    """The weight of each part of a fused column linear (built at tp=1), in part order."""
    return [fused.weight.narrow(0, offset, rows) for _, offset, rows in fused.local_parts()]


def parallelize(model: TitanLlama, mesh, sequence_parallel: bool = True,
                loss_parallel: bool = True) -> TitanLlama:
    """torchtitan's TP plan for its Llama (see the module doc)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput,
                                                   RowwiseParallel, SequenceParallel,
                                                   parallelize_module)

    seq = Shard(1) if sequence_parallel else Replicate()
    norm = SequenceParallel() if sequence_parallel else None
    top = {"tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=seq),
           "output": ColwiseParallel(input_layouts=seq,
                                     output_layouts=Shard(-1) if loss_parallel else Replicate(),
                                     use_local_output=not loss_parallel)}
    if norm is not None:
        top["norm"] = norm
    parallelize_module(model, mesh, top)
    for block in model.layers.values():
        plan = {"attention": PrepareModuleInput(input_layouts=(seq, None, None),
                                                desired_input_layouts=(Replicate(), None, None)),
                "attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(),
                "attention.wv": ColwiseParallel(),
                "attention.wo": RowwiseParallel(output_layouts=seq),
                "feed_forward": PrepareModuleInput(input_layouts=(seq,),
                                                   desired_input_layouts=(Replicate(),)),
                "feed_forward.w1": ColwiseParallel(), "feed_forward.w3": ColwiseParallel(),
                "feed_forward.w2": RowwiseParallel(output_layouts=seq)}
        if norm is not None:
            plan["attention_norm"] = SequenceParallel()
            plan["ffn_norm"] = SequenceParallel()
        parallelize_module(block, mesh, plan)
    return model
