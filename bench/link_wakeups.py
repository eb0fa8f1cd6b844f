"""Where a small gloo all-reduce's time goes on this machine: per round of back-to-back
all-reduces, the time per call beside the time the CPUs spent halted (cpuidle) per call.

    torchrun --nproc-per-node 2 bench/link_wakeups.py [--rounds 20] [--numel 16384]

A call that waits for its peer's message leaves a vCPU idle; in a VM a halted vCPU is woken by
the host, whose latency the guest cannot control. If the time per call follows the idle time
per call round by round, that wake-up latency is the link's cost (and its variation), which the
planner's calibration (`measure_link`: ``latency_us``, ``sync_us``) reads at one moment.
Linux only (``/sys/devices/system/cpu/cpu*/cpuidle``).
"""
from __future__ import annotations

import argparse
import glob
import statistics
import time

import torch
import torch.distributed as dist


def _idle() -> tuple[int, int]:
    """(halts, microseconds halted) summed over every CPU and idle state but polling."""
    halts = busy = 0
    for state in glob.glob("/sys/devices/system/cpu/cpu*/cpuidle/state*"):
        if open(f"{state}/name").read().strip() == "POLL":
            continue
        halts += int(open(f"{state}/usage").read())
        busy += int(open(f"{state}/time").read())
    return halts, busy


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--calls", type=int, default=100)
    ap.add_argument("--numel", type=int, default=16 * 1024, help="float32 elements (64 KB)")
    args = ap.parse_args()
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    x = torch.ones(args.numel)
    rows = []
    for _ in range(args.rounds):
        dist.barrier()
        h0, i0 = _idle()
        t0 = time.perf_counter()
        for _ in range(args.calls):
            dist.all_reduce(x)
        dt = (time.perf_counter() - t0) / args.calls
        h1, i1 = _idle()
        rows.append((dt * 1e3, (h1 - h0) / args.calls, (i1 - i0) / args.calls / 1e3))
    if dist.get_rank() == 0:
        print(f"{dist.get_world_size()} ranks, all-reduce of {4 * args.numel / 1024:.0f} KB")
        print("round  ms/call  halts/call  ms halted/call (all CPUs)")
        for k, (ms, halts, idle) in enumerate(rows):
            print(f"{k:5d}  {ms:7.3f}  {halts:10.1f}  {idle:8.3f}")
        ms, idle = [r[0] for r in rows], [r[2] for r in rows]
        print(f"ms/call {min(ms):.3f}-{max(ms):.3f}, median {statistics.median(ms):.3f}; "
              f"correlation with the time halted {statistics.correlation(ms, idle):.3f}; "
              f"median of (ms/call - ms halted/call) "
              f"{statistics.median(a - b for a, b in zip(ms, idle)):.3f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
