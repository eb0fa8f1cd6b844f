"""GPT: a decoder-only Transformer built from the tensor-parallel layers.

Blocks live in an ``nn.ModuleDict`` keyed by their layer index, and the embedding / final norm /
head are optional, so a pipeline stage is the same class built with a range of layers. Every
module's weights come from a seed derived from ``config.init_seed`` and its position, so the
same config gives the same full model whatever the (tp, pp) layout.
"""
from __future__ import annotations

import contextlib

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from .. import kernels
from ..tensor_parallel import (ColumnParallelLinear, VocabParallelEmbedding, copy_to_tp,
                               gather_from_sp, vocab_parallel_cross_entropy)
from ..tensor_parallel import mark_partial_grads
from ..tensor_parallel.overlap import deferred_reductions, filling
from ..mesh.profiling import span
from ..context_parallel import positions
from ..mesh.groups import group_rank, group_size
from .config import GPTConfig
from .layers import Norm, ParallelTransformerLayer, rotary_tables

# Activation recomputation, from none to the most: "selective" redoes attention's core
# (softmax(QK^T)V), "full" a whole layer's forward.
RECOMPUTE = ("none", "selective", "full")


@contextlib.contextmanager
def _seeded(seed: int):
    """Initialise under a fixed seed without disturbing the caller's RNG stream."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


class GPT(nn.Module):
    """The model, or one pipeline stage of it (``layers``, ``pre_process``, ``post_process``)."""

    def __init__(self, config: GPTConfig, *, tp_group=None, sequence_parallel=False,
                 overlap=True, layers=None, pre_process=True, post_process=True,
                 recompute="none", device=None, cp_group=None, ep_group=None,
                 ep_chunks=2):
        super().__init__()
        if recompute not in RECOMPUTE:
            raise ValueError(f"recompute={recompute!r} is not one of {RECOMPUTE}")
        tp = group_size(tp_group)
        config.check_tp(tp)
        # Context parallelism: the tokens given are this rank's two chunks of each sequence
        # (fastpar.context_parallel.shard_sequence), each at its true position.
        self.cp_group = cp_group if group_size(cp_group) > 1 else None
        if self.cp_group is not None and config.dropout:
            raise ValueError(f"GPT: dropout={config.dropout} with context parallelism is not "
                             "supported (the masks would not be the single-process ones)")
        layers = range(config.n_layers) if layers is None else layers
        if any(not 0 <= i < config.n_layers for i in layers):
            raise ValueError(f"layers {list(layers)} outside 0..{config.n_layers - 1}")
        self.config, self.tp_group, self.sp = config, tp_group, sequence_parallel
        self.pre_process, self.post_process, self.recompute = pre_process, post_process, recompute
        self._overlap = overlap
        # Expert parallelism: each MoE layer's experts split over ep_group, its tokens
        # dispatched in ep_chunks chunks (1: blocking).
        self.ep_group, self._ep_chunks = ep_group, ep_chunks
        if pre_process:
            self.embed = self._new_piece("embed", device)
            if not config.rotary:
                self.pos_embed = self._new_piece("pos_embed", device)
                if sequence_parallel and tp > 1:    # each rank adds its own rows' positions
                    mark_partial_grads(self.pos_embed, "weight")
        self.layers = nn.ModuleDict()
        for i in layers:
            self.layers[str(i)] = self._new_piece(f"layers.{i}", device)
        if post_process:
            self.norm = self._new_piece("norm", device)
            if not config.tie_embeddings:
                self.head = self._new_piece("head", device)
            elif not pre_process:
                # Tied embeddings on the last pipeline stage (Megatron's way): a copy of the
                # embedding, drawn as the first stage's, its gradient summed with the first
                # stage's over the embedding group once per step
                # (:func:`fastpar.pipeline.tied.reduce_tied_grads`), so both copies step alike;
                # not saved (the first stage's is the checkpoint's).
                self.embed = self._new_piece("embed", device)
                self.embed.weight.tied_embedding = self.embed.weight.tied_copy = True
        if pre_process and not post_process and config.tie_embeddings:
            self.embed.weight.tied_embedding = True     # the first stage's, of a pipeline
        if config.rotary:
            cos, sin = rotary_tables(config, device)
            self.register_buffer("rope_cos", cos, persistent=False)
            self.register_buffer("rope_sin", sin, persistent=False)

    def _new_piece(self, key: str, device) -> nn.Module:
        """The module ``key`` ("embed", "pos_embed", "layers.<i>", "norm", "head") as
        initialised: under its seed (derived from ``config.init_seed`` and its position), with
        GPT-2's scales on top of the layers' own init (embeddings N(0, 0.02); the projections
        that write into the residual stream shrunk by 1/sqrt(2 n_layers); elementwise, so
        every shard stays the slice of the full model)."""
        config, seed = self.config, self.config.init_seed * 1_000_003
        kw = dict(tp_group=self.tp_group, sequence_parallel=self.sp)
        # Under SP the column linears keep their gathered inputs for the weight gradients
        # (as autograd does for torch's own SP), unless activations are recomputed to save
        # memory: then they gather them again in backward, one more all-gather each, as
        # Megatron does. A fully recomputed block gathers in its forward replay anyway, so its
        # linears keep that copy; the head's is kept only without recompute.
        meta = torch.device("meta") if torch.device(device or "cpu").type == "meta" else \
            contextlib.nullcontext()          # shapes only: nothing drawn, nothing computed
        if key == "norm":
            return Norm(config, **kw).to(device)
        with meta, _seeded(seed + {"embed": 0, "pos_embed": 1, "head": 2}.get(key, 0)), \
                torch.no_grad():
            if key == "embed":
                m = VocabParallelEmbedding(config.padded_vocab, config.d_model, device=device,
                                           **kw)
                m.weight.mul_(0.02)
            elif key == "pos_embed":
                m = nn.Embedding(config.max_seq_len, config.d_model, device=device)
                m.weight.mul_(0.02)
            elif key == "head":
                m = ColumnParallelLinear(config.d_model, config.padded_vocab, bias=False,
                                         overlap=self._overlap, device=device,
                                         regather_input=self.recompute != "none", **kw)
            else:
                i = int(key.split(".")[1])
                torch.manual_seed(seed + 100 + i)
                m = ParallelTransformerLayer(config, overlap=self._overlap,
                                             cp_group=self.cp_group, ep_group=self.ep_group,
                                             ep_chunks=self._ep_chunks,
                                             regather_input=self.recompute == "selective",
                                             **kw).to(device)
                for w in (m.attn.o.weight, *([m.mlp.experts.down] + (
                        [m.mlp.shared.down] if m.mlp.shared is not None else [])
                        if config.n_experts else [m.mlp.down.weight])):
                    w.mul_((2 * config.n_layers) ** -0.5)
        return m

    @torch.no_grad()
    def init_weights_(self, params=None) -> None:
        """Write the initial values (those the constructor gives) into ``params`` (default:
        all of this module's), in place: what a model built on the meta device and sharded
        (ZeRO-3's ``DistributedOptimizer.materialize``) needs, a piece (a block, the
        embedding, ...) at a time, each built once more under its seed."""
        want = None if params is None else {id(p) for p in params}
        keys = ([k for k in ("embed", "pos_embed", "norm", "head") if hasattr(self, k)] +
                [f"layers.{i}" for i in self.layers])
        for key in keys:
            mine = self.get_submodule(key)
            named = [(n, p) for n, p in mine.named_parameters()
                     if want is None or id(p) in want]
            if not named:
                continue
            fresh = dict(self._new_piece(key, named[0][1].device).named_parameters())
            for n, p in named:
                p.copy_(fresh[n])

    def reset_buffers(self, device) -> None:
        """The rotary tables, and the MoE routers' loss-free biases (zeros), on ``device``,
        after a build on the meta device."""
        if self.config.rotary:
            self.rope_cos, self.rope_sin = rotary_tables(self.config, device)
        for m in self.modules():
            if isinstance(getattr(m, "router", None), nn.Module) and m.router.bias.is_meta:
                m.router.bias = torch.zeros(m.router.n_experts, device=device)

    def embed_tokens(self, tokens, start: int = 0, looked_up=None, positions=None):
        """(B, S) ids at positions ``start`` .. start + S - 1 (or ``positions`` (B, S), this
        rank's) -> (S, B, D) hidden, or (S/tp, B, D) under sequence parallelism. ``looked_up``:
        the embedding's output for ``tokens``, already computed."""
        x = self.embed(tokens.t().contiguous()) if looked_up is None else looked_up
        if not self.config.rotary:
            S = tokens.shape[1]
            if positions is not None:                           # (S, B, D): per sequence
                pos = self.pos_embed.weight[positions.t()]
            else:
                pos = self.pos_embed.weight[start:start + S] if self.cp_group is None else \
                    self.pos_embed.weight[self._positions(S)]
                pos = pos[:, None, :]
            if self.sp:     # this rank's rows: a partial gradient (marked in __init__)
                tp, r = group_size(self.tp_group), group_rank(self.tp_group)
                pos = pos.chunk(tp, 0)[r]
            x = x + pos
        # Dropout as the blocks do it (a Philox mask fixed by seed and offset): under SP each
        # rank's offset is where its sequence shard starts, so the shards' masks are the slices
        # of the unsharded one and the RNG is drawn from the same way at any tp.
        shard = group_rank(self.tp_group) if self.sp else 0
        return kernels.bias_dropout_add(x, None, torch.zeros_like(x), self.config.dropout,
                                        self.training, None, shard * x.numel())

    def logits(self, x):
        """(S[/tp], B, D) -> (B, S, V/tp) logits over this rank's vocabulary shard; padding -inf.
        A view of the head's sequence-first output (S, B, V/tp), not a copy."""
        z = self._head_out(x)
        cfg = self.config
        if cfg.padded_vocab != cfg.vocab_size:
            shard = z.shape[-1]
            ids = torch.arange(shard, device=z.device) + shard * group_rank(self.tp_group)
            z = z.masked_fill(ids >= cfg.vocab_size, float("-inf"))  # never predicted
        return z.transpose(0, 1)

    def _head_out(self, x):
        """(S[/tp], B, D) -> (S, B, Vp/tp): the head's output, padding columns not masked."""
        x = self.norm(x)
        if self.config.tie_embeddings:
            x = gather_from_sp(x, self.tp_group) if self.sp else copy_to_tp(x, self.tp_group)
            return F.linear(x, self.embed.weight)
        return self.head(x)

    def forward(self, x, targets=None, cache=None, docs=None):
        """Tokens (B, S) on the first stage, hidden (S[/tp], B, D) on the others. Returns the mean
        loss over non-ignored targets if ``targets`` (B, S) is given on the last stage, else the
        logits (B, S, V/tp) on the last stage, else the hidden state for the next stage.

        ``docs`` (:class:`~fastpar.models.documents.Documents`, every stage): packed documents,
        each token at its position in its document and attending inside its document only;
        under context parallelism they describe the whole sequence.

        ``cache`` (a :class:`~fastpar.models.generate.KVCache`, inference): the tokens are the
        ``cache.length``-th onwards; each layer appends its keys and values to the cache and
        attends to all it holds, and the cache grows by S."""
        if cache is not None:
            return self._forward_cached(x, cache)
        x, rope = self._enter(x, docs=docs)
        for layer in self.layers.values():
            if self.recompute == "full" and self.training:
                x = checkpoint(layer, x, rope, False, None, docs, use_reentrant=False)
            else:
                x = layer(x, rope, self.recompute == "selective" and self.training, None, docs)
        return self._exit(x, targets)

    def _enter(self, x, looked_up=None, docs=None):
        """The embedding (on the first stage) and the rotary rows of these tokens;
        ``looked_up`` as in :meth:`embed_tokens`."""
        positions = None
        if docs is not None:
            positions = docs.positions if self.cp_group is None else \
                docs.local(group_rank(self.cp_group), group_size(self.cp_group))
        if self.pre_process:
            self._check_tokens(x)
            if positions is not None and tuple(x.shape) != tuple(positions.shape):
                raise ValueError(f"GPT: documents of shape {docs.shape} for tokens "
                                 f"{tuple(x.shape)}")
            x = self.embed_tokens(x, looked_up=looked_up, positions=positions)
        rope = (self.rope_cos, self.rope_sin) if self.config.rotary else None
        if rope is not None and positions is not None:          # (B, S, hd/2): per sequence
            rope = tuple(t[positions] for t in rope)
        elif rope is not None and self.cp_group is not None:   # the rows of the true positions
            S = x.shape[0] * (group_size(self.tp_group) if self.sp else 1)
            rope = tuple(t[self._positions(S)] for t in rope)
        return x, rope

    def _check_tokens(self, x) -> None:
        if x.dim() != 2 or x.shape[1] > self.config.max_seq_len:
            raise ValueError(f"GPT: tokens must be (B, S) with S <= max_seq_len="
                             f"{self.config.max_seq_len}, got {tuple(x.shape)}")

    def _exit(self, x, targets):
        """The last stage's logits or loss from the blocks' output; else that output."""
        if not self.post_process:
            return x
        if targets is None:
            return self.logits(x)
        # The loss reads the head's output in place and leaves the padding out itself: no
        # masked copy of the logits, and a gradient laid out as the head's output.
        z = self._head_out(x).transpose(0, 1)                         # (B, S, Vp/tp), a view
        return token_loss(z, targets, self.tp_group, self.config.vocab_size)

    def check_interleave(self, dropout: bool = False) -> None:
        """Raise unless :meth:`interleaved` (or :meth:`forward_steps`) can run this model: no
        full recompute (its checkpointed blocks run whole), no dropout in training (unless
        ``dropout``: the micro-batches' forwards still run one after another), and no hook on
        the model or a block (it calls the blocks' :meth:`~ParallelTransformerLayer.steps`, not
        the blocks, so such hooks, e.g. ZeRO-3's gathers, would not run)."""
        if self.recompute == "full":
            raise ValueError("interleaved micro-batches need recompute 'none' or 'selective', "
                             "not 'full' (a checkpointed block runs whole)")
        if self.config.dropout and self.training and not dropout:
            raise ValueError(f"interleaved micro-batches with dropout={self.config.dropout}: "
                             f"the masks would be drawn in another order than one "
                             f"micro-batch after another")
        hooked = [name or "the model" for name, m in [("", self)] + list(self.layers.items())
                  if m._forward_pre_hooks or m._forward_hooks]
        if hooked:
            raise ValueError(f"interleaved micro-batches call the blocks' steps, not the "
                             f"blocks: the forward hooks on {', '.join(hooked)} would not run "
                             f"(ZeRO-3 gathers a block in such a hook: use --zero 0, 1 or 2)")

    def interleaved(self, xs, targets, docs=None):
        """``[self(x, t) for x, t in zip(xs, targets)]``, the same numbers, with the
        micro-batches' forwards interleaved block by block (:func:`interleave`): while one
        micro-batch's row-parallel all-reduce is in flight, the next one computes (what
        DeepSpeed's Domino does inside a batch, here across micro-batches that exist anyway).
        Every micro-batch's activations stay until their backward."""
        self.check_interleave()
        selective = self.recompute == "selective" and self.training

        docs = docs or [None] * len(xs)

        def run(x, d):
            x, rope = self._enter(x, docs=d)
            for layer in self.layers.values():
                x = yield from layer.steps(x, rope, selective, d)
            return x
        return [self._exit(x, t) for x, t in
                zip(interleave([run(x, d) for x, d in zip(xs, docs)]), targets)]

    def forward_steps(self, x, targets=None, docs=None) -> "ForwardSteps":
        """``self(x, targets)`` run a step at a time, from wherever the caller likes (the
        previous micro-batch's backward: :func:`overlap_forward_backward`): each step ends
        after the embedding or a row-parallel projection, with its all-reduce left in flight.
        The same ops in the same order as ``forward``, so the same numbers."""
        self.check_interleave(dropout=True)
        selective = self.recompute == "selective" and self.training

        def run():
            looked_up = None
            if self.pre_process:            # the embedding's all-reduce left in flight too
                self._check_tokens(x)
                looked_up = self.embed(x.t().contiguous(), defer=True)
                yield
            h, rope = self._enter(x, looked_up, docs)
            for layer in self.layers.values():
                h = yield from layer.steps(h, rope, selective, docs)
            return self._exit(h, targets)
        return ForwardSteps(run(), x.device.type)

    def _positions(self, local_len: int) -> torch.Tensor:
        """The true positions of this CP rank's ``local_len`` tokens of each sequence."""
        cp = group_size(self.cp_group)
        device = self.rope_cos.device if self.config.rotary else self.pos_embed.weight.device
        return positions(local_len * cp, group_rank(self.cp_group), cp, device)

    def _forward_cached(self, x, cache):
        """forward with a KV cache: positions from ``cache.length``, no recompute, no loss."""
        start = cache.length
        S = x.shape[1] if self.pre_process else x.shape[0]
        cache.check(self, S)
        if self.pre_process:
            x = self.embed_tokens(x, start)
        rope = (self.rope_cos[start:start + S], self.rope_sin[start:start + S]) \
            if self.config.rotary else None
        for name, layer in self.layers.items():
            x = layer(x, rope, kv=cache.layers[name])
        cache.advance(S)
        return self.logits(x) if self.post_process else x


def interleave(runs: list) -> list:
    """Run generators (each a micro-batch's forward, pausing after each row-parallel
    projection) round-robin to their ends; returns their results in order.

    Each step runs inside :func:`~fastpar.tensor_parallel.overlap.deferred_reductions`, so a
    row-parallel output's all-reduce is started, not waited; the run that made it waits it when
    it resumes, after the other runs' steps have computed (a GPU's compute stream meanwhile,
    the host's thread on CPU)."""
    works = [[] for _ in runs]
    out, live = [None] * len(runs), list(range(len(runs)))
    while live:
        for k in list(live):
            for work in works[k]:
                work.wait()
            works[k].clear()
            with deferred_reductions(works[k]):
                try:
                    next(runs[k])
                except StopIteration as done:
                    out[k] = done.value
                    live.remove(k)
    return out


class ForwardSteps:
    """A micro-batch's forward (:meth:`GPT.forward_steps`), one step per call. A step first
    waits the all-reduce the previous one left in flight, then runs inside
    ``deferred_reductions(late_grads=False)`` with grad on and the autocast state of the
    forward's creator, whatever the caller's (autograd turns grad off in a backward, and may
    run it on another thread)."""

    def __init__(self, run, device_type: str):
        self.run, self.works, self.done, self.result = run, [], False, None
        self.device_type = device_type
        self.autocast = (torch.is_autocast_enabled(device_type),
                         torch.get_autocast_dtype(device_type))

    def __call__(self) -> None:
        """One step; nothing once the forward is done."""
        if self.done:
            return
        for work in self.works:
            work.wait()
        self.works.clear()
        with torch.enable_grad(), torch.autocast(self.device_type, self.autocast[1],
                                                 enabled=self.autocast[0]), \
                deferred_reductions(self.works, late_grads=False):
            try:
                next(self.run)
            except StopIteration as end:
                self.done, self.result = True, end.value

    def finish(self):
        """The rest of the steps; returns the forward's result (the loss)."""
        while not self.done:
            self()
        return self.result


def overlap_forward_backward(model: GPT, xs, ys, divisor: int = 1, before_backward=None,
                             docs=None):
    """Forward and backward of the micro-batches ``xs``, ``ys`` one after another, each
    micro-batch's forward run inside the previous one's backward: a step of it wherever a
    column linear's backward has its input-gradient all-reduce in flight
    (:func:`~fastpar.tensor_parallel.overlap.filling`), and each step's own row all-reduce
    travelling while that backward computes on. The activations held stay about one
    micro-batch's: the backward frees its blocks from the top while the forward fills from the
    bottom. Each loss is divided by ``divisor`` before its backward; returns the sum of the
    divided losses, detached. ``before_backward(i)`` is called before micro-batch i's backward
    (e.g. to turn the data-parallel sync on for the last one). The same numbers as
    ``for x, y in zip(xs, ys): (model(x, y) / divisor).backward()``. ``docs``: each
    micro-batch's :class:`~fastpar.models.documents.Documents` (or None)."""
    total, prev = None, None
    docs = docs or [None] * len(xs)
    for i in range(len(xs) + 1):
        nxt = model.forward_steps(xs[i], ys[i], docs[i]) if i < len(xs) else None
        if prev is not None:
            if before_backward is not None:
                before_backward(i - 1)
            with span("backward of micro-batch", i - 1, *(("with the forward of micro-batch",
                                                           i, "inside") if nxt else ())):
                with filling(nxt) if nxt is not None else contextlib.nullcontext():
                    prev.backward()
        if nxt is not None:
            with span("forward of micro-batch", i, "(the rest)"):
                prev = nxt.finish() / divisor
            total = prev.detach() if total is None else total + prev.detach()
    return total


_PER_LOSS: float | None = None      # see tokens_per_loss


@contextlib.contextmanager
def tokens_per_loss(n: float | None):
    """Inside, :func:`token_loss` divides its sum by ``n`` instead of its own count of trained
    targets. A trainer whose micro-batches (or data-parallel ranks) train different numbers of
    targets (masks, packed documents) passes the global batch's count / (micro-batches x
    data-parallel x context-parallel ranks): the mean of the micro-batch losses over them is
    then the mean over every trained target of the global batch, as one process computes it.
    A plain module value, not a thread-local: the loss may run on a pipeline pair's or
    autograd's thread."""
    global _PER_LOSS
    outer, _PER_LOSS = _PER_LOSS, n
    try:
        yield
    finally:
        _PER_LOSS = outer


def token_loss(logits: torch.Tensor, targets: torch.Tensor, tp_group=None,
               vocab_size: int | None = None) -> torch.Tensor:
    """The model's loss, for every layout (the pipeline's last stage too): the mean
    cross-entropy over the targets that are not ignored (-100), from vocabulary-sharded logits
    (B, S, V/tp), read where they lie (the model's transposed view is not copied).
    ``vocab_size``: the real classes, when the logits' padding columns are not masked. Inside
    :func:`tokens_per_loss` the sum is divided by its count instead."""
    loss = vocab_parallel_cross_entropy(logits, targets, tp_group=tp_group,
                                        vocab_size=vocab_size)          # (B, S)
    if _PER_LOSS is not None:
        return loss.sum() / _PER_LOSS
    return loss.sum() / (targets != -100).sum().clamp(min=1)
