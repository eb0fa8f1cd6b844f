"""fastpar.kernels and the TP overlap ops against torch at 7-8B-parameter shapes, on one GPU.

    python bench/bench_kernels.py [--ops rms_norm,swiglu] [--shapes 4k,16k] [--no-compile]
                                  [--budget 400] [--out DIR]

Shapes (bf16): "4k" = 4096 tokens of the 7b preset (hidden 4096, FFN 11008, 32 heads, vocab
32000) and "16k" = 16384 tokens of a hidden-8192 model (FFN 28672, 64 heads, vocab 128256). The
ops run in the order the model uses them: the norms, rotary, swiglu, cross-entropy,
bias-dropout-add (bias-gelu last: the GELU MLP), then the TP overlap ops of fastpar._C as they run
at tp=1 (one GPU, a one-rank NCCL group) against torch's GEMM and collective on the same group.
For each op, shape and pass (forward, forward + backward) it prints the median time of each
implementation (``triton.testing.do_bench``, L2 flushed between runs), the fused kernels'
bandwidth from the fewest bytes the op must move (GB/s and % of this device's measured copy
bandwidth) or the GEMMs' TFLOP/s, the speedup over each peer (peer time / fastpar time), and the
peak memory one call allocates above its inputs. Rows go to DIR/kernels.json (default
bench/results); the torch.compile peers are skipped with ``--no-compile`` (each costs a compile).

A case not started within ``--budget`` seconds, or one that raised, is listed at the end and makes
the exit status 1: every case asked for either ran or is named. On a machine without CUDA it
refuses at once: under the Triton interpreter these shapes would take hours.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

SHAPES = {"4k": dict(tokens=4096, hidden=4096, ffn=11008, heads=32, kv=8, vocab=32000),
          "16k": dict(tokens=16384, hidden=8192, ffn=28672, heads=64, kv=8, vocab=128256)}
COLUMNS = ["op", "shape", "pass", "fastpar_ms", "eager_ms", "compile_ms", "GB/s", "%copy",
           "TFLOP/s", "x_eager", "x_compile", "peak_MiB", "eager_peak_MiB", "compile_peak_MiB",
           "max_rel_err"]


def _bench(fn) -> float:
    import triton.testing
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def _peak_mib(fn) -> float:
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def copy_bandwidth() -> float:
    """GB/s of a 4 GiB device-to-device copy, counting bytes read and written."""
    src = torch.empty(2**31, dtype=torch.int16, device="cuda").random_()
    dst = torch.empty_like(src)
    ms = _bench(lambda: dst.copy_(src))
    del src, dst
    return 2 * 2**32 / ms / 1e6


class Case(NamedTuple):
    op: str
    inputs: tuple
    fused: Callable
    eager: Callable
    bytes: tuple[int, int] | None = None   # fewest bytes moved (forward, backward): GB/s
    flops: float | None = None             # GEMM flops of one call (forward only): TFLOP/s


def _cases(s: dict, dev: str) -> list[Case]:
    """The kernels at one shape, in the order the model runs them (bias_gelu last: only the
    GELU MLP of the gpt2 preset uses it)."""
    import fastpar.kernels as K

    bf = dict(dtype=torch.bfloat16, device=dev)
    T, H, Fd, V = s["tokens"], s["hidden"], s["ffn"], s["vocab"]
    D = 128
    x, w, b = torch.randn(T, H, **bf), torch.rand(H, **bf) + 0.5, torch.randn(H, **bf)
    g, u = torch.randn(T, Fd, **bf), torch.randn(T, Fd, **bf)
    h4 = torch.randn(T, 4 * H, **bf)
    b4 = torch.randn(4 * H, **bf)
    q, k = torch.randn(1, T, s["heads"], D, **bf), torch.randn(1, T, s["kv"], D, **bf)
    phase = torch.arange(T, device=dev)[:, None] * 10000.0 ** (
        -torch.arange(0, D, 2, device=dev) / D)
    cos, sin = phase.cos().to(torch.bfloat16), phase.sin().to(torch.bfloat16)
    logits = torch.randn(T, V, **bf) * 3
    target = torch.randint(0, V, (T,), device=dev)

    def rope(t):
        c, sn = cos[:, None, :], sin[:, None, :]
        t1, t2 = t[..., :D // 2], t[..., D // 2:]
        return torch.cat([t1 * c - t2 * sn, t2 * c + t1 * sn], -1)

    es, MH, MF, M4 = 2, T * H * 2, T * Fd * 2, T * 4 * H * 2
    QK = (q.numel() + k.numel()) * es
    return [
        Case("rms_norm", (x, w), lambda x, w: K.rms_norm(x, w),
             lambda x, w: F.rms_norm(x, (H,), w, 1e-6), (2 * MH, 3 * MH)),
        Case("layer_norm", (x, w, b), lambda x, w, b: K.layer_norm(x, w, b),
             lambda x, w, b: F.layer_norm(x, (H,), w, b), (2 * MH, 3 * MH)),
        Case("rotary", (q, k), lambda q, k: K.rotary(q, k, cos, sin),
             lambda q, k: (rope(q), rope(k)), (2 * QK, 2 * QK)),
        Case("swiglu", (g, u), K.swiglu, lambda g, u: F.silu(g) * u, (3 * MF, 5 * MF)),
        Case("cross_entropy", (logits,), lambda z: K.cross_entropy(z, target),
             lambda z: F.cross_entropy(z, target, reduction="none"), (T * V * es, 2 * T * V * es)),
        Case("bias_dropout_add", (x, b, x.clone()),
             lambda x, b, r: K.bias_dropout_add(x, b, r, 0.1, True, seed=1, offset=0),
             lambda x, b, r: r + F.dropout(x + b, 0.1, True), (3 * MH, 2 * MH)),
        Case("bias_gelu", (h4, b4), K.bias_gelu,
             lambda x, b: F.gelu(x + b, approximate="tanh"), (2 * M4, 3 * M4)),
    ]


def _tp_cases(s: dict, dev: str, group) -> list[Case]:
    """fastpar._C's GEMM <-> collective ops at tp=1 (the group of one rank this GPU holds)
    against torch's GEMM then the same collective on the same group: what the overlap costs
    where there is nothing to overlap."""
    import torch.distributed as dist
    from fastpar import extension

    bf = dict(dtype=torch.bfloat16, device=dev)
    T, H, Fd = s["tokens"], s["hidden"], s["ffn"]
    x_ff, w_hf = torch.randn(T, Fd, **bf), torch.randn(H, Fd, **bf) / Fd ** 0.5    # row linear
    x_h, w_fh = torch.randn(T, H, **bf), torch.randn(Fd, H, **bf) / H ** 0.5       # column
    g = torch.randn(T, Fd, **bf)
    gemm = 2.0 * T * H * Fd

    def all_reduced(y):
        dist.all_reduce(y, group=group)
        return y

    # torch 2.13 renamed the tensor-in, tensor-out collectives.
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

    def gathered_matmul(x, w):
        full = torch.empty_like(x)
        gather(full, x, group=group)
        return full @ w.t()

    def matmul_scattered(x, w):
        y = x @ w.t()
        out = torch.empty_like(y)
        scatter(out, y, group=group)
        return out

    def column_backward(g, x, w):
        gx = g @ w
        dist.all_reduce(gx, group=group)
        return gx, g.t() @ x

    return [
        Case("tp_matmul_allreduce", (x_ff, w_hf),
             lambda x, w: extension.matmul_allreduce(x, w, group, 4),
             lambda x, w: all_reduced(x @ w.t()), flops=gemm),
        Case("tp_allgather_matmul", (x_h, w_fh),
             lambda x, w: extension.allgather_matmul(x, w, group)[0], gathered_matmul, flops=gemm),
        Case("tp_matmul_reducescatter", (x_ff, w_hf),
             lambda x, w: extension.matmul_reducescatter(x, w, group), matmul_scattered,
             flops=gemm),
        Case("tp_column_linear_backward", (g, x_h, w_fh),
             lambda g, x, w: extension.column_linear_backward(g, x, w, group, False, True, True,
                                                              4),
             column_backward, flops=2 * gemm),
    ]


def _tuple(out) -> tuple:
    return out if isinstance(out, tuple) else (out,)


def _step(fn, inputs, backward):
    """A closure running fn forward, or forward and backward with a fixed upstream gradient."""
    if not backward:
        return lambda: fn(*inputs)
    leaves = [t.detach().requires_grad_(t.is_floating_point()) for t in inputs]
    grads = [t for t in leaves if t.requires_grad]
    douts = [torch.randn_like(o) for o in _tuple(fn(*leaves))]
    return lambda: torch.autograd.grad(_tuple(fn(*leaves)), grads, douts)


def _rel_err(fused, eager, inputs) -> float:
    with torch.no_grad():
        a, b = fused(*inputs), eager(*inputs)
    return max(((x.double() - y.double()).norm() / y.double().norm().clamp_min(1e-30)).item()
               for x, y in zip(_tuple(a), _tuple(b)))


def run_case(case: Case, shape, compile_peers, copy_gbs) -> list[dict]:
    compiled = torch.compile(case.eager) if compile_peers and case.bytes else None
    err = None if case.op.startswith("bias_dropout") else _rel_err(case.fused, case.eager,
                                                                    case.inputs)
    rows = []
    for name, backward in [("fwd", False), ("fwd+bwd", True)][:2 if case.bytes else 1]:
        row = {"op": case.op, "shape": shape, "pass": name, "max_rel_err": err}
        impls = {"fastpar": case.fused, "eager": case.eager, "compile": compiled}
        for impl, fn in impls.items():
            if fn is None:
                continue
            step = _step(fn, case.inputs, backward)
            step()                                   # compile outside the timing
            row[f"{impl}_ms"] = _bench(step)
            row["peak_MiB" if impl == "fastpar" else f"{impl}_peak_MiB"] = _peak_mib(step)
        ms = row["fastpar_ms"]
        if case.bytes:
            row["GB/s"] = (case.bytes[0] + (case.bytes[1] if backward else 0)) / ms / 1e6
            row["%copy"] = 100 * row["GB/s"] / copy_gbs
        if case.flops:
            row["TFLOP/s"] = case.flops / ms / 1e9
        for peer in ("eager", "compile"):
            if f"{peer}_ms" in row:
                row[f"x_{peer}"] = row[f"{peer}_ms"] / ms
        rows.append(row)
        print(" ".join(f"{k}={common._fmt(v)}" for k, v in row.items()), flush=True)
    return rows


def _one_rank_group():
    """The one-rank NCCL group fastpar.init builds on this GPU, or (None, why not)."""
    try:
        import fastpar
        from fastpar import extension  # noqa: F401  (the compiled ops must load)
        return fastpar.init(backend="nccl").tp_group, None
    except Exception as e:                  # a build without CUDA, or NCCL failing to start
        return None, f"{type(e).__name__}: {e}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ops", default="", help="comma-separated op names (default: all)")
    p.add_argument("--shapes", default="4k,16k", help=f"comma-separated, of {sorted(SHAPES)}")
    p.add_argument("--quick", action="store_true", help="the 4k shape only")
    p.add_argument("--no-compile", action="store_true", help="skip the torch.compile peers")
    p.add_argument("--no-tp", action="store_true", help="skip the TP overlap ops")
    p.add_argument("--budget", type=float, default=400.0,
                   help="seconds; a case that would end past it is not started")
    p.add_argument("--out", default=str(common.RESULTS), help="folder for kernels.json")
    args = p.parse_args()
    shapes = ["4k"] if args.quick else [s for s in args.shapes.split(",") if s]
    if not shapes or set(shapes) - set(SHAPES):
        p.error(f"--shapes {args.shapes!r}: choose from {sorted(SHAPES)}")
    if not torch.cuda.is_available():
        sys.exit("bench_kernels.py needs a CUDA GPU and found none (torch.cuda.is_available() is "
                 "False). On CPU the Triton interpreter would take hours at these shapes; run it "
                 "on a GPU machine, e.g. with bench/gpu_check.sh.")
    if os.environ.get("TRITON_INTERPRET") == "1":
        sys.exit("bench_kernels.py: unset TRITON_INTERPRET (=1 runs the CPU interpreter)")
    torch.manual_seed(0)
    start = time.time()
    copy_gbs = copy_bandwidth()
    print(f"device {torch.cuda.get_device_name(0)}, copy bandwidth {copy_gbs:.0f} GB/s, "
          f"torch {torch.__version__}", flush=True)
    ops = set(filter(None, args.ops.split(",")))
    group, why_no_tp = (None, "--no-tp") if args.no_tp else _one_rank_group()
    rows, missed, longest = [], [], 0.0
    for shape in shapes:
        cases = _cases(SHAPES[shape], "cuda")
        if group is not None:
            cases += _tp_cases(SHAPES[shape], "cuda", group)
        elif not args.no_tp:
            missed.append(f"tp ops@{shape} ({why_no_tp})")
        for case in cases:
            if ops and case.op not in ops:
                continue
            t0 = time.time()
            if t0 - start + longest > args.budget:      # would end past the budget
                missed.append(f"{case.op}@{shape} (budget)")
                continue
            try:
                rows += run_case(case, shape, not args.no_compile, copy_gbs)
            except Exception as e:                      # keep measuring the others
                missed.append(f"{case.op}@{shape} ({type(e).__name__}: {e})")
                print(f"{case.op}@{shape} failed: {type(e).__name__}: {e}", flush=True)
            longest = max(longest, time.time() - t0)
        del cases
        torch.cuda.empty_cache()
    for r in rows:
        r["copy_GB/s"] = copy_gbs
    common.RESULTS = Path(args.out)
    if rows:
        common.report("kernels", rows, COLUMNS)
    print(f"total {time.time() - start:.0f} s, {len(rows)} rows")
    if group is not None:
        torch.distributed.destroy_process_group()
    if missed:
        sys.exit(f"not measured ({len(missed)}): {'; '.join(missed)}")


if __name__ == "__main__":
    main()
