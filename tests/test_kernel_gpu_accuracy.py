"""Accuracy of the Triton kernels compiled on one CUDA GPU (not interpreted), in about a minute: the
large shapes the interpreted kernel tests beside this file cannot reach.

    TRITON_INTERPRET=0 python -m pytest tests/test_kernel_gpu_accuracy.py -m gpu -q -s

Checks, one test each, printing its largest errors:
  * rms_norm and layer_norm, forward and backward (y, dx, dw, db), 4096 rows at hidden 8192 (whole
    rows in registers) and 16384 (rows walked in column chunks), bf16 and fp32 inputs and weights,
    against the float64 torch op on the same values;
  * cross_entropy, forward and backward, 16384 tokens x 131200 classes of bf16 logits (2^31 + 2M
    elements: offsets past int32, a ragged last chunk; 1 in 20 targets ignored), against
    ``F.cross_entropy`` on the logits in fp32 (torch runs 2048 rows at a time);
  * grouped_mm (the MoE experts), forward and backward (y, dx, dw), 16384 rows over 8 uneven
    groups (one empty) at 4096 -> 14336 in bf16, against a loop of torch matmuls.

A result passes when its largest absolute error is at most twice torch's own error at the input
dtype (the same op run by torch in bf16 / fp32 against the same reference; flash-attention's rule),
plus one rounding to the output dtype at the reference's largest magnitude (at least 64 fp32 ulps,
for accumulation order): a kernel that rounds once can be half an ulp off where torch happened
not to be. Marked ``gpu``; skipped without a CUDA GPU and under the interpreter
(TRITON_INTERPRET=1, which tests/conftest.py sets when it is unset). Needs about 30 GiB of GPU
memory. bench/gpu_check.sh runs it as its ``accuracy`` step.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fastpar.kernels.launch import interpreting
from kernel_testing import randn

DEVICE = "cuda"
ROWS, HIDDENS = 4096, (8192, 16384)
TOKENS, VOCAB, IGNORE = 16384, 131200, -100
FP32_SLACK = 64 * torch.finfo(torch.float32).eps


def _skip_reason() -> str | None:
    if not torch.cuda.is_available():
        return ("needs a CUDA GPU (torch.cuda.is_available() is False): the kernels are checked "
                "compiled, not interpreted")
    if interpreting():
        return ("needs compiled kernels: TRITON_INTERPRET=1 would interpret these shapes for "
                "hours; run with TRITON_INTERPRET=0 (bench/gpu_check.sh does)")
    return None


SKIP = _skip_reason()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(SKIP is not None, reason=SKIP or "")]


@pytest.fixture(autouse=True)
def _compiled_triton(monkeypatch):
    """The Triton kernels, never the torch fallback; the GPU's memory freed after each check."""
    monkeypatch.setenv("FASTPAR_KERNEL_IMPL", "triton")
    yield
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


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


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("hidden", HIDDENS)
@pytest.mark.parametrize("op", ["rms_norm", "layer_norm"])
def test_norm_compiled_matches_torch(op, hidden, dtype):
    ok, summary = check_norm(op, hidden, dtype)
    print(f"{op} {ROWS}x{hidden} {str(dtype).removeprefix('torch.')}: {summary}")
    assert ok, summary


def test_cross_entropy_compiled_matches_torch():
    ok, summary = check_cross_entropy()
    print(f"cross_entropy {TOKENS}x{VOCAB} bf16: {summary}")
    assert ok, summary


def check_grouped_mm(dtype: torch.dtype):
    """The MoE experts' grouped GEMM at a Mixtral-like layer's size: 16384 rows over 8 uneven
    groups (one empty), 4096 -> 14336, forward and both gradients, against a loop of
    torch matmuls at the input dtype and in float64."""
    from fastpar.kernels import grouped_mm
    g = torch.Generator(device=DEVICE).manual_seed(1)
    counts = torch.tensor([4096, 1, 3000, 0, 2048, 5000, 239, 2000], device=DEVICE)
    N, K, M = int(counts.sum()), 4096, 14336
    with torch.device(DEVICE):
        x = randn(N, K, dtype=dtype, generator=g)
        w = randn(8, M, K, dtype=dtype, generator=g, scale=K ** -0.5)
        dy = randn(N, M, dtype=dtype, generator=g)

    def run(fn, *ts):
        leaves = [t.detach().clone().requires_grad_() for t in ts]
        y = fn(*leaves)
        y.backward(dy.to(y.dtype))
        return [y.detach()] + [t.grad for t in leaves]

    def loop(x, w):
        return torch.cat([xg @ w[e].T for e, xg in enumerate(x.split(counts.tolist()))])
    ours = run(lambda x, w: grouped_mm(x, w, counts), x, w)
    peer = run(loop, x, w)
    ref = run(loop, x.double(), w.double())
    return compare({n: (o, t, r) for n, o, t, r in zip(("y", "dx", "dw"), ours, peer, ref)})


@pytest.mark.parametrize("dtype", [torch.bfloat16], ids=["bf16"])
def test_grouped_mm_compiled_matches_torch(dtype):
    ok, summary = check_grouped_mm(dtype)
    print(f"grouped_mm 16384x4096 -> 14336, 8 groups {str(dtype).removeprefix('torch.')}: "
          f"{summary}")
    assert ok, summary
