"""Balance stages: split the blocks so no stage costs much more than another.

Costs are given for the model's pieces in order: the modules before the blocks (the embedding),
each block, the modules after them (final norm, head, and the loss). The first stage always holds
the embedding and the last stage the head, so their costs count against those stages: with a large
vocabulary the head alone can cost several blocks, and the last stage then gets fewer blocks.
"""
from __future__ import annotations

import statistics
import time
from typing import Callable, Sequence

import torch
import torch.nn as nn

from ..mesh.layout import require_positive


def partition(layer_costs: Sequence[float], pp_size: int,
              virtual_stages: int = 1) -> list[range]:
    """Block ranges, one per stage (``pp_size * virtual_stages`` of them), minimising the most
    expensive stage.

    ``layer_costs`` is ``[embedding, block 0, ..., block N-1, head]``; the result's ranges index
    the N blocks. Among splits with the same maximum, the one whose stages sit closest to the
    average is kept. Exact (dynamic programming over the split points).
    """
    require_positive({"pp_size": pp_size, "virtual_stages": virtual_stages}, "partition: ")
    costs = [float(c) for c in layer_costs]
    if any(not c >= 0 for c in costs):                 # also catches NaN
        raise ValueError(f"partition: layer costs must be >= 0, got {costs}")
    stages, blocks = pp_size * virtual_stages, len(costs) - 2
    if blocks < stages:
        raise ValueError(f"partition: {max(blocks, 0)} blocks (layer_costs has {len(costs)} "
                         f"entries: embedding, blocks, head) cannot fill {stages} stages "
                         f"(pp_size={pp_size} x virtual_stages={virtual_stages})")
    first, last, block = costs[0], costs[-1], costs[1:-1]
    if len(set(block)) == 1 and stages > 1:
        return _uniform(blocks, stages, first, last, block[0])
    prefix = [0.0]
    for c in block:
        prefix.append(prefix[-1] + c)
    target = (prefix[-1] + first + last) / stages

    def cost(s: int, a: int, e: int) -> float:       # stage s holds blocks a..e-1
        ends = (first if s == 0 else 0.0) + (last if s == stages - 1 else 0.0)
        return prefix[e] - prefix[a] + ends

    # best[s][e]: (max stage cost, spread) for stages 0..s holding blocks 0..e-1
    inf = (float("inf"), float("inf"))
    best = [[inf] * (blocks + 1) for _ in range(stages)]
    cut = [[0] * (blocks + 1) for _ in range(stages)]
    for e in range(1, blocks - stages + 2):
        c = cost(0, 0, e)
        best[0][e] = (c, (c - target) ** 2)
    for s in range(1, stages):
        for e in range(s + 1, blocks - (stages - 1 - s) + 1):
            for a in range(s, e):
                prev = best[s - 1][a]
                c = cost(s, a, e)
                cand = (max(prev[0], c), prev[1] + (c - target) ** 2)
                if cand < best[s][e]:
                    best[s][e], cut[s][e] = cand, a
    parts, e = [], blocks
    for s in range(stages - 1, -1, -1):
        a = cut[s][e] if s > 0 else 0
        parts.append(range(a, e))
        e = a
    return parts[::-1]


def _uniform(blocks: int, stages: int, first: float, last: float, c: float) -> list[range]:
    """partition() when every block costs ``c``: the same objective (most expensive stage, then
    the spread around the average) without the DP. The first and last stages take n0 and nl
    blocks, the middle ones share the rest evenly; (n0, nl) pairs whose end stages already cost
    more than the best maximum found are skipped."""
    target = (blocks * c + first + last) / stages
    mid = stages - 2
    best_key, best = (float("inf"), float("inf")), None
    for n0 in range(1, blocks - stages + 2):
        head = first + n0 * c
        if head > best_key[0]:
            break
        for nl in range(1, blocks - n0 - mid + 1):
            tail = last + nl * c
            if tail > best_key[0]:
                break
            rest = blocks - n0 - nl
            if mid == 0:
                if rest:
                    continue
                q = r = 0
                top = max(head, tail)
            else:
                q, r = divmod(rest, mid)
                top = max(head, tail, (q + 1) * c if r else q * c)
            if top > best_key[0]:
                continue
            spread = ((head - target) ** 2 + (tail - target) ** 2 + r * ((q + 1) * c - target) ** 2
                      + (mid - r) * (q * c - target) ** 2)
            if (top, spread) < best_key:
                best_key, best = (top, spread), (n0, q, r, nl)
    n0, q, r, nl = best
    sizes = [n0] + [q + 1] * r + [q] * (mid - r) + [nl]
    parts, a = [], 0
    for n in sizes:
        parts.append(range(a, a + n))
        a += n
    return parts


def _pieces(model: nn.Module, blocks: str, first: Sequence[str], last: Sequence[str]):
    def seq(names):
        mods = [getattr(model, n) for n in names if getattr(model, n, None) is not None]
        return nn.Sequential(*mods)

    container = getattr(model, blocks, None)
    if not isinstance(container, nn.ModuleDict):
        raise ValueError(f"estimate_layer_costs: model.{blocks} must be an nn.ModuleDict")
    return [seq(first), *container.values(), seq(last)]


def _flops_per_token(module: nn.Module) -> float:
    """Forward + backward FLOPs per token from parameter counts: 6 per weight (2 forward, 4
    backward) for matmul-like layers; an embedding is a gather, costed at 6 per output element.
    Attention's sequence-length term is not counted (profile for that). For a model given as
    modules only; fastpar's GPT is costed by ``GPTConfig.piece_flops``, the model's one count."""
    total = 0.0
    for m in module.modules():
        own = [p for p in m.parameters(recurse=False)]
        if isinstance(m, nn.Embedding):
            total += 6.0 * m.embedding_dim
        else:
            total += 6.0 * sum(p.numel() for p in own)
    return total


def estimate_layer_costs(model: nn.Module, example: torch.Tensor | None = None, *,
                         target: torch.Tensor | None = None,
                         loss_fn: Callable | None = None, steps: int = 3,
                         blocks: str = "blocks", first: Sequence[str] = ("embed",),
                         last: Sequence[str] = ("norm", "head")) -> list[float]:
    """Costs ``[first modules, block 0, ..., block N-1, last modules]`` for :func:`partition`.

    Without ``example``: FLOPs per token from parameter counts (no compute). With ``example`` (a
    micro-batch for the first piece): a short timed profile, the median over ``steps`` runs of
    each piece's forward + backward in seconds; ``loss_fn(output, target)`` is charged to the
    last piece when both are given. Parameter gradients are left as they were.
    """
    pieces = _pieces(model, blocks, first, last)
    if example is None:
        return [_flops_per_token(p) for p in pieces]
    require_positive({"steps": steps}, "estimate_layer_costs: ")
    params = list(model.parameters())
    saved = [p.grad for p in params]
    device = example.device
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    times: list[list[float]] = [[] for _ in pieces]
    for run in range(steps + 1):                         # run 0 warms up
        x, held = example, []
        for i, piece in enumerate(pieces):
            xin = x.detach().requires_grad_(x.is_floating_point())
            sync()
            t0 = time.perf_counter()
            y = piece(xin)
            out = loss_fn(y, target) if (i == len(pieces) - 1 and loss_fn is not None
                                         and target is not None) else y
            sync()
            held.append((xin, out, time.perf_counter() - t0))
            x = y
        grad = None
        for i in range(len(pieces) - 1, -1, -1):
            xin, out, fwd = held[i]
            sync()
            t0 = time.perf_counter()
            if out.requires_grad:
                out.backward(grad if grad is not None or out.dim() == 0 else torch.ones_like(out))
            sync()
            if run:
                times[i].append(fwd + time.perf_counter() - t0)
            grad = xin.grad
    for p, g in zip(params, saved):
        p.grad = g
    return [statistics.median(t) for t in times]
