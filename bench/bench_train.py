"""Training step of the GPT presets per layout (dp2, tp2, pp2): fastpar's trainer against the same
layout built from torch's own parts, tokens/s and step-time ratio in one run.

    flock /tmp/fastpar-bench.lock python bench/bench_train.py [--models tiny small]
        [--small-layers 4] [--batch 8] [--micro 2] [--seq 128] [--rounds 5] [--iters 2]

One step = what ``fastpar.train`` does per step minus its logging, LR schedule, watchdog and
non-finite guard: forward and backward of the global batch in micro-batches, gradient sync, the
loss all-reduce over DP, clipping by the true global gradient norm, AdamW (fp32, fused). Every
variant starts from the same weights and sees the same batch; the losses of the two warm-up steps
(the second one after an optimizer step, so it checks the gradients too) must agree across all
variants, or the run stops.

  fastpar dp2   ``build_model`` (tp=1) and the trainer's ``_wrap`` / ``forward_backward`` / ``_clip``
  torch   dp2   the same GPT in DistributedDataParallel with gradient_as_bucket_view=True (no_sync
                on all but the last micro-batch;
                no buffer sync per forward: its only buffers are the constant rotary tables)
  fastpar tp2   ``build_model`` with the TP group (Column/RowParallelLinear, vocab-parallel
                embedding, head and cross-entropy), each micro-batch's forward inside the
                previous one's backward (the trainer's default, ``fb_overlap``)
  fastpar tp2-seq  the same, one micro-batch after another (``--no-fb-overlap``)
  fastpar tp2-il   the same, two micro-batches interleaved (``--interleave 2``)
  fastpar tp2-sp  the same with sequence parallelism (Megatron's 6 all-gathers + 4
                reduce-scatters per layer)
  torch   tp2[-sp]  the installed torchtitan 0.3.0 (bench/titan_real.py): its Llama3 with the
                same weights, its own TP plan (``set_llama3_sharding_config`` +
                ``Module.parallelize``), its vocabulary-parallel cross-entropy with gradient
                accumulation over the global token count, its clipping, fused AdamW; under
                ``--titan-backend`` spmd_types (its default) or partial_dtensor (DTensor), one
                backend per process (torchtitan sets it globally).
  fastpar pp2   the trainer's two stages in the PipelineExecutor, 1F1B
  torch   pp2   the same two stage modules in torch.distributed.pipelining PipelineStage +
                Schedule1F1B; the norm is summed over the stages by hand (torch has no helper)
Layouts that mix these torch parts (DDP with pipelining, DTensor TP inside pipeline stages) are
not measured: only the pure ones at world size 2.

TP bytes: one extra step of each TP variant under tests/wire.py's recorder (collectives of at
least 4 KiB), against ``megatron_tp_bytes``. The recorder sees the torch.distributed calls made
from Python; collectives DTensor issues from its dispatch may be missed (count from the
profiler for those).

Timing (bench/common.py's ``compare``): the variants (fastpar, the torch peer and a second
instance of the peer, an A/A control) of each layout in ``--layouts`` live in the same two ranks
and take turns round by round, the order rotated every round; each round runs a variant's
``--iters`` steps as one timed window, a barrier before it (a round's time the slowest rank's,
the median over ``--rounds`` rounds). tokens/s = global batch x seq / step; fastpar/torch is the
ratio of the two medians printed (lower is better), A/A the control's; GFLOP/s per rank uses the
trainer's 6N + 12 L d S per token.
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import os
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(1, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
import common  # noqa: E402

import fastpar  # noqa: E402
from fastpar.models import GPT  # noqa: E402
from fastpar.pipeline import PipelineExecutor, build_schedule  # noqa: E402
from fastpar.testing import run_ranks  # noqa: E402
from fastpar.train import TrainConfig  # noqa: E402
from wire import WireRecorder  # noqa: E402  (tests/wire.py)
from fastpar.train.step import forward_backward, loss_fn  # noqa: E402
from fastpar.train.trainer import _clip, _param_groups, _wrap, build_model  # noqa: E402

LAYOUTS = {"dp2": dict(dp=2), "tp2": dict(tp=2), "tp2-sp": dict(tp=2, sequence_parallel=True),
           "tp2-il": dict(tp=2, interleave=2),
           "tp2-seq": dict(tp=2, fb_overlap=False),
           "pp2": dict(pp=2)}


@dataclass(frozen=True)
class BenchConfig(TrainConfig):
    """TrainConfig with an optional layer count, for a reduced shape of a preset."""

    layers: int | None = None           # n_layers override; None = the preset's

    @property
    def model_config(self):
        mc = super().model_config
        return mc.replace(n_layers=self.layers) if self.layers else mc


def _adamw(cfg, chunks):
    return torch.optim.AdamW(_param_groups(chunks, cfg.weight_decay), lr=cfg.lr,
                             betas=(0.9, 0.95), eps=1e-8, fused=True)     # as the trainer


def _mean_loss(model, x, y, M, sync=None):
    """Forward + backward of M micro-batches; ``sync(last)`` gives the context for each."""
    total = torch.zeros(())
    for i, (xm, ym) in enumerate(zip(x.chunk(M), y.chunk(M))):
        with sync(i == M - 1) if sync else contextlib.nullcontext():
            loss = model(xm, ym) / M
            loss.backward()
        total += loss.detach()
    return total


def _finish(loss, group, dp, opt, params, norm_fn, max_norm):
    """The end of a trainer step: loss all-reduce, clip by the global norm, AdamW."""
    dist.all_reduce(loss, group=group)
    grads = [p.grad for p in params if p.grad is not None]
    torch.nn.utils.clip_grads_with_norm_(grads, max_norm, norm_fn(grads))
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.item() / dp


# -- fastpar: the trainer's own building blocks ------------------------------------------------
def fastpar_variant(cfg, mesh):
    chunks = build_model(cfg, mesh)
    dp = mesh.dp_size
    ddp, opt = _wrap(cfg, chunks, mesh)             # as the trainer: DataParallel + its optimizer
    M = cfg.num_microbatches(cfg.global_batch_size, dp)
    pipe = None
    if cfg.pp > 1:
        pipe = PipelineExecutor(chunks, build_schedule(cfg.schedule, cfg.pp, M), mesh.pp_group,
                                loss_fn=loss_fn(mesh.tp_group))

    def step(x, y):
        loss = forward_backward(chunks, ddp, pipe, x, y, M, mesh, interleave=cfg.interleave,
                                fb_overlap=cfg.fb_overlapped(M))
        dist.all_reduce(loss, group=mesh.dp_group)
        _clip(chunks, mesh, cfg.grad_clip, opt)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item() / dp
    return step


# -- torch: DDP, DTensor TP, torch.distributed.pipelining -------------------------------------
def torch_dp(cfg, mesh):
    model = GPT(cfg.model_config, device=mesh.device)
    ddp = DDP(model, process_group=mesh.dp_group, broadcast_buffers=False,
              gradient_as_bucket_view=True)
    opt, params = _adamw(cfg, [model]), list(model.parameters())
    M = cfg.num_microbatches(cfg.global_batch_size, mesh.dp_size)
    norm = torch.nn.utils.get_total_norm

    def step(x, y):
        loss = _mean_loss(ddp, x, y, M, lambda last: contextlib.nullcontext() if last
                          else ddp.no_sync())
        return _finish(loss, mesh.dp_group, mesh.dp_size, opt, params, norm, cfg.grad_clip)
    return step


def torch_tp(cfg, mesh, backend="spmd_types"):
    """The installed torchtitan (0.3.0): its Llama3 with the same weights, its own TP plan, its
    loss-parallel cross-entropy and clipping, under ``backend`` (bench/titan_real.py)."""
    import titan_real

    if mesh.dp_size > 1 or mesh.pp_size > 1:
        raise ValueError("the torchtitan peer is tensor parallel over the whole world only")
    return titan_real.build_step(GPT(cfg.model_config, device=mesh.device),
                                 cfg.sequence_parallel, backend, lr=cfg.lr,
                                 weight_decay=cfg.weight_decay, max_norm=cfg.grad_clip,
                                 micro_batches=cfg.num_microbatches(cfg.global_batch_size, 1))


def torch_pp(cfg, mesh):
    from torch.distributed import pipelining

    chunks = build_model(cfg, mesh)
    stage = pipelining.PipelineStage(chunks[0], mesh.pp_rank,
                                     cfg.pp, mesh.device, group=mesh.pp_group)
    M = cfg.num_microbatches(cfg.global_batch_size, mesh.dp_size)
    sched = pipelining.Schedule1F1B(stage, n_microbatches=M, loss_fn=loss_fn(mesh.tp_group))
    opt, params = _adamw(cfg, chunks), [p for c in chunks for p in c.parameters()]
    first, last = mesh.pp_rank == 0, mesh.pp_rank == cfg.pp - 1

    def norm(grads):
        sq = torch.nn.utils.get_total_norm(grads).square()
        dist.all_reduce(sq, group=mesh.pp_group)
        return sq.sqrt()

    def step(x, y):
        losses = []
        if first:
            sched.step(x)
        else:
            sched.step(target=y, losses=losses)
        loss = torch.stack(losses).mean() if last else torch.zeros(())
        dist.all_reduce(loss, group=mesh.pp_group)     # only the last stage holds it
        return _finish(loss, mesh.dp_group, mesh.dp_size, opt, params, norm, cfg.grad_clip)
    return step


TORCH = {"dp2": torch_dp, "tp2": torch_tp, "tp2-sp": torch_tp, "pp2": torch_pp}


def _peer_layout(name: str) -> str:
    """The layout whose torch step is ``name``'s peer: ``tp2-il`` (fastpar's interleaved
    micro-batches) and ``tp2-seq`` (its micro-batches one after another, ``--no-fb-overlap``),
    options of the same layout, are measured against torch's ``tp2``."""
    return name.removesuffix("-il").removesuffix("-seq")


def _measure(rank, world_size, a, model):
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // world_size))
    base = dict(model=model, global_batch_size=a.batch, micro_batch_size=a.micro, seq_len=a.seq,
                layers=a.small_layers if model == "small" else None)
    mc = BenchConfig(**base).model_config
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, mc.vocab_size, (a.batch, a.seq), generator=g)
    y = torch.randint(0, mc.vocab_size, (a.batch, a.seq), generator=g)
    variants, shares = {}, {}
    for name in a.layouts:
        dims = LAYOUTS[name]
        cfg = BenchConfig(**base, **dims)
        mesh = fastpar.init(layout=cfg.check_layout(world_size))
        shares[name] = x.chunk(mesh.dp_size)[mesh.dp_rank], y.chunk(mesh.dp_size)[mesh.dp_rank]
        variants[f"fastpar {name}"] = fastpar_variant(cfg, mesh)
        of = _peer_layout(name)             # an option of fastpar's: the same layout's peer
        shares[of] = shares[name]
        if f"torch {of}" in variants:
            continue
        peer = functools.partial(TORCH[of], backend=a.titan_backend) \
            if name.startswith("tp") else TORCH[of]
        variants[f"torch {of}"] = peer(cfg, mesh)
        variants[f"torch-aa {of}"] = peer(cfg, mesh)   # A/A: the peer against itself
    layout = {key: key.split()[1] for key in variants}

    losses = {key: [step(*shares[layout[key]]) for _ in range(2)]
              for key, step in variants.items()}
    ref = losses[f"fastpar {a.layouts[0]}"]
    for key, got in losses.items():                 # the same math in every variant
        for s, (l, r) in enumerate(zip(got, ref)):
            assert abs(l - r) <= 1e-4 * abs(r), f"{key} loss {l} at warm-up step {s} != {r}"
    wire = {}
    for key, step in variants.items():           # TP bytes of one step, outside the timing
        if not key.startswith("torch-aa") and layout[key].startswith("tp"):
            with WireRecorder() as rec:
                step(*shares[layout[key]])
            wire[key] = rec.summary(min_bytes=4096)
    # Each layout's fastpar and A/A control against torch's step of the same layout.
    result = common.compare(
        {key: (lambda step=step, key=key: step(*shares[layout[key]]))
         for key, step in variants.items()},
        f"torch {_peer_layout(a.layouts[0])}", torch.device("cpu"), a.rounds, a.iters,
        control=sorted({f"torch-aa {_peer_layout(name)}" for name in a.layouts}),
        peers={key: f"torch {_peer_layout(layout[key])}" for key in variants},
        barrier=dist.barrier)
    return result, ref, wire


def megatron_tp_bytes(mc, a, layout) -> int:
    """TP bytes of one step by Megatron's volumes, fp32 activations of S*B*H (B: a micro-batch):
    per layer and micro-batch 6 all-gathers + 4 reduce-scatters with SP, 4 all-reduces without;
    the vocab-parallel embedding (SP: 1 RS forward, 1 AG backward; else 1 AR) and the head
    (SP: 2 AG + 1 RS; else 1 AR of its input gradient); the loss's all-gather of 16 bytes per
    token and shard (4 fp32 statistics) is counted too. Collectives under 4 KiB (the loss
    scalar, the gradient norm) are left out, as in the recorded numbers."""
    if not layout.startswith("tp"):
        return 0
    tp, M = LAYOUTS[layout]["tp"], a.batch // a.micro
    act = a.seq * a.micro * mc.d_model * 4
    per_layer, ends = (10, 2 + 3) if "sp" in layout else (4, 1 + 1)
    loss = a.seq * a.micro * 16 * tp
    return M * ((per_layer * mc.n_layers + ends) * act + loss)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", default=["tiny", "small"])
    p.add_argument("--small-layers", type=int, default=None,
                   help="n_layers of the small preset (default: the preset's 8)")
    p.add_argument("--batch", type=int, default=8, help="global batch, sequences")
    p.add_argument("--micro", type=int, default=2, help="sequences per micro-batch")
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--iters", type=int, default=2)
    p.add_argument("--label", default="cpu", help="suffix of the results file")
    p.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    p.add_argument("--titan-backend", default="spmd_types",
                   choices=("spmd_types", "partial_dtensor"),
                   help="torchtitan's SPMD backend for the tp peers (one per process)")
    a = p.parse_args(argv)
    world, tokens = 2, a.batch * a.seq
    rows, comparisons = [], []
    for model in a.models:
        result, losses, wire = run_ranks(_measure, world, a, model, init_pg=False, timeout=3600)[0]
        mc = BenchConfig(model=model, seq_len=a.seq,
                         layers=a.small_layers if model == "small" else None).model_config
        flops = mc.train_flops(a.seq, tokens)
        shape = f"L{mc.n_layers} d{mc.d_model} h{mc.n_heads}"
        sec, ratio = result["median"], result["ratio"]
        comparisons.append({"key": model, **result})
        for name in a.layouts:
            peer = _peer_layout(name)
            f, t = sec[f"fastpar {name}"], sec[f"torch {peer}"]
            tp_bytes = {lib: sum(n for _, n in wire.get(f"{lib} {name if lib == 'fastpar' else peer}",
                                                      {}).values())
                        for lib in ("fastpar", "torch")}
            rows.append({"model": model, "shape": shape, "params_M": mc.num_params() / 1e6,
                         "fastpar_TP_MB": tp_bytes["fastpar"] / 1e6,
                         "torch_TP_MB": tp_bytes["torch"] / 1e6,
                         "megatron_TP_MB": megatron_tp_bytes(mc, a, name) / 1e6,
                         "wire": {"fastpar": wire.get(f"fastpar {name}"),
                                  "torch": wire.get(f"torch {peer}")},
                         "layout": name, "fastpar_ms": f * 1e3, "torch_ms": t * 1e3,
                         "fastpar_tok/s": tokens / f, "torch_tok/s": tokens / t,
                         "fastpar/torch": ratio[f"fastpar {name}"],
                         "A/A": ratio[f"torch-aa {peer}"],
                         "fastpar_GFLOP/s/rank": flops / f / world / 1e9,
                         "torch_GFLOP/s/rank": flops / t / world / 1e9, "warmup_losses": losses,
                         "batch": a.batch, "micro": a.micro, "seq": a.seq})
    common.report(f"train_{a.label}", rows,
                  ["model", "shape", "layout", "fastpar_ms", "torch_ms", "fastpar_tok/s",
                   "torch_tok/s", "fastpar/torch", "A/A", "fastpar_GFLOP/s/rank",
                   "torch_GFLOP/s/rank", "fastpar_TP_MB", "torch_TP_MB", "megatron_TP_MB"],
                  comparisons)


if __name__ == "__main__":
    main()
