"""Real collectives on a one-rank NCCL group, each result checked.

    python bench/nccl_check.py [--out DIR] [--mb 256]
    python bench/nccl_check.py --cpu [--out DIR]       # the same calls on gloo, no GPU needed

A dp=1 / tp=1 run on one GPU issues no collective (fastpar's bucket and TP paths skip a group of
one), so this issues them itself, on the group ``fastpar.init`` builds (NCCL options,
high-priority streams) and through ``fastpar.mesh.collectives`` (the calls training makes):

* all_reduce of a known tensor with NCCL's pre-multiplied sum (factor 3): on one rank NCCL itself
  computes 3 x, so the result shows the collective ran (a plain sum over one rank would equal its
  input whether or not anything ran). gloo has no pre-multiplied sum: the CPU run checks a sum;
* all_gather_into_tensor and reduce_scatter_tensor into NaN-poisoned outputs: each output must
  come back written with the input;
* the profiler's count of the backend's own ranges ("nccl:..." / "gloo:...") for these calls, and
  the checked all_reduce's median time over 20 calls (CUDA events) and GB/s read + written.

Writes DIR/nccl.json (each check with its result) and prints one line per check; exits 1 if any
check fails.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

FACTOR = 3.0


def _known(n: int, device) -> torch.Tensor:
    """0, 1, ..., 999, 0, 1, ... in fp32: exact, and exact times FACTOR."""
    return (torch.arange(n, device=device) % 1000).float()


def _poisoned(n: int, device) -> torch.Tensor:
    return torch.full((n,), float("nan"), device=device)


def _reduce_op(mesh):
    """NCCL's pre-multiplied sum by FACTOR (computed by NCCL even on one rank); gloo's sum."""
    return (dist._make_nccl_premul_sum(FACTOR) if mesh.device.type == "cuda" else
            dist.ReduceOp.SUM)


def run_checks(mesh, n: int) -> dict:
    """Each check's result on the mesh's dp group (one rank)."""
    from fastpar.mesh import collectives

    group, dev = mesh.dp_group, mesh.device
    nccl = mesh.device.type == "cuda"
    x = _known(n, dev)
    checks = {}

    buf = x.clone()
    collectives.all_reduce(buf, op=_reduce_op(mesh), group=group, async_op=True).wait()
    want = x * FACTOR if nccl else x
    checks["all_reduce"] = {"op": "premul_sum x3" if nccl else "sum",
                            "ok": bool(torch.equal(buf, want))}

    out = _poisoned(n, dev)
    collectives.all_gather_into_tensor(out, x, group=group)
    checks["all_gather_into_tensor"] = {"ok": bool(torch.equal(out, x))}

    out = _poisoned(n, dev)
    collectives.reduce_scatter_tensor(out, x.clone(), group=group)
    checks["reduce_scatter_tensor"] = {"ok": bool(torch.equal(out, x))}
    return checks


def backend_ranges(mesh, n: int) -> int:
    """How many of the profiler's events are the backend's own ("nccl:" / "gloo:") for one
    all_reduce, all-gather and reduce-scatter."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if mesh.device.type == "cuda"
                                     else [])
    with profile(activities=acts) as prof:
        run_checks(mesh, n)
        if mesh.device.type == "cuda":
            torch.cuda.synchronize()
    prefix = "nccl" if mesh.device.type == "cuda" else "gloo"
    return sum(e.name.lower().startswith(prefix) for e in prof.events())


def all_reduce_ms(mesh, n: int, reps: int = 20) -> float:
    """Median ms of one all_reduce of n fp32 values with the checked op (on one NCCL rank the
    pre-multiplied sum reads and writes every value; a plain sum in place would move nothing).
    CUDA events; a host clock on CPU."""
    from fastpar.mesh import collectives

    buf, op = _known(n, mesh.device), _reduce_op(mesh)
    times = []
    for _ in range(reps + 3):
        if mesh.device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            collectives.all_reduce(buf, op=op, group=mesh.dp_group)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            collectives.all_reduce(buf, op=op, group=mesh.dp_group)
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times[3:])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=".", help="folder for nccl.json")
    p.add_argument("--mb", type=float, default=256.0, help="MiB of the all_reduce (fp32)")
    p.add_argument("--cpu", action="store_true", help="gloo on CPU instead of NCCL")
    args = p.parse_args()
    if not args.cpu and not torch.cuda.is_available():
        sys.exit("nccl_check.py needs a CUDA GPU (torch.cuda.is_available() is False); --cpu "
                 "runs the same calls on gloo")
    import fastpar

    mesh = fastpar.init(backend="gloo" if args.cpu else "nccl")
    backend = dist.get_backend(mesh.dp_group)
    n = int(args.mb * 2**20) // 4
    checks = run_checks(mesh, n)
    ranges = backend_ranges(mesh, min(n, 2**20))
    ms = all_reduce_ms(mesh, n)
    gbs = 2 * 4 * n / ms / 1e6                      # bytes read and written, GB/s
    result = {"backend": backend, "world_size": dist.get_world_size(), "elements": n,
              "device": torch.cuda.get_device_name(0) if not args.cpu else "cpu",
              "checks": checks, "backend_ranges": ranges, "all_reduce_ms": ms,
              "all_reduce_GB/s": gbs, "torch": torch.__version__}
    if not args.cpu:
        result["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "nccl.json").write_text(json.dumps(result, indent=2))
    for name, check in checks.items():
        print(f"{backend} {name}{' (' + check['op'] + ')' if 'op' in check else ''}: "
              f"{'ok' if check['ok'] else 'WRONG RESULT'}")
    ok = sum(check["ok"] for check in checks.values())
    print(f"{backend}: {ok}/{len(checks)} collectives right (all_reduce "
          f"{checks['all_reduce']['op']}), {ranges} {backend} ranges in the profiler, all_reduce "
          f"of {args.mb:g} MiB {ms:.3f} ms = {gbs:.0f} GB/s read + written (median of 20)")
    dist.destroy_process_group()
    failed = [name for name, check in checks.items() if not check["ok"]]
    if failed:
        sys.exit(f"nccl_check.py: wrong result from {', '.join(failed)}")


if __name__ == "__main__":
    main()
