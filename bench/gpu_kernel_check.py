"""Accuracy of the Triton kernels compiled on one CUDA GPU (not interpreted), in about a minute.

    python bench/gpu_kernel_check.py

Checks, each on its own line, PASS or FAIL with its largest errors:
  * rms_norm and layer_norm, forward and backward (y, dx, dw, db), 4096 rows at hidden 8192 (whole
    rows in registers) and 16384 (rows walked in column chunks), bf16 and fp32 inputs and weights,
    against the float64 torch op on the same values;
  * cross_entropy, forward and backward, 16384 tokens x 131200 classes of bf16 logits (2^31 + 2M
    elements: offsets past int32, a ragged last chunk; 1 in 20 targets ignored), against
    ``F.cross_entropy`` on the logits in fp32 (torch runs 2048 rows at a time).

A result passes when its largest absolute error is at most twice torch's own error at the input
dtype (the same op run by torch in bf16 / fp32 against the same reference; flash-attention's rule),
plus one rounding to the output dtype at the reference's largest magnitude (at least 64 fp32 ulps,
for accumulation order): a kernel that rounds once can be half an ulp off where torch happened
not to be. The exit status
is 1 if any check failed, 2 without a CUDA GPU. Needs fastpar installed (``pip install -e .``) and
about 30 GiB of GPU memory.
"""
from __future__ import annotations

import os
import sys
import time

os.environ["TRITON_INTERPRET"] = "0"          # compiled kernels: set before triton is imported
os.environ["FASTPAR_KERNEL_IMPL"] = "triton"  # never the torch fallback

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

_BENCH = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, _BENCH)                                    # common
sys.path.append(os.path.join(os.path.dirname(_BENCH), "tests"))  # kernel_testing (randn)

DEVICE = "cuda"
ROWS, HIDDENS = 4096, (8192, 16384)
TOKENS, VOCAB, IGNORE = 16384, 131200, -100
FP32_SLACK = 64 * torch.finfo(torch.float32).eps


def max_err(a: torch.Tensor, ref: torch.Tensor, rows: int = 1024) -> float:
    """max |a - ref| in float64, row chunk by row chunk (no full-size temporaries); NaN if any."""
    a2, r2 = a.detach().reshape(-1, a.shape[-1]), ref.detach().reshape(-1, ref.shape[-1])
    worst = 0.0
    for i in range(0, a2.shape[0], rows):
        d = (a2[i:i + rows].double() - r2[i:i + rows].double()).abs()
        if d.isnan().any():
            return float("nan")
        worst = max(worst, d.max().item())
    return worst


def compare(named: dict) -> tuple[bool, str]:
    """``named``: {tensor: (kernel, torch at the input dtype, reference)} -> (ok, summary)."""
    ok, parts = True, []
    for name, (kernel, peer, ref) in named.items():
        err, peer_err = max_err(kernel, ref), max_err(peer, ref)
        slack = max(FP32_SLACK, torch.finfo(kernel.dtype).eps)         # one rounding
        bound = 2 * peer_err + slack * max(ref.detach().abs().max().item(), 1.0)
        ok &= err <= bound                    # False for NaN
        parts.append(f"{name} {err:.3g} (torch {peer_err:.3g}, bound {bound:.3g})")
    return ok, ", ".join(parts)


def _norm_inputs(op: str, hidden: int, dtype: torch.dtype):
    from kernel_testing import randn
    g = torch.Generator(device=DEVICE).manual_seed(hidden)
    with torch.device(DEVICE):
        x = randn(ROWS, hidden, dtype=dtype, scale=2.0, generator=g)
        if op == "layer_norm":
            x += 0.5                          # a mean to subtract
        w = randn(hidden, dtype=dtype, generator=g)
        b = randn(hidden, dtype=dtype, generator=g) if op == "layer_norm" else None
        return x, w, b, randn(ROWS, hidden, dtype=dtype, generator=g)


def _norm_run(fn, x, w, b, dy):
    """(y, dx, dw[, db]) of ``fn(x, w, b)`` for upstream ``dy``, on fresh leaves."""
    leaves = [t.detach().clone().requires_grad_() for t in (x, w, b) if t is not None]
    y = fn(*leaves)
    y.backward(dy.to(y.dtype))
    return [y] + [t.grad for t in leaves]


def check_norm(op: str, hidden: int, dtype: torch.dtype):
    from fastpar.kernels import layer_norm, rms_norm
    x, w, b, dy = _norm_inputs(op, hidden, dtype)
    if op == "rms_norm":
        kernel = lambda x, w: rms_norm(x, w, 1e-6)                        # noqa: E731
        peer = lambda x, w: F.rms_norm(x, (hidden,), w, 1e-6)             # noqa: E731
        names = ("y", "dx", "dw")
    else:
        kernel = lambda x, w, b: layer_norm(x, w, b, 1e-5)                # noqa: E731
        peer = lambda x, w, b: F.layer_norm(x, (hidden,), w, b, 1e-5)     # noqa: E731
        names = ("y", "dx", "dw", "db")
    ours = _norm_run(kernel, x, w, b, dy)
    torch_ = _norm_run(peer, x, w, b, dy)
    ref = _norm_run(peer, *(None if t is None else t.double() for t in (x, w, b, dy)))
    return compare({n: (o, t, r) for n, o, t, r in zip(names, ours, torch_, ref)})


def _torch_cross_entropy(logits, target, dloss, dtype, rows: int = 2048):
    """(loss, dlogits) of ``F.cross_entropy`` on the logits cast to ``dtype``, 2048 rows at a time
    (torch never sees the whole 2^31-element tensor, and fp32 copies stay small)."""
    loss = torch.empty(TOKENS, dtype=dtype, device=DEVICE)
    grad = torch.empty(TOKENS, VOCAB, dtype=dtype, device=DEVICE)
    for i in range(0, TOKENS, rows):
        z = logits[i:i + rows].to(dtype, copy=True).requires_grad_()
        part = F.cross_entropy(z, target[i:i + rows], reduction="none", ignore_index=IGNORE)
        part.backward(dloss[i:i + rows].to(dtype))
        loss[i:i + rows], grad[i:i + rows] = part.detach(), z.grad
    return loss, grad


def check_cross_entropy():
    from fastpar.kernels import cross_entropy
    g = torch.Generator(device=DEVICE).manual_seed(0)
    logits = torch.randn(TOKENS, VOCAB, generator=g, device=DEVICE, dtype=torch.bfloat16).mul_(4)
    target = torch.randint(0, VOCAB, (TOKENS,), generator=g, device=DEVICE)
    target[::20] = IGNORE
    dloss = torch.rand(TOKENS, generator=g, device=DEVICE)
    z = logits.detach().requires_grad_()
    loss = cross_entropy(z, target, IGNORE)                 # fp32 loss, bf16 gradient
    loss.backward(dloss)
    ours = (loss.detach(), z.grad)
    del z, loss
    peer = _torch_cross_entropy(logits, target, dloss, torch.bfloat16)
    ref = _torch_cross_entropy(logits, target, dloss, torch.float32)
    return compare({"loss": (ours[0][:, None], peer[0][:, None], ref[0][:, None]),
                    "dlogits": (ours[1], peer[1], ref[1])})


def run(name: str, fn) -> bool:
    """Run one check; print one line; never raise."""
    start = time.perf_counter()
    try:
        ok, summary = fn()
    except Exception as e:                    # reported as this check's failure, then go on
        ok, summary = False, f"{type(e).__name__}: {e}".replace("\n", " ")[:400]
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    print(f"{'PASS' if ok else 'FAIL'} {name} ({time.perf_counter() - start:.1f} s): {summary}",
          flush=True)
    return ok


def main() -> int:
    if not torch.cuda.is_available():
        print("gpu_kernel_check.py: torch sees no CUDA GPU here; run it on a GPU machine "
              "(the kernels are checked compiled, not interpreted)", file=sys.stderr)
        return 2
    try:
        import triton

        import common
        import fastpar.kernels  # noqa: F401
    except ImportError as e:
        print(f"gpu_kernel_check.py: {e}; install fastpar first (pip install -e .)",
              file=sys.stderr)
        return 2
    props = torch.cuda.get_device_properties(0)
    print(f"== {props.name}, {props.total_memory / 2**30:.0f} GiB; torch {torch.__version__}, "
          f"triton {triton.__version__}; host {common.machine()['host']}", flush=True)
    start = time.perf_counter()
    results = []
    for op in ("rms_norm", "layer_norm"):
        for hidden in HIDDENS:
            for dtype in (torch.bfloat16, torch.float32):
                name = f"{op} {ROWS}x{hidden} {str(dtype).removeprefix('torch.')}"
                results.append(run(name, lambda: check_norm(op, hidden, dtype)))
    results.append(run(f"cross_entropy {TOKENS}x{VOCAB} bf16", check_cross_entropy))
    failed = results.count(False)
    print(f"== {len(results) - failed} passed, {failed} failed in "
          f"{time.perf_counter() - start:.0f} s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
