"""Ring attention's memory and precision: peak memory of forward + backward grows linearly with
the local sequence length (no block materialises its score matrix), and the blocks compute in
the activations' dtype (bf16 under autocast or with bf16 inputs), on 2 gloo ranks.

Peak memory is read from ``torch.profiler`` with ``profile_memory=True``: it records every
allocation and free of torch's CPU allocator, inside kernels included (the flash kernel's own
scratch, which a TorchDispatchMode would not see), on every thread. Walking those records in time
order, the running sum of their bytes is the memory allocated since the profiler started, and its
maximum the peak above the inputs (deterministic: the same ops allocate the same bytes). The
ranks run one thread each, so the kernel's per-thread scratch is one tile of a fixed size.

What a rank holds, in units of U = the bytes of its q (B, h, S_local, hd): its out and the fp32
out/lse accumulators, the k/v message and the next one (each 2 h_kv / h U), a block's outputs,
then dq, dk, dv with their fp32 accumulators and the dk/dv message in flight: about 11 U at
h = 2 h_kv. A block that materialises its (B, h, Sq, Sk) scores adds S_local / hd U per score-sized
temporary (64 U each at S_local = 2048, hd = 32), growing with the square of the length.
"""
import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

from fastpar.context_parallel import ring_attention
from fastpar.testing import run_ranks

B, H, H_KV, HD = 1, 4, 2, 32
LENGTHS = (512, 2048)           # local tokens per rank (sequence 1K and 4K over cp = 2)
GROWTH_U = 16                   # the peak may grow by at most this many U's worth of bytes


def _inputs(s_local, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, n, s_local, HD, generator=g).to(dtype) for n in (H, H_KV, H_KV, H)]


def _fwd_bwd(q, k, v, dout, group):
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    ring_attention(q, k, v, group).backward(dout)


def peak_bytes(fn) -> int:
    """Peak bytes allocated by torch's CPU allocator while ``fn()`` runs, above what was
    allocated before it (see the module doc)."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    records = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                     key=lambda e: e.start_ns())
    now = peak = 0
    for e in records:
        now += e.nbytes()
        peak = max(peak, now)
    return peak


def _peaks(rank, cp):
    torch.set_num_threads(1)
    peaks = {}
    for s in LENGTHS:
        args = _inputs(s, seed=rank)
        _fwd_bwd(*args, dist.group.WORLD)               # warm-up: one-off allocations
        peaks[s] = peak_bytes(lambda: _fwd_bwd(*args, dist.group.WORLD))
    return peaks


def test_peak_memory_grows_linearly_with_the_local_length():
    lo, hi = LENGTHS
    u = {s: B * H * s * HD * 4 for s in LENGTHS}          # bytes of q (fp32)
    for peaks in run_ranks(_peaks, 2, timeout=60):
        mib = {s: f"{p / 2**20:.1f} MiB" for s, p in peaks.items()}
        # 4x the tokens: 4x the memory when linear, up to 16x with a score matrix.
        assert peaks[hi] < 6 * peaks[lo], mib
        assert peaks[hi] - peaks[lo] <= GROWTH_U * (u[hi] - u[lo]), (mib, GROWTH_U)


# -- the blocks compute in the activations' dtype ---------------------------------------------

FLASH = ("aten::_scaled_dot_product_flash_attention_for_cpu",
         "aten::_scaled_dot_product_flash_attention_for_cpu_backward")


def _kernel_dtypes(rank, cp):
    """The input dtypes of every block kernel call (forward: q, k, v; backward: dout, q, k, v,
    out), as the profiler recorded them, per run."""
    q, k, v, dout = _inputs(32, seed=rank)
    bf16 = [t.to(torch.bfloat16) for t in (q, k, v, dout)]
    runs = {"fp32": lambda: _fwd_bwd(q, k, v, dout, dist.group.WORLD),
            "bf16 tensors": lambda: _fwd_bwd(*bf16, dist.group.WORLD)}

    def autocast():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            _fwd_bwd(q, k, v, bf16[3], dist.group.WORLD)
    runs["autocast"] = autocast
    seen = {}
    for name, run in runs.items():
        with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
            run()
        seen[name] = [(e.name, e.input_dtypes[:3 if e.name == FLASH[0] else 5])
                      for e in prof.events() if e.name in FLASH]
    return seen


def test_blocks_compute_in_the_activation_dtype():
    for seen in run_ranks(_kernel_dtypes, 2, timeout=60):
        for run, dtype in (("fp32", "float"), ("bf16 tensors", "c10::BFloat16"),
                           ("autocast", "c10::BFloat16")):
            calls = seen[run]
            # cp = 2 blocks forward and 2 backward, each one fused kernel call.
            assert sorted(name for name, _ in calls) == sorted(FLASH * 2), (run, calls)
            assert all(set(dtypes) == {dtype} for _, dtypes in calls), (run, calls)

