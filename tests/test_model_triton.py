"""The GPU path of the GPT model, end to end on CPU: the Triton kernels (under the interpreter)
give the loss and every parameter gradient that the torch references give.

Each case builds one model and runs forward + backward with ``FASTPAR_KERNEL_IMPL=torch`` and
with ``FASTPAR_KERNEL_IMPL=triton`` (``impl_for`` reads the variable at every call), the same
RNG seed before each so dropout draws the same Philox seeds, hence the same masks. What it
exercises is what only the model's wiring feeds the kernels: strided views out of the fused QKV
/ up-gate split, (B, S, h, hd) views into rotary, sequence shards under SP (and their dropout
offsets), the stage boundary of a pipeline, bf16 activations beside fp32 weights under autocast.
It also checks that the Triton run really went through every kernel the config uses.

Cases: (a) one process, also with full activation recompute; (b) tp=2 with sequence
parallelism; (c) pp=2, stages built with ``GPT(layers=..., pre_process=..., post_process=...)``
and run by hand: stage 0 forward, stage 1 forward + loss from a fresh leaf (as received over
p2p), backward of stage 1, then of stage 0 from the leaf's gradient, at tp=1 and, inside (b),
at tp=2 with SP (the boundary is then an (S/tp, B, D) sequence shard). Configs: rmsnorm + swiglu
+ rotary + GQA, untied; layernorm + gelu + bias + learned positions + tied embeddings with
dropout 0.1 in training mode (untied for the pipeline, which cannot split a tied pair).

Runtime: ~25 s on 2 cores, about half of it in the two tp=2 spawns.

Tolerances. fp32: loss and each gradient elementwise within rtol 1e-4 and atol 1e-5 * max
|torch gradient| (both paths compute in fp32; only summation order differs, ~1e-6 seen).
bf16 autocast: both paths round activations to bf16 (8 significant bits), so each is compared
with the fp32 torch run in norm, ``err(g) = |g - g_fp32| / |g_fp32|`` per tensor, and the
Triton path must satisfy ``err(triton) <= 2 err(torch) + 4e-3`` (2x torch's own bf16 error,
as flash-attention bounds its kernels; ~1.6x seen), with the loss within 1e-2 relative of the
torch bf16 loss.
"""
import contextlib
import os

import pytest
import torch
import torch.distributed as dist

from fastpar.models import GPT, GPTConfig
from fastpar.tensor_parallel import reduce_replicated_grads
from fastpar.testing import run_ranks

BASE = dict(vocab_size=200, n_layers=2, d_model=32, n_heads=4, max_seq_len=16, pad_vocab_to=64)
CONFIGS = {
    "rms-swiglu-rope-gqa": dict(BASE, n_kv_heads=2),
    "ln-gelu-bias-pos-tied-dropout": dict(BASE, norm="layernorm", activation="gelu", rotary=False,
                                          tie_embeddings=True, bias=True, dropout=0.1),
}
BATCH, SEQ = 2, 8
FP32_RTOL, FP32_ATOL = 1e-4, 1e-5
BF16_LOSS_RTOL, BF16_ERR_FACTOR, BF16_ERR_FLOOR = 1e-2, 2.0, 4e-3

# The autograd Functions of the Triton path that each config's graph must contain.
_COMMON = {"BiasDropoutAddFunctionBackward", "VocabParallelCrossEntropyBackward"}
FUNCTIONS = {
    "rms-swiglu-rope-gqa": _COMMON | {"RMSNormFunctionBackward", "RotaryFunctionBackward",
                                      "SwiGLUFunctionBackward"},
    "ln-gelu-bias-pos-tied-dropout": _COMMON | {"LayerNormFunctionBackward",
                                                "BiasGeluFunctionBackward"},
}


@contextlib.contextmanager
def _impl(name):
    """FASTPAR_KERNEL_IMPL=name inside the block (also in spawned ranks, which have no
    monkeypatch)."""
    saved = os.environ.get("FASTPAR_KERNEL_IMPL")
    os.environ["FASTPAR_KERNEL_IMPL"] = name
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("FASTPAR_KERNEL_IMPL")
        else:
            os.environ["FASTPAR_KERNEL_IMPL"] = saved


def _data(cfg):
    g = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, cfg.vocab_size, (BATCH, SEQ + 1), generator=g)
    targets = tokens[:, 1:].clone()
    targets[0, :2] = -100                                  # some ignored positions
    return tokens[:, :-1], targets


def _graph(*roots):
    """Type names of every autograd node reachable from ``roots``."""
    seen, stack = set(), [r.grad_fn for r in roots]
    while stack:
        node = stack.pop()
        if node is not None and node not in seen:
            seen.add(node)
            stack += [n for n, _ in node.next_functions]
    return {type(n).__name__ for n in seen}


def _step(stages, tokens, targets, impl, bf16):
    """One forward + backward through ``stages`` (one model, or pipeline stages in order):
    (loss, {name: grad}, dtypes of the tensors sent between stages, autograd node names)."""
    for m in stages:
        m.zero_grad(set_to_none=True)
    torch.manual_seed(1234)                                # dropout's seeds are drawn from it
    with _impl(impl):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            sent, received, x = [], [], tokens
            for m in stages[:-1]:
                x = m(x)
                sent.append(x)
                x = x.detach().requires_grad_()            # as received from the previous stage
                received.append(x)
            loss = stages[-1](x, targets)
        nodes = _graph(loss, *sent)
        loss.backward()
        for out, inp in zip(reversed(sent), reversed(received)):
            out.backward(inp.grad)                         # the gradient sent back
    grads = {f"{i}.{n}": p.grad.clone() for i, m in enumerate(stages)
             for n, p in m.named_parameters()}
    return loss.detach(), grads, [s.dtype for s in sent], nodes


def _compare(stages, tokens, targets, bf16, functions):
    """Error messages (empty if all agree) of the Triton path against the torch path."""
    loss_t, grads_t, sent_t, _ = _step(stages, tokens, targets, "torch", bf16)
    loss_k, grads_k, sent_k, nodes = _step(stages, tokens, targets, "triton", bf16)
    errors = [f"Triton path never ran {name}" for name in sorted(functions - nodes)]
    if sent_k != sent_t:
        errors.append(f"stage outputs {sent_k} vs {sent_t}")
    rtol, atol = (BF16_LOSS_RTOL, 0.0) if bf16 else (FP32_RTOL, FP32_ATOL)
    if not torch.allclose(loss_k, loss_t, rtol=rtol, atol=atol):
        errors.append(f"loss {loss_k.item()} vs {loss_t.item()}")
    if bf16:
        _, grads_32, _, _ = _step(stages, tokens, targets, "torch", False)
    for name, g in grads_t.items():
        k = grads_k[name]
        if k.dtype != g.dtype or k.shape != g.shape:
            errors.append(f"{name}: {k.dtype}{tuple(k.shape)} vs {g.dtype}{tuple(g.shape)}")
        elif bf16:
            ref = grads_32[name]
            err_k, err_t = ((x - ref).norm() / ref.norm() for x in (k, g))
            if not err_k <= BF16_ERR_FACTOR * err_t + BF16_ERR_FLOOR:
                errors.append(f"{name}: bf16 error {err_k:.3g} vs torch's {err_t:.3g}")
        elif not torch.allclose(k, g, rtol=FP32_RTOL, atol=FP32_ATOL * g.abs().max().item()):
            errors.append(f"{name}: max |diff| {(k - g).abs().max().item():.3g} "
                          f"(max |grad| {g.abs().max().item():.3g})")
    return errors


def _stages(cfg, **kw):
    """The model cut into two pipeline stages of one layer each (untied: a tied pair must sit
    on one stage)."""
    cfg = cfg.replace(tie_embeddings=False)
    return [GPT(cfg, layers=range(0, 1), post_process=False, **kw).train(),
            GPT(cfg, layers=range(1, 2), pre_process=False, **kw).train()]


def _check(name, pipeline, bf16, **kw):
    cfg = GPTConfig(**CONFIGS[name])
    stages = _stages(cfg, **kw) if pipeline else [GPT(cfg, **kw).train()]
    errors = _compare(stages, *_data(cfg), bf16, FUNCTIONS[name])
    where = " ".join([name] + [f"{k}={v}" for k, v in kw.items() if k == "recompute"]
                     + ["pp=2"] * pipeline + ["bf16" if bf16 else "fp32"])
    return [f"{where}: {e}" for e in errors]


DTYPES = pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])


@DTYPES
@pytest.mark.parametrize("name", CONFIGS)
def test_single_process(name, bf16):
    errors = _check(name, False, bf16)
    assert not errors, "\n".join(errors)


@pytest.mark.parametrize("name", CONFIGS)
def test_full_recompute(name):
    """Activation recompute replays the kernels' forward (dropout: the same seeds, restored by
    torch.utils.checkpoint, hence the same masks) inside the backward."""
    errors = _check(name, False, False, recompute="full")
    assert not errors, "\n".join(errors)


@DTYPES
@pytest.mark.parametrize("name", CONFIGS)
def test_pipeline_two_stages(name, bf16):
    errors = _check(name, True, bf16)
    assert not errors, "\n".join(errors)


def _tp_ranks(rank, world_size):
    kw = dict(tp_group=dist.group.WORLD, sequence_parallel=True)
    return [e for name in CONFIGS for pipeline in (False, True) for bf16 in (False, True)
            for e in _check(name, pipeline, bf16, **kw)]


def test_tp2_sequence_parallel():
    """Both configs, whole model and two pipeline stages, fp32 and bf16, at tp=2 with SP: each
    rank compares its own shards."""
    errors = run_ranks(_tp_ranks, 2, timeout=180)
    flat = [f"rank {r}: {e}" for r, errs in enumerate(errors) for e in errs]
    assert not flat, "\n".join(flat)


def _dropout_ranks(rank, world_size):
    from test_model import _params, _shard             # how test_model slices the full model

    cfg = GPTConfig(**CONFIGS["ln-gelu-bias-pos-tied-dropout"])
    tokens, targets = _data(cfg)
    ref = GPT(cfg).train()
    model = GPT(cfg, tp_group=dist.group.WORLD, sequence_parallel=True).train()
    with _impl("triton"):
        losses = []
        for m in (ref, model):
            torch.manual_seed(1234)
            losses.append(m(tokens, targets))
            losses[-1].backward()
    reduce_replicated_grads([model], dist.group.WORLD)  # the step's sum of SP's partial grads
    errors = [] if torch.allclose(*losses, rtol=1e-5) else [f"loss {losses[1]} vs {losses[0]}"]
    modules = dict(model.named_modules())
    for name, p, full, _ in _params(model, ref, world_size, rank):
        owner, pname = name.rsplit(".", 1)
        expected = _shard(modules[owner], pname, full.grad, world_size, rank)
        if not torch.allclose(p.grad, expected, rtol=1e-4, atol=1e-5):
            errors.append(f"{name} grad: max |diff| {(p.grad - expected).abs().max():.3g}")
    return errors


def test_tp2_sequence_parallel_dropout_equals_single_process():
    """Dropout masks are fixed by (seed, offset): tp=2 with SP on the Triton path must give the
    single-process loss and gradients (the shards' masks are slices of the unsharded mask)."""
    errors = run_ranks(_dropout_ranks, 2, timeout=120)
    flat = [f"rank {r}: {e}" for r, errs in enumerate(errors) for e in errs]
    assert not flat, "\n".join(flat)
