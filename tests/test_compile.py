"""Transformer blocks compiled with torch.compile (fastpar.models.compile_blocks), fullgraph:
no graph break under TP (overlapped and plain), sequence parallelism and context parallelism,
one graph for every block, and two training steps whose losses and gradients equal the eager
model's. Inductor (C++ code generated and built on this CPU) for the single-process case and
for TP + SP; aot_eager (the same traced graph run by torch's eager kernels) elsewhere, which
keeps the multi-rank cases quick."""
import time

import pytest
import torch
import torch.distributed as dist

from fastpar.context_parallel import shard_sequence
from fastpar.models import GPT, GPTConfig
from fastpar.models.compile import compile_blocks
from fastpar.models.generate import generate
from fastpar.testing import run_ranks

# Three blocks: a recompile per block (anything in the block's guards that names the block,
# say a parameter's id) shows up as more than one graph.
CFG = GPTConfig(vocab_size=96, n_layers=3, d_model=32, n_heads=4, n_kv_heads=2, max_seq_len=16,
                pad_vocab_to=32)
TOL = dict(rtol=1e-4, atol=1e-5)             # inductor reorders reductions; aot_eager is exact


def _build(kind, rank, world, overlap, recompute):
    group = dist.group.WORLD if world > 1 else None
    kw = dict(tp_group=group, sequence_parallel=kind == "sp", overlap=overlap) \
        if kind in ("tp", "sp") else dict(cp_group=group) if kind == "cp" else {}
    return GPT(CFG, recompute=recompute, **kw), GPT(CFG, recompute=recompute, **kw)


def _train_both(rank, world, kind, backend, overlap=True, recompute="none", autocast=False):
    """Two SGD steps of an eager model and its block-compiled twin on the same tokens; asserts
    equal losses and gradients at each step and no graph break. Returns (seconds of the first
    compiled step, of the first eager step, max |loss difference|)."""
    torch._dynamo.reset()
    counters = torch._dynamo.utils.counters
    counters.clear()
    eager, compiled = _build(kind, rank, world, overlap, recompute)
    compile_blocks(compiled, backend=backend)
    torch.manual_seed(0)
    tokens = torch.randint(0, CFG.vocab_size, (2, 17))
    x, y = tokens[:, :-1], tokens[:, 1:]
    if kind == "cp":                           # this rank's two chunks of each sequence
        x, y = (shard_sequence(t, rank, world, dim=1) for t in (x, y))
    seconds, worst = [], 0.0
    for step in range(2):
        losses = []
        for model in (compiled, eager):
            t0 = time.perf_counter()
            with torch.autocast("cpu", torch.bfloat16, enabled=autocast):
                loss = model(x, y)
            loss.backward()
            seconds.append(time.perf_counter() - t0)
            losses.append(loss.detach())
        tol = dict(rtol=2e-2, atol=2e-2) if autocast else TOL
        torch.testing.assert_close(losses[0], losses[1], **tol, msg=f"loss at step {step}")
        worst = max(worst, (losses[0] - losses[1]).abs().item())
        for (name, p), q in zip(compiled.named_parameters(), eager.parameters()):
            torch.testing.assert_close(p.grad, q.grad, **tol, msg=f"{name} grad, step {step}")
        with torch.no_grad():                  # the same SGD step on both
            for p, q in zip(compiled.parameters(), eager.parameters()):
                p -= 0.1 * p.grad
                q -= 0.1 * q.grad
                p.grad = q.grad = None
    assert not counters["graph_break"], dict(counters["graph_break"])
    # One graph for all three blocks: compiled once, reused, never a recompile per block. Under
    # autocast two: the first block takes the fp32 embedding, the others the bf16 stream.
    assert counters["stats"]["unique_graphs"] == 1 + autocast, dict(counters["stats"])
    return seconds[0], seconds[1], worst


def _check(results, label):
    first, eager_s, worst = results[0]
    print(f"\n{label}: first compiled step {first:.1f} s (the blocks' one compile: "
          f"{first - eager_s:.1f} s), eager step {eager_s:.2f} s, |loss - eager| <= {worst:.1e}")


def test_single_process_inductor():
    _check(run_ranks(_train_both, 1, "none", "inductor", timeout=300), "tp=1 inductor")


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "plain"])
def test_tensor_parallel(overlap):
    """The extension's fused GEMM + collective ops (fake implementations, group by name), or
    the mappings' torch.distributed collectives, traced by dynamo."""
    _check(run_ranks(_train_both, 2, "tp", "aot_eager", overlap, timeout=120),
           f"tp=2 {'overlap' if overlap else 'plain'} aot_eager")


def test_sequence_parallel_inductor():
    _check(run_ranks(_train_both, 2, "sp", "inductor", timeout=300), "tp=2 sp inductor")


def test_context_parallel():
    """Ring attention: the fastpar::ring_attention_fwd/_bwd custom ops, opaque to dynamo."""
    _check(run_ranks(_train_both, 2, "cp", "aot_eager", timeout=120), "cp=2 aot_eager")


@pytest.mark.parametrize("recompute", ["selective", "full"])
def test_recompute(recompute):
    """Selective recompute checkpoints inside the compiled block, full recompute around it."""
    _check(run_ranks(_train_both, 2, "sp", "aot_eager", True, recompute, timeout=120),
           f"tp=2 sp recompute={recompute} aot_eager")


def test_bf16_autocast():
    """Under bf16 autocast (GPU training's precision): the linears cast, the ops get bf16."""
    _check(run_ranks(_train_both, 2, "tp", "aot_eager", True, "none", True, timeout=120),
           "tp=2 bf16 autocast aot_eager")


def _zero3_both(rank, world):
    """ZeRO-3 as the trainer builds it (meta device, each block a unit gathered in its hooks,
    which run around the compiled forward): two steps of the block-compiled model give the eager
    one's losses and parameters, with no graph break and one graph."""
    import fastpar
    from fastpar.train import TrainConfig
    from fastpar.train.step import forward_backward
    from fastpar.train.trainer import _clip, _fill, _wrap, build_model

    cfg = TrainConfig(model="tiny", dp=2, zero=3, seq_len=16, global_batch_size=4,
                      micro_batch_size=1, out="unused")
    mesh = fastpar.init(layout=cfg.check_layout(world))
    g = torch.Generator().manual_seed(0)
    x, y = (torch.randint(0, cfg.model_config.vocab_size, (2, 16), generator=g)
            for _ in range(2))
    torch._dynamo.reset()
    counters = torch._dynamo.utils.counters
    counters.clear()
    runs = []
    for compiled in (True, False):
        chunks = build_model(cfg, mesh, "meta")
        if compiled:
            chunks = [compile_blocks(m, backend="aot_eager") for m in chunks]
        ddp, opt = _wrap(cfg, chunks, mesh)
        _fill(cfg, chunks, mesh, opt, None, None, None)
        losses = []
        for _ in range(2):
            losses.append(forward_backward(chunks, ddp, None, x, y, 2, mesh).item())
            _clip(chunks, mesh, cfg.grad_clip, opt)
            opt.step()
            opt.zero_grad(set_to_none=True)
        opt.unshard_all()
        runs.append((losses, [p.detach().clone() for p in chunks[0].parameters()]))
    (l1, p1), (l2, p2) = runs
    assert l1 == pytest.approx(l2, rel=1e-6, abs=1e-6), (l1, l2)
    for a, b in zip(p1, p2):
        # AdamW divides each gradient element by its own scale: where a gradient is about zero,
        # the decompositions' rounding moves that element's update by a fraction of lr (3e-3).
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-4)
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
    return True


def test_zero3():
    assert all(run_ranks(_zero3_both, 2, timeout=180))


def _generate_both(rank, world):
    """Generation with a KV cache runs the blocks eagerly: the same tokens as the eager model,
    and nothing compiled."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    eager, compiled = _build("tp", rank, world, True, "none")
    compile_blocks(compiled, backend="aot_eager")
    out = [generate(m.eval(), [3, 1, 4, 1, 5], 6, temperature=0.0) for m in (compiled, eager)]
    assert out[0] == out[1] and len(out[0]) == 6, out
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 0
    return True


def test_generation_runs_eager():
    assert all(run_ranks(_generate_both, 2, timeout=60))


def test_bad_input():
    model = GPT(CFG)
    with pytest.raises(ValueError, match="dropout=0.1 draws its mask seed"):
        compile_blocks(GPT(CFG.replace(dropout=0.1)))
    compile_blocks(model, backend="aot_eager")
    with pytest.raises(ValueError, match="block 'layers.0' is compiled already"):
        compile_blocks(model)
    with pytest.raises(ValueError, match="Linear has no ParallelTransformerLayer"):
        compile_blocks(torch.nn.Linear(2, 2))



def test_train_flag():
    """``fastpar train --compile`` is TrainConfig.compile; what a compiled block cannot do is
    refused at start."""
    import argparse

    from fastpar.train import TrainConfig
    from fastpar.train.flags import add_flags

    parser = argparse.ArgumentParser()
    add_flags(parser, TrainConfig)
    assert TrainConfig(**vars(parser.parse_args(["--compile"]))).compile
    assert not TrainConfig().compile
    with pytest.raises(ValueError, match="--compile with --schedule zb-h1 is not supported"):
        TrainConfig(compile=True, pp=2, schedule="zb-h1")
    with pytest.raises(ValueError, match="--compile with --interleave 2 is not supported"):
        TrainConfig(compile=True, tp=2, interleave=2)
    cfg = TrainConfig(compile=True, pp=2, schedule="1f1b")
    with pytest.raises(ValueError, match=r"--compile needs a model without dropout \(dropout=0.1"):
        cfg._check_compile(cfg.model_config.replace(dropout=0.1))

@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_triton_kernels_on_gpu():
    """On CUDA the blocks run the Triton kernels' autograd Functions (norm, rotary, SwiGLU,
    bias-dropout-add): traced fullgraph and compiled by inductor, under bf16 autocast."""
    torch._dynamo.reset()
    counters = torch._dynamo.utils.counters
    counters.clear()
    eager, compiled = GPT(CFG, device="cuda"), compile_blocks(GPT(CFG, device="cuda"))
    tokens = torch.randint(0, CFG.vocab_size, (2, 17), device="cuda")
    losses = []
    for model in (compiled, eager):
        with torch.autocast("cuda", torch.bfloat16):
            loss = model(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        losses.append(loss.detach())
    torch.testing.assert_close(losses[0], losses[1], rtol=2e-2, atol=2e-2)
    for (name, p), q in zip(compiled.named_parameters(), eager.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=2e-2, atol=2e-2, msg=name)
    assert not counters["graph_break"], dict(counters["graph_break"])
    print(f"\ncuda bf16 inductor: loss {losses[0].item():.4f} (eager {losses[1].item():.4f})")
