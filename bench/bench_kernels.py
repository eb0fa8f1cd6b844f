"""fastpar.kernels against torch eager and torch.compile at 1-8B-parameter shapes, on one GPU.

    python bench/bench_kernels.py [--ops rms_norm,swiglu] [--quick] [--no-compile] [--budget 400]

Shapes (bf16): "4k" = 4096 tokens of a hidden-4096 model (FFN 11008, 32 heads, vocab 32000) and
"16k" = 16384 tokens of a hidden-8192 model (FFN 28672, 64 heads, vocab 128256). For each op,
shape and pass (forward, forward + backward) it prints the median time of each implementation
(``triton.testing.do_bench``, L2 flushed between runs), the fused kernels' bandwidth from the
fewest bytes the op must move (GB/s and % of this device's measured copy bandwidth), the speedup
over each peer (peer time / fastpar time), and the peak memory one call allocates above its
inputs. Rows go to bench/results/kernels.json.

On a machine without CUDA it refuses at once: under the Triton interpreter these shapes would take
hours.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

SHAPES = {"4k": dict(tokens=4096, hidden=4096, ffn=11008, heads=32, kv=8, vocab=32000),
          "16k": dict(tokens=16384, hidden=8192, ffn=28672, heads=64, kv=8, vocab=128256)}
COLUMNS = ["op", "shape", "pass", "fastpar_ms", "eager_ms", "compile_ms", "GB/s", "%copy",
           "x_eager", "x_compile", "peak_MiB", "eager_peak_MiB", "compile_peak_MiB", "max_rel_err"]


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


def _cases(s: dict, dev: str):
    """(op, inputs, fused, eager, fwd bytes, bwd bytes) for one shape."""
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
        ("rms_norm", (x, w), lambda x, w: K.rms_norm(x, w),
         lambda x, w: F.rms_norm(x, (H,), w, 1e-6), 2 * MH, 3 * MH),
        ("layer_norm", (x, w, b), lambda x, w, b: K.layer_norm(x, w, b),
         lambda x, w, b: F.layer_norm(x, (H,), w, b), 2 * MH, 3 * MH),
        ("swiglu", (g, u), K.swiglu, lambda g, u: F.silu(g) * u, 3 * MF, 5 * MF),
        ("bias_gelu", (h4, b4), K.bias_gelu,
         lambda x, b: F.gelu(x + b, approximate="tanh"), 2 * M4, 3 * M4),
        ("bias_dropout_add", (x, b, x.clone()),
         lambda x, b, r: K.bias_dropout_add(x, b, r, 0.1, True, seed=1, offset=0),
         lambda x, b, r: r + F.dropout(x + b, 0.1, True), 3 * MH, 2 * MH),
        ("rotary", (q, k), lambda q, k: K.rotary(q, k, cos, sin),
         lambda q, k: (rope(q), rope(k)), 2 * QK, 2 * QK),
        ("cross_entropy", (logits,), lambda z: K.cross_entropy(z, target),
         lambda z: F.cross_entropy(z, target, reduction="none"), T * V * es, 2 * T * V * es),
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


def run_case(case, shape, compile_peers, copy_gbs) -> list[dict]:
    op, inputs, fused, eager, fwd_bytes, bwd_bytes = case
    compiled = torch.compile(eager) if compile_peers else None
    err = _rel_err(fused, eager, inputs) if not op.startswith("bias_dropout") else None
    rows = []
    for name, backward in [("fwd", False), ("fwd+bwd", True)]:
        row = {"op": op, "shape": shape, "pass": name, "max_rel_err": err}
        impls = {"fastpar": fused, "eager": eager, "compile": compiled}
        for impl, fn in impls.items():
            if fn is None:
                continue
            step = _step(fn, inputs, backward)
            step()                                   # compile outside the timing
            row[f"{impl}_ms"] = _bench(step)
            row["peak_MiB" if impl == "fastpar" else f"{impl}_peak_MiB"] = _peak_mib(step)
        ms = row["fastpar_ms"]
        row["GB/s"] = (fwd_bytes + (bwd_bytes if backward else 0)) / ms / 1e6
        row["%copy"] = 100 * row["GB/s"] / copy_gbs
        for peer in ("eager", "compile"):
            if f"{peer}_ms" in row:
                row[f"x_{peer}"] = row[f"{peer}_ms"] / ms
        rows.append(row)
        print(" ".join(f"{k}={common._fmt(v)}" for k, v in row.items()), flush=True)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ops", default="", help="comma-separated op names (default: all)")
    p.add_argument("--quick", action="store_true", help="the 4k shape only")
    p.add_argument("--no-compile", action="store_true", help="skip the torch.compile peers")
    p.add_argument("--budget", type=float, default=400.0,
                   help="seconds; later cases are skipped once this is spent")
    args = p.parse_args()
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
    rows, skipped = [], []
    for shape in ["4k"] if args.quick else ["16k", "4k"]:   # the 8B shapes first
        cases = _cases(SHAPES[shape], "cuda")
        for case in cases:
            if ops and case[0] not in ops:
                continue
            if time.time() - start > args.budget:
                skipped.append(f"{case[0]}@{shape}")
                continue
            rows += run_case(case, shape, not args.no_compile, copy_gbs)
        del cases
        torch.cuda.empty_cache()
    for r in rows:
        r["copy_GB/s"] = copy_gbs
    common.report("kernels", rows, COLUMNS)
    if skipped:
        print(f"skipped (over the {args.budget:.0f} s budget): {', '.join(skipped)}")
    print(f"total {time.time() - start:.0f} s")


if __name__ == "__main__":
    main()
