"""Sharded checkpoints that load into any (tp, pp, dp) layout.

``OUT/checkpoints/step_N/`` holds one safetensors file per (tp, pp) shard, written in parallel by
the first data-parallel replica, plus ``index_tp{t}_pp{p}.json`` saying for each tensor its global
shape and which slice the file holds, ``rng_rank{r}.safetensors`` per rank, and ``manifest.json``
(step, data position, configuration, layout). Everything is written into ``step_N.tmp`` and
renamed when complete, so a crash never leaves a broken latest checkpoint. Loading reads, for each
local tensor, the overlapping slices of whatever files hold it: a checkpoint saved with one layout
loads into another. Only tensors are read back (safetensors, JSON), never pickled objects.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
from safetensors import safe_open
from safetensors.torch import save_file

from ..tensor_parallel import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding

_OPTIM_KEYS = ("exp_avg", "exp_avg_sq")


def shard_specs(modules: list[nn.Module], tp_size: int, tp_rank: int) -> dict:
    """name -> (tensor, global shape, split dim or None, start, stop) for every parameter."""
    out = {}
    for root in modules:
        for mname, module in root.named_modules():
            for pname, p in module.named_parameters(recurse=False):
                dim = None
                if isinstance(module, (ColumnParallelLinear, VocabParallelEmbedding)):
                    dim = 0
                elif isinstance(module, RowParallelLinear) and pname == "weight":
                    dim = 1
                shape = list(p.shape)
                start = stop = 0
                if dim is not None and tp_size > 1:
                    start, stop = p.shape[dim] * tp_rank, p.shape[dim] * (tp_rank + 1)
                    shape[dim] *= tp_size
                else:
                    dim = None
                out[f"{mname}.{pname}" if mname else pname] = (p, shape, dim, start, stop)
    return out


def _barrier():
    if dist.is_initialized():
        dist.barrier()


def save_checkpoint(root, step: int, modules, optimizer, mesh, manifest: dict,
                    rank_tensors: dict | None = None) -> Path:
    """Write ``root/step_{step}`` (see the module docstring); collective over the world.
    ``rank_tensors``: this rank's own tensors (e.g. a ZeRO optimizer shard), kept per rank."""
    root = Path(root)
    tmp, final = root / f"step_{step}.tmp", root / f"step_{step}"
    rank = mesh.rank if mesh is not None else 0
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    _barrier()
    tp, pp, dp = (mesh.tp_rank, mesh.pp_rank, mesh.dp_rank) if mesh else (0, 0, 0)
    specs = shard_specs(modules, mesh.tp_size if mesh else 1, tp)
    if dp == 0:
        tensors, index = {}, {}
        for name, (p, shape, dim, start, stop) in specs.items():
            tensors[name] = p.detach().contiguous().cpu()
            index[name] = {"shape": shape, "dim": dim, "start": start, "stop": stop}
            state = optimizer.state.get(p, {}) if optimizer is not None else {}
            for key in _OPTIM_KEYS:
                if key in state:
                    tensors[f"optim.{key}.{name}"] = state[key].detach().contiguous().cpu()
                    index[f"optim.{key}.{name}"] = index[name]
            if "step" in state:
                tensors[f"optim.step.{name}"] = torch.as_tensor(state["step"]).reshape(1).float()
                index[f"optim.step.{name}"] = {"shape": [1], "dim": None, "start": 0, "stop": 0}
        save_file(tensors, str(tmp / f"model_tp{tp}_pp{pp}.safetensors"))
        (tmp / f"index_tp{tp}_pp{pp}.json").write_text(json.dumps(index))
    save_file({"cpu": torch.get_rng_state()}, str(tmp / f"rng_rank{rank}.safetensors"))
    if rank_tensors:
        save_file({k: v.detach().contiguous().cpu() for k, v in rank_tensors.items()},
                  str(tmp / f"rank{rank}.safetensors"))
    _barrier()
    if rank == 0:
        (tmp / "manifest.json").write_text(json.dumps(dict(manifest, step=step), indent=2))
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        (root / "latest.tmp").write_text(final.name)
        os.replace(root / "latest.tmp", root / "latest")
    _barrier()
    return final


def latest_checkpoint(root) -> Path | None:
    """The newest complete checkpoint under ``root``, or None."""
    root = Path(root)
    done = [p for p in root.glob("step_*") if p.is_dir() and not p.name.endswith(".tmp")
            and (p / "manifest.json").exists()]
    return max(done, key=lambda p: int(p.name.split("_")[1]), default=None)


def read_rank_tensors(path, rank: int) -> dict:
    """The ``rank_tensors`` that rank ``rank`` saved (empty if none)."""
    f = Path(path) / f"rank{rank}.safetensors"
    if not f.exists():
        return {}
    with safe_open(str(f), framework="pt") as st:
        return {k: st.get_tensor(k) for k in st.keys()}


def read_manifest(path) -> dict:
    return json.loads((Path(path) / "manifest.json").read_text())


def _read_full(path: Path, index: dict, name: str, shape) -> torch.Tensor:
    """The whole global tensor ``name``, assembled from the files that hold its slices."""
    out, covered = None, 0
    for idx_file, entries in index.items():
        entry = entries.get(name)
        if entry is None:
            continue
        if list(entry["shape"]) != list(shape):
            raise ValueError(f"checkpoint {path}: {name} has shape {entry['shape']}, the model "
                             f"{list(shape)}: a checkpoint of another model shape")
        tensors = idx_file.with_name(idx_file.name.replace("index_", "model_")).with_suffix(
            ".safetensors")
        with safe_open(str(tensors), framework="pt") as st:
            t = st.get_tensor(name)
        if entry["dim"] is None:
            return t
        if out is None:
            out = torch.empty(shape, dtype=t.dtype)
        out.narrow(entry["dim"], entry["start"], entry["stop"] - entry["start"]).copy_(t)
        covered += entry["stop"] - entry["start"]
        if covered == shape[entry["dim"]]:
            return out
    raise ValueError(f"checkpoint {path} does not hold all of {name!r}")


def _read_slice(path, index, name, shape, dim, start, stop) -> torch.Tensor:
    full = _read_full(path, index, name, shape)
    return full if dim is None else full.narrow(dim, start, stop - start).contiguous()


def load_checkpoint(path, modules, optimizer, mesh) -> dict:
    """Load ``path`` into this rank's modules (and optimizer state); returns the manifest."""
    path = Path(path)
    manifest = read_manifest(path)
    index = {f: json.loads(f.read_text()) for f in sorted(path.glob("index_*.json"))}
    specs = shard_specs(modules, mesh.tp_size if mesh else 1, mesh.tp_rank if mesh else 0)
    with torch.no_grad():
        for name, (p, shape, dim, start, stop) in specs.items():
            p.copy_(_read_slice(path, index, name, shape, dim, start, stop))
            if optimizer is None or not any(f"optim.step.{name}" in i for i in index.values()):
                continue
            state = optimizer.state[p]
            for key in _OPTIM_KEYS:
                state[key] = _read_slice(path, index, f"optim.{key}.{name}", shape, dim, start,
                                         stop).to(p.device, p.dtype)
            step = _read_slice(path, index, f"optim.step.{name}", [1], None, 0, 0)
            state["step"] = step.reshape(()).clone()
    rank = mesh.rank if mesh is not None else 0
    rng = path / f"rng_rank{rank}.safetensors"
    if rng.exists():
        with safe_open(str(rng), framework="pt") as st:
            torch.set_rng_state(st.get_tensor("cpu"))
    return manifest
