"""The cost model of one Transformer layer: FLOPs, kernel times, memory and communication.

Everything is per GPU and per micro-batch unless a name says otherwise. Notation: micro-batch
``b`` sequences of ``s`` tokens (``T = b s`` rows), hidden ``h``, ``a`` query heads and ``g``
key/value heads of size ``d``, MLP inner size ``f``, vocabulary ``V``, tensor-parallel size ``t``,
``E`` bytes per activation element.

FLOPs of one layer's forward (whole layer, before dividing by ``t``)::

    q, k, v, o projections   2 T h (2 a d + 2 g d)       (= 8 T h^2 with a d = g d = h)
    attention core           4 b a s^2 d                 (q k^T and p v)
    MLP                      2 T h f * (2 GELU, 3 SwiGLU)  (= 16 T h^2 with GELU, f = 4h)

so a GELU layer is 24 T h^2 + 4 T s h, Megatron's count (Narayanan et al. 2021, appendix).
Backward is twice the forward: input gradient ``B`` and weight gradient ``W`` each equal the
forward of the linears; the attention core's backward (no weights) goes to ``B``. Recompute adds
the layer's forward (``full``) or the attention core's (``selective``) to ``B``.

Activation memory follows Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large
Transformer Models", sec. 4): 34 s b h + 5 a s^2 b bytes per layer without parallelism, of which
10 s b h stay replicated over TP unless sequence parallelism (SP) splits them too; written here
per stored tensor so GQA, SwiGLU, fused attention and dropout-free training are counted as such,
and as fastpar's layer keeps them (the fused q/k/v output, rotary's new q and k, the fused core's
own output beside o's input). Off CUDA fastpar runs torch's reference ops, which keep fp32
intermediates: ``activation_bytes(..., reference=True)``, re-counted on the real layer by
tests/test_plan.py.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..models import RECOMPUTE, GPTConfig
from ..tensor_parallel.overlap import row_chunks
from .hardware import (ATTENTION_BACKWARD_FLASH, ATTENTION_BACKWARD_UNFUSED, CAUSAL_FRACTION,
                       GPU_BACKWARD_FACTOR, GPU_LAYER_KERNELS, GPU_ROTARY_KERNELS, Hardware)


@dataclass(frozen=True)
class Features:
    """What the modelled training software does; the default is fastpar's trainer."""

    tp_overlap: bool = True          # TP collectives pipelined with their GEMM in row chunks
    tp_chunks: int = 4               # at most this many chunks (the layers' default ``chunks``)
    fused_qkv: bool = True           # one QKV and one up-gate linear (fastpar's, as Megatron):
    #                                  two column linears per layer, each with one TP reduction
    dp_overlap: bool = True          # DP buckets reduced during the last backward (pp == 1)
    dp_overlap_pipeline: bool = True   # the same under pp > 1 (during the last micro-batch's)
    bucket_mb: float = 25.0          # DP bucket size: the last bucket is always exposed
    flash_attention: bool = True     # fused attention: no (s, s) scores stored or moved
    dropout: bool = False            # dropout masks stored and applied
    weight_bytes: int = 2            # per parameter: bf16 weights (--precision bf16, the GPU default)
    grad_bytes: int = 4              # per parameter: fp32 main gradients, reduced over DP as fp32
    optimizer_bytes: int = 12        # per parameter: fp32 master weight and Adam's two moments
    reduce_bytes: int = 4            # per parameter: the DP buckets' reduction dtype (fp32)

    @property
    def main_grads(self) -> bool:
        """Low-precision (bf16 / fp16) weights: fp32 main gradients beside them, into which
        every micro-batch's gradients are added (DataParallel's ``main_grads``)."""
        return self.weight_bytes < 4


FASTPAR = Features()

# Bytes per parameter (weight, gradient, optimizer state) as fastpar's trainer keeps them under
# each precision (fastpar/train/trainer.py ``_wrap``, fastpar/data_parallel):
# - "bf16" (Megatron's mixed precision): bf16 parameters; fp32 main gradients (DataParallel's
#   ``main_grads``); fp32 master weights and Adam's two fp32 moments (FASTPAR's defaults);
# - "fp32": fp32 parameters; gradients are views into the fp32 DP buckets; Adam's two moments,
#   no master (the optimizer steps the parameters themselves);
# - "amp" (bf16 autocast over fp32 parameters): as fp32, plus the bf16 copy of each weight that
#   autocast casts and caches for the step (its cache lives as long as the ``torch.autocast``
#   region, which in the trainer holds forward and backward; embeddings are not cast: counted
#   anyway).
# A bf16 gradient reduction (``--grad-reduce-dtype bf16``) adds a bf16 bucket beside the fp32
# gradients: 2 bytes more.
PRECISION_BYTES = {"bf16": (2, 4, 12), "fp32": (4, 4, 8), "amp": (6, 4, 8)}


def trainer_features(precision: str, grad_reduce_dtype: str = "fp32", **fields) -> Features:
    """:class:`Features` with the bytes per parameter of the trainer under ``precision``
    ("bf16", "fp32" or "amp": what ``TrainConfig.precision`` resolves to on the device) and
    ``grad_reduce_dtype``; ``fields`` sets any other feature."""
    if precision not in PRECISION_BYTES:
        raise ValueError(f"precision={precision!r} is not one of {tuple(PRECISION_BYTES)}")
    w, g, o = PRECISION_BYTES[precision]
    g += 2 if grad_reduce_dtype == "bf16" else 0
    return Features(**{"weight_bytes": w, "grad_bytes": g, "optimizer_bytes": o,
                       "reduce_bytes": 2 if grad_reduce_dtype == "bf16" else 4, **fields})


@dataclass(frozen=True)
class Shape:
    """One micro-batch's sizes on one GPU."""

    model: GPTConfig
    seq_len: int
    micro_batch: int
    tp: int = 1
    sp: bool = False                 # sequence parallelism (only meaningful with tp > 1)
    cp: int = 1                      # context parallelism: seq_len / cp tokens of each sequence
                                     # here, attention over all seq_len by the key/value ring
    span: float | None = None        # packed documents: the keys a token's document holds on
                                     # average (attention inside documents); None: seq_len
    ep: int = 1                      # expert parallelism: n_experts / ep experts here
    ep_chunks: int = 1               # ... and its dispatch's chunks (each runs the experts)

    @property
    def tokens(self) -> int:
        return self.micro_batch * self.seq_len // self.cp

    @property
    def moe_tokens(self) -> int:
        """The tokens an MoE layer routes on one GPU: under TP it runs whole on every rank,
        on the hidden state without SP, on the rank's sequence shard with SP."""
        return self.tokens // (self.tp if self.sp else 1)

    @property
    def expert_passes(self) -> int:
        """Times each local expert runs per forward: once, or under a chunked expert-parallel
        dispatch once per chunk and twice more on this rank's own rows (moe.py ``_Finish``)."""
        return self.ep_chunks + 2 if self.ep > 1 and self.ep_chunks > 1 else 1


def _linears(shape: Shape) -> list[tuple[int, int, int]]:
    """The (m, n, k) of each linear GEMM of one layer's forward on one GPU."""
    m, t = shape.model, shape.tp
    h, d, T = m.d_model, m.head_dim, shape.tokens
    mats = [(T, m.n_heads * d // t, h), (T, m.kv_heads * d // t, h), (T, m.kv_heads * d // t, h),
            (T, h, m.n_heads * d // t)]
    if m.n_experts:     # the router; the rows each token sends its top_k experts (as one GEMM
        #                 of all of them, fastpar's grouped GEMM; balanced over ep ranks) and the
        #                 shared experts' (as one MLP); gate, up, down (tp = 1)
        T = shape.moe_tokens
        R, F, S = T * m.moe_top_k, m.expert_ffn, m.moe_shared_experts * m.expert_ffn
        shared = [(T, S, h), (T, S, h)] if S else []
        return mats + [(T, m.n_experts, h), (R, F, h), (R, F, h)] + shared + \
            ([(T, h, S)] if S else []) + [(R, h, F)]
    mats.append((T, m.ffn_dim // t, h))
    if m.activation == "swiglu":
        mats.append((T, m.ffn_dim // t, h))
    return mats + [(T, h, m.ffn_dim // t)]


def loop_linears(shape: Shape) -> list[tuple[int, int, int]]:
    """:func:`_linears` as the CPU path runs them: an MoE layer's routed experts are a loop of
    GEMMs, per local expert and pass (:attr:`Shape.expert_passes`) one fused gate-up
    (rows, 2F, h) and one down (rows, h, F) on its share of the rows."""
    m = shape.model
    mats = _linears(shape)
    if not m.n_experts:
        return mats
    R, F, h = shape.moe_tokens * m.moe_top_k, m.expert_ffn, m.d_model
    routed = {(R, F, h), (R, h, F)}
    loops = m.n_experts // shape.ep * shape.expert_passes
    rows = -(-R // loops)
    return [g for g in mats if g not in routed] + [(rows, 2 * F, h), (rows, h, F)] * loops


def expert_gemms(shape: Shape) -> list[tuple[int, int, int]]:
    """The routed experts' GEMMs of one MoE layer's forward (:func:`_linears`' last three
    rows): what an expert-parallel dispatch is pipelined with."""
    m = shape.model
    R, F, h = shape.moe_tokens * m.moe_top_k, m.expert_ffn, m.d_model
    return [(R, F, h), (R, F, h), (R, h, F)] if m.n_experts else []


def _ep_pass(one: float, chunks: int, before: float, per_chunk: float, after: float) -> float:
    """Exposed seconds of one pass of the chunked dispatch (fastpar/models/moe.py ``_Finish``):
    ``chunks`` transfers of ``one / chunks`` each, issued together on a link that carries one
    at a time; ``before`` computes from the start (what needs no transfer); chunk i's compute
    (``per_chunk``) once it has arrived, then its return on the link; ``after`` computes after
    the last chunk's. The pass ends with the last return and the last compute; what is left
    beyond the compute shows."""
    piece, t, link = one / chunks, before, one
    for i in range(chunks):
        t = max(t, (i + 1) * piece) + per_chunk
        link = max(link, t) + piece
    t += after
    return max(t, link) - (before + chunks * per_chunk + after)


def ep_alltoall(shape: Shape, hw: Hardware, ep: int, chunks: int, link_gbps: float,
                overlap: bool = True) -> tuple[float, float]:
    """Exposed seconds of one MoE layer's expert-parallel dispatch, forward and backward
    (fastpar/models/moe.py ``_Send``, ``_Finish``): per pass, the rows go out and come back
    (two all-to-alls of the T * top_k rows, (ep - 1) / ep of them leaving the rank, in
    ``chunks`` pieces) pipelined with the experts' GEMMs (:func:`_ep_pass`). The 1 / ep of
    the rows a rank routes to its own experts need no transfer: in the forward half of them
    compute while the first chunk's dispatch travels (after the shared experts), half while
    the last chunk's return does; in the backward their input gradients compute first, and
    every weight gradient (and the shared experts' backward) after the last chunk's, under
    the returns. The forward also exchanges the per-expert counts (a small all-to-all the
    host waits for). One chunk: nothing hidden (each transfer waited as soon as issued).

    ``overlap=False`` (a CPU, where gloo's threads move the bytes on the cores that compute):
    every transfer's bytes and ring steps show, but its wait for the other ranks (its sync)
    is hidden by what the host computes between issuing it and waiting for it, as far as
    that goes (:func:`_ep_waits`): each chunk's dispatch is waited after the shared experts,
    half the own rows and the chunks before it, each return after the chunks after it and
    the other half; in the backward each dispatch after the own rows' input gradients and
    the chunks before it, each return after the chunks after it, every weight gradient and
    the shared experts' backward. The counts' exchange, waited at once, pays its sync whole
    (on 2 gloo ranks of a 2-core machine the counts' all-to-alls took 0.6-1.0 ms a call,
    the rows' 0.3 from issue to the end of the wait, both after milliseconds of computing)."""
    if ep <= 1 or not shape.model.n_experts:
        return 0.0, 0.0
    m = shape.model
    rows = shape.moe_tokens * m.moe_top_k * m.d_model * hw.bytes_per_element
    one = chunks * collective_time("all_to_all", rows / chunks, ep, link_gbps, hw)
    counts = collective_time("all_to_all", 8 * m.n_experts * chunks, ep, link_gbps, hw)
    gemms = expert_gemms(shape)
    f = sum(hw.for_forward().gemm_time(*g) for g in gemms)
    b = sum(hw.gemm_time(*g) for g in gemms)        # the input gradients' (the weights' after)
    if chunks == 1:
        return 2 * one + counts, 2 * one
    T, h, S = shape.moe_tokens, m.d_model, m.moe_shared_experts * m.expert_ffn
    shared = [(T, S, h), (T, S, h), (T, h, S)] if S else []
    sf = sum(hw.for_forward().gemm_time(*g) for g in shared)
    sb = 2 * sum(hw.gemm_time(*g) for g in shared)
    own_f, own_b = f / ep, b / ep
    per_f, per_b = (f - own_f) / chunks, (b - own_b) / chunks
    if not overlap:
        sync = hw.call_sync("all_to_all")
        shown = 2 * (one - chunks * sync)           # the bytes and ring steps of both ways
        return shown + counts + _ep_waits(sync, chunks, sf + own_f / 2, per_f, own_f / 2), \
            shown + _ep_waits(sync, chunks, own_b, per_b, b + sb)
    return _ep_pass(one, chunks, sf + own_f / 2, per_f, own_f / 2) + counts, \
        _ep_pass(one, chunks, own_b, per_b, b + sb)


def _ep_waits(sync: float, chunks: int, before: float, per_chunk: float, after: float) -> float:
    """Seconds of the ranks' waits for each other left showing in one pass of the chunked
    dispatch on a CPU (:func:`ep_alltoall`): each transfer's ``sync`` less what the host
    computes between issuing it and waiting for it. Chunk c's dispatch, issued with the
    others at the start, is waited after ``before`` and c chunks' compute (``per_chunk``);
    its return, issued after its own chunk's compute, after the later chunks' and ``after``."""
    return sum(max(0.0, sync - (before + c * per_chunk)) +
               max(0.0, sync - ((chunks - 1 - c) * per_chunk + after)) for c in range(chunks))


def _core_time(shape: Shape, hw: Hardware, feat: Features) -> float:
    """The attention core's forward: (s, d) @ (d, s) and (s, s) @ (s, d) per head and sequence.
    Under CP each GPU has 1/cp of the causal work (the load-balanced chunks) and reads every
    rank's k and v."""
    m, s, cp = shape.model, shape.seq_len, shape.cp
    span = min(shape.span or s, s)
    heads = shape.micro_batch * m.n_heads // shape.tp
    if feat.flash_attention:      # one fused kernel; causal: half the blocks are skipped
        flops = CAUSAL_FRACTION * 4.0 * heads * s * span * m.head_dim / cp
        io = hw.bytes_per_element * heads * (2 * s / cp + 2 * s) * m.head_dim   # q, o; k, v
        ops = REFERENCE_OPS["core"][0] if hw.kind == "cpu" else 1
        if shape.span is not None:  # off CUDA one call per document (about s / span of them)
            ops *= shape.micro_batch * max(1, round(s / span)) if hw.kind == "cpu" else 1
        return max(flops / (hw.peak_flops * hw.attention_fraction(flops)),
                   io / hw.bandwidth(io)) + ops * hw.kernel_overhead_us * 1e-6
    return hw.gemm_time(s // cp, s, m.head_dim, heads) + hw.gemm_time(s // cp, m.head_dim, s,
                                                                      heads)


# Operators of torch's reference code (what fastpar runs off CUDA) per forward / backward,
# counted with a dispatch-mode counter on fastpar's modules (tests/test_plan.py re-counts them):
# a norm is pow, mean, add, rsqrt and two muls (RMSNorm; LayerNorm adds a mean, a sub, an add);
# rotary, per rotated tensor (q, k), is an empty output, two muls and two addcmuls
# (kernels.rotary's RotaryTorchFunction; its backward the same rotation by -theta).
REFERENCE_OPS = {"rmsnorm": (6, 14), "layernorm": (9, 20), "rotary": (5, 5), "swiglu": (2, 3),
                 "gelu": (1, 1), "core": (2, 7), "residual": (1, 0)}


# fastpar's MoE MLP (fastpar/models/moe.py) outside its GEMMs, counted the same way
# (tests/test_plan.py re-counts them). Operators, forward / backward: routing (softmax, bias add,
# top-k, gather, renormalise), the sort by expert and the counts, the rows gathered by expert and
# scattered back weighted, the statistics and the auxiliary loss's forward ("fixed"); the
# auxiliary loss's backward ("aux"); each expert's SwiGLU and the concatenation around it, per
# expert and pass off CUDA (a loop), once on CUDA ("expert"); the shared experts' concatenation
# and add ("shared"); their sigmoid gate, its one-column GEMM included ("gate").
MOE_OPS = {"fixed": (26, 22), "aux": (0, 5), "expert": (2, 4), "shared": (2, 4), "gate": (3, 7)}
# Elements those operators read and write beyond the SwiGLU's (REFERENCE_BYTES["swiglu"] on the
# rows), per (tokens x h) and per (rows x h), rows = tokens x top_k, forward / backward: the
# gather by expert reads the tokens and writes the rows; the weighted rows, their concatenation,
# the zeroed output and index_add; in the backward index_select, the index's gradient, index_put,
# the sum of the consumers' gradients and the router weights' gradient. Off CUDA the experts'
# weight gradients are stacked once (each weight read and written: 2 per element). The shared
# experts' output concatenated and added, and its gradient; their gate's product, per
# (tokens x h).
MOE_BYTES = {"token": (5, 7), "row": (6, 11), "stack": (0, 2), "shared": (5, 5), "gate": (2, 9)}


def moe_ops(shape: Shape, cpu: bool) -> tuple[int, int]:
    """(forward, backward) operators of one MoE layer outside its GEMMs (:data:`MOE_OPS`)."""
    m = shape.model
    if not m.n_experts:
        return 0, 0
    runs = (m.n_experts // shape.ep * shape.expert_passes if cpu else 1) + \
        (1 if m.moe_shared_experts else 0)
    parts = [MOE_OPS["fixed"]] + [MOE_OPS["expert"]] * runs
    parts += [MOE_OPS["aux"]] if m.moe_aux_loss else []
    parts += [MOE_OPS["shared"]] if m.moe_shared_experts else []
    parts += [MOE_OPS["gate"]] if m.moe_shared_experts and m.moe_shared_gate else []
    return tuple(sum(p[i] for p in parts) for i in range(2))


def moe_bytes(shape: Shape, cpu: bool) -> tuple[float, float]:
    """Elements (forward, backward) one MoE layer's operators move outside its GEMMs and its
    SwiGLU (:data:`MOE_BYTES`)."""
    m = shape.model
    if not m.n_experts:
        return 0.0, 0.0
    T, h = shape.moe_tokens, m.d_model
    R = T * m.moe_top_k
    weights = 3 * h * m.expert_ffn * (m.n_experts // shape.ep + m.moe_shared_experts) \
        if cpu else 0
    tok, row, st = MOE_BYTES["token"], MOE_BYTES["row"], MOE_BYTES["stack"]
    for part, on in (("shared", m.moe_shared_experts), ("gate", m.moe_shared_experts and
                                                       m.moe_shared_gate)):
        if on:
            tok = tuple(a + b for a, b in zip(tok, MOE_BYTES[part]))
    return tuple(tok[i] * T * h + row[i] * R * h + st[i] * weights for i in range(2))


def column_linears(model: GPTConfig, feat: Features = None) -> int:
    """Column-parallel linears of one layer: each reduces its input gradient over TP (an MoE
    layer's MLP has none: every TP rank runs it whole)."""
    feat = feat or FASTPAR
    mlp = 0 if model.n_experts else 1 if feat.fused_qkv else \
        (2 if model.activation == "swiglu" else 1)
    return (1 if feat.fused_qkv else 3) + mlp


def reference_ops(model: GPTConfig, feat: Features = None) -> tuple[int, int]:
    """(forward, backward) operators of one layer outside its GEMMs on torch's reference path:
    norms, rotary, activation, attention core, residual adds, and in the backward one add per
    extra consumer of a tensor (its gradients are summed)."""
    norm = REFERENCE_OPS[model.norm]
    act = (0, 0) if model.n_experts else REFERENCE_OPS[model.activation]   # MoE: moe_ops
    parts = [norm, norm, act, REFERENCE_OPS["core"], REFERENCE_OPS["residual"],
             REFERENCE_OPS["residual"]]
    if model.rotary:
        parts += [REFERENCE_OPS["rotary"]] * 2
    f, b = (sum(p[i] for p in parts) for i in range(2))
    # x feeds norm1 and the residual, norm1's output each column linear of the attention,
    # x2 norm2 and the residual, norm2's output the MLP's column linears.
    b += 1 + 1 + (column_linears(model, feat) - 1)
    b += 1 if model.bias else 0                   # the bias gradients' row sums (7 small ones)
    return f, b


# Bytes those reference operators read and write, forward / backward, in units of the tensor
# each acts on (measured the same way): a norm, in (s, b, h) tensors (RMSNorm's forward: pow,
# mean, the normalising mul and the weight's mul each read and write one); rotary, in the rotated
# q or k; the activation, in (s, b, f) tensors, of which ``transcendental`` is the SiLU / GELU
# kernel itself (compute-bound on a CPU core); the attention core, the copy of its output back
# to (s, b, h) and, in the backward, of q's, k's and v's gradients; a residual add.
# The vocab-parallel cross entropy's reference (row chunks of ~1M elements), in fp32 (s b, V)
# logits: 8 forward, 17 backward (it recomputes the softmax), of them 2 each its exp's.
REFERENCE_BYTES = {"rmsnorm": (7, 24), "layernorm": (12, 33), "rotary": (7, 7),
                   "swiglu": (5, 9), "gelu": (2, 3), "transcendental": (2, 3), "residual": (3, 0),
                   "cross_entropy": (8, 17), "cross_entropy_exp": (2, 2)}
# Its operators: a fixed few plus, per row chunk, (forward, backward).
CE_REFERENCE_OPS = ((17, 3), (23, 20))


def reference_bytes(shape: Shape) -> tuple[float, float, float, float]:
    """Elements (forward, backward) one layer's reference operators move outside its GEMMs and
    the attention kernel, and of them the activation's transcendental kernels' (forward,
    backward)."""
    m, t, T = shape.model, shape.tp, shape.tokens
    rep = T * m.d_model / (t if shape.sp else 1)
    q, kv, f = T * m.n_heads * m.head_dim / t, T * m.kv_heads * m.head_dim / t, T * m.ffn_dim / t
    if m.n_experts:     # the SwiGLU of the routed rows and the shared experts
        f = shape.moe_tokens * m.expert_ffn * (m.moe_top_k + m.moe_shared_experts)
    norm, act, tr = REFERENCE_BYTES[m.norm], REFERENCE_BYTES[m.activation], \
        REFERENCE_BYTES["transcendental"]
    fwd = 2 * norm[0] * rep + act[0] * f + 2 * REFERENCE_BYTES["residual"][0] * rep + 2 * q
    bwd = 2 * norm[1] * rep + act[1] * f + 2 * (q + 2 * kv)
    bwd += 3 * column_linears(m) * rep     # summing the gradients of a tensor's consumers
    # A fused projection's output is split into its parts (views); in the backward their
    # gradients are concatenated: read and write q + 2 kv, and up + gate under SwiGLU.
    bwd += 2 * (q + 2 * kv) + (4 * f if m.activation == "swiglu" else 0)
    if m.rotary:
        rot = REFERENCE_BYTES["rotary"]
        fwd, bwd = fwd + rot[0] * (q + kv), bwd + rot[1] * (q + kv)
    if m.bias and m.activation == "gelu":  # bias_gelu's reference adds the bias, then GELU
        fwd += 2 * f
    if m.bias:                             # each bias gradient reads its output gradient
        bwd += T * (2 * (m.n_heads + m.kv_heads) * m.head_dim / t + m.ffn_dim / t * (
            2 if m.activation == "swiglu" else 1)) + 2 * rep
    return fwd, bwd, tr[0] * f, tr[1] * f


def _elementwise(shape: Shape, hw: Hardware, feat: Features) -> tuple[float, float]:
    """Seconds of one layer's forward and backward outside the GEMMs and the attention core."""
    m, t, E, T = shape.model, shape.tp, hw.bytes_per_element, shape.tokens
    h_rep = m.d_model / (t if shape.sp else 1)     # the replicated (or SP-split) hidden width
    extra, kernels = 0.0, 0
    if feat.dropout:                               # hidden dropouts: mask write + apply
        extra += 2 * T * h_rep * (1 + 2 * E)
        kernels += 2
    if not feat.flash_attention:                   # scale-mask-softmax over stored scores
        scores = shape.micro_batch * m.n_heads / t * shape.seq_len ** 2 / shape.cp
        extra += 2 * scores * E + (scores * (1 + 2 * E) if feat.dropout else 0)
        kernels += 2 if feat.dropout else 1
    if hw.kind == "cpu":
        # Unfused reference ops, their operators and bytes counted as they run; the
        # activation's transcendental kernels at their own rate.
        fwd, bwd, tr_f, tr_b = (E * x for x in reference_bytes(shape))
        k_f, k_b = reference_ops(m, feat)
        k_f, k_b = k_f - REFERENCE_OPS["core"][0], k_b - REFERENCE_OPS["core"][1]
        (o_f, o_b), (b_f, b_b) = moe_ops(shape, True), moe_bytes(shape, True)
        k_f, k_b, fwd, bwd = k_f + o_f, k_b + o_b, fwd + E * b_f, bwd + E * b_b
        return (hw.memory_time(fwd - tr_f + extra, k_f) + hw.activation_time(tr_f),
                hw.memory_time(bwd - tr_b + 2 * extra, k_b) + hw.activation_time(tr_b))
    # Fused kernels; each backward kernel reads the output gradient and the saved input and
    # writes one, twice the forward's traffic.
    f = T * m.ffn_dim / t
    if m.n_experts:     # the routed rows' and the shared experts' SwiGLU
        f = shape.moe_tokens * m.expert_ffn * (m.moe_top_k + m.moe_shared_experts)
    nbytes = extra + 2 * 2 * T * h_rep * E         # two norms: read x, write y
    nbytes += 2 * 3 * T * h_rep * E                # two residual adds: read two, write one
    nbytes += (3 if m.activation == "swiglu" else 2) * f * E
    kernels += GPU_LAYER_KERNELS
    if m.rotary:
        nbytes += 2 * T * (m.n_heads + m.kv_heads) * m.head_dim / t * E
        kernels += GPU_ROTARY_KERNELS
    (o_f, o_b), (b_f, b_b) = moe_ops(shape, False), moe_bytes(shape, False)
    return (hw.memory_time(nbytes + E * b_f, kernels + o_f),
            hw.memory_time(GPU_BACKWARD_FACTOR * nbytes + E * b_b,
                           GPU_BACKWARD_FACTOR * kernels + o_b))


@dataclass(frozen=True)
class LayerCost:
    """Seconds of one layer for one micro-batch: compute, and TP communication before overlap."""

    f: float                # forward compute
    b: float                # input-gradient compute (with what recompute redoes)
    w: float                # weight-gradient compute
    gemm_f: float           # the linears' forward GEMMs (what TP forward comm can hide behind)
    gemm_b: float           # the linears' input-gradient GEMMs
    tp_comm_f: float        # TP collectives of the forward
    tp_comm_b: float        # TP collectives of the backward (recompute's forward ones included)
    cp_exposed_f: float = 0.0   # the CP ring's transfers that the block attention does not hide
    cp_exposed_b: float = 0.0


def layer_cost(shape: Shape, hw: Hardware, recompute: str = "none", tp_link_gbps: float = 1.0,
               feat: Features = FASTPAR, cp_link_gbps: float = 1.0) -> LayerCost:
    """The :class:`LayerCost` of one layer on one GPU."""
    if recompute not in RECOMPUTE:
        raise ValueError(f"recompute={recompute!r} is not one of {RECOMPUTE}")
    # The forward's operators at their own overhead (on a CPU, Python modules and autograd's
    # recording cost about twice the backward's per operator); the backward's at the default.
    hf = hw.for_forward()
    mats = loop_linears(shape) if hw.kind == "cpu" else _linears(shape)
    gemm = sum(hf.gemm_time(*mnk) for mnk in mats)
    gemm_b = sum(hw.gemm_time(*mnk) for mnk in mats)
    c = tp_pieces(shape, hw, feat)
    if c > 1:
        # The overlapped path runs the row linears' forward GEMMs and the column linears'
        # input-gradient GEMMs in c row chunks (smaller GEMMs, more launches).
        lin = _linears(shape)
        rows, cols = [lin[3], lin[-1]], lin[:3] + lin[4:-1]

        def chunked(h, group):
            return sum(h.gemm_time(-(-m // c), n, k, c) - h.gemm_time(m, n, k)
                       for m, n, k in group)
        gemm, gemm_b = gemm + chunked(hf, rows), \
            gemm_b + chunked(hw, [(m, k, n) for m, n, k in cols])
    core, core_at_b = _core_time(shape, hf, feat), _core_time(shape, hw, feat)
    elem_f, elem_b = _elementwise(shape, hf, feat)[0], _elementwise(shape, hw, feat)[1]
    # What the forward saves for the backward it writes to memory that none of its later
    # operators reuses (the same forward without recording reuses hot buffers): 10-20% of a
    # layer's forward on a CPU core at 128-900 tokens (hw.saved_gbps, measured).
    ref = hw.kind == "cpu"
    saved = hw.saved_time(activation_bytes(shape, recompute, feat, hw.bytes_per_element, ref))
    f = gemm + core + elem_f + saved
    back = ATTENTION_BACKWARD_FLASH if feat.flash_attention else ATTENTION_BACKWARD_UNFUSED
    core_b = back * core_at_b                       # flash recomputes q k^T
    if hw.kind == "cpu" and feat.flash_attention:   # its backward's extra ops: overhead only
        core_b += (REFERENCE_OPS["core"][1] - back * REFERENCE_OPS["core"][0]) \
            * hw.kernel_overhead_us * 1e-6
    b = gemm_b + core_b + elem_b
    w = sum(hw.gemm_time(*mnk) for mnk in mats)
    comm_f, comm_b = tp_collectives(shape, hw, tp_link_gbps, feat,
                                    regather=regathers(recompute, feat), compute=(f, b + w))
    if recompute == "full":     # the forward again, recording all that a layer saves
        b, comm_b = b + f - saved + hw.saved_time(activation_bytes(
            shape, "none", feat, hw.bytes_per_element, ref)), comm_b + comm_f
    elif recompute == "selective":
        b += core
    cp_f, cp_b = cp_ring_exposed(shape, hw, cp_link_gbps, core_at_b, core_b)
    if recompute == "full":
        cp_b += cp_f
    return LayerCost(f=f, b=b, w=w, gemm_f=gemm, gemm_b=gemm_b, tp_comm_f=comm_f,
                     tp_comm_b=comm_b, cp_exposed_f=cp_f, cp_exposed_b=cp_b)


def cp_ring_exposed(shape: Shape, hw: Hardware, link_gbps: float, core_f: float,
                    core_b: float) -> tuple[float, float]:
    """Seconds of one layer's CP ring left exposed, forward and backward. Forward: cp - 1 hops of
    this rank's k and v (kv heads only); backward: the k and v again with their fp32 gradient
    accumulators (three times the bytes), and the last hop home. Each hop is in flight while one
    block (1/cp of the core) computes, so only what exceeds the block shows; on a CPU gloo's
    threads share the cores and nothing is hidden. Each hop is one batch of an isend and an
    irecv, each costing the host ``p2p_post_us`` to post (cp - 1 batches forward; backward
    cp - 1 of k and v and cp of the accumulators)."""
    cp, m = shape.cp, shape.model
    if cp == 1:
        return 0.0, 0.0
    kv = 2 * shape.tokens * m.kv_heads * m.head_dim / shape.tp * hw.bytes_per_element
    hop_f = ring_time("send", kv, 2, link_gbps, hw.collective_latency_us)
    hop_b = ring_time("send", 3 * kv, 2, link_gbps, hw.collective_latency_us)
    post = 2 * hw.p2p_post_us * 1e-6
    post_f, post_b = (cp - 1) * post, (2 * cp - 1) * post
    if hw.kind == "cpu":
        return (cp - 1) * hop_f + post_f, cp * hop_b + post_b
    return ((cp - 1) * max(0.0, hop_f - core_f / cp) + post_f,
            (cp - 1) * max(0.0, hop_b - core_b / cp) + post_b +
            ring_time("send", 2 * kv, 2, link_gbps, hw.collective_latency_us))


def ring_time(kind: str, nbytes: float, n: int, link_gbps: float, latency_us: float) -> float:
    """Seconds of a ring collective over ``n`` ranks on a tensor of ``nbytes`` (whole tensor).

    all_reduce moves 2 (n-1)/n of it through each rank's link in 2 (n-1) steps; all_gather,
    reduce_scatter and all_to_all (``nbytes``: what one rank holds, (n-1)/n of it leaving)
    half of that; send moves it once.
    """
    if n <= 1 and kind != "send":
        return 0.0
    steps, share = {"all_reduce": (2 * (n - 1), 2 * (n - 1) / n),
                    "all_gather": (n - 1, (n - 1) / n), "reduce_scatter": (n - 1, (n - 1) / n),
                    "all_to_all": (n - 1, (n - 1) / n), "send": (1, 1.0)}[kind]
    return steps * latency_us * 1e-6 + share * nbytes / (link_gbps * 1e9)


def collective_time(kind: str, nbytes: float, n: int, link_gbps: float, hw: Hardware,
                    pieces: int = 1, gap: float = 0.0, sync_as: str | None = None) -> float:
    """Seconds of one collective call site over ``n`` ranks, issued as ``pieces`` collectives of
    equal parts (an overlapped linear's chunks): each is a ring (:func:`ring_time`); the first
    also pays the sync of a call site of its kind (``Hardware.call_sync``: the ranks' drift and
    wake-up when they meet after computing apart) and paces the chunks after it. ``sync_as``:
    the kind of call that carries it, where it differs from ``kind`` (the C++ extension's ring
    all-gathers and reduce-scatters run as pairwise exchanges: an all-to-all's). ``gap``:
    seconds the ranks computed since their previous call; beyond the ``sync_gap_us`` the sync
    was measured after, each second of it adds ``sync_per_gap`` (on a CPU gloo's wait grows
    with it)."""
    if n <= 1:
        return 0.0
    return pieces * ring_time(kind, nbytes / pieces, n, link_gbps, hw.collective_latency_us) \
        * hw.link_factor(nbytes / pieces) + hw.call_sync(sync_as or kind) \
        + hw.sync_per_gap * max(0.0, gap - hw.sync_gap_us * 1e-6)


def tp_collectives(shape: Shape, hw: Hardware, link_gbps: float,
                   feat: Features = FASTPAR, regather: bool = False,
                   compute: tuple[float, float] = (0.0, 0.0)) -> tuple[float, float]:
    """Seconds of one layer's TP communication, forward and backward, before any overlap.

    With ``c`` column-parallel linears (fastpar: q, k, v, and gate and up or fc1, each with its
    own input-gradient reduction; a fused QKV / gate-up makes it 2) and 2 row-parallel ones:
    without SP, an all-reduce after each row linear (forward) and of each column linear's input
    gradient (backward); the overlapped path issues each of them as :func:`tp_pieces`
    all-reduces of a row chunk, so the per-call latency is paid that many times. With SP: every column
    linear gathers its input and every row linear reduce-scatters its output (forward); the
    backward reduce-scatters each column linear's input gradient and gathers each row linear's
    output gradient; with ``regather`` (Megatron's choice, fastpar's under selective recompute)
    it also gathers each column linear's input again for its weight gradient, which fastpar
    otherwise keeps from the forward. On a CPU (gloo) the backward's reduce-scatters cost
    all-reduces. ``compute``: the layer's forward and backward compute, shared evenly
    between the gaps before its calls (each call's sync grows with its gap:
    :func:`collective_time`).
    """
    t = shape.tp
    if t == 1:
        return 0.0, 0.0
    n = shape.tokens * shape.model.d_model * hw.bytes_per_element      # (s, b, h)
    row, col = tp_call_sites(shape, feat)
    calls = (col + row, col * (2 if regather else 1) + row) if shape.sp else (row, col)
    gap_f, gap_b = (c / k for c, k in zip(compute, calls))

    def ring(kind, gap, pieces=1, sync_as=None):
        return collective_time(kind, n, t, link_gbps, hw, pieces, gap, sync_as)

    if shape.sp:
        # The overlapped path's column forward and row forward and backward are the C++
        # extension's rings of pairwise exchanges (allgather_matmul, matmul_reducescatter);
        # the column backward's gathers and reduce-scatters are the backend's own.
        ex = "all_to_all" if feat.tp_overlap else None
        fwd = col * ring("all_gather", gap_f, sync_as=ex) \
            + row * ring("reduce_scatter", gap_f, sync_as=ex)
        again = ring("all_gather", gap_b) if regather else 0.0
        # gloo reduce-scatters a tensor through an all-reduce of the whole of it (the column
        # linears' input gradients; the row linears' forward runs its own ring of exchanges)
        scatter_kind = "all_reduce" if hw.kind == "cpu" else "reduce_scatter"
        scatter = ring(scatter_kind, gap_b)
        bwd = col * (again + scatter) + row * ring("all_gather", gap_b, sync_as=ex)
        if hw.kind == "cpu" and feat.tp_overlap:
            hid_f, hid_b = _sp_hidden_syncs(shape, hw, feat, regather, scatter_kind)
            fwd, bwd = fwd - hid_f, bwd - hid_b
        return fwd, bwd
    pieces = tp_pieces(shape, hw, feat)
    return row * ring("all_reduce", gap_f, pieces), col * ring("all_reduce", gap_b, pieces)


def tp_linears(shape: Shape, feat: Features = FASTPAR) -> tuple[list, list]:
    """(column, row) GEMMs (m, n, k) of one layer's TP linears, one per call site of
    :func:`tp_call_sites` (a fused QKV / gate-up as one GEMM of all its outputs)."""
    mats = _linears(shape)
    mlp = [] if shape.model.n_experts else mats[4:-1]
    rows = [mats[3]] + ([] if shape.model.n_experts else [mats[-1]])
    if not feat.fused_qkv:
        return mats[:3] + mlp, rows

    def fuse(gemms):                    # one GEMM of all their outputs
        return [(gemms[0][0], sum(g[1] for g in gemms), gemms[0][2])] if gemms else []
    return fuse(mats[:3]) + fuse(mlp), rows


def _sp_hidden_syncs(shape: Shape, hw: Hardware, feat: Features, regather: bool,
                     scatter_kind: str) -> tuple[float, float]:
    """Seconds of the SP calls' syncs a CPU hides, forward and backward: each call of the
    overlapped path is issued before a GEMM and waited after it, which covers the call's wait
    for the other ranks as far as it goes (gloo's threads still move the bytes on the cores
    that compute). A column forward's ring issues its exchange and computes a block of the
    gathered rows; a row forward computes a block, issues it, and computes the next before
    waiting; a row backward as a column forward, on the output gradient; a column backward
    issues its reduce-scatter after the input gradient's GEMM and waits after the weight
    gradient's (its regather, issued first, after the input gradient's). On 2 gloo ranks of a
    2-core machine the tiny model's SP calls at sequence 240 took 1.05-1.08 ms each beyond
    their GEMMs, the column backward 1.9-2.0, where the sync whole gave 1.30 and 2.32."""
    t, f = shape.tp, hw.for_forward()
    cols, rows = tp_linears(shape, feat)
    ex = hw.call_sync("all_to_all")
    hid_f = sum(min(ex, f.gemm_time(m // t, n, k)) for m, n, k in cols + rows)
    hid_b = sum(min(ex, hw.gemm_time(m // t, k, n)) for m, n, k in rows)
    hid_b += sum(min(hw.call_sync(scatter_kind), hw.gemm_time(n, k, m)) for m, n, k in cols)
    if regather:
        hid_b += sum(min(hw.call_sync("all_gather"), hw.gemm_time(m, k, n)) for m, n, k in cols)
    return hid_f, hid_b


def tp_call_sites(shape: Shape, feat: Features = FASTPAR) -> tuple[int, int]:
    """(forward, backward) TP collective call sites of one layer without SP: an all-reduce
    after each row linear, one of each column linear's input gradient (:func:`tp_collectives`)."""
    return 1 if shape.model.n_experts else 2, column_linears(shape.model, feat)


def tp_pieces(shape: Shape, hw: Hardware, feat: Features = FASTPAR) -> int:
    """Row chunks of each overlapped TP all-reduce (a (tokens, h) tensor), by the layers' own
    rule (:func:`fastpar.tensor_parallel.overlap.row_chunks`); 1 without overlap or under SP."""
    if shape.tp == 1 or shape.sp or not feat.tp_overlap:
        return 1
    return row_chunks(feat.tp_chunks, shape.tokens, shape.model.d_model, hw.bytes_per_element)


def exposed(comm: float, compute: float, chunks: int) -> float:
    """Communication left showing when it is pipelined with ``compute`` in ``chunks`` pieces:
    the longer of the two runs throughout, one chunk of the shorter one sticks out."""
    return max(0.0, comm - compute) + min(comm, compute) / max(chunks, 1)


# Bytes per element of the torch reference ops' arithmetic (what fastpar runs off CUDA): they
# compute in torch.promote_types(x.dtype, float32), fp32 for bf16 and fp32 activations alike
# (fastpar/kernels/rms_norm.py, layer_norm.py, swiglu.py, bias_gelu.py: ``*_reference``).
REFERENCE_COMPUTE_BYTES = 4


def norm_bytes(shape: Shape, bytes_per_element: int = 2, reference: bool = False) -> float:
    """Bytes one norm and the linear after it keep for the backward, per micro-batch: its input
    and its output (the linear's saved input). The torch reference (``reference``, off CUDA)
    keeps its fp32 input and its fp32 normalised ``x * rstd`` (for the weight's gradient), then
    the output cast to the activation dtype (``rms_norm_reference``: ``xf * rsqrt(...)`` saves
    ``xf``, ``* weight`` saves the product; ``layer_norm_reference`` keeps ``x - mean`` instead
    of ``xf``). Per-row statistics (rstd: one fp32 per row) are left out, as everywhere here."""
    m, E = shape.model, bytes_per_element
    rep = shape.tokens * m.d_model / (shape.tp if shape.sp else 1)
    return (2 * REFERENCE_COMPUTE_BYTES + E) * rep if reference else 2 * E * rep


def regathers(recompute: str, feat: Features = FASTPAR) -> bool:
    """Whether the column linears gather their inputs again in backward under SP (instead of
    keeping the forward's gathered copy): on the overlapped path under selective recompute
    (fastpar.models.gpt.GPT); the plain path's autograd always keeps them."""
    return feat.tp_overlap and recompute == "selective"


def activation_bytes(shape: Shape, recompute: str, feat: Features = FASTPAR,
                     bytes_per_element: int = 2, reference: bool = False) -> float:
    """Bytes one layer keeps for its backward, per micro-batch, on one GPU (see the module doc).
    ``reference``: fastpar's torch reference ops run (off CUDA, ``Hardware.kind == "cpu"``),
    which keep fp32 intermediates (:data:`REFERENCE_COMPUTE_BYTES`) where the fused kernels
    keep their inputs only; tests/test_plan.py counts what autograd saves on the real layer."""
    m, t, E, T = shape.model, shape.tp, bytes_per_element, shape.tokens
    rep = T * m.d_model / (t if shape.sp else 1)        # an (s, b, h) tensor outside the TP pair
    if recompute == "full":                            # only the layer's input
        return E * rep
    q, kv = T * m.n_heads * m.head_dim / t, T * m.kv_heads * m.head_dim / t
    f = T * m.ffn_dim / t
    norm = norm_bytes(shape, E, reference)             # the norm's input, the q/k/v input
    # The fused q/k/v projection's output is one storage; v is a view of it that the core
    # saves, which keeps all of it (fastpar/models/layers.py, ParallelAttention.forward).
    qkv = E * (q + 2 * kv)
    if m.rotary:     # kernels.rotary writes new q and k (inplace=False), which the core saves
        qkv += E * (q + kv)
    # A fused core (SDPA's flash kernels, CUDA and CPU alike; the CP ring) saves its output
    # (and one fp32 log-sum-exp per row and head, left out) unless selective recompute redoes
    # it, and o saves its input, the output turned sequence-first (``y.permute(2, 0, 1, 3)``):
    # a copy when the core wrote it batch-first. torch's CPU flash kernel lays its output out
    # as q is; without rotary q is a view of the sequence-first projection, so o's input is a
    # view of the core's output (counted on the real layer by tests/test_plan.py).
    core_out = E * q if feat.flash_attention and recompute != "selective" else 0.0
    attn = norm + qkv + (E * q if reference and not m.rotary else core_out + E * q)
    def swiglu(f):
        if reference:    # swiglu_reference: fp32 gate, silu(gate) and up, and the product cast
            #              back (down's input); bias_gelu_reference: fp32 x + bias, gelu(...)
            C = REFERENCE_COMPUTE_BYTES
            return (3 * C + E) * f if m.activation == "swiglu" else (C + E) * f
        return E * f * (3 if m.activation == "swiglu" else 2)   # the fused kernels' inputs
    if m.n_experts:     # fastpar/models/moe.py, whole on each TP rank (its SP shard)
        k, T = m.moe_top_k, shape.moe_tokens
        act = (swiglu(T * k * m.expert_ffn) + swiglu(T * m.moe_shared_experts * m.expert_ffn)
               + E * 3 * T * k * m.d_model     # the rows gathered by expert, the experts'
               #                                 outputs, those outputs weighed (index_add's)
               + T * (E * k + 16 * k + 4 * m.n_experts))   # their weights; the chosen experts
        #                                   and the sorted rows' tokens (int64); fp32 router
    else:
        act = swiglu(f)
    mlp = norm + act
    if shape.sp and t > 1 and not regathers(recompute, feat):
        # qkv and fc1 keep their gathered inputs (tp times the shard the norm wrote; an MoE
        # layer gathers nothing)
        kept = E * (shape.tokens * m.d_model - rep)
        attn, mlp = attn + kept, mlp + (0 if m.n_experts else kept)
    masks = 2 * rep if feat.dropout else 0.0            # one byte per element
    scores = 0.0
    if not feat.flash_attention and recompute != "selective":
        p = shape.micro_batch * m.n_heads / t * shape.seq_len ** 2 / shape.cp
        scores = E * p + ((1 + E) * p if feat.dropout else 0.0)
    return attn + mlp + masks + scores


def waiting_grad_bytes(shape: Shape, bytes_per_element: int = 2) -> float:
    """Bytes one layer holds per micro-batch between a zero-bubble schedule's B and its W, on top
    of its activations (which B keeps for W: ``retain_graph``): the output gradient of every
    module whose weight gradient waits for W (fastpar/pipeline/backward.py, ``backward_input``):
    the two norms, q/k/v and the first MLP linear (gate and up). The row linears (o and the
    second MLP linear) hand their bias to a fused add and get their weight gradients in B."""
    m, t, E, T = shape.model, shape.tp, bytes_per_element, shape.tokens
    rep = T * m.d_model / (t if shape.sp else 1)
    q, kv = T * m.n_heads * m.head_dim / t, T * m.kv_heads * m.head_dim / t
    f = T * m.ffn_dim / t * (2 if m.activation == "swiglu" else 1)
    return E * (2 * rep + q + 2 * kv + f)
