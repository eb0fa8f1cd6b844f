"""The CUDA paths of the parallel layers on one GPU, over a one-rank NCCL group.

    python bench/gpu_tp_check.py          # on a GPU
    python bench/gpu_tp_check.py --cpu    # the same checks on gloo and CPU autocast (a dry run)

One GPU cannot host two NCCL ranks, but a one-rank NCCL group runs every CUDA-side piece that
multi-rank training uses: the extension's GEMM <-> collective ops on NCCL's stream and their
events, the overlapped TP autograd Functions under CUDA bf16 autocast (bf16 activations next to
fp32 weights, as the trainer runs them), DataParallel's comm stream with the CUDA multi-tensor
kernel, and the pipeline's p2p stream (a send to itself is not allowed, so only the stream setup).
Each check prints PASS / FAIL with its numbers; the exit code is the number of failures.

Tolerances: bf16 results against the same math in fp32, max |error| <= 2e-2 * max |reference|
(bf16 keeps 8 significant bits; a GEMM over K=1024 accumulates in fp32 and rounds once).
"""
from __future__ import annotations

import sys
import time
import traceback

import torch
import torch.nn.functional as F

TOL = 2e-2
failures = 0


def check(name):
    def run(fn):
        global failures
        t0 = time.perf_counter()
        try:
            detail = fn()
            print(f"PASS  {name}: {detail} ({time.perf_counter() - t0:.1f} s)", flush=True)
        except Exception:  # noqa: BLE001 - every check reports, the next one runs
            failures += 1
            print(f"FAIL  {name}:\n{traceback.format_exc()}", flush=True)
        return fn
    return run


def rel(a, b) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


def main() -> int:
    cpu = "--cpu" in sys.argv[1:]
    if not cpu and not torch.cuda.is_available():
        print("gpu_tp_check.py: torch sees no CUDA GPU here; run it on a GPU machine "
              "(or --cpu for a dry run on gloo)")
        return 2
    kind = "cpu" if cpu else "cuda"
    import fastpar
    from fastpar import extension
    from fastpar.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from fastpar.tensor_parallel.overlap import ColumnLinearOverlap, RowLinearOverlap

    mesh = fastpar.init(backend="gloo" if cpu else "nccl")    # one rank: NCCL on this GPU
    group = mesh.tp_group
    dev = mesh.device
    name = "CPU" if cpu else torch.cuda.get_device_name(dev)
    print(f"backend {torch.distributed.get_backend(group)}, device {dev}, {name}", flush=True)
    sync = (lambda: None) if cpu else torch.cuda.synchronize
    torch.manual_seed(0)

    # GPU-sized shapes; the CPU dry run (bf16 GEMMs are slow on a CPU) runs the same code on an
    # eighth of each dimension.
    f = 8 if cpu else 1
    R, N, D, FF, S = 4096 // f, 2048 // f, 1024 // f, 4096 // f, 512 // f

    @check("extension ops on NCCL (matmul_allreduce, allgather_matmul, matmul_reducescatter, "
           "column_linear_backward), bf16")
    def _():
        x = torch.randn(R, D, device=dev, dtype=torch.bfloat16)
        w = torch.randn(N, D, device=dev, dtype=torch.bfloat16)
        ref = (x.float() @ w.float().t())
        errs = [rel(extension.matmul_allreduce(x, w, group, 4), ref),
                rel(extension.allgather_matmul(x, w, group)[0], ref),
                rel(extension.matmul_reducescatter(x, w, group), ref)]
        g = torch.randn(R, N, device=dev, dtype=torch.bfloat16)
        for sp in (False, True):
            gi, gw = extension.column_linear_backward(g, x, w, group, sp, True, True, 4)
            errs += [rel(gi, g.float() @ w.float()), rel(gw, g.float().t() @ x.float())]
        sync()
        assert max(errs) <= TOL, errs
        return f"max relative error {max(errs):.1e}"

    @check("overlapped TP Functions under bf16 autocast, every sequence-parallel setting")
    def _():
        worst = 0.0
        for sp in (False, True):
            torch.manual_seed(1)
            col = ColumnParallelLinear(D, FF, tp_group=group, sequence_parallel=sp,
                                       device=dev)
            row = RowParallelLinear(FF, D, tp_group=group, sequence_parallel=sp, device=dev)
            x = torch.randn(S, 4, D, device=dev, requires_grad=True)
            with torch.autocast(kind, dtype=torch.bfloat16):
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
        sync()
        assert worst <= TOL, worst
        return f"bf16 outputs, fp32 grads, max relative error vs fp32 {worst:.1e}"

    @check("DataParallel on NCCL: comm stream, CUDA multi-tensor pack, bf16 reduce")
    def _():
        from fastpar.data_parallel import DataParallel
        torch.manual_seed(2)
        net = torch.nn.Sequential(torch.nn.Linear(D, FF), torch.nn.GELU(),
                                  torch.nn.Linear(FF, D)).to(dev)
        ref = [p.detach().clone() for p in net.parameters()]
        ddp = DataParallel(net, dp_group=mesh.dp_group, bucket_cap_mb=4,
                           reduce_dtype=torch.bfloat16)
        x = torch.randn(256, D, device=dev)
        with torch.autocast(kind, dtype=torch.bfloat16):
            loss = ddp(x).float().square().mean()
        loss.backward()
        plain = torch.nn.Sequential(torch.nn.Linear(D, FF), torch.nn.GELU(),
                                    torch.nn.Linear(FF, D)).to(dev)
        with torch.no_grad():
            for p, r in zip(plain.parameters(), ref):
                p.copy_(r)
        with torch.autocast(kind, dtype=torch.bfloat16):
            plain(x).float().square().mean().backward()
        errs = [rel(p.grad, q.grad) for p, q in zip(net.parameters(), plain.parameters())]
        sync()
        assert max(errs) <= TOL, errs
        return f"gradients through bf16 buckets, max relative error {max(errs):.1e}"

    @check("mixed precision on CUDA: bf16 parameters, fp32 main gradients, fp32 masters")
    def _():
        from fastpar.data_parallel import DataParallel, DistributedOptimizer
        torch.manual_seed(3)
        net = torch.nn.Sequential(torch.nn.Linear(D, FF), torch.nn.GELU(),
                                  torch.nn.Linear(FF, D)).to(dev, torch.bfloat16)
        plain = [p.detach().clone().requires_grad_() for p in net.parameters()]
        ddp = DataParallel(net, dp_group=mesh.dp_group, main_grads=True)
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
        sync()
        assert max(errs) <= TOL and min(moved) > 0, (errs, moved)
        return (f"main gradients vs plain autograd, max relative error {max(errs):.1e}; "
                f"fused AdamW on the masters moved every parameter")

    torch.distributed.destroy_process_group()
    print(f"gpu_tp_check.py: {failures} failure(s)")
    return failures


if __name__ == "__main__":
    sys.exit(main())
