"""Evaluate one (tp, pp, dp, schedule, ...) configuration, or search them all, best first.

A step is timed by running the pipeline simulator on the real schedule (``build_schedule``)
with per-stage F / B / W costs from :mod:`.cost` (TP communication that the overlapped GEMMs do
not hide is added to them) and the p2p time of one activation as ``comm``; then the DP gradient
reduction that is not hidden and the optimizer step are added. Placement is ``fastpar.layout``'s
default ``tp-dp-pp``: TP groups are consecutive ranks (inside a node), DP next, PP outermost.
"""
from __future__ import annotations

import dataclasses
import itertools
from dataclasses import asdict, dataclass, field

from ..kernels.cross_entropy import REFERENCE_CHUNK
from ..mesh.layout import require_positive
from ..models.parallel_config import ParallelConfig
from ..models import RECOMPUTE, GPTConfig
from ..pipeline import build_schedule, partition, simulate
from ..pipeline.actions import rank_of
from ..pipeline.schedules import PLACEMENT
from . import cost
from .cost import FASTPAR, Features, Shape
from .hardware import (ACCUMULATE_PASSES, BUCKET_COPY_PASSES, CPU_EMBED_OPS,
                       CPU_OPTIMIZER_OPS_PER_TENSOR, GPU_CROSS_ENTROPY_KERNELS,
                       GPU_EMBED_KERNELS, GPU_NORM_KERNELS, GPU_OPTIMIZER_KERNELS,
                       OPTIMIZER_STEP_BYTES, Hardware)


@dataclass(frozen=True)
class Cluster:
    """``gpus`` accelerators of one kind, ``gpus_per_node`` to a node."""

    gpus: int
    gpus_per_node: int
    hardware: Hardware

    def __post_init__(self):
        require_positive({k: getattr(self, k) for k in ("gpus", "gpus_per_node")})
        if self.gpus % self.gpus_per_node:
            raise ValueError(f"gpus={self.gpus} is not divisible by gpus_per_node="
                             f"{self.gpus_per_node} (whole nodes only)")

    def link_gbps(self, span: int, per_node: int = 1) -> float:
        """Bandwidth per rank of a group whose ranks lie within ``span`` consecutive ranks,
        ``per_node`` of them in each node it spans. Across nodes every GPU has its own NIC, and
        a ring collective runs one ring per NIC (as NCCL does), each leaving the node through
        another of the group's GPUs, so its inter-node hops carry ``per_node`` NICs' worth at
        once; the intra-node link still bounds it."""
        hw = self.hardware
        if span <= self.gpus_per_node:
            return hw.intra_node_gbps
        return min(hw.intra_node_gbps, hw.inter_node_gbps * max(1, per_node))


@dataclass(frozen=True)
class Workload:
    """The model and the batch of one optimizer step."""

    model: GPTConfig
    seq_len: int
    global_batch: int                # sequences per step
    doc_span: float | None = None    # packed documents: the keys a token's document holds on
                                     # average (fastpar.data.packing.attention_span); None:
                                     # attention over whole sequences

    def __post_init__(self):
        require_positive({k: getattr(self, k) for k in ("seq_len", "global_batch")})
        if self.doc_span is not None and not 0 < self.doc_span <= self.seq_len:
            raise ValueError(f"Workload: doc_span={self.doc_span} must be in (0, seq_len="
                             f"{self.seq_len}]")


def check(cfg: ParallelConfig, work: Workload, cluster: Cluster) -> None:
    """Raise ValueError naming the numbers if ``cfg`` cannot run ``work`` on ``cluster``."""
    if cfg.dp is None:
        raise ValueError("the planner needs dp given (tp * pp * dp = gpus)")
    cfg.check(work.model, cluster.gpus, work.global_batch, work.seq_len, world_name="gpus=")


@dataclass
class Estimate:
    """The predicted step of one configuration (times in seconds, memory in GB = 1e9 bytes)."""

    config: ParallelConfig
    step_time_s: float
    tflops_per_gpu: float            # model FLOPs (no recompute) per second per GPU
    hw_tflops_per_gpu: float         # FLOPs computed, recompute included
    mfu: float
    memory_gb_per_gpu: float
    tokens_per_s: float
    bubble_fraction: float           # from the simulator: idle / step over pipeline ranks
    compute_s: float                 # busiest pipeline rank's compute, exposed TP comm included
    tp_exposed_s: float              # TP communication the GEMMs do not hide (busiest rank)
    cp_exposed_s: float              # the CP ring's transfers the attention does not hide
    dp_exposed_s: float
    optimizer_s: float
    grad_accumulation_s: float       # adding each micro-batch's weight gradients
    p2p_s: float                     # one activation between stages
    memory: dict = field(default_factory=dict)
    fits: bool = True
    reason: str | None = None        # why it was rejected

    def to_dict(self) -> dict:
        out = {**asdict(self.config), **{k: v for k, v in asdict(self).items()
                                        if k != "config"}}
        return {k: (round(v, 6) if isinstance(v, float) else v) for k, v in out.items()}


def _stage_costs(work, cluster, cfg, feat, split):
    """Per-stage F, B, W seconds; the layer split; the busiest stage's exposed TP time."""
    hw, t = cluster.hardware, cfg.tp
    shape = Shape(work.model, work.seq_len, cfg.micro_batch_size, t, cfg.sequence_parallel,
                  cfg.cp, work.doc_span, cfg.ep, cfg.ep_chunks)
    # tp-cp-dp-pp placement: a CP ring's neighbours are tp ranks apart, within tp * cp ranks.
    lc = cost.layer_cost(shape, hw, cfg.recompute, cluster.link_gbps(t), feat,
                         cluster.link_gbps(t * cfg.cp))
    partner_b = lc.gemm_b + (0.0 if split else lc.w) + (lc.gemm_f if cfg.recompute == "full"
                                                        else 0.0)
    if feat.tp_overlap and hw.kind != "cpu":   # on a CPU gloo shares the cores: no overlap
        pieces = feat.tp_chunks if shape.sp else cost.tp_pieces(shape, hw, feat)
        exp_f = cost.exposed(lc.tp_comm_f, lc.gemm_f, pieces)
        exp_b = cost.exposed(lc.tp_comm_b, partner_b, pieces)
    else:
        exp_f, exp_b = lc.tp_comm_f, lc.tp_comm_b
    # What another micro-batch's compute can hide of this one's TP all-reduces. On a GPU all of
    # it. On a CPU whose cores all compute, only each call's wait for the other ranks (its
    # sync): gloo's threads move and reduce the bytes on the cores the other micro-batch is
    # computing on (tp2 of the small model at sequence 144, forward inside backward on and
    # off: 0.88x the step measured, 0.72x when the whole all-reduce was hidden).
    spare_f, spare_b = exp_f, exp_b
    if hw.kind == "cpu" and not shape.sp:
        rows, columns = cost.tp_call_sites(shape, feat)
        spare_f = min(exp_f, rows * hw.sync_us * 1e-6)
        spare_b = min(exp_b, columns * hw.sync_us * 1e-6)
    # Interleaved micro-batches: a block's all-reduce travels while the other k - 1
    # micro-batches compute their blocks; in the backward a column linear's input-grad
    # all-reduce while they compute theirs.
    others = interleaved(cfg, work) - 1
    hide_f, hide_b = min(spare_f, others * lc.f), min(spare_b, others * lc.b)
    exp_f, exp_b, spare_f, spare_b = (exp_f - hide_f, exp_b - hide_b, spare_f - hide_f,
                                      spare_b - hide_b)
    # Forward inside backward (fastpar.models.gpt.overlap_forward_backward): but the first
    # micro-batch's forward and the last one's backward, a forward all-reduce travels while the
    # previous micro-batch computes its backward, a backward one while the next computes its
    # forward.
    M = cfg.num_microbatches(work.global_batch)
    if cfg.pp == 1 and cfg.fb_overlapped(M):
        q = (M - 1) / M
        exp_f -= q * min(spare_f, lc.b)
        exp_b -= q * min(spare_b, lc.f)
    # Expert parallelism: each MoE layer's dispatch, over ep consecutive dp ranks (tp apart),
    # or folded over ep consecutive ranks (whole TP groups), pipelined with its experts in
    # ep_chunks chunks (on a CPU gloo shares the cores).
    span = cfg.ep if cfg.ep_fold_tp else t * cfg.ep
    ep_f, ep_b = cost.ep_alltoall(shape, hw, cfg.ep, cfg.ep_chunks, cluster.link_gbps(span),
                                  overlap=hw.kind != "cpu")
    exp_f, exp_b = exp_f + ep_f, exp_b + ep_b
    if work.model.n_experts:    # the MoE layer's token counts (its auxiliary loss counts whole
        #                         sequences) all-reduced over cp and over the SP group
        for n, ranks in ((cfg.cp, t * cfg.cp), (t if cfg.sequence_parallel else 1, t)):
            exp_f += cost.collective_time("all_reduce", 8 * work.model.n_experts, n,
                                          cluster.link_gbps(ranks), hw)
    layer = (lc.f + exp_f + lc.cp_exposed_f, lc.b + exp_b + lc.cp_exposed_b, lc.w)
    if split:   # fastpar/pipeline/backward.py: the row linears' (o, down) weight GEMMs run in B
        mats = cost._linears(shape)
        rows = hw.gemm_time(*mats[3]) + hw.gemm_time(*mats[-1])
        layer = (layer[0], layer[1] + rows, layer[2] - rows)
    call = hw.split_call_us * 1e-6 if split else 0.0
    if call:    # B runs one autograd call per layer, W one per deferred module (the two norms
        #         and the column linears)
        m = work.model
        columns = 2 if feat.fused_qkv else 3 + (2 if m.activation == "swiglu" else 1)
        layer = (layer[0], layer[1] + call, layer[2] + (2 + columns) * call)
    m, E, T = work.model, hw.bytes_per_element, shape.tokens
    act = T * m.d_model * E                        # one (s, b, h) activation
    link = cluster.link_gbps(t)
    tp_ar = cost.collective_time("all_reduce", act, t, link, hw)
    # The head's input-gradient all-reduce runs in row chunks like the layers'; the vocab-parallel
    # cross entropy all-reduces its row maxima and its (sum exp, target logit) pairs.
    pieces = feat.tp_chunks if feat.tp_overlap else 1
    head_ar = cost.collective_time("all_reduce", act, t, link, hw, pieces)
    # The loss: one all-gather of 4 fp32 statistics per token and shard.
    ce_ar = cost.collective_time("all_gather", T * 16 * t, t, link, hw)
    # Kernels: the fused path's, or torch's reference ops (embedding and its backward; the final
    # norm and the cross entropy's max, sub, exp, sum, log, gather, ... and their backward).
    ref = hw.kind == "cpu"
    norm_f, norm_b = cost.REFERENCE_OPS[m.norm] if ref else GPU_NORM_KERNELS
    chunks = -(-T * (m.padded_vocab // t) // REFERENCE_CHUNK)
    (fix_f, fix_b), (per_f, per_b) = cost.CE_REFERENCE_OPS
    embed_k, ce_f, ce_b = (CPU_EMBED_OPS, fix_f + per_f * chunks, fix_b + per_b * chunks) \
        if ref else (GPU_EMBED_KERNELS, *GPU_CROSS_ENTROPY_KERNELS)
    hf = hw.for_forward()                       # a forward's operators at their own overhead
    embed = (hf.memory_time(2 * act / (t if cfg.sequence_parallel else 1), embed_k) + tp_ar,
             hw.memory_time(2 * act, embed_k), 0.0)
    logits = (m.d_model, m.padded_vocab // t)
    fp32_logits = T * m.padded_vocab / t * 4
    if ref:     # reference ops, bytes counted as they run (cost.REFERENCE_BYTES); exp's own rate
        nb_f, nb_b = cost.REFERENCE_BYTES[m.norm]
        (ce_bf, ce_bb), (ce_exp, _) = (cost.REFERENCE_BYTES[k] for k in
                                       ("cross_entropy", "cross_entropy_exp"))
        ce = (hf.memory_time((ce_bf - ce_exp) * fp32_logits, ce_f)
              + hw.activation_time(ce_exp * fp32_logits),
              hw.memory_time((ce_bb - ce_exp) * fp32_logits, ce_b)
              + hw.activation_time(ce_exp * fp32_logits))
        norm = (hf.memory_time(nb_f * act, norm_f), hw.memory_time(nb_b * act, norm_b))
    else:       # the kernels read the logits (forward), read them and write the gradient
        # (backward); the fused norm reads and writes
        logit_bytes = T * m.padded_vocab / t * E
        ce = (hf.memory_time(logit_bytes, ce_f), hw.memory_time(2 * logit_bytes, ce_b))
        norm = (hf.memory_time(2 * act, norm_f), hw.memory_time(4 * act, norm_b))
    head = (hf.gemm_time(T, logits[1], logits[0]) + ce[0] + norm[0] + ce_ar,
            hw.gemm_time(T, logits[0], logits[1]) + ce[1] + norm[1] + head_ar,
            hw.gemm_time(logits[0], logits[1], T) + (1 if m.tie_embeddings else 2) * call)
    embed = (embed[0], embed[1], embed[2] + (0 if m.tie_embeddings else call))
    stages = cfg.pp * cfg.virtual_stages
    if stages == 1:
        ranges = [range(m.n_layers)]
    else:
        ranges = partition([sum(embed)] + [sum(layer)] * m.n_layers + [sum(head)],
                           cfg.pp, cfg.virtual_stages)
    fbw, waits = [], []
    # Of each, the time spent waiting on collectives (what uses no core while it waits)
    layer_waits = (exp_f + lc.cp_exposed_f, exp_b + lc.cp_exposed_b, 0.0)
    embed_waits, head_waits = (tp_ar, 0.0, 0.0), (ce_ar, head_ar, 0.0)
    for s, r in enumerate(ranges):
        fbw.append([len(r) * layer[i] + (embed[i] if s == 0 else 0.0)
                    + (head[i] if s == stages - 1 else 0.0) for i in range(3)])
        waits.append([len(r) * layer_waits[i] + (embed_waits[i] if s == 0 else 0.0)
                      + (head_waits[i] if s == stages - 1 else 0.0) for i in range(3)])
    # What DualPipeV's pairs can hide (fastpar/mesh/fill.py): the MoE dispatch's waits, the
    # forward's under the paired backward's compute and the backward's under the forward's.
    fills = ([len(r) * ep_f for r in ranges], [len(r) * ep_b for r in ranges])
    return fbw, ranges, (exp_f + exp_b) * max(len(r) for r in ranges), lc, \
        (lc.cp_exposed_f + lc.cp_exposed_b) * max(len(r) for r in ranges), waits, fills


def _sharing(cluster: Cluster, cfg: ParallelConfig) -> tuple[tuple | None, float]:
    """How the ranks of a CPU node share its cores: the simulator's ``shared`` argument
    (processes per pipeline rank, ranks that compute at once) when one node holds every rank,
    and the factor by which what all ranks compute at once (the optimizer, the gradients'
    accumulation) slows: node ranks / ranks that compute at once, at least 1."""
    concurrent = cluster.hardware.concurrent_ranks
    node = min(cluster.gpus, cluster.gpus_per_node)
    if not concurrent or node <= concurrent:
        return None, 1.0
    slow = node / concurrent
    if cluster.gpus > cluster.gpus_per_node:        # several nodes: every rank busy, as a rule
        return None, slow
    return (cfg.tp * cfg.cp * cfg.dp, concurrent), slow


def memory_per_gpu(work: Workload, cluster: Cluster, cfg: ParallelConfig,
                   feat: Features = FASTPAR, ranges=None, peaks=None) -> dict:
    """GB (1e9 bytes) per GPU on the fullest pipeline rank, by kind: weights, gradients,
    optimizer, activations, reserve and their total (and ``params_per_gpu``, a count).

    ``ranges``: each stage's layers; default the trainer's split (``partition`` over
    ``GPTConfig.piece_flops``, as ``fastpar.train.trainer.build_model`` cuts the model).
    ``peaks``: per pipeline rank, the (micro-batch chunks alive, of those awaiting W) pairs the
    peak can be at; default the schedule's own (``build_schedule(...).in_flight``, as
    :func:`evaluate` uses). Bytes per
    parameter come from ``feat``, bytes per activation element and the reserve from the
    hardware; ``hardware.kind == "cpu"`` counts what torch's reference ops keep (fastpar's
    path off CUDA). This is the one memory model: the planner and the trainer's check before
    launch (:mod:`fastpar.train.memory_check`) both call it."""
    check(cfg, work, cluster)
    m, pp = work.model, cfg.pp
    stages = pp * cfg.virtual_stages
    if ranges is None:
        ranges = [range(m.n_layers)] if stages == 1 else \
            partition(m.piece_flops(work.seq_len), pp, cfg.virtual_stages)
    if peaks is None:
        peaks = schedule_peaks(cfg, work)
    return _memory(work, cluster, cfg, feat, ranges, peaks)


def interleaved(cfg: ParallelConfig, work: Workload) -> int:
    """Micro-batches whose forwards run together (``cfg.interleave``, at most the step's)."""
    return min(cfg.interleave, cfg.num_microbatches(work.global_batch)) if cfg.pp == 1 else 1


def schedule_peaks(cfg: ParallelConfig, work: Workload, sched=None) -> list[tuple]:
    """Per pipeline rank, the (micro-batches alive, of those awaiting W) pairs its peak can be
    at: the schedule's (``sched``, default built here; its ``in_flight``); without a pipeline,
    the micro-batches interleaved (``fastpar.models.GPT.interleaved``: all their activations
    are held until their one backward)."""
    k = interleaved(cfg, work)
    if k > 1:
        return [((k, 0),)]
    if sched is None:
        sched = build_schedule(cfg.schedule, cfg.pp, cfg.num_microbatches(work.global_batch),
                               cfg.virtual_stages)
    return sched.in_flight


def _memory(work, cluster, cfg, feat, ranges, peaks) -> dict:
    """:func:`memory_per_gpu` with the stage split and the peaks given: the fullest rank's."""
    return max(memory_rows(work, cluster, cfg, feat, ranges, peaks), key=lambda r: r["total"])


def bytes_per_param(cfg: ParallelConfig, feat: Features, hw) -> tuple[float, float, float]:
    """Bytes per parameter of ``cfg``'s weights, gradients and optimizer state on ``hw``: the
    trainer's under its precision (``feat``), with what ZeRO-1 shards and adds (ZeRO-2 the
    same; it frees the whole gradients between a step's reduction and the next backward, which
    :func:`gradient_bytes` counts). Each bucket's
    reduce-scatter lands in a 1/dp shard of its own beside the bucket (gloo's pairwise
    reduce-scatter, ``hw.kind == "cpu"``, receives one peer's block into that shard and the
    others' into (dp-2)/dp of scratch), copied into an fp32
    shard for the optimizer when reduced in bf16; the parameters are views of the flat buffer
    their bucket's updated shards are gathered into, at any precision (fastpar/data_parallel/
    reducer.py ``enable_sharding``, zero.py ``_shard_buffer``, ``_adopt_params``)."""
    weight, grad, opt = feat.weight_bytes, feat.grad_bytes, feat.optimizer_bytes
    n = shard_size(cfg)
    if cfg.zero == 3 and n > 1:
        # Only shards between steps (whole units come and go: zero3_bytes): the fp32 master
        # apart from the gathered weights at any precision, the reduced gradient shard.
        opt = (opt + (4 if not feat.main_grads else 0)) / n
        return 0.0, feat.reduce_bytes / n + (4 / n if feat.reduce_bytes < 4 else 0), opt
    if cfg.zero and n > 1:
        opt /= n
        grad += feat.reduce_bytes * ((n - 1) / n if hw.kind == "cpu" else 1 / n)
        grad += 4 / n if feat.reduce_bytes < 4 else 0
    return weight, grad, opt


def expert_view(cfg: ParallelConfig) -> ParallelConfig:
    """What the experts' parameters see of ``cfg`` under expert parallelism: their gradients
    reduced, and their ZeRO shards cut, over their replicas, dp x cp / ep ranks
    (fastpar/data_parallel/reducer.py ``place``); under HSDP over those inside a shard group,
    dp_shard x cp / ep ranks (``fastpar.mesh.hsdp_expert_group``)."""
    return dataclasses.replace(cfg, dp=(cfg.dp or 1) * cfg.cp // cfg.ep_dp, cp=1, ep=1,
                               ep_fold_tp=False, dp_shard=cfg.dp_shard * cfg.cp // cfg.ep_dp)


def shard_size(cfg: ParallelConfig) -> int:
    """Ranks the ZeRO state is sharded over: dp x cp (the ranks whose gradients are averaged),
    or HSDP's shard groups (``dp_shard`` dp ranks with their cp ranks)."""
    return cfg.dp_shard * cfg.cp if 0 < cfg.dp_shard < (cfg.dp or 1) else \
        (cfg.dp or 1) * cfg.cp


def grads_apart(cfg: ParallelConfig, work: Workload) -> bool:
    """Whether ``cfg``'s whole gradients and its activations peak apart: under ZeRO-2 with one
    micro-batch per step and no pipeline, the gradients come back only as the backward frees
    the activations (fastpar/data_parallel/reducer.py ``acquire``). With gradient
    accumulation (or a pipeline's micro-batches) every forward after the first finds the whole
    gradients allocated, as under ZeRO-1."""
    return cfg.zero >= 2 and shard_size(cfg) > 1 and cfg.pp == 1 and \
        cfg.num_microbatches(work.global_batch) == 1


# ZeRO-3: units whole at once in forward and backward (the one computing and the prefetched
# one), and whose whole gradients exist at once (the one reduce-scatter in flight and the one
# accumulating): fastpar/data_parallel/zero3.py with its default prefetch=1.
ZERO3_GATHERED, ZERO3_GRADS = 2, 2


def zero3_bytes(cfg, work, feat, hw, params: float, unit: float, root: float,
                units: int) -> tuple[float, float]:
    """ZeRO-3's whole parameters and whole gradients at a rank's peak, in bytes, for ``params``
    elements in ``units`` units of at most ``unit`` elements plus ``root`` outside them: the
    units in flight, and the root (embedding, head) from its first use to its gradients. With
    several micro-batches per step (accumulation, a pipeline) every whole gradient is kept
    until the step's last backward, as under ZeRO-1."""
    n = shard_size(cfg)
    whole_grad = feat.grad_bytes + (feat.reduce_bytes * max(0, n - 2) / n
                                    if hw.kind == "cpu" else 0.0)    # gloo's scratch
    weights = (min(ZERO3_GATHERED, units) * unit + root) * feat.weight_bytes
    held = params if cfg.pp > 1 or cfg.num_microbatches(work.global_batch) > 1 else \
        min(ZERO3_GRADS, units) * unit + root
    return weights, held * whole_grad


def gradient_bytes(cfg, work, feat, hw, grads: float, acts: float) -> float:
    """Bytes of gradients a rank holds at its peak, for ``grads`` gradient elements (its
    buckets' padded sizes, or its parameters) and ``acts`` bytes of peak activations: what
    :func:`bytes_per_param` gives, less, where they peak apart (:func:`grads_apart`), the
    whole gradients the activations leave room for."""
    whole = grads * feat.grad_bytes
    held = grads * bytes_per_param(cfg, feat, hw)[1]
    return held - min(whole, acts) if grads_apart(cfg, work) else held


def memory_rows(work, cluster, cfg, feat=FASTPAR, ranges=None, peaks=None) -> list[dict]:
    """:func:`memory_per_gpu`'s breakdown for every pipeline rank, in pp-rank order (GB, and
    ``params_per_gpu``); the defaults as there."""
    m, pp = work.model, cfg.pp
    if ranges is None:
        ranges = [range(m.n_layers)] if pp * cfg.virtual_stages == 1 else \
            partition(m.piece_flops(work.seq_len), pp, cfg.virtual_stages)
    if peaks is None:
        peaks = schedule_peaks(cfg, work)
    hw, m, t, pp = cluster.hardware, work.model, cfg.tp, cfg.pp
    E, ref = hw.bytes_per_element, hw.kind == "cpu"
    shape = Shape(m, work.seq_len, cfg.micro_batch_size, t, cfg.sequence_parallel, cfg.cp)
    per_layer = cost.activation_bytes(shape, cfg.recompute, feat, E, ref)
    full = cost.activation_bytes(shape, "none", feat, E, ref)
    rows = []
    waiting = cost.waiting_grad_bytes(shape, E)
    rep = shape.tokens * m.d_model / (t if shape.sp else 1)
    for rank in range(pp):
        mine = stages_on(cfg, rank)
        # An MoE layer is whole on every TP rank (no SP): only the rest of the block is split.
        moe, rep_p = m.moe_params(cfg.ep), m.replicated_layer_params()
        block = (m.layer_params(cfg.ep) - moe - rep_p) / t + moe + rep_p   # on one TP rank
        params = sum(len(ranges[s]) for s in mine) * block
        layers = max(len(ranges[s]) for s in mine)
        # Under a split backward each micro-batch between its B and its W also holds its
        # weights' output gradients: the layers', the embedding's on the first stage, the final
        # norm's and the head's (the logits') on the last.
        ends = (E * rep if 0 in mine else 0.0) + (
            E * (rep + shape.tokens * m.padded_vocab / t) if len(ranges) - 1 in mine else 0.0)
        acts = max(alive * layers * per_layer + wait * (layers * waiting + ends)
                   for alive, wait in peaks[rank])
        if cfg.recompute == "full":
            acts += full                           # one layer's activations while it recomputes
        if 0 in mine:
            params += m.padded_vocab * m.d_model / t + (0 if m.rotary else
                                                        m.max_seq_len * m.d_model)
        if len(ranges) - 1 in mine:     # tied across stages: the last one holds a copy
            params += (0 if m.tie_embeddings and 0 in mine else
                       m.padded_vocab * m.d_model / t) + \
                m.d_model * (2 if m.norm == "layernorm" else 1)
            # One micro-batch's final norm and head input, and its logits, which the cross
            # entropy saves as they are (in the activation dtype, no fp32 copy) next to their
            # gradient in the same dtype in the backward
            # (fastpar/tensor_parallel/cross_entropy.py). Once: the last stage runs each
            # micro-batch's backward right after its forward (GPipe's would hold more); each
            # of the interleaved micro-batches' before their one backward, the gradient once.
            logits = shape.tokens * m.padded_vocab / t * E
            acts += interleaved(cfg, work) * (cost.norm_bytes(shape, E, ref) + logits) + logits
            if pp == 1 and cfg.fb_overlapped(cfg.num_microbatches(work.global_batch)):
                # The next micro-batch's forward starts in the head's backward, once the loss
                # has freed the logits it saved: its embedding output and first half-block (at
                # most a layer) next to all of this micro-batch's.
                acts = max(acts, acts - logits + per_layer)
            if shape.sp and t > 1 and (cfg.recompute == "none" or not feat.tp_overlap):
                # the head keeps its gathered input (fastpar.models.gpt: gathered again only
                # under recompute)
                acts += E * shape.tokens * m.d_model * (1 - 1 / t)
        weight, grad, opt = bytes_per_param(cfg, feat, hw)
        weights, grads = params * weight, gradient_bytes(cfg, work, feat, hw, params, acts)
        optimizer = params * opt
        if cfg.zero == 3 and shard_size(cfg) > 1:
            n = sum(len(ranges[s]) for s in mine)
            unit = block                        # a block as this rank holds it
            whole_w, whole_g = zero3_bytes(cfg, work, feat, hw, params, unit,
                                           params - n * unit, n)
            weights, grads = whole_w, params * grad + whole_g
        if cfg.ep > 1 and cfg.zero:     # the experts' shards are cut over fewer ranks
            experts = sum(len(ranges[s]) for s in mine) * m.routed_expert_params() / cfg.ep
            _, grad_e, opt_e = bytes_per_param(expert_view(cfg), feat, hw)
            grads += experts * (grad_e - grad)
            optimizer += experts * (opt_e - opt)
        row = {"weights": weights, "gradients": grads,
               "optimizer": optimizer, "activations": acts,
               "reserve": hw.memory_reserve_gb * 1e9, "params_per_gpu": params}
        row["total"] = sum(v for k, v in row.items() if k != "params_per_gpu")
        rows.append({k: (v if k == "params_per_gpu" else v / 1e9) for k, v in row.items()})
    return rows


def _dp_time(cluster, cfg, feat, params, last_backward, compute=0.0, num_mb=1, layers=1) -> float:
    """Exposed seconds of the gradient reduction (and ZeRO-1's parameter gather), with the
    copy of each gradient into its bucket and the division by dp before it. ZeRO-3 gathers
    the parameters twice per micro-batch instead (forward, backward), prefetched behind the
    ``compute`` seconds of a micro-batch's forward and backward in ``layers`` units."""
    hw, dp = cluster.hardware, cfg.dp * cfg.cp      # CP ranks' gradients are averaged too
    if dp == 1:
        return 0.0
    # tp-cp-dp-pp placement: a DP x CP group is every tp-th rank, min(dp * cp, gpus_per_node /
    # tp) per node.
    per_node = min(dp, max(1, cluster.gpus_per_node // cfg.tp))
    nbytes, link = params * feat.grad_bytes, cluster.link_gbps(cfg.tp * dp, per_node)
    shard, replicas = shard_size(cfg), 1
    if cfg.zero and shard < dp:
        # HSDP: reduce-scatters and gathers inside the shard groups (consecutive dp ranks), then
        # an all-reduce of each shard over the replicas, ranks tp x shard apart.
        replicas = dp // shard
        link = cluster.link_gbps(cfg.tp * shard, min(shard, per_node))
        across = cluster.link_gbps(cfg.tp * dp, max(1, per_node // shard))
    reduce = cost.collective_time("reduce_scatter" if cfg.zero else "all_reduce", nbytes,
                                  shard if cfg.zero else dp, link, hw)
    if replicas > 1:
        reduce += cost.collective_time("all_reduce", nbytes / shard, replicas, across, hw)
    gather = cost.collective_time("all_gather", nbytes, shard, link, hw) if cfg.zero else 0.0
    hidden = feat.dp_overlap if cfg.pp == 1 else feat.dp_overlap_pipeline
    if cfg.zero == 3:
        # Two gathers per micro-batch and the reduce-scatter share one link behind the step's
        # compute, a unit's transfer at a time.
        total = num_mb * 2 * cost.collective_time("all_gather", params * feat.weight_bytes,
                                                  shard, link, hw) + reduce
        if hidden and hw.kind != "cpu":
            total = cost.exposed(total, num_mb * compute, 2 * layers * num_mb)
        return total + (hw.memory_time(2 * nbytes, 1) if feat.main_grads else 0.0)
    if hidden and hw.kind != "cpu":
        buckets = max(1, round(nbytes / (feat.bucket_mb * 1e6)))
        reduce = cost.exposed(reduce, last_backward, buckets)
    # fp32 main gradients are divided in place before the reduction (views are on their way in)
    return reduce + gather + (hw.memory_time(2 * nbytes, 1) if feat.main_grads else 0.0)


def _schedule(cfg: ParallelConfig, work: Workload, schedules: dict):
    """The pipeline schedule of ``cfg``, built once per (schedule, pp, micro-batches, v)."""
    key = (cfg.schedule, cfg.pp, cfg.num_microbatches(work.global_batch), cfg.virtual_stages)
    if key not in schedules:
        schedules[key] = build_schedule(*key)
    return schedules[key]


def _cache_key(cfg: ParallelConfig) -> tuple:
    """What a configuration's per-stage costs depend on (the last item: a split backward)."""
    return (cfg.tp, cfg.pp, cfg.virtual_stages, cfg.micro_batch_size, cfg.recompute,
            cfg.sequence_parallel, cfg.interleave, cfg.ep, cfg.ep_chunks, cfg.ep_fold_tp,
            cfg.schedule in SPLIT_SCHEDULES)


def evaluate(work: Workload, cluster: Cluster, cfg: ParallelConfig,
             feat: Features = FASTPAR, schedules: dict | None = None) -> Estimate:
    """Predict one configuration. Raises ValueError if it cannot run; one that runs out of
    memory comes back with ``fits=False`` and the ``reason``."""
    check(cfg, work, cluster)
    hw, m = cluster.hardware, work.model
    num_mb = cfg.num_microbatches(work.global_batch)
    sched = _schedule(cfg, work, {} if schedules is None else schedules)
    fbw, ranges, tp_exposed, _, cp_exposed, waits, fills = _stage_costs(
        work, cluster, cfg, feat, sched.split_backward)
    shared, slow = _sharing(cluster, cfg)
    if shared is None and slow > 1:
        fbw = [[slow * (x - y) + y for x, y in zip(row, wrow)] for row, wrow in zip(fbw, waits)]
    mem = _memory(work, cluster, cfg, feat, ranges, schedule_peaks(cfg, work, sched))
    tokens = cfg.micro_batch_size * work.seq_len // cfg.cp * m.d_model * hw.bytes_per_element
    p2p = 0.0
    if cfg.pp > 1:
        p2p = cost.ring_time("send", tokens / (cfg.tp if cfg.sequence_parallel else 1), 2,
                             cluster.link_gbps(cfg.tp * cfg.cp * cfg.dp * cfg.pp),
                             hw.collective_latency_us)
    sim = simulate(sched, *([row[i] - wrow[i] for row, wrow in zip(fbw, waits)]
                            for i in range(3)), comm=p2p,
                   waits=[[wrow[i] for wrow in waits] for i in range(3)], shared=shared,
                   post=hw.p2p_post_us * 1e-6, fillable=fills,
                   early=hw.kind == "cpu" or sched.early_sends_block_safely())
    params, tensors = mem["params_per_gpu"], _tensors_per_gpu(m, ranges, cfg)
    dp_exposed = _dp_time(cluster, cfg, feat, params, fbw[-1][1] + fbw[-1][2],
                          max(sum(row) for row in fbw), num_mb,
                          max(len(r) for r in ranges) * cfg.virtual_stages)
    # The gradients' way into DataParallel's buckets (any dp): the first micro-batch's copied
    # into its bucket view, each later one's added there by autograd (one add per parameter
    # tensor); fp32 main gradients are zeroed, then every micro-batch's is added into them.
    passes = (1 + num_mb * ACCUMULATE_PASSES) if feat.main_grads else \
        BUCKET_COPY_PASSES + (num_mb - 1) * ACCUMULATE_PASSES
    accumulate = slow * hw.memory_time(passes * params * feat.grad_bytes, num_mb * tensors)
    # Adam reads weight, gradient and both moments and writes three; clipping reads the grads.
    # Multi-tensor kernels on a GPU; off CUDA torch's foreach ops loop over the tensors.
    kernels = GPU_OPTIMIZER_KERNELS if hw.kind != "cpu" else CPU_OPTIMIZER_OPS_PER_TENSOR * tensors
    optimizer = slow * hw.memory_time(params / (shard_size(cfg) if cfg.zero else 1)
                                      * OPTIMIZER_STEP_BYTES, kernels)
    step = sim.step_time + accumulate + dp_exposed + optimizer + _step_collectives(cluster, cfg)
    step += _tied_time(work, cluster, cfg, feat) + _replicated_time(work, cluster, cfg, ranges)
    tokens = work.global_batch * work.seq_len
    model_flops = m.train_flops(work.seq_len, tokens, span=work.doc_span)
    hw_flops = m.train_flops(work.seq_len, tokens, cfg.recompute, work.doc_span)
    est = Estimate(
        config=cfg, step_time_s=step, tflops_per_gpu=model_flops / step / cluster.gpus / 1e12,
        hw_tflops_per_gpu=hw_flops / step / cluster.gpus / 1e12,
        mfu=model_flops / step / (cluster.gpus * hw.peak_flops),
        memory_gb_per_gpu=mem["total"], tokens_per_s=work.global_batch * work.seq_len / step,
        bubble_fraction=sim.bubble_fraction, compute_s=max(sim.busy),
        tp_exposed_s=tp_exposed * num_mb, cp_exposed_s=cp_exposed * num_mb,
        dp_exposed_s=dp_exposed, optimizer_s=optimizer,
        grad_accumulation_s=accumulate,
        p2p_s=p2p, memory={k: v for k, v in mem.items() if k != "params_per_gpu"})
    if mem["total"] > hw.hbm_gb:
        est.fits = False
        parts = ", ".join(f"{k} {v:.1f}" for k, v in est.memory.items() if k != "total")
        est.reason = (f"needs {mem['total']:.1f} GB per GPU, more than the {hw.hbm_gb:g} GB of "
                      f"{hw.name} ({parts})")
    return est


# The schedules whose backward is split into input and weight gradients (B and W).
SPLIT_SCHEDULES = ("zb-h1", "zb-v", "dualpipe-v")


def stages_on(cfg: ParallelConfig, rank: int) -> list[int]:
    """The model stages pipeline rank ``rank`` holds under ``cfg.schedule``'s placement
    (``s % pp == rank`` looped; stages ``rank`` and ``2 pp - 1 - rank`` in a V)."""
    placement = PLACEMENT.get(cfg.schedule, "loop") if cfg.pp > 1 else "loop"
    return [s for s in range(cfg.pp * cfg.virtual_stages)
            if rank_of(placement, cfg.pp, s)[0] == rank]


def _tensors_per_gpu(m: GPTConfig, ranges, cfg: ParallelConfig) -> int:
    """Parameter tensors on the fullest pipeline rank (weights and biases)."""
    per_layer = (2 if m.norm == "layernorm" else 1) * 2 \
        + (5 + (1 if m.activation == "swiglu" else 0) + 2) * (2 if m.bias else 1)
    layers = max(sum(len(ranges[s]) for s in stages_on(cfg, r)) for r in range(cfg.pp))
    return layers * per_layer + 3


def _tied_time(work: Workload, cluster: Cluster, cfg: ParallelConfig, feat: Features) -> float:
    """Tied embeddings under a pipeline (fastpar/pipeline/tied.py): once a step, after the DP
    reduction, the first and the last stage sum the embedding's gradient (its 1/tp rows; under
    ZeRO each rank's shard of it) in one all-reduce of two ranks, pp - 1 stages apart."""
    m = work.model
    if cfg.pp == 1 or not m.tie_embeddings:
        return 0.0
    n = m.padded_vocab * m.d_model / cfg.tp / (shard_size(cfg) if cfg.zero else 1)
    world = cfg.tp * cfg.cp * cfg.pp * (cfg.dp or 1)
    return cost.collective_time("all_reduce", n * feat.reduce_bytes, 2,
                                cluster.link_gbps(world), cluster.hardware)


def _replicated_time(work: Workload, cluster: Cluster, cfg: ParallelConfig, ranges) -> float:
    """Under sequence parallelism, once a step: the parameters each TP rank holds whole but
    trains on its own tokens (the norms, the row linears' biases, learned positions, and an MoE
    layer's router and experts, the experts not when folded into ep) have partial gradients,
    summed over TP in one all-reduce of one fp32 buffer (``reduce_replicated_grads``: copied
    in, reduced, copied back). The rank with the most layers."""
    t, m = cfg.tp, work.model
    if t == 1 or not cfg.sequence_parallel:
        return 0.0
    per_layer = m.replicated_layer_params() + m.moe_params(cfg.ep) - (
        m.routed_expert_params() // cfg.ep if cfg.ep_fold_tp else 0)
    layers = max(len(r) for r in ranges) * cfg.virtual_stages
    n = layers * per_layer + m.d_model * (2 if m.norm == "layernorm" else 1)
    n += 0 if m.rotary else m.max_seq_len * m.d_model
    hw, nbytes = cluster.hardware, 4 * n
    return cost.collective_time("all_reduce", nbytes, t, cluster.link_gbps(t), hw) + \
        hw.memory_time(4 * nbytes, 2)


def _step_collectives(cluster: Cluster, cfg: ParallelConfig) -> float:
    """The trainer's small all-reduces once a step: the loss over PP and DP, the gradient norm's
    square over TP and PP (over DP too with ZeRO-1), the non-finite check over all ranks. Each
    is latency only."""
    hw = cluster.hardware

    def ar(n, span):
        return cost.collective_time("all_reduce", 8, n, cluster.link_gbps(span), hw)
    world = cfg.tp * cfg.cp * cfg.pp * cfg.dp
    total = ar(cfg.pp, world) + ar(cfg.dp * cfg.cp, cfg.tp * cfg.cp * cfg.dp)     # the loss
    total += ar(cfg.tp, cfg.tp) + ar(cfg.pp, world)                  # the gradient norm
    total += ar(shard_size(cfg), cfg.tp * cfg.cp * cfg.dp) if cfg.zero else 0.0
    return total + ar(world, world)                                  # the non-finite check


def _peak_lower_bound(cfg: ParallelConfig, num_mb: int) -> int:
    """Fewest micro-batch chunks rank 0 holds at once under ``cfg.schedule`` (its warm-up plus
    one; the interleaved micro-batches without a pipeline); the real schedule's count is
    checked when the configuration is evaluated."""
    pp, v = cfg.pp, cfg.virtual_stages
    if pp == 1:
        return min(cfg.interleave, num_mb)
    if cfg.schedule == "gpipe":
        return num_mb
    if cfg.schedule == "interleaved":
        return min(num_mb * v, (pp - 1) * 2 + (v - 1) * pp + 1)
    if PLACEMENT.get(cfg.schedule) == "v":      # 2 pp - 1 warm-up forwards of chunk 0 (as
        return min(2 * pp - 1, num_mb) + 1      # many as there are), then chunk 1's first
    return min(pp, num_mb)


def _step_lower_bound(fbw, pp: int, num_mb: int, split: bool, stages=None) -> float:
    """Seconds no schedule of these per-stage (F, B, W) costs can beat (stage ``s`` on rank
    ``s % pp``), communication taken as free. Every rank ``r`` runs all its work, ``num_mb``
    times its stages' F + B + W, one action at a time; it cannot start before the first
    forward has passed the ``r`` stages before it, and after its last backward the backward
    of the ``r`` stages below it is still to come. Without a split-off W a rank's last action
    is that backward (costing B + W); with one, only the W work can follow it."""
    best = 0.0
    for r in range(pp):     # ``stages[r]``: rank r's stages (default looped; its first: r)
        mine = fbw[r::pp] if stages is None else [fbw[i] for i in stages[r]]
        work = num_mb * sum(sum(row) for row in mine)
        head = sum(row[0] for row in fbw[:r])
        if split:
            tail = max(0.0, sum(row[1] for row in fbw[:r]) - num_mb * sum(row[2] for row in mine))
        else:
            tail = sum(row[1] + row[2] for row in fbw[:r])
        best = max(best, head + work + tail)
    return best


def candidates(work: Workload, cluster: Cluster, fixed: dict | None = None):
    """Every configuration that can run, TP inside a node; ``fixed`` pins fields by name."""
    fixed = fixed or {}
    m, cp = work.model, fixed.get("cp", 1)      # context parallelism only when asked for
    gpus = cluster.gpus // cp if cluster.gpus % cp == 0 else 0
    pow2 = [2 ** i for i in range(12)]
    for tp in [x for x in pow2 if x <= cluster.gpus_per_node and gpus and gpus % x == 0]:
        for pp in [x for x in range(1, m.n_layers + 1) if (gpus // tp) % x == 0]:
            dp = gpus // (tp * pp)
            for mbs in [x for x in pow2 if x <= 16 and work.global_batch % (x * dp) == 0]:
                scheds = [("1f1b", 1)] if pp == 1 else \
                    [("1f1b", 1), ("zb-h1", 1), ("gpipe", 1)] + \
                    [("zb-v", 2)] * (2 * pp <= m.n_layers) + \
                    [("dualpipe-v", 2)] * (2 * pp <= m.n_layers and
                                           work.global_batch // (mbs * dp) >= 2 * pp) + \
                    [("interleaved", v) for v in (2, 3, 4, 5, 6, 8) if pp * v <= m.n_layers]
                for name, v in scheds:
                    for rec in RECOMPUTE:
                        for sp in ((False, True) if tp > 1 else (False,)):
                            for zero in ((0, 1, 2, 3) if dp > 1 else (0,)):
                                cfg = ParallelConfig(tp, pp, dp, v, mbs, name, rec, sp, zero,
                                                     cp)
                                if zero == 2 and not grads_apart(cfg, work):
                                    continue        # ZeRO-1's time and memory, to the byte
                                node = cluster.gpus_per_node // (tp * cp)   # dp ranks
                                if zero == 3 and node * cp > 1 and 1 <= node < dp and \
                                        dp % node == 0:
                                    hsdp = dataclasses.replace(cfg, dp_shard=node)
                                    if all(getattr(hsdp, k) == val for k, val in fixed.items()):
                                        try:
                                            check(hsdp, work, cluster)
                                            yield hsdp
                                        except ValueError:
                                            pass
                                # Interleaved pairs of micro-batches where they hide
                                # something (cfg.check refuses them elsewhere); the experts
                                # split over ep dp ranks (the default two chunks), or under
                                # SP over whole TP groups of them (TP folded into ep).
                                eps = [(e, False) for e in pow2 if e <= dp * cp and
                                       (dp * cp) % e == 0 and m.n_experts % e == 0] \
                                    if m.n_experts else [(1, False)]
                                if m.n_experts and sp:
                                    eps += [(tp * e, True) for e, _ in eps
                                            if m.n_experts % (tp * e) == 0]
                                for il, (ep, fold) in itertools.product(
                                        (1, 2) if tp > 1 and pp == 1 else (1,), eps):
                                    one = dataclasses.replace(cfg, interleave=il, ep=ep,
                                                              ep_fold_tp=fold)
                                    if any(getattr(one, k) != val for k, val in fixed.items()):
                                        continue
                                    try:
                                        check(one, work, cluster)
                                    except ValueError:
                                        continue
                                    yield one


def search(work: Workload, cluster: Cluster, feat: Features = FASTPAR, fixed: dict | None = None,
           top: int = 10) -> tuple[list[Estimate], dict]:
    """The ``top`` fastest configurations that fit, best first, and what was rejected:
    ``rejected["memory"]`` counts the configurations that do not fit in memory and
    ``rejected["smallest"]`` is the :class:`Estimate` (``fits=False``, its ``memory`` the
    breakdown) of the one among them that needs the least memory, or None if none was
    rejected. Branch and bound: candidates are visited by a lower bound on their step time
    (:func:`_step_lower_bound`) and the search stops once that bound reaches the ``top``-th
    best step found; configurations whose memory cannot fit even at the fewest live
    micro-batches their schedule allows are rejected without simulating. Both bounds hold for
    every candidate, so the result is what evaluating every candidate gives (tested)."""
    bounds, rejected, cache = [], {"memory": 0, "smallest": None}, {}
    too_big = []            # (memory lower bound, cfg, ranges) of each configuration rejected
    limit = cluster.hardware.hbm_gb
    for cfg in candidates(work, cluster, fixed):
        key = _cache_key(cfg)
        if key not in cache:
            fbw, ranges = _stage_costs(work, cluster, cfg, feat, key[-1])[:2]
            cache[key] = fbw, ranges
        fbw, ranges = cache[key]
        num_mb = cfg.num_microbatches(work.global_batch)
        peaks = [((_peak_lower_bound(cfg, num_mb), 0),)] + [((0, 0),)] * (cfg.pp - 1)
        need = _memory(work, cluster, cfg, feat, ranges, peaks)["total"]
        if need > limit:
            rejected["memory"] += 1
            too_big.append((need, cfg, ranges))
            continue
        bounds.append((_step_lower_bound(fbw, cfg.pp, num_mb, key[-1],
                                         [stages_on(cfg, r) for r in range(cfg.pp)]), cfg))
    bounds.sort(key=lambda x: x[0])
    found: list[Estimate] = []
    schedules: dict = {}
    for i, (bound, cfg) in enumerate(bounds):
        if len(found) >= top and bound >= found[top - 1].step_time_s:
            # Too slow to rank, but still counted if it does not fit: its memory at its
            # schedule's own peak (no simulation of its step).
            for _, rest in bounds[i:]:
                need = _memory(work, cluster, rest, feat, cache[_cache_key(rest)][1],
                               schedule_peaks(rest, work, _schedule(rest, work,
                                                                    schedules)))["total"]
                if need > limit:
                    rejected["memory"] += 1
                    too_big.append((need, rest, None))
            break
        est = evaluate(work, cluster, cfg, feat, schedules)
        if not est.fits:
            rejected["memory"] += 1
            too_big.append((est.memory_gb_per_gpu, cfg, None))
            continue
        found.append(est)
        found.sort(key=lambda e: (e.step_time_s, e.memory_gb_per_gpu))
    rejected["smallest"] = _smallest_need(work, cluster, feat, too_big, schedules)
    return found[:top], rejected


def _smallest_need(work, cluster, feat, too_big, schedules) -> Estimate | None:
    """The :func:`evaluate` of the rejected configuration that needs the least memory. Each
    entry's first number is a lower bound of its need (or the need itself), so they are
    visited in its order and the visit stops once it exceeds the least need found."""
    best = None
    for bound, cfg, ranges in sorted(too_big, key=lambda x: x[0]):
        if best is not None and bound >= best[0]:
            break
        if ranges is None:                          # evaluated: ``bound`` is its need
            need = bound
        else:
            key = (cfg.schedule, cfg.pp, cfg.num_microbatches(work.global_batch),
                   cfg.virtual_stages)
            if key not in schedules:
                schedules[key] = build_schedule(*key)
            need = _memory(work, cluster, cfg, feat, ranges,
                           schedule_peaks(cfg, work, schedules[key]))["total"]
        if best is None or need < best[0]:
            best = (need, cfg)
    return None if best is None else evaluate(work, cluster, best[1], feat, schedules)
