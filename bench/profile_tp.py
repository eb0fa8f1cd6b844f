"""Where a tensor-parallel training step spends its time: fastpar's trainer step against the
installed torchtitan's (bench/bench_train.py builds both), profiled op by op on 2 gloo ranks.

    python bench/profile_tp.py [--models tiny small] [--layouts tp2 tp2-sp]
        [--titan-backend spmd_types] [--steps 3]

Per model and layout, for each side (rank 0's profile of one step after two warm-ups; the
unprofiled ms/step is the mean of ``--steps`` steps between barriers):
  - ops: aten calls per step, and the ops whose self time differs most between the sides
    (count and self ms on each);
  - collectives: every ``c10d`` op that reached the dispatcher in one more step (a dispatch
    mode sees those DTensor's dispatch and the extension's C++ issue, which the Python-level
    wire recorder misses), count and bytes sent per rank by kind (ring algorithms over the 2
    ranks);
  - host syncs (``aten::_local_scalar_dense``, less those inside CPU fused AdamW, which reads
    each step count on the host where its CUDA kernel does not), copies (``aten::copy_`` calls and bytes),
    the optimizer (``Optimizer.step``) and the clipping norm (``aten::linalg_vector_norm`` and
    the ops of ``clip``);
  - overhead: the same step at 8 tokens per sequence (compute about nil), i.e. what Python,
    autograd and dispatch cost per step whatever the shape, and per layer.
Self times come from the profiler, which slows every op alike; the ms/step columns do not.
"""
from __future__ import annotations

import argparse
import collections
import math
import os
import sys
import time

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_train as bt  # noqa: E402

import fastpar  # noqa: E402
from fastpar import extension  # noqa: E402
from fastpar.testing import run_ranks  # noqa: E402

SIDES = ("fastpar", "torchtitan")
_ITEMSIZE = {"float": 4, "c10::BFloat16": 2, "c10::Half": 2, "double": 8, "long int": 8,
             "int": 4, "bool": 1}


def _nbytes(t) -> int:
    if isinstance(t, (list, tuple)):
        return sum(_nbytes(u) for u in t)
    return t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0


def _sent(op: str, args, n: int) -> int:
    """Bytes one rank sends for a c10d op over ``n`` ranks (ring algorithms; an all-to-all
    sends what its splits route to other ranks)."""
    if op == "allreduce_":
        return 2 * (n - 1) * _nbytes(args[0]) // n
    if op in ("_allgather_base_", "allgather_", "allgather_into_tensor_coalesced_"):
        return (n - 1) * _nbytes(args[1])
    if op in ("_reduce_scatter_base_", "reduce_scatter_", "reduce_scatter_tensor_coalesced_"):
        return (n - 1) * _nbytes(args[0])
    if op == "alltoall_base_":
        inp, splits = args[1], list(args[3])
        row = _nbytes(inp) // max(inp.shape[0], 1)
        return row * (sum(splits) - splits[dist.get_rank()]) if splits else \
            (n - 1) * _nbytes(inp) // n
    if op == "send":
        return _nbytes(args[0])
    return 0


class _Collectives(TorchDispatchMode):
    """Every c10d op that reaches the dispatcher (from Python, DTensor's dispatch or the
    extension's C++ alike): count and bytes sent per kind."""

    def __init__(self, n: int):
        super().__init__()
        self.n, self.kinds = n, collections.defaultdict(lambda: [0, 0])

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._opname
        if func.namespace == "c10d" and name not in ("barrier", "monitored_barrier"):
            self.add(name, _sent(name, args, self.n))
        elif func.namespace == "_c10d_functional" and name in _FUNCTIONAL:
            self.add(_FUNCTIONAL[name], _ring(_FUNCTIONAL[name], _nbytes(args[0]), self.n,
                                              input_is_whole=name != "all_gather_into_tensor"))
        return func(*args, **(kwargs or {}))

    def add(self, kind: str, sent: int) -> None:
        row = self.kinds[kind]
        row[0] += 1
        row[1] += sent

    def add_native(self, events) -> None:
        """The extension's collectives, from its own log (``coll:<kind>``, the whole tensor's
        bytes): its C++ calls c10d below the dispatch mode."""
        for name, nbytes, _ in events:
            if name.startswith("coll:"):
                kind = _NATIVE[name[5:]]
                self.add(f"{kind} (fastpar extension)", _ring(kind, nbytes, self.n))


_FUNCTIONAL = {"all_reduce": "allreduce_", "all_gather_into_tensor": "_allgather_base_",
               "reduce_scatter_tensor": "_reduce_scatter_base_"}
_NATIVE = {"all_reduce": "allreduce_", "all_gather": "_allgather_base_",
           "reduce_scatter": "_reduce_scatter_base_"}


def _ring(kind: str, nbytes: int, n: int, input_is_whole: bool = True) -> int:
    """Bytes a rank sends for a ring collective of ``nbytes`` (the whole tensor; for an
    all-gather given its input, ``input_is_whole=False``, that input is 1/n of it)."""
    whole = nbytes if input_is_whole else n * nbytes
    return (2 if kind == "allreduce_" else 1) * (n - 1) * whole // n


def _under(e, name: str) -> bool:
    while e is not None:
        if e.name == name:
            return True
        e = e.cpu_parent
    return False


def _summary(prof) -> dict:
    events = prof.events()
    ops = collections.defaultdict(lambda: [0, 0.0])
    copies, syncs = [0, 0], 0
    opt_ms = 0.0
    for e in events:
        ops[e.name][0] += 1
        ops[e.name][1] += e.self_cpu_time_total / 1e3
        if e.name == "aten::_local_scalar_dense" and not _under(e, "aten::_fused_adamw_"):
            syncs += 1
        if e.name == "aten::copy_":
            copies[0] += 1
            shape, dtype = e.input_shapes[0], e.input_dtypes[0]
            copies[1] += math.prod(shape) * _ITEMSIZE.get(dtype, 4) if shape else 0
        if e.name.startswith("Optimizer.step"):
            opt_ms += e.cpu_time_total / 1e3
    return {"ops": {k: tuple(v) for k, v in ops.items()},
            "aten_calls": sum(v[0] for k, v in ops.items() if k.startswith("aten::")),
            "host_syncs": syncs,
            "copies": tuple(copies), "optimizer_ms": opt_ms}


def _steps(cfg, mesh):
    return {"fastpar": bt.fastpar_variant(cfg, mesh), "torchtitan": bt.torch_tp(cfg, mesh)}


def _time(step, x, y, n) -> float:
    dist.barrier()
    t = time.perf_counter()
    for _ in range(n):
        step(x, y)
    dist.barrier()
    return (time.perf_counter() - t) / n


def _rank(rank, world, a, model, layout):
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // world))
    base = dict(model=model, global_batch_size=a.batch, micro_batch_size=a.micro,
                layers=a.small_layers if model == "small" else None)
    cfg = bt.BenchConfig(**base, seq_len=a.seq, **bt.LAYOUTS[layout])
    mesh = fastpar.init(layout=cfg.check_layout(world))
    V = cfg.model_config.vocab_size
    g = torch.Generator().manual_seed(1)
    out = {}
    for seq, key in ((a.seq, "full"), (8, "floor")):
        cfg_s = bt.BenchConfig(**base, seq_len=seq, **bt.LAYOUTS[layout])
        x = torch.randint(0, V, (a.batch, seq), generator=g)
        y = torch.randint(0, V, (a.batch, seq), generator=g)
        for side, step in _steps(cfg_s, mesh).items():
            for _ in range(2):
                step(x, y)
            ms = _time(step, x, y, a.steps) * 1e3
            row = out.setdefault(side, {})
            row[f"{key}_ms"] = ms
            if key == "full":
                with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
                    step(x, y)
                row.update(_summary(prof))
                extension.events.enable()
                with _Collectives(world) as coll:
                    step(x, y)
                coll.add_native(extension.events.take())
                extension.events.enable(False)
                row["collectives"] = {k: tuple(v) for k, v in coll.kinds.items()}
    return out, cfg.model_config.n_layers


def _report(model, layout, res, layers, top) -> str:
    f, t = res["fastpar"], res["torchtitan"]
    lines = [f"### {model} {layout} (L={layers}), rank 0, one step", "",
             "| | fastpar | torchtitan |", "|---|---|---|"]
    lines.append(f"| ms/step (unprofiled, mean of steps) | {f['full_ms']:.1f} | {t['full_ms']:.1f} |")
    lines.append(f"| ms/step at 8 tokens/sequence (overhead floor) | {f['floor_ms']:.1f} | "
                 f"{t['floor_ms']:.1f} |")
    lines.append(f"| floor per layer, ms | {f['floor_ms'] / layers:.2f} | "
                 f"{t['floor_ms'] / layers:.2f} |")
    lines.append(f"| aten calls | {f['aten_calls']} | {t['aten_calls']} |")
    for side in (f, t):
        side["coll_n"] = sum(n for n, _ in side["collectives"].values())
        side["coll_b"] = sum(b for _, b in side["collectives"].values())
    lines.append(f"| collectives per step | {f['coll_n']} | {t['coll_n']} |")
    lines.append(f"| bytes sent per rank, MB | {f['coll_b'] / 1e6:.2f} | {t['coll_b'] / 1e6:.2f} |")
    for kind in sorted(set(f["collectives"]) | set(t["collectives"])):
        fn, fb = f["collectives"].get(kind, (0, 0))
        tn, tb = t["collectives"].get(kind, (0, 0))
        lines.append(f"| &nbsp; {kind} | {fn} ({fb / 1e6:.2f} MB) | {tn} ({tb / 1e6:.2f} MB) |")
    lines.append(f"| host syncs | {f['host_syncs']} | {t['host_syncs']} |")
    lines.append(f"| copies (aten::copy_), MB | {f['copies'][0]} ({f['copies'][1] / 1e6:.1f}) | "
                 f"{t['copies'][0]} ({t['copies'][1] / 1e6:.1f}) |")
    lines.append(f"| optimizer step, ms | {f['optimizer_ms']:.2f} | {t['optimizer_ms']:.2f} |")
    lines += ["", "Ops whose self time differs most (profiled ms; count):", "",
              "| op | fastpar | torchtitan | difference, ms |", "|---|---|---|---|"]
    keys = sorted(set(f["ops"]) | set(t["ops"]),
                  key=lambda k: -abs(f["ops"].get(k, (0, 0))[1] - t["ops"].get(k, (0, 0))[1]))
    for k in keys[:top]:
        fc, fs = f["ops"].get(k, (0, 0.0))
        tc, ts = t["ops"].get(k, (0, 0.0))
        lines.append(f"| `{k[:70]}` | {fs:.2f} ({fc}) | {ts:.2f} ({tc}) | {fs - ts:+.2f} |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", default=["tiny", "small"])
    p.add_argument("--layouts", nargs="+", default=["tp2", "tp2-sp"], choices=["tp2", "tp2-sp"])
    p.add_argument("--small-layers", type=int, default=4)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--micro", type=int, default=2)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--top", type=int, default=25)
    a = p.parse_args(argv)
    for model in a.models:
        for layout in a.layouts:
            res, layers = run_ranks(_rank, 2, a, model, layout, init_pg=False, timeout=1800)[0]
            print(_report(model, layout, res, layers, a.top), flush=True)


if __name__ == "__main__":
    main()
