"""The CUDA paths of the parallel layers on one GPU, over a one-rank NCCL group: what the TP, DP
and mixed-precision tests beside this file check on gloo, run on a real device.

    TRITON_INTERPRET=0 python -m pytest tests/test_tp_gpu.py -m gpu -q -s           # on a GPU
    FASTPAR_GPU_DRY_RUN=1 python -m pytest tests/test_tp_gpu.py -m gpu -q -s      # gloo, CPU

One GPU cannot host two NCCL ranks, but a one-rank NCCL group runs every CUDA-side piece that
multi-rank training uses: the extension's GEMM <-> collective ops on NCCL's stream and their
events, the overlapped TP autograd Functions under CUDA bf16 autocast (bf16 activations next to
fp32 weights, as the trainer runs them), DataParallel's comm stream with the CUDA multi-tensor
kernel, mixed precision's fp32 main gradients and fused AdamW on fp32 masters, and ZeRO-3 (a
model built on the meta device, its units gathered on a side stream and freed back to the
caching allocator). The pipeline's p2p is not run (a rank cannot send to itself). Each check
prints its numbers.

Tolerances: bf16 results against the same math in fp32, max |error| <= 2e-2 * max |reference|
(bf16 keeps 8 significant bits; a GEMM over K=1024 accumulates in fp32 and rounds once).

Marked ``gpu``; skipped without a CUDA GPU. ``FASTPAR_GPU_DRY_RUN=1`` runs the same checks on gloo
with CPU autocast instead (tests/test_gpu_scripts.py does, so a CPU-only run exercises what a GPU
run will execute). bench/gpu_check.sh runs this file as its ``tp-nccl`` step.
"""
from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

TOL = 2e-2
CPU = os.environ.get("FASTPAR_GPU_DRY_RUN") == "1"

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    not CPU and not torch.cuda.is_available(),
    reason="needs a CUDA GPU (torch.cuda.is_available() is False); FASTPAR_GPU_DRY_RUN=1 runs "
           "these checks on gloo and CPU autocast as a dry run")]


def rel(a, b) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


@pytest.fixture(scope="module")
def one_rank():
    """A one-rank mesh (NCCL on this GPU, or gloo on CPU for the dry run) and the shapes."""
    import fastpar
    saved = dict(os.environ)          # fastpar.init sets MASTER_ADDR / _PORT and NCCL's variables
    fresh = not torch.distributed.is_initialized()
    mesh = fastpar.init(backend="gloo" if CPU else "nccl")    # one rank: NCCL on this GPU
    dev = mesh.device
    name = "CPU" if CPU else torch.cuda.get_device_name(dev)
    print(f"backend {torch.distributed.get_backend(mesh.tp_group)}, device {dev}, {name}")
    # GPU-sized shapes; the CPU dry run (bf16 GEMMs are slow on a CPU) runs the same code on an
    # eighth of each dimension.
    f = 8 if CPU else 1
    yield SimpleNamespace(mesh=mesh, group=mesh.tp_group, dev=dev, kind="cpu" if CPU else "cuda",
                          sync=(lambda: None) if CPU else torch.cuda.synchronize,
                          R=4096 // f, N=2048 // f, D=1024 // f, FF=4096 // f, S=512 // f)
    if fresh:
        torch.distributed.destroy_process_group()
    for key in set(os.environ) - set(saved):
        del os.environ[key]
    os.environ.update(saved)


def test_extension_ops_on_nccl_bf16(one_rank):
    """matmul_allreduce, allgather_matmul, matmul_reducescatter, column_linear_backward, bf16."""
    from fastpar import extension
    r, group, dev = one_rank, one_rank.group, one_rank.dev
    torch.manual_seed(0)
    x = torch.randn(r.R, r.D, device=dev, dtype=torch.bfloat16)
    w = torch.randn(r.N, r.D, device=dev, dtype=torch.bfloat16)
    ref = (x.float() @ w.float().t())
    errs = [rel(extension.matmul_allreduce(x, w, group, 4), ref),
            rel(extension.allgather_matmul(x, w, group)[0], ref),
            rel(extension.matmul_reducescatter(x, w, group), ref)]
    g = torch.randn(r.R, r.N, device=dev, dtype=torch.bfloat16)
    for sp in (False, True):
        gi, gw = extension.column_linear_backward(g, x, w, group, sp, True, True, 4)
        errs += [rel(gi, g.float() @ w.float()), rel(gw, g.float().t() @ x.float())]
    r.sync()
    assert max(errs) <= TOL, errs
    print(f"max relative error {max(errs):.1e}")


def test_overlapped_tp_functions_under_bf16_autocast(one_rank):
    """The overlapped TP Functions under bf16 autocast, every sequence-parallel setting."""
    from fastpar.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from fastpar.tensor_parallel.overlap import ColumnLinearOverlap, RowLinearOverlap
    r, group, dev = one_rank, one_rank.group, one_rank.dev
    D, FF, S = r.D, r.FF, r.S
    worst = 0.0
    for sp in (False, True):
        torch.manual_seed(1)
        col = ColumnParallelLinear(D, FF, tp_group=group, sequence_parallel=sp, device=dev)
        row = RowParallelLinear(FF, D, tp_group=group, sequence_parallel=sp, device=dev)
        x = torch.randn(S, 4, D, device=dev, requires_grad=True)
        with torch.autocast(r.kind, dtype=torch.bfloat16):
            # The layers' overlapped path as they take it at tp > 1: cast, then the Function.
            xc, wc, bc = col._cast(x)
            h = ColumnLinearOverlap.apply(xc.reshape(-1, D), wc, group, sp, 4,
                                          id(col.weight)) + bc
            hc, w2, b2 = row._cast(F.gelu(h))
            y = RowLinearOverlap.apply(hc, w2, group, sp, 4, id(row.weight)) + b2
        assert h.dtype == y.dtype == torch.bfloat16, (h.dtype, y.dtype)
        y.float().square().mean().backward()
        assert col.weight.grad.dtype == row.weight.grad.dtype == torch.float32
        x32 = x.detach().clone().requires_grad_()
        y32 = F.linear(F.gelu(F.linear(x32.reshape(-1, D), col.weight, col.bias)),
                       row.weight, row.bias)
        gc, gr = torch.autograd.grad(y32.square().mean(), [col.weight, row.weight])
        worst = max(worst, rel(y, y32), rel(col.weight.grad, gc), rel(row.weight.grad, gr))
    r.sync()
    assert worst <= TOL, worst
    print(f"bf16 outputs, fp32 grads, max relative error vs fp32 {worst:.1e}")


def test_data_parallel_comm_stream_and_bf16_reduce(one_rank):
    """DataParallel on NCCL: comm stream, CUDA multi-tensor pack, bf16 reduce."""
    from fastpar.data_parallel import DataParallel
    r, dev = one_rank, one_rank.dev
    D, FF = r.D, r.FF
    torch.manual_seed(2)
    net = torch.nn.Sequential(torch.nn.Linear(D, FF), torch.nn.GELU(),
                              torch.nn.Linear(FF, D)).to(dev)
    ref = [p.detach().clone() for p in net.parameters()]
    ddp = DataParallel(net, dp_group=r.mesh.dp_group, bucket_cap_mb=4,
                       reduce_dtype=torch.bfloat16)
    x = torch.randn(256, D, device=dev)
    with torch.autocast(r.kind, dtype=torch.bfloat16):
        loss = ddp(x).float().square().mean()
    loss.backward()
    plain = torch.nn.Sequential(torch.nn.Linear(D, FF), torch.nn.GELU(),
                                torch.nn.Linear(FF, D)).to(dev)
    with torch.no_grad():
        for p, q in zip(plain.parameters(), ref):
            p.copy_(q)
    with torch.autocast(r.kind, dtype=torch.bfloat16):
        plain(x).float().square().mean().backward()
    errs = [rel(p.grad, q.grad) for p, q in zip(net.parameters(), plain.parameters())]
    r.sync()
    assert max(errs) <= TOL, errs
    print(f"gradients through bf16 buckets, max relative error {max(errs):.1e}")


def test_mixed_precision_main_grads_and_fp32_masters(one_rank):
    """Mixed precision on CUDA: bf16 parameters, fp32 main gradients, fp32 masters."""
    from fastpar.data_parallel import DataParallel, DistributedOptimizer
    r, dev = one_rank, one_rank.dev
    D, FF, S = r.D, r.FF, r.S
    torch.manual_seed(3)
    net = torch.nn.Sequential(torch.nn.Linear(D, FF), torch.nn.GELU(),
                              torch.nn.Linear(FF, D)).to(dev, torch.bfloat16)
    plain = [p.detach().clone().requires_grad_() for p in net.parameters()]
    ddp = DataParallel(net, dp_group=r.mesh.dp_group, main_grads=True)
    opt = DistributedOptimizer(ddp, torch.optim.AdamW, shard=False, lr=1e-3, fused=True)
    x = torch.randn(2, S // 4, D, device=dev, dtype=torch.bfloat16)
    for i, xm in enumerate(x):                      # two micro-batches, fp32 accumulation
        ddp.set_requires_gradient_sync(i == 1)
        ddp(xm).float().square().mean().backward()
    assert all(p.grad is None and p.main_grad.dtype == torch.float32
               for p in net.parameters())
    w1, b1, w2, b2 = plain
    grads = [torch.zeros_like(p, dtype=torch.float32) for p in plain]
    for xm in x:
        y = torch.nn.functional.linear(torch.nn.functional.gelu(
            torch.nn.functional.linear(xm, w1, b1)), w2, b2)
        for acc, g in zip(grads, torch.autograd.grad(y.float().square().mean(), plain)):
            acc.add_(g)
    errs = [rel(p.main_grad, g) for p, g in zip(net.parameters(), grads)]
    opt.step()
    moved = [float((p.detach().float() - q.detach().float()).abs().max()) for p, q in
             zip(net.parameters(), plain)]
    r.sync()
    assert max(errs) <= TOL and min(moved) > 0, (errs, moved)
    print("main gradients vs plain autograd, max relative error "
          f"{max(errs):.1e}; fused AdamW on the masters moved every parameter")


def test_zero3_meta_build_gathers_on_a_side_stream_and_frees(one_rank):
    """ZeRO-3 on the device: a GPT built on the meta device, filled a unit at a time, gathered
    on its own stream, trains as the same GPT under ZeRO-1; between steps the device holds the
    fp32 masters and moments only (the units' memory really goes back to the allocator), and
    after the first step the caching allocator serves every gather from its cache."""
    from fastpar.data_parallel import DataParallel, DistributedOptimizer
    from fastpar.models import GPT, GPTConfig
    r, dev = one_rank, one_rank.dev
    cfg = GPTConfig(vocab_size=512, n_layers=4, d_model=r.D // 2, n_heads=8, max_seq_len=r.S)
    allocated = (lambda: 0) if CPU else (lambda: torch.cuda.memory_allocated(dev))
    runs = {}
    for stage in (1, 3):
        torch.manual_seed(4)
        model = GPT(cfg, device="meta" if stage == 3 else dev)
        if stage == 3:
            model.reset_buffers(dev)
        ddp = DataParallel(model, dp_group=r.mesh.dp_group, device=dev,
                           units=list(model.layers.values()) if stage == 3 else None)
        opt = DistributedOptimizer(ddp, torch.optim.AdamW, stage=stage, lr=1e-3,
                                   fused=not CPU)
        if stage == 3:
            opt.materialize(model.init_weights_)
            assert CPU or opt._gather_stream.stream is not None     # a side CUDA stream
        g = torch.Generator().manual_seed(5)
        mallocs = []                     # the caching allocator's device allocations so far
        for _ in range(3):
            x = torch.randint(0, 512, (2, r.S // 4), generator=g).to(dev)
            with torch.autocast(r.kind, dtype=torch.bfloat16):
                loss = ddp(x, x)
            loss.backward()
            opt.step()
            opt.zero_grad()
            r.sync()
            mallocs.append(0 if CPU else torch.cuda.memory_stats(dev)["num_device_alloc"])
        # The units' buffers come and go every step, from the cache: no new device memory
        # after the first step (no allocator churn).
        assert mallocs[1] == mallocs[2], mallocs
        held = allocated()
        with opt.gathered():
            runs[stage] = ([p.detach().clone() for p in model.parameters()], held,
                           sum(p.numel() for p in model.parameters()))
        del model, ddp, opt
    (one, held1, n), (three, held3, _) = runs[1], runs[3]
    errs = [rel(p, q) for p, q in zip(three, one)]
    assert max(errs) <= 1e-5, errs
    if not CPU:     # ZeRO-3: masters and moments, 12 bytes a parameter; ZeRO-1 (at dp 1 its
        #             masters are the parameters) keeps its gradient buckets too, 4 more
        assert held3 <= 13 * n and held3 <= held1 - 3 * n, (held1, held3, n)
    print(f"ZeRO-3 vs ZeRO-1 after 3 steps, max relative difference {max(errs):.1e}; "
          f"held between steps {held3 / 2**20:.1f} vs {held1 / 2**20:.1f} MiB")


def test_forward_steps_inside_a_column_backward_under_bf16_autocast(one_rank):
    """``fb_overlap``'s device side: a micro-batch's forward steps run inside a column
    linear's backward (on a GPU: autograd's device thread, grad off, no autocast of its own)
    with the autocast and grad mode they were created under, and give that forward's loss and
    gradients."""
    import threading

    from fastpar.models import GPT, GPTConfig
    from fastpar.tensor_parallel.overlap import ColumnLinearOverlap, filling
    r, group, dev = one_rank, one_rank.group, one_rank.dev
    cfg = GPTConfig(vocab_size=512, n_layers=2, d_model=r.D // 4, n_heads=4, max_seq_len=r.S)
    torch.manual_seed(3)
    model = GPT(cfg, device=dev)
    x = torch.randint(0, cfg.vocab_size, (2, r.S), device=dev)
    y = torch.randint(0, cfg.vocab_size, (2, r.S), device=dev)
    with torch.autocast(r.kind, dtype=torch.bfloat16):
        ref = model(x, y)
    ref.backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    with torch.autocast(r.kind, dtype=torch.bfloat16):
        steps = model.forward_steps(x, y)           # created under autocast, run outside it
    seen = []

    def fill():
        seen.append((threading.get_ident(), torch.is_autocast_enabled(r.kind)))
        steps()
    a = torch.randn(64, 32, device=dev, requires_grad=True)
    w = torch.randn(16, 32, device=dev)
    for _ in range(2 * cfg.n_layers + 3):           # a step per column backward, and one more
        with filling(fill):
            ColumnLinearOverlap.apply(a, w, group, False, 1, id(w)).sum().backward()
    assert steps.done and len(seen) == 2 * cfg.n_layers + 3
    loss = steps.result
    assert loss.requires_grad and rel(loss, ref) <= 1e-6, (loss, ref)
    loss.backward()                 # (attention's backward may accumulate in another order)
    worst = max(rel(p.grad, want[n]) for n, p in model.named_parameters())
    r.sync()
    assert worst <= TOL, worst
    where = "another thread" if seen[0][0] != threading.get_ident() else "the caller's thread"
    print(f"{len(seen)} forward steps inside column backwards on {where}, autocast "
          f"{'on' if seen[0][1] else 'off'} around them; loss {loss.item():.4f} equal")
