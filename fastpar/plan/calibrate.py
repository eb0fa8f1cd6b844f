"""Measure this machine into a :class:`Hardware` profile: ``fastpar plan --calibrate``.

- matmul: square GEMMs from 64 to 1024 in the training dtype (bf16 on a GPU, fp32 on a CPU);
  the best rate is the profile's peak (so ``matmul_efficiency`` is 1), the time of a tiny one
  its per-kernel overhead;
- memory: a 64 MB copy (read + write);
- links, under torchrun (or any initialised process group): all-reduces of 64 KB and 16 MB, solved
  for the per-step latency and the bandwidth of the ring model of :func:`cost.ring_time`.

With several ranks on one machine every rank measures at the same time, as they will train.
"""
from __future__ import annotations

import os
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist

from .hardware import Hardware, save_hardware


def _timed(fn, device, iters: int) -> float:
    """Median seconds of ``fn`` over ``iters`` calls, after two untimed ones."""
    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    for _ in range(2):
        fn()
    sync()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure_matmul(device: torch.device, dtype: torch.dtype,
                   sizes=(64, 128, 256, 512, 1024)) -> tuple[float, float]:
    """(best FLOP/s over ``sizes``, seconds of a tiny GEMM: the per-kernel overhead)."""
    best = 0.0
    for n in sizes:
        a, b = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(2))
        t = _timed(lambda: a @ b, device, iters=max(3, min(50, int(2e9 / n ** 3))))
        best = max(best, 2.0 * n ** 3 / t)
    a = torch.randn(8, 8, device=device, dtype=dtype)
    return best, _timed(lambda: a @ a, device, iters=200)


def measure_memory(device: torch.device) -> float:
    """Bytes per second of a 64 MB copy (read and write counted)."""
    src = torch.empty(16 * 2 ** 20, device=device, dtype=torch.float32).uniform_()
    dst = torch.empty_like(src)
    t = _timed(lambda: dst.copy_(src), device, iters=10)
    return 2 * src.numel() * 4 / t


def measure_link(group=None, device=None) -> tuple[float, float]:
    """(bytes per second, seconds of latency per ring step) of all-reduce over ``group``."""
    n = dist.get_world_size(group)
    small, large = 16 * 2 ** 10, 4 * 2 ** 20           # float32 elements: 64 KB and 16 MB
    times = {}
    for numel in (small, large):
        x = torch.ones(numel, device=device)

        def run():
            dist.all_reduce(x, group=group)
        dist.barrier(group=group)
        t = _timed(run, device or torch.device("cpu"), iters=5 if numel == large else 20)
        t = torch.tensor([t], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)   # the slowest rank's time
        times[numel] = float(t)
    steps, share = 2 * (n - 1), 2 * (n - 1) / n
    bw = share * 4 * (large - small) / max(times[large] - times[small], 1e-9)
    latency = max(0.0, (times[small] - share * 4 * small / bw) / steps)
    return bw, latency


def measure(name: str = "calibrated", group=None) -> Hardware:
    """This rank's profile; links are measured when a process group is initialised."""
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    peak, overhead = measure_matmul(device, dtype)
    mem_bw = measure_memory(device)
    if cuda:
        hbm = torch.cuda.get_device_properties(device).total_memory / 1e9
    else:
        ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        hbm = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9 / ranks
    link, latency = (mem_bw, 0.0)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
        link, latency = measure_link(group, device if cuda else None)
    return Hardware(name=name, peak_tflops=peak / 1e12, matmul_efficiency=1.0, hbm_gb=hbm,
                    hbm_gbps=mem_bw / 1e9, intra_node_gbps=link / 1e9, inter_node_gbps=link / 1e9,
                    collective_latency_us=latency * 1e6, kernel_overhead_us=overhead * 1e6,
                    bytes_per_element=2 if cuda else 4,
                    memory_reserve_gb=min(1.0, hbm / 4))


def calibrate(out: str | Path = "hardware.json", name: str | None = None) -> tuple[Hardware, Path]:
    """Measure (joining torchrun's process group if there is one) and write the profile from
    the first rank; returns it and the path."""
    started = False
    if "RANK" in os.environ and not dist.is_initialized():
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
        started = True
    hw = measure(name or Path(out).stem)
    path = Path(out)
    if not dist.is_initialized() or dist.get_rank() == 0:
        save_hardware(hw, path)
    if started:
        dist.destroy_process_group()
    return hw, path
