"""The expert-parallel peer as the installed torchtitan (0.3.0) builds it: its own MoE layer
(``TokenChoiceTopKRouter``, ``GroupedExperts`` on ``torch._grouped_mm``, the
``AllToAllTokenDispatcher``), its own MoE sharding plan and its expert-parallel mesh.

``build_step(gpt, ep_group_size=2, backend="spmd_types")`` takes a fastpar MoE GPT built at ep=1
(every expert held: RMSNorm, rotary, no biases, untied head, SwiGLU experts) and returns
``step(tokens, targets) -> loss`` (float) for the same network in torchtitan's hands, on every
rank of the default gloo group, each rank with its own batch (what bench/bench_moe.py times:
one forward and backward, no optimizer step, no data-parallel reduction; the gradients are
dropped after each step, as there):

  model   ``Qwen3Model.Config`` of ``Qwen3TransformerBlock``s, each with torchtitan's ``MoE``
          (the Qwen3-MoE layer builder's choices: ``score_func="softmax"``, ``route_norm`` =
          the GPT's ``moe_norm_topk``, the "standard" all-to-all dispatcher), at the GPT's
          shape; no q/k norm (fastpar has none), ``CosSinRoPE`` (rotate-half, fastpar's
          layout: no permutation of the query/key rows), SDPA as inner attention, no
          auxiliary-loss-free bias (``load_balance_coeff=None``: fastpar's ``moe_bias_rate``
          0). The GPT's weights loaded into it (``_titan_state``).
  plan    ``set_qwen3_sharding_config(config, enable_sp=False, enable_ep=True)`` then
          ``model.parallelize(ParallelDims(dp_shard=world, ep=ep_group_size, ...))``: what
          ``parallelize_qwen3`` does before FSDP (not applied here). The routed experts'
          ``w1/w2/w3`` are sharded on the expert dimension over the ``ep`` mesh axis (rank r
          holds experts [r E/ep, (r+1) E/ep), as fastpar's ep shards); the token counts are
          exchanged by one all-to-all, then the rows by ``all_to_all_single`` (functional
          collectives, or spmd_types' ``all_to_all``) each way.
  loss    ``CrossEntropyLoss`` (sum over tokens) divided by this rank's token count: each
          rank's own mean, as fastpar's ``GPT(x, y)``.

What torchtitan needs to run on CPU: as bench/titan_real.py (``_cpu_ready``: its
``device_type`` set to "cpu", the ``fake`` process-group backend registered).
``GroupedExperts`` casts to bf16 and calls ``torch._grouped_mm``, which this torch runs on CPU
(forward and backward). Under the ``spmd_types`` backend (torchtitan's default) one patch, to
spmd_types rather than torchtitan: its uneven all-to-all is a list ``dist.all_to_all``, which
gloo refuses for unequal chunks; on gloo groups it is made ``dist.all_to_all_single`` with the
same splits (``_gloo_uneven_all_to_all``). ``partial_dtensor`` needs no patch (its dispatcher
calls the functional ``all_to_all_single``). Both give the same losses and gradients.

Semantic differences from fastpar's MoE (``fastpar.models.moe``):
  - the auxiliary load-balancing loss: torchtitan has none (its balancing is the
    auxiliary-loss-free bias, off here). fastpar's (``moe_aux_loss``) leaves the forward
    loss unchanged (it enters through the backward only), so losses compare, the gradients
    differ by the aux term.
  - precision: torchtitan's experts compute in bf16 (inputs and weights cast, outputs cast
    back to fp32); fastpar's CPU path computes them in fp32. Measured: first losses within
    2e-4 relative; gradients (aux loss off) within ~1e-1 of the largest entry, all of it
    the bf16 (with torchtitan's experts patched to fp32, 1e-6). So the times compare bf16
    expert GEMMs against fastpar's fp32 ones on CPU.
  - routing: the same (softmax over the fp32 logits of ``x W_r^T``, top-k, the picked
    probabilities renormalised, weights applied to the experts' outputs before the sum);
    torchtitan's top-k is unsorted (the same set), its renormalisation adds 1e-20 to the
    denominator, and it scales in fp32 then casts (fp32 here anyway).
  - dispatch: torchtitan sends all rows at once (one all-to-all each way, blocking): the
    peer of fastpar's ``ep_chunks=1``, not of its chunked overlap.

    python bench/titan_moe.py [--batch 2] [--seq 512]

runs the smoke check: 2 gloo ranks, ep=2, each on its own batch (bench_moe's), the first loss
of torchtitan's model against fastpar's single-process GPT on the same batch (within ``--tol``,
relative: bf16 experts), then the time of 3 steps (the slower rank's, per step), beside
fastpar's ep=2 (``ep_chunks`` 1 and 2) at the same shape.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
import warnings

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from titan_real import _cpu_ready, _rows  # noqa: E402

BACKENDS = ("spmd_types", "partial_dtensor")


def _gloo_uneven_all_to_all() -> None:
    """Under ``spmd_types`` the dispatcher's row exchange is ``spmd.all_to_all`` with split
    sizes, which spmd_types runs as ``dist.all_to_all`` over a list of per-rank chunks; gloo's
    list all-to-all takes equal chunks only ("ProcessGroupGloo::alltoall: invalid tensor size
    at index 1"). On a gloo group the same exchange is made by ``dist.all_to_all_single`` with
    the splits (gloo's alltoallv; what the ``partial_dtensor`` backend calls): the same rows,
    one collective as before. Other backends keep spmd_types' own code."""
    from spmd_types import _collectives as sc

    cls = sc._AllToAllUneven
    if getattr(cls, "_gloo_single", False):
        return
    original = cls.forward

    def forward(ctx, x, axis, output_split_sizes, input_split_sizes, dtype_options):
        if dist.get_backend(axis) != "gloo":
            return original(ctx, x, axis, output_split_sizes, input_split_sizes, dtype_options)
        ctx.axis, ctx.backward_options = axis, dtype_options.backward_options
        x = sc._apply_op_dtype(x, dtype_options.op_dtype)
        even = [x.shape[0] // dist.get_world_size(axis)] * dist.get_world_size(axis)
        ctx.output_split_sizes = output_split_sizes = output_split_sizes or even
        ctx.input_split_sizes = input_split_sizes = input_split_sizes or even
        out = x.new_empty([sum(output_split_sizes), *x.shape[1:]])
        dist.all_to_all_single(out, x.contiguous(), output_split_sizes, input_split_sizes,
                               group=axis)
        return sc._apply_out_dtype(out, dtype_options.out_dtype)

    cls.forward = staticmethod(forward)
    cls._gloo_single = True


def _moe_config(c, enable_ep: bool):
    """torchtitan's Qwen3 MoE config at the GPT's shape, sharded by its own plan."""
    from torchtitan.models.common import CosSinRoPE, Embedding, Linear, RMSNorm
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.common.config_utils import (make_gqa_config, make_moe_config,
                                                       make_routed_experts_config,
                                                       make_router_config)
    from torchtitan.models.qwen3 import Qwen3Model
    from torchtitan.models.qwen3.model import Qwen3TransformerBlock
    from torchtitan.models.qwen3.sharding import set_qwen3_sharding_config

    V, D, E, K, F = c.padded_vocab, c.d_model, c.n_experts, c.moe_top_k, c.expert_ffn
    hd = c.head_dim

    def norm(n):
        return RMSNorm.Config(normalized_shape=n, eps=c.norm_eps)

    layers = []
    for _ in range(c.n_layers):
        attention = make_gqa_config(
            dim=D, n_heads=c.n_heads, n_kv_heads=c.kv_heads, head_dim=hd,
            wqkv_param_init={}, wo_param_init={}, fuse_qkv=True, qk_norm=None,
            # flex attention has no CPU backward: torchtitan's SDPA module (causal)
            inner_attention=ScaledDotProductAttention.Config(),
            rope=CosSinRoPE.Config(dim=hd, max_seq_len=c.max_seq_len, theta=c.rotary_base))
        moe = make_moe_config(
            num_experts=E, load_balance_coeff=None,
            router=make_router_config(dim=D, num_experts=E, gate_param_init={}, top_k=K,
                                      score_func="softmax", route_norm=c.moe_norm_topk),
            routed_experts=make_routed_experts_config(dim=D, hidden_dim=F, num_experts=E,
                                                      top_k=K, param_init={},
                                                      comm_backend="standard"))
        layers.append(Qwen3TransformerBlock.Config(attention_norm=norm(D), ffn_norm=norm(D),
                                                   attention=attention, moe=moe))
    config = Qwen3Model.Config(
        dim=D, vocab_size=V, layers=layers, enable_weight_tying=False,
        tok_embeddings=Embedding.Config(num_embeddings=V, embedding_dim=D),
        norm=norm(D), lm_head=Linear.Config(in_features=D, out_features=V))
    set_qwen3_sharding_config(config, enable_sp=False, enable_ep=enable_ep)
    return config


@torch.no_grad()
def _titan_state(gpt) -> dict[str, torch.Tensor]:
    """The GPT's weights under torchtitan's names and layouts: fused ``wqkv`` as
    (kv heads, q heads per kv + 2, head_dim, D) rows; the experts' ``gate_up`` (E, 2F, D)
    split into ``w1_EFD`` (gate) and ``w3_EFD`` (up), ``down`` (E, D, F) as ``w2_EDF``."""
    c = gpt.config
    hd, nkv, D, F = c.head_dim, c.kv_heads, c.d_model, c.expert_ffn
    state = {"tok_embeddings.weight": gpt.embed.weight, "lm_head.weight": gpt.head.weight,
             "norm.weight": gpt.norm.weight}
    for i, src in gpt.layers.items():
        q, k, v = _rows(src.attn.qkv)
        q = q.reshape(nkv, -1, hd, D)
        k, v = k.reshape(nkv, 1, hd, D), v.reshape(nkv, 1, hd, D)
        moe, p = src.mlp, f"layers.{i}."
        e = p + "moe.routed_experts.inner_experts."
        state |= {p + "attention.qkv_linear.wqkv.weight": torch.cat([q, k, v], 1).flatten(0, 2),
                  p + "attention.wo.weight": src.attn.o.weight,
                  p + "attention_norm.weight": src.norm1.weight,
                  p + "ffn_norm.weight": src.norm2.weight,
                  p + "moe.router.gate.weight": moe.router.weight,
                  e + "w1_EFD": moe.experts.gate_up[:, :F], e + "w3_EFD": moe.experts.gate_up[:, F:],
                  e + "w2_EDF": moe.experts.down}
    return {k: v.detach().clone().contiguous() for k, v in state.items()}


def _check_gpt(c, gpt, ep: int) -> None:
    bad = {k: v for k, v, ok in (
        ("norm", c.norm, c.norm == "rmsnorm"), ("rotary", c.rotary, c.rotary),
        ("bias", c.bias, not c.bias), ("tie_embeddings", c.tie_embeddings, not c.tie_embeddings),
        ("dropout", c.dropout, not c.dropout), ("n_experts", c.n_experts, c.n_experts >= 2),
        ("moe_shared_experts", c.moe_shared_experts, not c.moe_shared_experts),
        ("moe_capacity_factor", c.moe_capacity_factor, not c.moe_capacity_factor),
        ("moe_bias_rate", c.moe_bias_rate, not c.moe_bias_rate)) if not ok}
    if bad:
        raise ValueError(f"torchtitan's Qwen3 MoE mirrors dropless RMSNorm / rotary MoE GPTs "
                         f"without biases, tying, dropout, shared experts or the loss-free "
                         f"bias, not {bad}")
    held = next(iter(gpt.layers.values())).mlp.experts.n
    if held != c.n_experts:
        raise ValueError(f"build_step wants the GPT built at ep=1 (all {c.n_experts} experts "
                         f"held), this one holds {held}")
    if c.n_experts % ep:
        raise ValueError(f"ep={ep} must divide n_experts={c.n_experts}")


def build_step(gpt, ep_group_size: int = 2, backend: str = "spmd_types"):
    """``step(tokens (B, S), targets (B, S)) -> loss (float)`` of torchtitan's MoE model
    holding the weights of ``gpt`` (a fastpar MoE GPT at ep=1), its experts split over
    ``ep_group_size`` ranks of the default group (the whole group: each rank its own batch),
    see the module doc. One forward and backward; the gradients are dropped after it.
    ``step.model`` is the parallelized model, ``step.dims`` its ParallelDims."""
    import spmd_types as spmd
    from torchtitan.components.loss import IGNORE_INDEX, CrossEntropyLoss
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed import utils as dist_utils

    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} is not one of {BACKENDS}")
    c, world = gpt.config, dist.get_world_size()
    _check_gpt(c, gpt, ep_group_size)
    if world % ep_group_size:
        raise ValueError(f"ep={ep_group_size} must divide the world size {world}")
    device = gpt.embed.weight.device
    _cpu_ready(device.type)
    dist_utils.set_spmd_backend(backend)
    if backend == "spmd_types":
        _gloo_uneven_all_to_all()
    # torchtitan's EP borrows its ranks from dp_shard * cp * tp: every rank a data-parallel
    # rank with its own batch (no FSDP applied, no gradient reduction: bench_moe's step).
    dims = ParallelDims(dp_replicate=1, dp_shard=world, cp=1, tp=1, pp=1, ep=ep_group_size,
                        world_size=world, spmd_backend=backend)
    dims.build_mesh()
    context = dist_utils.get_spmd_context(parallel_dims=dims)

    config = _moe_config(c, enable_ep=ep_group_size > 1)
    with torch.device(device):
        model = config.build()
    model.load_state_dict(_titan_state(gpt), strict=True)
    with context():
        model.parallelize(dims)
    model.train()
    loss_fn = CrossEntropyLoss.Config(global_vocab_size=c.padded_vocab).build()

    def step(tokens, targets):
        """One forward and backward of this rank's batch; its mean loss over the targets that
        are not IGNORE_INDEX."""
        count = (targets != IGNORE_INDEX).sum().clamp(min=1)
        with context():
            pred = model(tokens)
            loss, _ = loss_fn(pred, targets, count)
            with spmd.no_typecheck():
                loss.backward()
        model.zero_grad(set_to_none=True)
        loss = loss.detach()
        return float(loss.full_tensor() if hasattr(loss, "full_tensor") else loss)
    step.model, step.dims = model, dims
    return step


# -- smoke check: 2 gloo ranks against fastpar's single-process GPT ----------------------------
def _config(seq: int):
    from fastpar.models import GPTConfig
    return GPTConfig(vocab_size=256, n_layers=4, d_model=256, n_heads=8, max_seq_len=seq,
                     n_experts=8, moe_top_k=2, moe_ffn=512, moe_aux_loss=0.01)   # bench_moe's


def _batch(c, rank: int, batch: int, seq: int):
    g = torch.Generator().manual_seed(rank)     # bench_moe's batch of this rank
    tokens = torch.randint(0, c.vocab_size, (batch, seq + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def _reference(batch: int, seq: int) -> list[float]:
    """fastpar's GPT, one process, ep=1: the loss of each rank's batch."""
    from fastpar.models import GPT
    c = _config(seq)
    gpt = GPT(c)
    with torch.no_grad():
        return [gpt(*_batch(c, r, batch, seq)).item() for r in range(2)]


def _timed(step, x, y, n: int = 3) -> list[float]:
    times = []
    for _ in range(n):
        dist.barrier()
        t0 = time.perf_counter()
        step(x, y)
        times.append(time.perf_counter() - t0)
    return times


def _rank_check(rank, world, batch, seq, backend, fastpar_peers):
    """This rank's first torchtitan loss and the times of 3 steps (after one warm-up);
    fastpar's ep=2 the same way with ``ep_chunks`` in ``fastpar_peers``."""
    from fastpar.models import GPT

    torch.set_num_threads(1)                    # 2 ranks on 2 cores, as bench_moe
    warnings.filterwarnings("ignore", category=FutureWarning)  # c10d's renamed collectives
    # the router's autocast to fp32 (a no-op on CPU: the gate is fp32 already)
    warnings.filterwarnings("ignore", message="In CPU autocast, but the target dtype")
    c = _config(seq)
    x, y = _batch(c, rank, batch, seq)
    step = build_step(GPT(c), 2, backend)
    experts = [tuple(p.to_local().shape if hasattr(p, "to_local") else p.shape)
               for n, p in step.model.named_parameters() if n.endswith("w1_EFD")][0]
    out = {"loss": step(x, y), "experts": experts}
    out["titan"] = _timed(step, x, y)
    for chunks in fastpar_peers:
        torch.manual_seed(0)
        model = GPT(c, ep_group=dist.group.WORLD, ep_chunks=chunks)

        def fp_step(x, y, model=model):
            loss = model(x, y)
            loss.backward()
            model.zero_grad(set_to_none=True)
            return loss.item()
        out[f"fastpar ep_chunks={chunks} loss"] = fp_step(x, y)
        out[f"fastpar ep_chunks={chunks}"] = _timed(fp_step, x, y)
    return out


def main():
    from fastpar.testing import run_ranks

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--tol", type=float, default=2e-2, help="relative, on the first loss")
    ap.add_argument("--backend", default="spmd_types", choices=BACKENDS)
    ap.add_argument("--fastpar-chunks", type=int, nargs="*", default=[1, 2],
                    help="fastpar ep=2 peers timed beside it (ep_chunks); none: skip")
    args = ap.parse_args()
    ref = _reference(args.batch, args.seq)
    print(f"bench_moe's MoE GPT (4 blocks, d 256, 8 experts of 512, top 2), "
          f"{args.batch} x {args.seq} tokens per rank; fastpar (1 process) losses "
          + ", ".join(f"rank {r} {v:.6f}" for r, v in enumerate(ref)))
    out = run_ranks(_rank_check, 2, args.batch, args.seq, args.backend, args.fastpar_chunks,
                    timeout=600)
    failed = []
    for r, o in enumerate(out):
        rel = abs(o["loss"] - ref[r]) / abs(ref[r])
        ok = rel <= args.tol and o["experts"][0] == _config(args.seq).n_experts // 2
        failed += [] if ok else [r]
        print(f"torchtitan ep=2 ({args.backend}) rank {r}: loss {o['loss']:.6f} (relative "
              f"diff {rel:.1e}) {'ok' if ok else 'MISMATCH'}; w1 per rank {o['experts']}")
        for chunks in args.fastpar_chunks:
            fl = o[f"fastpar ep_chunks={chunks} loss"]
            print(f"  fastpar ep=2 ep_chunks={chunks} rank {r}: loss {fl:.6f} (diff "
                  f"{fl - ref[r]:+.1e})")
    for name in ["titan"] + [f"fastpar ep_chunks={k}" for k in args.fastpar_chunks]:
        ms = [1e3 * max(o[name][i] for o in out) for i in range(3)]
        label = "torchtitan ep=2" if name == "titan" else name.replace("fastpar", "fastpar ep=2")
        print(f"{label:28s} step ms " + " ".join(f"{t:.1f}" for t in ms))
    if failed:
        raise SystemExit(f"torchtitan's loss differs from fastpar's beyond {args.tol:g} "
                         f"(relative) on ranks {failed}")


if __name__ == "__main__":
    main()
