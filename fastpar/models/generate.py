"""Text generation: a KV cache for :class:`~fastpar.models.GPT`, and greedy / top-k sampling.

``generate`` prefills the prompt through ``GPT.forward(tokens, cache=cache)``, then feeds one
token at a time: each layer appends that token's keys and values to its :class:`LayerCache` and
attends over everything cached, at the token's true position (rotary rows or learned position
``cache.length``). Under tensor parallelism each rank caches only its own key/value heads and the
model's layers do their usual collectives; the last position's logits (a vocabulary shard per
rank) are all-gathered, so every rank holds the same full row and draws the same token from its
own CPU ``torch.Generator`` seeded with ``seed``: no broadcast is needed, and the draws do not
depend on the device or on tp (only the logits' rounding does).
"""
from __future__ import annotations

import math

import torch

from ..tensor_parallel import gather_from_tp


class LayerCache:
    """One layer's keys and values on this TP rank: (B, kv_heads/tp, max_len, hd) each, of which
    positions ``0 .. length - 1`` are filled. Allocated at the first append in the keys' dtype and
    device (bf16 under autocast, say), for all ``max_len`` positions at once."""

    def __init__(self, owner: "KVCache"):
        self._owner, self.k, self.v = owner, None, None

    @property
    def length(self) -> int:
        return self._owner.length

    def append(self, k: torch.Tensor, v: torch.Tensor):
        """Write k, v (B, h_kv, S, hd) at positions length .. length + S - 1; return the keys and
        values of positions 0 .. length + S - 1 (views of the cache)."""
        start, end = self.length, self.length + k.shape[2]
        if self.k is None:
            B, h, _, hd = k.shape
            self.k = k.new_empty(B, h, self._owner.max_len, hd)
            self.v = v.new_empty(B, h, self._owner.max_len, hd)
        elif k.shape[:2] != self.k.shape[:2] or k.dtype != self.k.dtype:
            raise ValueError(f"KVCache: keys {tuple(k.shape)} {k.dtype} do not fit a cache of "
                             f"{tuple(self.k.shape)} {self.k.dtype} (another batch or dtype)")
        self.k[:, :, start:end] = k
        self.v[:, :, start:end] = v
        return self.k[:, :, :end], self.v[:, :, :end]


class KVCache:
    """Keys and values of every layer of ``model`` (this TP rank's heads) for up to ``max_len``
    positions (default the model's ``max_seq_len``); ``length`` positions are filled. Pass it to
    ``model(tokens, cache=cache)``; :meth:`reset` empties it for a new sequence."""

    def __init__(self, model, max_len: int | None = None):
        if model.cp_group is not None:
            raise ValueError("KVCache: generation does not run a context-parallel model; build "
                             "the GPT without cp_group (same weights, same checkpoint)")
        if model.sp:
            raise ValueError("KVCache: generation does not run a sequence-parallel model; build "
                             "the GPT without sequence_parallel (same weights, same checkpoint)")
        limit = model.config.max_seq_len
        self.max_len = limit if max_len is None else max_len
        if not 1 <= self.max_len <= limit:
            raise ValueError(f"KVCache: max_len={self.max_len} must be in 1 .. the model's "
                             f"max_seq_len={limit}")
        self.length = 0
        self.layers = {name: LayerCache(self) for name in model.layers}

    def check(self, model, new: int) -> None:
        """Raise ValueError if ``new`` more positions of ``model`` do not fit this cache."""
        if list(model.layers) != list(self.layers):
            raise ValueError(f"KVCache: built for layers {list(self.layers)}, the model has "
                             f"{list(model.layers)}")
        if self.length + new > self.max_len:
            raise ValueError(f"KVCache: {self.length} cached + {new} new positions > "
                             f"max_len={self.max_len}")

    def advance(self, n: int) -> None:
        self.length += n

    def reset(self) -> None:
        self.length = 0


def pick_token(logits: torch.Tensor, temperature: float, top_k: int | None,
               generator: torch.Generator) -> int:
    """The next token from one row of full-vocabulary logits (V,): the argmax at temperature 0,
    else a draw from softmax(logits / temperature) over the ``top_k`` largest (None/0: all)."""
    if temperature == 0:
        return int(logits.argmax())
    logits = logits.float() / temperature
    if top_k and top_k < logits.numel():
        kth = logits.topk(top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return int(torch.multinomial(torch.softmax(logits, -1), 1, generator=generator))


def check_generate(cfg, prompt_ids, max_new_tokens: int, temperature: float,
                   top_k: int | None) -> list[int]:
    """The prompt as a list of ints; ValueError naming the values that ``generate`` cannot use
    with a model of config ``cfg`` (a :class:`~fastpar.models.GPTConfig`)."""
    prompt = [int(t) for t in prompt_ids]
    if not prompt:
        raise ValueError("generate: the prompt is empty (at least one token is needed)")
    bad = [t for t in prompt if not 0 <= t < cfg.vocab_size]
    if bad:
        raise ValueError(f"generate: prompt token {bad[0]} is outside the model's vocabulary "
                         f"0 .. {cfg.vocab_size - 1}")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) \
            or max_new_tokens < 1:
        raise ValueError(f"generate: max_new_tokens={max_new_tokens!r} must be an int >= 1")
    if len(prompt) + max_new_tokens > cfg.max_seq_len:
        raise ValueError(f"generate: the prompt's {len(prompt)} tokens + max_new_tokens="
                         f"{max_new_tokens} = {len(prompt) + max_new_tokens} is more than the "
                         f"model's max_seq_len={cfg.max_seq_len}")
    if not (isinstance(temperature, (int, float)) and math.isfinite(temperature)
            and temperature >= 0):
        raise ValueError(f"generate: temperature={temperature!r} must be a finite number >= 0 "
                         "(0 = greedy)")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0):
        raise ValueError(f"generate: top_k={top_k!r} must be None or an int >= 0 (0 = all)")
    return prompt


@torch.no_grad()
def generate(model, prompt_ids, max_new_tokens: int, temperature: float = 1.0,
             top_k: int | None = None, seed: int = 0, eos_id: int | None = None) -> list[int]:
    """The new tokens (at most ``max_new_tokens``; the last is ``eos_id`` if it stopped there)
    after ``prompt_ids`` for one sequence on a whole GPT (``model.tp_group`` may be a TP group:
    every rank calls this with the same arguments and returns the same tokens). Temperature 0 is
    greedy; ``top_k`` None or 0 samples from the whole vocabulary. Runs in eval mode, without
    gradients; every argument is checked before any collective."""
    if not (model.pre_process and model.post_process):
        raise ValueError("generate: the model must be whole (pre_process and post_process), "
                         "not a pipeline stage")
    prompt = check_generate(model.config, prompt_ids, max_new_tokens, temperature, top_k)
    device, vocab = next(model.parameters()).device, model.config.vocab_size
    generator = torch.Generator().manual_seed(seed)     # on the CPU: the same draw on any device
    was_training = model.training
    model.eval()
    try:
        cache = KVCache(model, len(prompt) + max_new_tokens - 1)
        x, new = torch.tensor([prompt], device=device), []
        for _ in range(max_new_tokens):
            z = gather_from_tp(model(x, cache=cache)[:, -1], model.tp_group)   # (1, Vp)
            new.append(pick_token(z[0, :vocab].cpu(), temperature, top_k, generator))
            if new[-1] == eos_id:
                break
            x = torch.tensor([new[-1:]], device=device)
    finally:
        model.train(was_training)
    return new
