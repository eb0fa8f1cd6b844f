"""Mixture of experts: a top-k router and SwiGLU experts, in place of a block's MLP.

Tokens are rows ``(T, D)`` (the block's ``(S, B, D)`` flattened). The router scores every expert
in fp32 (softmax of ``x W_r^T``), picks each token's ``top_k`` and weighs their outputs by the
picked probabilities (renormalised over the ``top_k`` when ``norm_topk``, as Mixtral does). Two ways
to balance the load, usable together:

- the auxiliary loss of Switch / GShard as Mixtral defines it, ``E * sum_e (tokens to e / T) *
  (mean router probability of e)``, times ``aux_loss_coef``, added to the training loss through
  the backward (:class:`AuxLoss`: the model's outputs are unchanged; Megatron's way), per
  micro-batch, scaled by 1 / M as the training loss is (:func:`aux_scale`);
- the auxiliary-loss-free bias of DeepSeek-V3: a per-expert bias added to the scores for the
  choice only (not the weights), moved after each optimizer step by ``bias_update_rate`` towards
  the experts that got fewer tokens than the mean (:func:`update_biases`: the counts summed over
  the data-parallel ranks first, so every replica steps alike).

Dropless by default: every expert takes all the tokens routed to it. With ``capacity_factor`` > 0
an expert takes at most ``ceil(capacity_factor * T * top_k / E)`` tokens, the first ones in token
order; the others' assignments are dropped (their weight lost, as in Switch) and counted.

Optional shared experts (DeepSeek, Qwen-MoE): one dense SwiGLU MLP every token goes through, its
output added, optionally scaled by ``sigmoid(x w_g)`` (Qwen2-MoE's shared-expert gate).

The experts' GEMMs are grouped GEMMs over the rows sorted by expert (fastpar's Triton kernel on
CUDA, one launch for all experts; a loop of matmuls elsewhere). The per-expert counts are read on
the host once per MoE layer and forward (they size the buffers; under expert parallelism, the
all-to-all's splits).
"""
from __future__ import annotations

import contextlib
import math

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from .. import kernels
from ..mesh import collectives, fill
from ..mesh.groups import group_rank, group_size


# What the auxiliary loss's gradient is multiplied by besides its coefficient: the step's 1 / M
# for M micro-batches, as the training loss of each micro-batch is divided by M
# (:func:`aux_scale`; Megatron's MoEAuxLossAutoScaler.set_loss_scale).
_aux_scale = 1.0


@contextlib.contextmanager
def aux_scale(scale: float):
    """Inside, each auxiliary loss enters the backward times ``scale`` (and its coefficient)."""
    global _aux_scale
    outer, _aux_scale = _aux_scale, scale
    try:
        yield
    finally:
        _aux_scale = outer


def moe_layers(modules) -> list:
    """The :class:`MoE` layers of ``modules`` (e.g. the pipeline chunks), in order."""
    return [m for mod in modules for m in mod.modules() if isinstance(m, MoE)]


@torch.no_grad()
def update_biases(modules, group=None) -> None:
    """:meth:`MoE.update_bias` for every MoE layer of ``modules`` with the loss-free bias on,
    from the tokens each expert got since the last call summed over ``group`` (the data- and
    context-parallel ranks: every replica then takes the same step) in one all-reduce (and
    over the TP ranks under sequence parallelism, in another)."""
    layers = [m for m in moe_layers(modules) if m.bias_update_rate and m._load is not None]
    if not layers:
        return
    load = torch.stack([m._load for m in layers]).float()
    if group is not None and torch.distributed.is_initialized() and \
            torch.distributed.get_world_size(group) > 1:
        torch.distributed.all_reduce(load, group=group)
    if layers[0].sp_group is not None:  # under SP each TP rank routed its shard of the tokens
        torch.distributed.all_reduce(load, group=layers[0].sp_group)
    for m, mine in zip(layers, load):
        m._load = mine
        m.update_bias()


def router_stats(modules) -> dict[str, torch.Tensor]:
    """The routers' statistics since the last call, over this rank's tokens (device scalars,
    no host sync; reset): ``moe_balance``, the busiest expert's tokens over the mean, the
    worst of the layers (1.0: even), and ``moe_dropped``, the share of assignments dropped
    by capacity. Empty without MoE layers (or before a training forward)."""
    counts = [m._step_counts for m in moe_layers(modules) if m._step_counts is not None]
    if not counts:
        return {}
    for m in moe_layers(modules):
        m._step_counts = None
    c = torch.stack(counts).float()                          # (layers, E + 1)
    tokens, dropped = c[:, :-1], c[:, -1]
    balance = (tokens.amax(1) / tokens.mean(1).clamp(min=1e-9)).amax()
    return {"moe_balance": balance,
            "moe_dropped": dropped.sum() / (tokens.sum() + dropped.sum()).clamp(min=1.0)}


class AuxLoss(torch.autograd.Function):
    """Identity on ``y``; its backward also gives ``aux`` the gradient ``scale``: the auxiliary
    loss joins the training loss's backward without changing what the model returns."""

    @staticmethod
    def forward(ctx, y, aux, scale: float):
        ctx.scale = scale
        ctx.aux_shape, ctx.aux_dtype = aux.shape, aux.dtype
        return y.view_as(y)

    @staticmethod
    def backward(ctx, g):
        return g, torch.full(ctx.aux_shape, ctx.scale, dtype=ctx.aux_dtype,
                             device=g.device), None


def _init_linear_(w: torch.Tensor) -> None:
    nn.init.kaiming_uniform_(w, a=math.sqrt(5))     # nn.Linear's


class Router(nn.Module):
    """Top-k softmax router over ``n_experts``; ``bias`` (a buffer) only steers the choice."""

    def __init__(self, d_model: int, n_experts: int, top_k: int, norm_topk: bool = True,
                 device=None, dtype=None):
        super().__init__()
        if not 1 <= top_k <= n_experts:
            raise ValueError(f"Router: top_k={top_k} must be in [1, n_experts={n_experts}]")
        self.n_experts, self.top_k, self.norm_topk = n_experts, top_k, norm_topk
        self.weight = nn.Parameter(torch.empty(n_experts, d_model, device=device, dtype=dtype))
        _init_linear_(self.weight)
        self.register_buffer("bias", torch.zeros(n_experts, device=device), persistent=True)

    def forward(self, x: torch.Tensor):
        """x (T, D) -> (probs (T, E) fp32, experts (T, k), weights (T, k) fp32)."""
        probs = F.linear(x, self.weight).float().softmax(-1)
        experts = (probs + self.bias).topk(self.top_k, dim=-1).indices   # the bias: choice only
        weights = probs.gather(-1, experts)
        if self.norm_topk:
            weights = weights / weights.sum(-1, keepdim=True)
        return probs, experts, weights


class Experts(nn.Module):
    """SwiGLU experts ``first`` .. ``first + n - 1`` of ``total``, their weights stacked:
    ``gate_up`` (n, 2F, D) (gate rows, then up rows), ``down`` (n, D, F). Each expert is drawn
    as in a stack of all ``total`` (the others' draws made and dropped), so expert parallelism's
    shards are the slices of the whole.

    A split backward (zero-bubble schedules) computes their weight gradients in B, not W: the
    grouped GEMMs' backward reads the weights, which ZeRO-3 frees once B has passed a layer."""

    defer_weight_grad = False

    def __init__(self, n: int, d_model: int, ffn: int, device=None, dtype=None, *,
                 first: int = 0, total: int | None = None):
        super().__init__()
        total = n if total is None else total
        self.n, self.ffn, self.first, self.total = n, ffn, first, total
        # Checkpoints (fastpar.tensor_parallel.sharding.shard_specs): the experts held, of total.
        self.expert_slice = (first, first + n) if n < total else None
        self.gate_up = nn.Parameter(torch.empty(n, 2 * ffn, d_model, device=device, dtype=dtype))
        self.down = nn.Parameter(torch.empty(n, d_model, ffn, device=device, dtype=dtype))
        gu, dn = (torch.empty_like(w[0]) for w in (self.gate_up, self.down))
        for e in range(total):
            for w in (gu[:ffn], gu[ffn:], dn):
                _init_linear_(w)
            if first <= e < first + n:
                self.gate_up.data[e - first].copy_(gu)
                self.down.data[e - first].copy_(dn)

    def forward(self, rows: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """``rows`` sorted by expert, ``counts[e]`` of them for (local) expert e -> the
        experts' outputs, in the same order: two grouped GEMMs (one launch each for all the
        experts, :func:`fastpar.kernels.grouped_mm`) around the SwiGLU."""
        if kernels.impl_for(rows, self.gate_up) != "triton":     # torch's: a loop of GEMMs
            # unbind, not w[e]: its backward stacks the experts' gradients once, where
            # indexing's would zero-fill a whole stack per expert and add the stacks up
            gate_up, down = self.gate_up.unbind(0), self.down.unbind(0)
            outs = [F.linear(kernels.swiglu(*F.linear(part, gate_up[e]).chunk(2, dim=-1)),
                             down[e]) for e, part in enumerate(rows.split(counts)) if counts[e]]
            return torch.cat(outs) if outs else rows.new_zeros((0, rows.shape[-1]))
        counts = torch.tensor(counts, dtype=torch.int64).to(rows.device, non_blocking=True)
        gate, up = _grouped(rows, self.gate_up, counts).chunk(2, dim=-1)
        return _grouped(kernels.swiglu(gate, up), self.down, counts)


def _grouped(x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """:func:`fastpar.kernels.grouped_mm` in autocast's dtype where it is on (as F.linear)."""
    kind = x.device.type
    if torch.is_autocast_enabled(kind):
        dtype = torch.get_autocast_dtype(kind)
        x, w = x.to(dtype), w.to(dtype)
    elif x.dtype != w.dtype:
        x = x.to(w.dtype)
    return kernels.grouped_mm(x, w, counts)


def _a2a(out: torch.Tensor, inp: torch.Tensor, out_splits, in_splits, group):
    """Start an all-to-all of ``inp`` rows (``in_splits[p]`` to rank p) into ``out``."""
    return collectives.all_to_all_single(out, inp, out_splits, in_splits, group=group,
                                         async_op=True)


# The experts' three phases under expert parallelism, by hand (no autograd graph), so that the
# backward can send each chunk's input gradient before any weight gradient is computed: forward
# (rows -> outputs, what the backward needs), input gradient, weight gradient. Triton's grouped
# GEMMs on CUDA, a loop of matmuls elsewhere; arithmetic in autocast's dtype where it is on.

def _gmm(x, w, counts: list[int], ct, kind: str):
    """Per expert e, on its ``counts[e]`` rows: "y" x_e @ w[e]^T, "dx" x_e @ w[e]."""
    if kernels.impl_for(x, w) == "triton":
        from ..kernels import grouped_gemm as gg
        return gg.grouped_mm_forward(x, w, ct) if kind == "y" else \
            gg.grouped_mm_backward(x, x, w.transpose(1, 2), ct, True, False)[0]
    out = x.new_empty((x.shape[0], w.shape[1 if kind == "y" else 2]))
    for e, (xe, oe) in enumerate(zip(x.split(counts), out.split(counts))):
        if counts[e]:       # straight into its rows of the output (no concatenation)
            torch.mm(xe, w[e].t() if kind == "y" else w[e], out=oe)
    return out


def _gmm_dw(dy, x, w, counts: list[int], ct, out=None):
    """Per expert e: dy_e^T @ x_e (w's shape; zero for an expert without rows), fp32 sums;
    added to ``out`` where given (and returned)."""
    if kernels.impl_for(x, w) == "triton":
        from ..kernels import grouped_gemm as gg
        dw = gg.grouped_mm_backward(dy, x, w, ct, False, True)[1]
        return dw if out is None else out.add_(dw)
    if out is None:
        out = torch.zeros(w.shape, dtype=w.dtype, device=w.device)
    for e, (de, xe) in enumerate(zip(dy.split(counts), x.split(counts))):
        if counts[e]:
            out[e].addmm_(de.t(), xe)
    return out


def _expert_forward(experts, x, counts: list[int]):
    """The experts on ``x`` (rows sorted by local expert): (y, what the backward needs)."""
    kind = x.device.type
    dtype = torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else \
        experts.gate_up.dtype
    with torch.autocast(kind, enabled=False):
        ct = torch.tensor(counts, dtype=torch.int64).to(x.device, non_blocking=True)
        x, wgu, wd = x.to(dtype), experts.gate_up.detach().to(dtype), experts.down.detach().to(dtype)
        gu = _gmm(x, wgu, counts, ct, "y")
        a = kernels.swiglu(*gu.chunk(2, dim=-1))
        return _gmm(a, wd, counts, ct, "y"), (x, gu, a, wgu, wd, ct)


def _swiglu_grad(da, gate, up):
    """The gradient of ``swiglu(gate, up)`` for ``da``: (dgate | dup) side by side, as the
    gate-up GEMM's output gradient. Off CUDA in closed form, each half written in place
    (fp32 arithmetic for 16-bit inputs, as the reference swiglu)."""
    if kernels.impl_for(da, gate) == "triton":
        from ..kernels.swiglu import swiglu_backward
        return torch.cat(swiglu_backward(da, gate, up), dim=-1)
    f = gate.shape[-1]
    dh = da.new_empty((da.shape[0], 2 * f))
    ct = torch.promote_types(da.dtype, torch.float32)
    if ct == da.dtype:
        torch.mul(da, F.silu(gate), out=dh[:, f:])
        torch.ops.aten.silu_backward.grad_input(da * up, gate, grad_input=dh[:, :f])
    else:
        d, g = da.to(ct), gate.to(ct)
        dh[:, f:] = d * F.silu(g)
        dh[:, :f] = torch.ops.aten.silu_backward(d * up.to(ct), g)
    return dh


def _expert_dx(saved, dy, counts: list[int]):
    """The input gradient of :func:`_expert_forward`'s rows for ``dy``, and what the weight
    gradients need (the output gradients of both GEMMs)."""
    x, gu, a, wgu, wd, ct = saved
    dy = dy.to(x.dtype)
    dh = _swiglu_grad(_gmm(dy, wd, counts, ct, "dx"), *gu.chunk(2, dim=-1))
    return _gmm(dh, wgu, counts, ct, "dx"), (dy, dh)


def _expert_dw(saved, grads, counts: list[int], acc=None):
    """The weight gradients (gate_up, down) of :func:`_expert_forward` for the output
    gradients :func:`_expert_dx` kept; added to ``acc`` (an earlier call's result) if given."""
    x, gu, a, wgu, wd, ct = saved
    dy, dh = grads
    acc = acc or (None, None)
    return _gmm_dw(dh, x, wgu, counts, ct, acc[0]), _gmm_dw(dy, a, wd, counts, ct, acc[1])


def _expert_major(segs: list[list[int]], device, skip: int | None = None):
    """Rows in ``len(segs)`` segments one after another, each sorted by local expert
    (``segs[s][e]`` rows of expert e): (rows per expert, the permutation taking them to
    expert-major order, stable within an expert). Segment ``skip``'s rows are left out."""
    S, El = len(segs), len(segs[0])
    counts = [sum(s[e] for i, s in enumerate(segs) if i != skip) for e in range(El)]
    lens = torch.tensor([n for s in segs for n in s], device=device)
    seg = torch.repeat_interleave(torch.arange(S * El, device=device), lens)
    key = (seg % El) * S + seg // El
    if skip is None:
        return counts, key.argsort(stable=True)
    idx = ((seg // El) != skip).nonzero().squeeze(1)
    return counts, idx[key[idx].argsort(stable=True)]


class _Chunk:
    """One chunk of a layer's tokens under expert parallelism: the rows it sends each rank
    (``send``) and receives from each (``recv``), and for the received rows the experts
    compute here (every source's, or all but ``me``'s when this rank's own rows are computed
    apart, straight from its input) their per-local-expert ``counts`` and ``perm`` from the
    received (source-major) order to expert-major."""

    def __init__(self, send: list[int], recv: list[list[int]], device, me: int | None = None):
        self.send, self.recv, self.me = send, [sum(r) for r in recv], me
        self.counts, self.perm = _expert_major(recv, device, skip=me)
        if me is not None:      # where this rank's own rows sit in what it sends / receives
            self.own = (sum(send[:me]), send[me])


class _Local:
    """Under chunked dispatch, the rows a rank routes to its own experts: they need no
    transfer, so they are computed straight from the layer's rows, in two parts: the first
    while the first chunk's dispatch travels, the second while the last chunk's return does
    (backward: all of them while the output gradients travel). ``parts``: per part, the rows'
    places in the layer's rows (expert-major) and the rows per local expert."""

    def __init__(self, chunks: list[_Chunk], mine: list[list[int]], device):
        counts, pos = _expert_major(mine, device)
        starts, at = [], 0
        for c in chunks:
            starts.append(at + c.own[0])
            at += sum(c.send)
        index = torch.cat([torch.arange(a, a + c.own[1], device=device)
                           for a, c in zip(starts, chunks)])[pos]
        first, left = [], sum(counts) // 2
        for n in counts:
            first.append(min(n, left))
            left -= first[-1]
        h = sum(first)
        self.index = index
        self.parts = [(index[:h], first), (index[h:], [n - f for n, f in zip(counts, first)])]


def _fill(y: torch.Tensor, chunk: _Chunk) -> torch.Tensor:
    """Chunk results ``y`` (expert-major) -> the received (source-major) layout, to send back;
    this rank's own segment, when computed apart, is left as it is (its results are written
    into the layer's output directly)."""
    out = y.new_empty((sum(chunk.recv), y.shape[1]))
    out[chunk.perm] = y
    return out


class _Flight:
    """One MoE layer's expert-parallel dispatch between :class:`_Send` and :class:`_Finish`:
    the chunks' splits, the transfers in flight, what the backward needs."""

    def __init__(self, experts, chunks, group, grad: bool, local: _Local | None):
        self.experts, self.chunks, self.group, self.grad = experts, chunks, group, grad
        self.local = local
        self.works = self.got = self.saved = self.rows = self.local_saved = None
        self.local_dx = None


class _Send(torch.autograd.Function):
    """Starts every chunk's dispatch of ``rows`` (sorted by chunk, then expert) to the ranks
    holding their experts; returns an empty token :class:`_Finish` takes. What runs in
    between (the shared experts) computes while the dispatches travel (one chunk: blocking,
    waited here). Its backward waits
    for the input gradients :class:`_Finish`'s backward sent back: what autograd runs
    between the two (the shared experts' backward) computes while they travel."""

    @staticmethod
    def forward(ctx, rows, flight):
        ctx.flight, ctx.dtype = flight, rows.dtype
        chunks, D = flight.chunks, rows.shape[1]
        flight.got = [rows.new_empty((sum(c.recv), D)) for c in chunks]
        flight.works = [_a2a(r, x, c.recv, c.send, flight.group) for r, x, c in
                        zip(flight.got, rows.split([sum(c.send) for c in chunks]), chunks)]
        if len(chunks) == 1:        # blocking: nothing computes while a transfer travels
            fill.fill()             # (but another micro-batch's backward, paired with this)
            flight.works[0].wait()
        flight.rows = rows if flight.local is not None else None
        return rows.new_empty(0)

    @staticmethod
    def backward(ctx, _):
        flight = ctx.flight
        for w in flight.works:
            fill.fill()             # a paired micro-batch's forward, if any (DualPipe)
            w.wait()
        back, flight.works = flight.got, None
        dx = torch.cat(back)
        if flight.local is not None:        # this rank's own rows, computed apart
            dx[flight.local.index] = flight.local_dx
            flight.local_dx = None
        return dx.to(ctx.dtype), None


class _Finish(torch.autograd.Function):
    """The dispatch :class:`_Send` started -> the experts' outputs for its rows, back from the
    ranks that hold them. Chunk c's experts compute while the later chunks' dispatches and
    the earlier ones' returns travel; under chunks the rows this rank keeps
    (:class:`_Local`) compute half before the first chunk's wait and half after the last
    return is started (one chunk: nothing to hide behind). The backward runs the same
    pipeline the other way, input gradients only (the own rows' first): chunk c's goes back
    while chunk c + 1's is computed; the weight gradients of every chunk are computed next,
    while the last returns travel, and :class:`_Send`'s backward waits for them (one chunk:
    blocking, the return waited first). The experts run by hand (:func:`_expert_forward`,
    :func:`_expert_dx`, :func:`_expert_dw`); their weight gradients are this function's,
    accumulated by autograd as any other parameter's (data-parallel hooks fire as usual)."""

    @staticmethod
    def forward(ctx, token, flight, gate_up, down):
        ctx.flight, ctx.dtype = flight, gate_up.dtype
        chunks, group, D = flight.chunks, flight.group, flight.got[0].shape[1]
        saved, back, returns, local, own = [], [], [], flight.local, []

        def own_part(k):     # this rank's own rows (part k), computed from the layer's rows
            index, counts = local.parts[k]
            y, keep = _expert_forward(flight.experts, flight.rows[index], counts)
            own.append(y)
            flight.local_saved.append(keep if flight.grad else None)

        if local is not None:       # while the first chunk's dispatch travels
            flight.local_saved = []
            own_part(0)
        for c, chunk in enumerate(chunks):
            fill.fill()             # a paired micro-batch's backward, if any (DualPipe)
            flight.works[c].wait()
            y, keep = _expert_forward(flight.experts, flight.got[c][chunk.perm], chunk.counts)
            saved.append(keep if flight.grad else None)
            back.append(y.new_empty((sum(chunk.send), D)))
            returns.append(_a2a(back[c], _fill(y, chunk), chunk.send, chunk.recv, group))
        if local is not None:       # while the last chunk's return travels
            own_part(1)
        for w in returns:
            fill.fill()
            w.wait()
        flight.saved, flight.works, flight.got, flight.rows = saved, None, None, None
        out = torch.cat(back)
        if local is not None:
            out[local.index] = torch.cat(own)
        return out

    @staticmethod
    def backward(ctx, g):
        flight = ctx.flight
        chunks, group, local = flight.chunks, flight.group, flight.local
        g = g.contiguous()
        D, sent = g.shape[1], g.split([sum(c.send) for c in chunks])
        got = [g.new_empty((sum(c.recv), D)) for c in chunks]
        works = [_a2a(r, x, c.recv, c.send, group) for r, x, c in zip(got, sent, chunks)]
        back, returns, kept, parts = [], [], [], []
        if local is not None:       # this rank's own rows first: the gradients travel
            own = []
            for (index, counts), saved in zip(local.parts, flight.local_saved):
                dx, keep = _expert_dx(saved, g[index], counts)
                own.append(dx)
                parts.append((saved, keep, counts))
            flight.local_dx = torch.cat(own)
        for c, chunk in enumerate(chunks):
            fill.fill()
            works[c].wait()
            dx, keep = _expert_dx(flight.saved[c], got[c][chunk.perm], chunk.counts)
            kept.append(keep)
            back.append(dx.new_empty((sum(chunk.send), D)))
            returns.append(_a2a(back[c], _fill(dx, chunk), chunk.send, chunk.recv, group))
        if len(chunks) == 1:        # blocking: nothing computes while a transfer travels
            fill.fill()             # (but another micro-batch's forward, paired with this)
            returns[0].wait()
        # The weight gradients, while the returns travel.
        parts += [(flight.saved[c], kept[c], chunk.counts) for c, chunk in enumerate(chunks)]
        acc = None
        for saved, keep, counts in parts:
            acc = _expert_dw(saved, keep, counts, acc)
        dgu, dd = acc
        flight.saved, flight.got, flight.works = None, back, returns   # _Send waits
        flight.local_saved = None
        if not ctx.needs_input_grad[0]:     # no _Send backward to come (rows need no grad)
            flight.local_dx = None
            for w in returns:
                fill.fill()
                w.wait()
        return g.new_zeros(0), None, dgu.to(ctx.dtype), dd.to(ctx.dtype)


class MoE(nn.Module):
    """The MoE layer of a block: router, experts, optional shared experts. Returns
    ``(output, None)`` like the dense MLP (the None: no bias left for the caller to add).

    ``stats`` after each forward (detached, on the device, no host sync): ``tokens`` per expert
    (assignments kept), ``dropped`` assignments, ``aux`` loss (before its coefficient)."""

    def __init__(self, d_model: int, n_experts: int, top_k: int, ffn: int, *,
                 n_shared: int = 0, shared_gate: bool = False, capacity_factor: float = 0.0,
                 aux_loss_coef: float = 0.0, norm_topk: bool = True,
                 bias_update_rate: float = 0.0, ep_group=None, ep_chunks: int = 2,
                 cp_group=None, sp_group=None, device=None, dtype=None):
        super().__init__()
        ep = group_size(ep_group)
        if n_experts < 2 or n_experts % ep or ep_chunks < 1:
            raise ValueError(f"MoE: n_experts={n_experts} must be at least 2 and a multiple of "
                             f"the expert-parallel size {ep}, ep_chunks={ep_chunks} >= 1")
        if capacity_factor < 0 or aux_loss_coef < 0 or bias_update_rate < 0:
            raise ValueError(f"MoE: capacity_factor={capacity_factor}, aux_loss_coef="
                             f"{aux_loss_coef} and bias_update_rate={bias_update_rate} must be "
                             f">= 0")
        self.router = Router(d_model, n_experts, top_k, norm_topk, device, dtype)
        # Expert parallelism: this rank holds experts [first, first + n_experts / ep).
        self.ep_group, self.ep_chunks = (ep_group if ep > 1 else None), ep_chunks
        local = n_experts // ep
        self.experts = Experts(local, d_model, ffn, device, dtype, first=group_rank(ep_group)
                               * local if ep > 1 else 0, total=n_experts)
        for p in self.experts.parameters():     # reduced over their own replicas only
            p.expert_parallel = ep > 1
        self.shared = Experts(1, d_model, n_shared * ffn, device, dtype) if n_shared else None
        self.shared_gate = nn.Parameter(torch.empty(1, d_model, device=device, dtype=dtype)) \
            if n_shared and shared_gate else None
        if self.shared_gate is not None:
            _init_linear_(self.shared_gate)
        self.capacity_factor, self.aux_loss_coef = capacity_factor, aux_loss_coef
        # Context parallelism, and sequence parallelism over ``sp_group`` (the TP group: each
        # TP rank routes its shard of the tokens, and the layer's parameters get partial
        # gradients, summed over TP once per step): this rank's tokens are part of each
        # sequence; the auxiliary loss's load fractions are counted over the whole sequences
        # (one small all-reduce per group).
        self.cp_group = cp_group if group_size(cp_group) > 1 else None
        self.sp_group = sp_group if group_size(sp_group) > 1 else None
        # TP folded into expert parallelism (the ep group holds the TP group's ranks): each TP
        # rank holds other experts, their gradients summed over TP by the all-to-alls already.
        self.folded = self.sp_group is not None and self.ep_group is not None and set(
            dist.get_process_group_ranks(self.sp_group)) <= set(
            dist.get_process_group_ranks(self.ep_group))
        if self.sp_group is not None:
            from ..tensor_parallel.sharding import mark_partial_grads
            for m in self.modules():
                if self.folded and m is self.experts:
                    continue
                names = [n for n, _ in m.named_parameters(recurse=False)]
                if names:
                    mark_partial_grads(m, *names)
        self.bias_update_rate = bias_update_rate
        self.stats: dict[str, torch.Tensor] = {}
        self._load = None       # tokens per expert since the last update_bias
        self._step_counts = None    # tokens per expert and dropped, since router_stats

    @property
    def n_experts(self) -> int:
        return self.router.n_experts

    def capacity(self, tokens: int) -> int | None:
        """Assignments an expert takes at most for ``tokens`` tokens; None when dropless."""
        if not self.capacity_factor:
            return None
        return math.ceil(self.capacity_factor * tokens * self.router.top_k / self.n_experts)

    def forward(self, x: torch.Tensor):
        shape = x.shape
        x = x.reshape(-1, shape[-1])                            # (T, D)
        T, E, k = x.shape[0], self.n_experts, self.router.top_k
        probs, experts, weights = self.router(x)
        flat = experts.reshape(-1)                              # (T*k,) token-major
        keep = None
        cap = self.capacity(T)
        if cap is not None:     # the first `cap` assignments of each expert, in token order
            onehot = F.one_hot(flat, E)
            rank = (onehot.cumsum(0) * onehot).sum(-1) - 1      # place within its expert
            keep = rank < cap
        key = flat
        if self.ep_group is not None:   # sorted by chunk of tokens first
            chunk = torch.arange(T * k, device=x.device) // k * self.ep_chunks // T
            key = chunk * E + flat
        order = key.argsort(stable=True)                        # by expert, then token order
        tokens = torch.bincount(flat, minlength=E)
        if keep is not None:
            order = order[keep[order]]
        src = order // k                                        # each sorted row's token
        if self.ep_group is None:
            kept = torch.bincount(flat[keep], minlength=E) if keep is not None else tokens
            rows = self.experts(x[src], kept.tolist())          # one host sync
            s = self._shared(x, T)
        else:           # the shared experts compute while the dispatch travels
            counts = torch.bincount(key[order], minlength=self.ep_chunks * E)
            kept = counts.view(-1, E).sum(0)
            flight, token = self._send(x[src], counts)
            s = self._shared(x, T)
            rows = _Finish.apply(token, flight, self.experts.gate_up, self.experts.down)
        w = weights.reshape(-1)[order].to(rows.dtype)
        y = x.new_zeros(x.shape, dtype=rows.dtype).index_add_(0, src, rows * w[:, None])
        if s is not None:
            y = y + s
        if self.cp_group is None and self.sp_group is None:
            aux = E * (tokens.to(probs.dtype) / T * probs.mean(0)).sum()
        else:   # this rank's share of the whole sequences' loss (over n = cp x sp shards),
            #     times cp (the gradients are averaged over the cp ranks, summed over sp):
            #     the single process's loss and gradients
            every, n = tokens.clone(), 1
            for g in (self.cp_group, self.sp_group):
                if g is not None:
                    collectives.all_reduce(every, group=g)
                    n *= group_size(g)
            cp = group_size(self.cp_group)
            aux = cp * E * (every.to(probs.dtype) / (T * n) * probs.sum(0) / (T * n)).sum()
        self.stats = {"tokens": kept.detach(), "dropped": (tokens - kept).sum().detach(),
                      "aux": aux.detach()}
        if self.bias_update_rate:
            self._load = kept.detach() if self._load is None else self._load + kept.detach()
        if self.training:       # this step's, for router_stats
            add = torch.cat([kept.detach(), (tokens - kept).sum().reshape(1).detach()])
            self._step_counts = add if self._step_counts is None else self._step_counts + add
        if self.training and self.aux_loss_coef and torch.is_grad_enabled():
            y = AuxLoss.apply(y, aux, self.aux_loss_coef * _aux_scale)
        return y.view(shape), None

    def _shared(self, x: torch.Tensor, T: int):
        """The shared experts' output for every token (gated), or None."""
        if self.shared is None:
            return None
        s = self.shared(x, [T])
        if self.shared_gate is not None:
            s = s * torch.sigmoid(F.linear(x, self.shared_gate))
        return s

    def _send(self, rows: torch.Tensor, counts: torch.Tensor):
        """Expert parallelism: start sending ``rows`` (sorted by (chunk, expert), ``counts``
        (C * E) of each) to the ranks holding their experts; ``(flight, token)`` for
        :class:`_Finish`. The counts each rank sends every other are exchanged first (one
        all-to-all) and read on the host with this rank's own (one sync, as without expert
        parallelism)."""
        group, P, C = self.ep_group, group_size(self.ep_group), self.ep_chunks
        El = self.experts.n
        send = counts.view(C, P, El).transpose(0, 1).contiguous()       # (P, C, El)
        recv = torch.empty_like(send)
        collectives.all_to_all_single(recv, send, group=group)
        host = torch.cat([counts, recv.flatten()]).tolist()             # one host sync
        mine = [host[i:i + El] for i in range(0, C * P * El, El)]       # [c * P + p]
        theirs = [host[C * P * El + i:][:El] for i in range(0, P * C * El, El)]  # [p * C + c]
        me = group_rank(group) if C > 1 else None   # chunked: own rows computed apart
        chunks = [_Chunk([sum(mine[c * P + p]) for p in range(P)],
                         [theirs[p * C + c] for p in range(P)], rows.device, me)
                  for c in range(C)]
        local = _Local(chunks, [mine[c * P + me] for c in range(C)], rows.device) \
            if me is not None else None
        grad = torch.is_grad_enabled() and (rows.requires_grad or any(
            p.requires_grad for p in self.experts.parameters()))
        flight = _Flight(self.experts, chunks, group, grad, local)
        return flight, _Send.apply(rows, flight)

    @torch.no_grad()
    def update_bias(self) -> None:
        """The auxiliary-loss-free step (DeepSeek-V3): each expert's bias moves by
        ``bias_update_rate`` up if it got fewer tokens than the mean since the last call, down
        if more. Call after the optimizer step."""
        if not self.bias_update_rate or self._load is None:
            return
        load = self._load.float()
        self.router.bias += self.bias_update_rate * torch.sign(load.mean() - load)
        self._load = None
