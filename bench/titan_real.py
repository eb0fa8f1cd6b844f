"""The tensor-parallel peer as the installed torchtitan (0.3.0) builds it: its own Llama3 model,
its own TP plan, its own loss-parallel cross-entropy and gradient clipping.

``build_step(gpt, sequence_parallel, backend, lr, weight_decay, max_norm, micro_batches)`` takes a
fastpar GPT built at tp=1 (RMSNorm, SwiGLU, rotary on the first and second half of each head, no
biases, untied head) and returns ``step(tokens, targets) -> loss`` for the same network in
torchtitan's hands, on every rank of the default (gloo or NCCL) process group:

  model   ``Llama3Model.Config`` built from torchtitan's own layer builder
          (``_build_llama3_layers``: fused ``wqkv``, ``ComplexRoPE``, ``FeedForward`` w1/w2/w3)
          at the GPT's shape, the GPT's weights loaded into it (see ``_titan_state``).
  plan    ``set_llama3_sharding_config(config, enable_sp=...)`` then ``model.parallelize(
          ParallelDims(..., tp=world, spmd_backend=backend))``: what ``parallelize_llama`` does
          for TP without FSDP.
  loss    ``CrossEntropyLoss`` (``cross_entropy_loss``: vocabulary-parallel on the sharded
          logits), the sum over tokens divided by their count, as the trainer does.
  clip    ``torchtitan.distributed.utils.clip_grad_norm_`` under ``partial_dtensor`` (DTensor
          gradients, its norm reduced by DTensor). Under ``spmd_types`` without FSDP the
          gradients are plain local tensors: the reductions FSDP would do are added here (the
          sequence-parallel norm weights' gradient sum over TP, and the global norm: sharded
          gradients summed over TP, replicated ones counted once), then torch's
          ``clip_grads_with_norm_``, which torchtitan's ``clip_grad_norm_`` ends with.
  optim   AdamW as fastpar's trainer: betas (0.9, 0.95), eps 1e-8, decay on matrices only,
          fused where the device has it.

What torchtitan needs to run on CPU (it targets CUDA): its ``device_type`` is set to "cpu", the
``fake`` process-group backend is registered (its mesh uses it for size-1 axes), and the inner
attention is its ``ScaledDotProductAttention`` module (causal) rather than flex attention,
which has no CPU backward.

torchtitan's ComplexRoPE rotates adjacent pairs (2i, 2i+1) where fastpar rotates (i, i + hd/2):
the rows of each query and key head are permuted so (2i, 2i+1) holds fastpar's (i, i + hd/2);
scores q.k are unchanged by a permutation applied to both.

    python bench/titan_real.py [--model tiny] [--batch 4] [--seq 128]

runs the smoke check: 2 gloo ranks, tp2 and tp2-sp under both backends, against fastpar's
single-process GPT on the same batch: the first loss, the gradient norm, every clipped gradient
(gathered, in torchtitan's layout) and the loss after one AdamW step, each within ``--tol``;
then the time of 3 steps (the slower rank's, per step).
"""
from __future__ import annotations

import argparse
import copy
import os
import sys
import time
import warnings

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

BACKENDS = ("spmd_types", "partial_dtensor")


def _cpu_ready(device_type: str) -> None:
    """Point torchtitan at ``device_type`` (it picks CUDA on import) and register the fake
    process-group backend its mesh uses for size-1 axes."""
    import torch.testing._internal.distributed.fake_pg  # noqa: F401  registers "fake"
    import torchtitan.distributed.parallel_dims as parallel_dims
    import torchtitan.tools.utils as tools_utils

    tools_utils.device_type = device_type
    parallel_dims.device_type = device_type


def _llama3_config(c, sequence_parallel: bool):
    """torchtitan's Llama3 config at the GPT's shape, sharded by its own plan."""
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.llama3 import Llama3Model, _build_llama3_layers
    from torchtitan.models.llama3.sharding import set_llama3_sharding_config

    V, D = c.padded_vocab, c.d_model
    layers = _build_llama3_layers(
        n_layers=c.n_layers, dim=D, n_heads=c.n_heads, n_kv_heads=c.kv_heads,
        hidden_dim=c.ffn_dim, fuse_qkv=True, attn_backend="flex",
        rope=ComplexRoPE.Config(dim=c.head_dim, max_seq_len=c.max_seq_len,
                                theta=c.rotary_base, scaling="none"))
    for layer in layers:            # flex attention has no CPU backward: torchtitan's SDPA module
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
        layer.attention_norm.eps = layer.ffn_norm.eps = c.norm_eps
    config = Llama3Model.Config(
        dim=D, vocab_size=V, layers=layers,
        tok_embeddings=Embedding.Config(num_embeddings=V, embedding_dim=D),
        norm=RMSNorm.Config(normalized_shape=D, eps=c.norm_eps),
        lm_head=Linear.Config(in_features=D, out_features=V))
    set_llama3_sharding_config(config, enable_sp=sequence_parallel)
    return config


@torch.no_grad()
def _titan_state(gpt) -> dict[str, torch.Tensor]:
    """The GPT's weights under torchtitan's names and layouts (fused ``wqkv`` as
    (kv heads, q heads per kv + 2, head_dim, D) rows, q/k rows permuted for ComplexRoPE)."""

    c = gpt.config
    hd, nkv = c.head_dim, c.kv_heads
    r = hd // 2
    perm = torch.stack([torch.arange(r), torch.arange(r) + r], -1).flatten()  # (hd,)
    state = {"tok_embeddings.weight": gpt.embed.weight, "lm_head.weight": gpt.head.weight,
             "norm.weight": gpt.norm.weight}
    for i, src in gpt.layers.items():
        q, k, v = _rows(src.attn.qkv)
        up, gate = _rows(src.mlp.fc1)
        q = q.reshape(nkv, -1, hd, c.d_model)[:, :, perm]       # (kv, q per kv, hd, D)
        k = k.reshape(nkv, 1, hd, c.d_model)[:, :, perm]
        v = v.reshape(nkv, 1, hd, c.d_model)
        p = f"layers.{i}."
        state |= {p + "attention.qkv_linear.wqkv.weight": torch.cat([q, k, v], 1).flatten(0, 2),
                  p + "attention.wo.weight": src.attn.o.weight,
                  p + "feed_forward.w1.weight": gate, p + "feed_forward.w3.weight": up,
                  p + "feed_forward.w2.weight": src.mlp.down.weight,
                  p + "attention_norm.weight": src.norm1.weight,
                  p + "ffn_norm.weight": src.norm2.weight}
    return {k: v.detach().clone() for k, v in state.items()}


def _adamw(model, lr, weight_decay):
    """AdamW as fastpar's trainer sets it: decay on matrices only, fused where available."""
    from torch.utils._foreach_utils import _get_fused_kernels_supported_devices as _fused_devices

    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    device = params[0].device.type
    kernel = dict(fused=True) if device in _fused_devices() else dict(foreach=True)
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), eps=1e-8, **kernel)


def _rows(fused):
    """The weight of each part of a fused column linear (built at tp=1), in part order."""
    return [fused.weight.narrow(0, offset, rows) for _, offset, rows in fused.local_parts()]


def build_step(gpt, sequence_parallel: bool, backend: str = "spmd_types", lr: float = 3e-3,
               weight_decay: float = 0.1, max_norm: float = 1.0, micro_batches: int = 1):
    """``step(tokens (B, S), targets (B, S)) -> loss (float)`` of torchtitan's Llama3 holding the
    weights of ``gpt`` (a fastpar GPT at tp=1), tensor parallel over the whole default group
    (see the module doc). ``step.model`` and ``step.optimizer`` are the sharded model and its
    AdamW."""
    import spmd_types as spmd
    from torchtitan.components.loss import IGNORE_INDEX, CrossEntropyLoss
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed import utils as dist_utils

    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} is not one of {BACKENDS}")
    c, world = gpt.config, dist.get_world_size()
    if (c.norm, c.activation, c.rotary, c.bias, c.tie_embeddings, c.dropout) != \
            ("rmsnorm", "swiglu", True, False, False, 0.0):
        raise ValueError(f"torchtitan's Llama3 mirrors RMSNorm / SwiGLU / rotary models without "
                         f"biases, tying or dropout, not {c}")
    if c.n_heads % world or c.kv_heads % world:
        raise ValueError(f"tp={world} must divide n_heads={c.n_heads} and "
                         f"n_kv_heads={c.kv_heads}")
    device = gpt.embed.weight.device
    _cpu_ready(device.type)
    dist_utils.set_spmd_backend(backend)
    dims = ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=world, pp=1, ep=1,
                        world_size=world, spmd_backend=backend)
    dims.build_mesh()
    context = dist_utils.get_spmd_context(parallel_dims=dims)

    config = _llama3_config(c, sequence_parallel)
    with torch.device(device):
        model = config.build()
    model.load_state_dict(_titan_state(gpt), strict=True)
    with context():
        model.parallelize(dims)
    model.train()
    loss_fn = CrossEntropyLoss.Config(global_vocab_size=c.padded_vocab).build()
    opt = _adamw(model, lr, weight_decay)
    params = list(model.parameters())
    tp_group = dims.get_mesh("tp").get_group()
    full = _titan_state_shapes(c)
    names = [n for n, _ in model.named_parameters()]
    # Under spmd_types every parameter is a plain local tensor: a TP shard or a full replica.
    sharded = [p for n, p in zip(names, params) if p.shape != full[n]]
    replicated = [p for n, p in zip(names, params) if p.shape == full[n]]

    max_norm = max_norm if max_norm > 0 else float("inf")      # 0 disables, as in fastpar

    def clip() -> torch.Tensor:
        if backend == "partial_dtensor":
            return dist_utils.clip_grad_norm_(params, max_norm, foreach=True)
        if sequence_parallel:       # each rank's norm gradient is its sequence shard's part
            for p in replicated:
                dist.all_reduce(p.grad, group=tp_group)
        sq = torch.nn.utils.get_total_norm([p.grad for p in sharded]).square()
        dist.all_reduce(sq, group=tp_group)
        sq = sq + torch.nn.utils.get_total_norm([p.grad for p in replicated]).square()
        total = sq.sqrt()
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total, foreach=True)
        return total

    def step(tokens, targets):
        """One training step on the global batch (the same on every rank); returns its mean
        loss over the targets that are not IGNORE_INDEX. The gradient norm before clipping is
        kept, as a tensor, in ``step.grad_norm``."""
        if sequence_parallel and tokens.shape[1] % world:
            raise ValueError(f"sequence parallelism over tp={world} needs a sequence length "
                             f"divisible by it, got tokens of shape {tuple(tokens.shape)}")
        # Gradient accumulation as torchtitan's trainer does it: every micro-batch's loss is
        # its sum over the global count of valid tokens, so the sum is the batch's mean.
        count, total = (targets != IGNORE_INDEX).sum(), 0.0
        for xm, ym in zip(tokens.chunk(micro_batches), targets.chunk(micro_batches)):
            with context():
                pred = model(xm)
                loss, _ = loss_fn(pred, ym, count)
                with spmd.no_typecheck():
                    loss.backward()
            loss = loss.detach()
            total = total + (loss.full_tensor() if hasattr(loss, "full_tensor") else loss)
        step.grad_norm = clip().detach()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return total.item()
    step.model, step.optimizer = model, opt
    return step


def _titan_state_shapes(c) -> dict[str, torch.Size]:
    """The unsharded shape of every torchtitan parameter at the GPT config ``c``."""
    D, V, F, hd = c.d_model, c.padded_vocab, c.ffn_dim, c.head_dim
    shapes = {"tok_embeddings.weight": (V, D), "lm_head.weight": (V, D), "norm.weight": (D,)}
    for i in range(c.n_layers):
        p = f"layers.{i}."
        shapes |= {p + "attention.qkv_linear.wqkv.weight": ((c.n_heads + 2 * c.kv_heads) * hd, D),
                   p + "attention.wo.weight": (D, c.n_heads * hd),
                   p + "feed_forward.w1.weight": (F, D), p + "feed_forward.w3.weight": (F, D),
                   p + "feed_forward.w2.weight": (D, F),
                   p + "attention_norm.weight": (D,), p + "ffn_norm.weight": (D,)}
    return {k: torch.Size(v) for k, v in shapes.items()}


# -- smoke check: 2 gloo ranks against fastpar's single-process GPT ----------------------------
def _batch(c, batch: int, seq: int):
    g = torch.Generator().manual_seed(1234)
    tokens = torch.randint(0, c.vocab_size, (batch, seq + 1), generator=g)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def _reference(model_name: str, batch: int, seq: int) -> list[float]:
    """fastpar's GPT, one process: the loss before and after one step (clip 1.0, AdamW)."""
    from fastpar.models import GPT
    from fastpar.models.config import PRESETS

    gpt = GPT(PRESETS[model_name])
    x, y = _batch(gpt.config, batch, seq)
    opt = _adamw(gpt, 3e-3, 0.1)
    loss = gpt(x, y)
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(list(gpt.parameters()), 1.0)
    grads = copy.deepcopy(gpt)
    for p, g in zip(grads.parameters(), gpt.parameters()):
        p.data = g.grad.clone()
    opt.step()
    with torch.no_grad():
        return [loss.item(), gpt(x, y).item(), norm.item()], _titan_state(grads)


def _rank_check(rank, world, model_name, batch, seq, sequence_parallel, backend):
    """Losses of the first two steps and the time of the next 3 on this rank."""
    from fastpar.models import GPT
    from fastpar.models.config import PRESETS

    gpt = GPT(PRESETS[model_name])
    x, y = _batch(gpt.config, batch, seq)
    warnings.filterwarnings("ignore", category=FutureWarning)  # c10d's renamed collectives
    step = build_step(gpt, sequence_parallel, backend)
    shapes, grads = _titan_state_shapes(gpt.config), {}
    names = {id(p): n for n, p in step.model.named_parameters()}

    def keep_grads(opt, args, kwargs):            # clipped, as the optimizer sees them
        if not grads:
            grads.update({names[id(p)]: _full(p.grad, shapes[names[id(p)]])
                          for g in opt.param_groups for p in g["params"]})
    hook = step.optimizer.register_step_pre_hook(keep_grads)
    losses = [step(x, y)]
    hook.remove()
    norm = step.grad_norm
    norm = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
    losses.append(step(x, y))
    times = []
    for _ in range(3):
        dist.barrier()
        t0 = time.perf_counter()
        step(x, y)
        times.append(time.perf_counter() - t0)
    local = sum((p.to_local() if hasattr(p, "to_local") else p).numel()
                for p in step.model.parameters())
    return losses, norm, times, local, grads if rank == 0 else None


def _full(t: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """The whole tensor of a TP shard: DTensor's own gather, else an all-gather over the
    default group along the one dimension where the local shape differs from ``shape``."""
    if hasattr(t, "full_tensor"):
        return t.full_tensor()
    if t.shape == shape:
        return t.clone()
    dim = next(i for i, (a, b) in enumerate(zip(t.shape, shape)) if a != b)
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, t.contiguous())
    return torch.cat(parts, dim)

def main():
    from fastpar.models.config import PRESETS
    from fastpar.testing import run_ranks

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="tiny", choices=["tiny", "small"])
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--tol", type=float, default=1e-4)
    args = ap.parse_args()
    ref, ref_grads = _reference(args.model, args.batch, args.seq)
    n_params = sum(t.numel() for t in _titan_state_shapes(PRESETS[args.model]).values())
    print(f"{args.model}: {n_params:,} parameters in torchtitan's Llama3")
    print(f"fastpar GPT {args.model} (1 process): loss {ref[0]:.6f}, after one step "
          f"{ref[1]:.6f}, first gradient norm {ref[2]:.6f}")
    failed = []
    for backend in BACKENDS:
        for sp in (False, True):
            name = f"tp2{'-sp' if sp else ''} {backend}"
            out = run_ranks(_rank_check, 2, args.model, args.batch, args.seq, sp, backend,
                            timeout=300)
            (l0, l1), norm, _, _, grads = out[0]
            grad_err = max(float((grads[n] - g).abs().max() / g.abs().max())
                           for n, g in ref_grads.items())
            local = [r[3] for r in out]
            step_ms = [1e3 * max(r[2][i] for r in out) for i in range(3)]
            ok = sum(local) > n_params and max(local) < n_params and abs(l0 - ref[0]) <= args.tol and abs(l1 - ref[1]) <= args.tol \
                and abs(norm - ref[2]) <= args.tol * max(1.0, ref[2]) and grad_err <= args.tol
            failed += [] if ok else [name]
            print(f"{name:26s} loss {l0:.6f} (diff {l0 - ref[0]:+.1e}), after one step "
                  f"{l1:.6f} (diff {l1 - ref[1]:+.1e}), norm {norm:.6f}, clipped gradients' "
                  f"max relative error {grad_err:.1e} "
                  f"{'ok' if ok else 'MISMATCH'}; parameters per rank {local}; "
                  f"step ms " + " ".join(f"{t:.1f}" for t in step_ms))
    if failed:
        raise SystemExit(f"loss differs from fastpar's beyond {args.tol:g}: {failed}")


if __name__ == "__main__":
    main()
