"""Sharded checkpoints that load into any (tp, pp, dp) layout.

``OUT/checkpoints/step_N/`` holds one safetensors file per (tp, pp) shard, written in parallel by
the first data-parallel replica, plus ``index_tp{t}_pp{p}.json`` saying for each tensor its global
shape and which slice the file holds, ``rng_rank{r}.safetensors`` per rank, and ``manifest.json``
(step, data position, configuration, layout, and the size and sha256 of every file). Everything
is written into ``step_N.tmp-*`` and renamed when complete (see :mod:`.checkpoint_writer`), so a
crash never leaves a broken latest checkpoint and a partial one is ignored. Loading checks each
file against the manifest before reading it (a truncated or corrupt file is one clear
:class:`CheckpointError` naming it), then reads, for each local tensor, the overlapping slices of
whatever files hold it: a checkpoint saved with one layout loads into another. Only tensors are
read back (safetensors, JSON), never pickled objects.
"""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import math
import re
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from ..data_parallel.zero_state import WholeState
from ..models.config import GPTConfig
from ..tensor_parallel.sharding import shard_specs

_OPTIM_KEYS = ("exp_avg", "exp_avg_sq")


def per_param(optimizer):
    """The optimizer whose state is saved and loaded per parameter as it is, or None: a sharded
    (ZeRO) optimizer's goes through its :meth:`~fastpar.data_parallel.DistributedOptimizer.
    whole_state` (gathered over the dp group), so that it too loads into any layout."""
    return None if optimizer is None or getattr(optimizer, "shard", False) else optimizer


def _state_of(optimizer, p: torch.Tensor, rows):
    """``p``'s optimizer state and master weight (the fp32 copy the checkpoint stores in place
    of a low-precision parameter; ``rows`` of it for one part of a fused parameter)."""
    state = optimizer.state.get(p, {}) if optimizer is not None else {}
    master = optimizer.master_of(p) if hasattr(optimizer, "master_of") else None
    return state, master if master is None or rows is None else master.narrow(0, *rows)


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded: a missing, truncated or corrupt file, a bad manifest."""


def snapshot(modules, optimizer, mesh, rank_tensors: dict | None = None,
             copy: bool = False) -> dict[str, dict | str]:
    """This rank's files of a checkpoint, as ``file name -> tensors`` (safetensors) or ``-> text``
    (JSON). ``copy=True`` clones every tensor to CPU, so training can go on while they are
    written (the parameters and optimizer state change in place)."""
    def cpu(t):
        # A view (one part of a fused parameter) is copied: safetensors stores no shared memory.
        return t.detach().to("cpu", copy=copy or t._base is not None).contiguous()

    # A sharded (ZeRO) optimizer's masters are what is saved, gathered bucket by bucket: the
    # parameters need not be whole (at ZeRO-3 no rank ever holds the whole model).
    sharded = getattr(optimizer, "shard", False)
    with contextlib.nullcontext() if sharded else \
            getattr(optimizer, "gathered", contextlib.nullcontext)():
        return _snapshot(modules, optimizer, mesh, rank_tensors, cpu)


def _snapshot(modules, optimizer, mesh, rank_tensors, cpu) -> dict[str, dict | str]:
    rank = mesh.rank if mesh is not None else 0
    tp, pp = (mesh.tp_rank, mesh.pp_rank) if mesh else (0, 0)
    if optimizer is not None and per_param(optimizer) is None:
        optimizer = optimizer.whole_state()       # every dp rank takes part in the gather
        # (under HSDP the first rank of every shard group gets it; replica 0 saves)
        if optimizer is None and (mesh is None or mesh.replica_rank == 0):
            raise RuntimeError("the ZeRO optimizer's state gathers to dp rank 0, which is not "
                               "the replica that saves this model shard")
    files: dict[str, dict | str] = {}
    if mesh is None or mesh.replica_rank == 0:      # one copy of each (tp, pp) shard writes it
        tensors, index = {}, {}
        for name, (t, shape, dim, start, stop, p, rows) in shard_specs(
                modules, mesh.tp_size if mesh else 1, tp).items():
            state, master = _state_of(optimizer, p, rows)
            tensors[name] = cpu(t if master is None else master)
            index[name] = {"shape": shape, "dim": dim, "start": start, "stop": stop}
            for key in _OPTIM_KEYS:
                if key in state:
                    st = state[key] if rows is None else state[key].narrow(0, *rows)
                    tensors[f"optim.{key}.{name}"] = cpu(st)
                    index[f"optim.{key}.{name}"] = index[name]
            if "step" in state:
                tensors[f"optim.step.{name}"] = \
                    torch.as_tensor(state["step"]).reshape(1).float().clone()
                index[f"optim.step.{name}"] = {"shape": [1], "dim": None, "start": 0, "stop": 0}
        files[f"model_tp{tp}_pp{pp}.safetensors"] = tensors
        files[f"index_tp{tp}_pp{pp}.json"] = json.dumps(index)
    files[f"rng_rank{rank}.safetensors"] = {"cpu": torch.get_rng_state()}
    if rank_tensors:
        files[f"rank{rank}.safetensors"] = {k: cpu(v) for k, v in rank_tensors.items()}
    return files


def file_digest(path: Path) -> dict:
    """``{"bytes": size, "sha256": hex}`` of a file, as the manifest records it."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return {"bytes": path.stat().st_size, "sha256": h.hexdigest()}


_STEP_DIR = re.compile(r"step_(\d+)")


def complete_checkpoints(root) -> list[Path]:
    """The complete checkpoints under ``root`` (renamed, with a manifest), oldest first."""
    done = [p for p in Path(root).glob("step_*") if p.is_dir() and _STEP_DIR.fullmatch(p.name)
            and (p / "manifest.json").exists()]
    return sorted(done, key=lambda p: int(p.name.split("_")[1]))


def latest_checkpoint(root) -> Path | None:
    """The newest complete checkpoint under ``root``, or None; partial ones are ignored."""
    done = complete_checkpoints(root)
    return done[-1] if done else None


def pointer_note(root, chosen: Path | None) -> str | None:
    """What is wrong with ``root/latest`` when it does not name ``chosen`` (None if all is
    well): it names a checkpoint that is missing or incomplete, or an older one."""
    pointer = Path(root) / "latest"
    if not pointer.exists():
        return None
    name = pointer.read_text().strip()
    target = Path(root) / name
    if chosen is not None and target == chosen:
        return None
    use = f"using {chosen.name}, the newest complete checkpoint" if chosen is not None else \
        "no complete checkpoint is left"
    if not target.is_dir():
        return f"{pointer} names {name}, which is missing; {use}"
    if not (target / "manifest.json").exists():
        return f"{pointer} names {name}, which is incomplete (no manifest.json); {use}"
    return f"{pointer} names {name}, older than {chosen.name}; {use}" if chosen else None


def read_rank_tensors(path, rank: int) -> dict:
    """The ``rank_tensors`` that rank ``rank`` saved (empty if none)."""
    name = f"rank{rank}.safetensors"
    if not (Path(path) / name).exists():
        return {}
    with _open(Path(path), name, Verifier(path)) as st:
        return {k: st.get_tensor(k) for k in st.keys()}


def read_manifest(path) -> dict:
    f = Path(path) / "manifest.json"
    try:
        manifest = json.loads(f.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint {path} has no manifest.json") from None
    except OSError as e:
        raise CheckpointError(f"checkpoint {path}: manifest.json cannot be read ({e.strerror})") \
            from None
    except (ValueError, UnicodeDecodeError) as e:
        raise CheckpointError(f"checkpoint {path}: manifest.json is not valid JSON ({e})") \
            from None
    if not isinstance(manifest, dict) or "step" not in manifest:
        raise CheckpointError(f"checkpoint {path}: manifest.json holds no step")
    return manifest


class Verifier:
    """Checks the files of a checkpoint against its manifest, each at most once."""

    def __init__(self, path, manifest: dict | None = None):
        self.path = Path(path)
        self.files = (manifest or read_manifest(path)).get("files")   # None: saved before sums
        self.done: set[str] = set()

    def __call__(self, name: str, full: bool = True) -> None:
        if self.files is None or name in self.done:
            return
        where = f"checkpoint {self.path}: {name}"
        entry, f = self.files.get(name), self.path / name
        if entry is None:
            raise CheckpointError(f"{where} is not listed in its manifest")
        if not f.exists():
            raise CheckpointError(f"{where} is missing")
        size = f.stat().st_size
        if size != entry["bytes"]:
            raise CheckpointError(f"{where} holds {size} bytes, the manifest says "
                                  f"{entry['bytes']}: the file is truncated or was replaced")
        if full:
            if file_digest(f)["sha256"] != entry["sha256"]:
                raise CheckpointError(f"{where} is corrupt: its sha256 differs from the "
                                      f"manifest's")
            self.done.add(name)

    def all(self, full: bool = True) -> None:
        for name in self.files or ():
            self(name, full)


def verify_checkpoint(path, full: bool = True) -> dict:
    """Check every file of ``path`` (sizes only when ``full=False``); returns the manifest."""
    manifest = read_manifest(path)
    Verifier(path, manifest).all(full)
    return manifest


class _open:
    """``safe_open`` of a checkpoint file, verified first; a safetensors error names the file."""

    def __init__(self, path: Path, name: str, verify: Verifier):
        verify(name)
        self.where = f"checkpoint {path}: {name}"
        try:
            self.st = safe_open(str(path / name), framework="pt")
        except (SafetensorError, OSError) as e:
            raise CheckpointError(f"{self.where} cannot be read ({e})") from None

    def __enter__(self):
        return self.st.__enter__()

    def __exit__(self, *exc):
        return self.st.__exit__(*exc)


def _tensors_file(index_file: Path) -> str:
    """The safetensors file whose tensors ``index_tp{t}_pp{p}.json`` describes."""
    return index_file.name.replace("index_", "model_").replace(".json", ".safetensors")


def _read_indexes(path: Path, verify: Verifier) -> dict[Path, dict]:
    """Every ``index_*.json`` of a checkpoint (verified against the manifest), by file."""
    index = {}
    for f in sorted(path.glob("index_*.json")):
        verify(f.name)
        try:
            index[f] = json.loads(f.read_text())
        except ValueError as e:
            raise CheckpointError(f"checkpoint {path}: {f.name} is not valid JSON ({e})") \
                from None
        if not isinstance(index[f], dict):
            raise CheckpointError(f"checkpoint {path}: {f.name} is not a JSON object")
    return index


def _read_full(path: Path, index: dict, name: str, shape, verify: Verifier) -> torch.Tensor:
    """The whole global tensor ``name``, assembled from the files that hold its slices."""
    out, covered = None, 0
    for idx_file, entries in index.items():
        entry = entries.get(name)
        if entry is None:
            continue
        if list(entry["shape"]) != list(shape):
            raise ValueError(f"checkpoint {path}: {name} has shape {entry['shape']}, the model "
                             f"{list(shape)}: a checkpoint of another model shape")
        tensors = _tensors_file(idx_file)
        with _open(path, tensors, verify) as st:
            if name not in st.keys():
                raise CheckpointError(f"checkpoint {path}: {tensors} lacks {name!r}, which its "
                                      f"index lists")
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


def _read_slice(path, index, name, shape, dim, start, stop, verify) -> torch.Tensor:
    """Rows ``start:stop`` along ``dim`` of the global tensor ``name`` (all of it when ``dim``
    is None), read from the files that hold it: of each, only the part that overlaps (a lazy
    safetensors slice), so a rank never builds a whole tensor it holds a shard of."""
    if dim is None:
        return _read_full(path, index, name, shape, verify)
    out, covered = None, 0
    for idx_file, entries in index.items():
        entry = entries.get(name)
        if entry is None:
            continue
        if list(entry["shape"]) != list(shape):
            raise ValueError(f"checkpoint {path}: {name} has shape {entry['shape']}, the model "
                             f"{list(shape)}: a checkpoint of another model shape")
        if entry["dim"] not in (None, dim):         # sharded along another dim: assemble
            return _read_full(path, index, name, shape, verify).narrow(
                dim, start, stop - start).contiguous()
        first, last = (0, shape[dim]) if entry["dim"] is None else \
            (entry["start"], entry["stop"])
        lo, hi = max(start, first), min(stop, last)
        if lo >= hi:
            continue
        tensors = _tensors_file(idx_file)
        with _open(path, tensors, verify) as st:
            if name not in st.keys():
                raise CheckpointError(f"checkpoint {path}: {tensors} lacks {name!r}, which its "
                                      f"index lists")
            piece = _rows(st.get_slice(name), shape, dim, lo - first, hi - first)
        if hi - lo == stop - start:
            return piece
        if out is None:
            out = torch.empty(list(shape[:dim]) + [stop - start] + list(shape[dim + 1:]),
                              dtype=piece.dtype)
        out.narrow(dim, lo - start, hi - lo).copy_(piece)
        covered += hi - lo
        if covered == stop - start:
            return out
    raise ValueError(f"checkpoint {path} does not hold all of {name!r}")


# A slice along a dim other than the first is read this many bytes of whole rows at a time.
_BLOCK_BYTES = 16 << 20


def _rows(sl, shape, dim: int, a: int, b: int) -> torch.Tensor:
    """``[a, b)`` along ``dim`` of a lazy safetensors slice, contiguous and owning its memory.
    Along dim 0 that is one read of those rows; along a later dim safetensors reads the whole
    span of the rows it covers, so the rows are read a block at a time (at most
    :data:`_BLOCK_BYTES` of them), each cut down before the next is read."""
    cut = (slice(None),) * dim + (slice(a, b),)
    if dim == 0:
        return sl[cut].contiguous()
    row_bytes = max(1, math.prod(shape[1:])) * _DTYPE_BYTES.get(sl.get_dtype(), 4)
    step = max(1, _BLOCK_BYTES // row_bytes)
    parts = [sl[(slice(r, min(r + step, shape[0])),) + cut[1:]].contiguous()
             for r in range(0, shape[0], step)]
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def weight_filler(path, modules, mesh):
    """A ``DistributedOptimizer.materialize`` fill from checkpoint ``path``: ``fill(params)``
    writes the weights of ``params`` (parameters of ``modules``, e.g. one ZeRO-3 unit's,
    whole on this rank for the call). The files are verified once, not per call."""
    path = Path(path)
    verify = Verifier(path, read_manifest(path))
    index = _read_indexes(path, verify)
    tp, rank = (mesh.tp_size, mesh.tp_rank) if mesh else (1, 0)

    @torch.no_grad()
    def fill(params) -> None:
        for name, (t, shape, dim, start, stop, _base, _rows) in shard_specs(
                modules, tp, rank, {id(p) for p in params}).items():
            t.copy_(_read_slice(path, index, name, shape, dim, start, stop, verify))
    return fill


def load_checkpoint(path, modules, optimizer, mesh) -> dict:
    """Load ``path`` into this rank's modules (and optimizer state); returns the manifest."""
    path = Path(path)
    manifest = read_manifest(path)
    verify = Verifier(path, manifest)
    index = _read_indexes(path, verify)
    if optimizer is not None and hasattr(optimizer, "finish_param_sync"):
        optimizer.finish_param_sync()  # no gather lands on what is loaded (ZeRO-3: nothing
    #                                    is gathered; its masters are loaded, then gathered)
    specs = shard_specs(modules, mesh.tp_size if mesh else 1, mesh.tp_rank if mesh else 0)
    sharded, optimizer = optimizer, per_param(optimizer)
    if sharded is not None and optimizer is None and manifest.get("zero1"):
        raise CheckpointError(f"checkpoint {path} holds its ZeRO optimizer state in per-rank "
                              f"shard files, a format no longer read: load its weights with "
                              f"--init-from (the moments start afresh)")
    if sharded is not None and optimizer is None:
        optimizer = WholeState()        # loaded per parameter (on the CPU), then sliced into
    whole = isinstance(optimizer, WholeState)      # the shards, a parameter at a time
    with torch.no_grad():
        items = list(specs.items())
        for k, (name, (t, shape, dim, start, stop, base, rows)) in enumerate(items):
            weight = _read_slice(path, index, name, shape, dim, start, stop, verify)
            if not t.is_meta:                          # (ZeRO-3: no memory; masters below)
                t.copy_(weight)
            _, master = _state_of(optimizer, base, rows)
            if master is not None:
                master.copy_(weight)
            if optimizer is None or not any(f"optim.step.{name}" in i for i in index.values()):
                continue
            state = optimizer.state[base]
            for key in _OPTIM_KEYS:
                got = _read_slice(path, index, f"optim.{key}.{name}", shape, dim, start, stop,
                                  verify).to(master.device if whole else t.device,
                                             t.dtype if master is None else master.dtype)
                if rows is None:
                    state[key] = got
                else:                      # one part of a fused parameter's state
                    full = state.setdefault(key, torch.zeros_like(base, dtype=got.dtype,
                                                                   device=got.device))
                    full.narrow(0, *rows).copy_(got)
            step = _read_slice(path, index, f"optim.step.{name}", [1], None, 0, 0, verify)
            state["step"] = step.reshape(()).clone()
            if whole and (k + 1 == len(items) or items[k + 1][1].param is not base):
                sharded.load_whole_state(optimizer, gather=False)   # this parameter done:
                optimizer = WholeState()                           # the host holds one
    rank = mesh.rank if mesh is not None else 0
    if whole:
        sharded.load_whole_state(optimizer)        # (empty by now) the parameters gathered
    rng = f"rng_rank{rank}.safetensors"
    if (path / rng).exists():
        with _open(path, rng, verify) as st:
            torch.set_rng_state(st.get_tensor("cpu"))
    return manifest


# Checking a checkpoint before loading it (``fastpar train --init-from``): everything loading
# needs, from the manifest, the indexes and the safetensors headers, without reading tensors.

_MAX_HEADER = 100_000_000           # safetensors' own limit on a header's length
_DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1,
                "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U64": 8, "U32": 4, "U16": 2, "U8": 1,
                "BOOL": 1}


def safetensors_header(file) -> dict[str, dict]:
    """name -> ``{dtype, shape, data_offsets}`` of a safetensors file, from its header alone
    (a little-endian u64 length, then that much JSON; the data follows). A header that does not
    parse, an entry whose bytes do not fit its shape, or a file size other than the header's
    (truncated, or with bytes appended) is one :class:`CheckpointError` naming the file."""
    file = Path(file)
    try:
        size = file.stat().st_size
        with open(file, "rb") as f:
            length = int.from_bytes(f.read(8), "little") if size >= 8 else 0
            if length > _MAX_HEADER:
                raise CheckpointError(f"{file}: a safetensors header of {length} bytes is "
                                      f"impossible: the file is corrupt or not safetensors")
            raw = f.read(length)
    except OSError as e:
        raise CheckpointError(f"{file} cannot be read ({e.strerror})") from None
    if size < 8 + length:       # also a file too short to hold the length (length is 0 then)
        raise CheckpointError(f"{file} holds {size} bytes, fewer than its safetensors header "
                              f"needs ({8 + length}): the file is truncated or not safetensors")
    try:
        header = json.loads(raw)
    except ValueError as e:
        raise CheckpointError(f"{file}: the safetensors header is not valid JSON ({e}): the "
                              f"file is corrupt or not safetensors") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{file}: the safetensors header is not a JSON object")
    header.pop("__metadata__", None)
    end = max([_data_end(file, name, t) for name, t in header.items()], default=0)
    if size != 8 + length + end:
        why = "truncated" if size < 8 + length + end else "followed by bytes no tensor uses"
        raise CheckpointError(f"{file} holds {size} bytes, its header needs {8 + length + end}: "
                              f"the file is {why}")
    return header


def _data_end(file: Path, name: str, t) -> int:
    """Where tensor ``name``'s bytes end in the data (after checking its header entry)."""
    ok = isinstance(t, dict) and isinstance(t.get("dtype"), str) and \
        isinstance(t.get("shape"), list) and isinstance(t.get("data_offsets"), list) and \
        len(t["data_offsets"]) == 2 and all(_natural(v) for v in t["shape"] + t["data_offsets"])
    if not ok:
        raise CheckpointError(f"{file}: the safetensors header's entry of {name!r} is malformed")
    begin, end = t["data_offsets"]
    item = _DTYPE_BYTES.get(t["dtype"])      # an unknown dtype: its size is not checked
    if begin > end or (item is not None and end - begin != item * math.prod(t["shape"])):
        raise CheckpointError(f"{file}: tensor {name!r} ({t['dtype']} {t['shape']}) spans bytes "
                              f"[{begin}, {end}), not its size: the file is corrupt")
    return end


def _natural(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def check_header_tensor(file: Path, header: dict, name: str, shape: list[int],
                        expected_by: str) -> None:
    """That a safetensors header's tensor ``name`` (present) is floating point of ``shape``
    (which ``expected_by``, e.g. "the config", says it must have)."""
    held = header[name]
    if held["shape"] != list(shape):
        raise CheckpointError(f"{file}: tensor {name!r} has shape {held['shape']}, "
                              f"{expected_by} needs {list(shape)}")
    if not (held["dtype"].startswith("F") or held["dtype"] == "BF16"):
        raise CheckpointError(f"{file}: tensor {name!r} is {held['dtype']}, not floating point")


def checkpoint_config(path, manifest: dict) -> GPTConfig:
    """The model config a checkpoint's manifest records; one error naming unknown or missing
    fields (a manifest always holds them all: the dict is ``GPTConfig.to_dict()``)."""
    where = f"checkpoint {path}: manifest.json"
    saved = manifest.get("model_config")
    if not isinstance(saved, dict):
        raise CheckpointError(f"{where} holds no model_config")
    fields = {f.name for f in dataclasses.fields(GPTConfig)}
    unknown, missing = sorted(set(saved) - fields), sorted(fields - set(saved))
    if unknown or missing:
        raise CheckpointError(f"{where}: model_config has " + "; ".join(
            f"{what} field(s) {', '.join(names)}" for what, names in
            (("unknown", unknown), ("no", missing)) if names))
    try:
        return GPTConfig(**saved)
    except (TypeError, ValueError) as e:    # a value of the wrong type, or out of range
        raise CheckpointError(f"{where}: model_config is not a valid GPTConfig ({e})") from None


def check_checkpoint(path, shapes: dict[str, list[int]], manifest: dict | None = None) -> dict:
    """Everything :func:`load_checkpoint` of a model whose tensors have ``shapes`` (name ->
    full shape) needs, checked without reading tensors: every file the manifest lists present
    with its size and sha256, every index valid, every tensor covered by index entries of its
    shape whose files' headers hold those slices. Returns the manifest."""
    path = Path(path)
    manifest = manifest if manifest is not None else read_manifest(path)
    _check_file_list(path, manifest)
    verify = Verifier(path, manifest)
    verify.all(full=False)      # sizes first: a truncated file is named as such, not as bad JSON
    index, headers = _read_indexes(path, verify), {}
    for name, shape in shapes.items():
        spans = []
        for idx_file, entries in index.items():
            if name in entries:
                spans.append(_span(path, idx_file, name, entries[name], shape))
                _check_slice(path, idx_file, name, shape, spans[-1], headers)
        _check_covered(path, name, shape, spans)
    verify.all(full=True)       # last: reading every byte is the slow part
    return manifest


def _check_file_list(path: Path, manifest: dict) -> None:
    """The manifest's ``files`` (name -> bytes, sha256) is what :class:`Verifier` reads."""
    files = manifest.get("files")
    ok = files is None or isinstance(files, dict) and all(
        isinstance(e, dict) and _natural(e.get("bytes")) and isinstance(e.get("sha256"), str)
        for e in files.values())
    if not ok:
        raise CheckpointError(f"checkpoint {path}: manifest.json's files are malformed (each "
                              f"must be name -> bytes and sha256)")


def _span(path: Path, idx_file: Path, name: str, entry, shape) -> tuple[int, int, int] | None:
    """The ``(dim, start, stop)`` of tensor ``name`` an index entry says its file holds; None:
    all of it."""
    where = f"checkpoint {path}: {idx_file.name}"
    if not isinstance(entry, dict) or not isinstance(entry.get("shape"), list):
        raise CheckpointError(f"{where}: the entry of {name!r} is malformed")
    if entry["shape"] != list(shape):
        raise CheckpointError(f"checkpoint {path}: {name} has shape {entry['shape']}, the "
                              f"model {list(shape)}: a checkpoint of another model shape")
    dim, start, stop = entry.get("dim"), entry.get("start"), entry.get("stop")
    if dim is None:
        return None
    if not all(_natural(v) for v in (dim, start, stop)) or dim >= len(shape) or \
            not start < stop <= shape[dim]:
        raise CheckpointError(f"{where}: {name!r} is split at dim={dim!r} [{start!r}, "
                              f"{stop!r}), outside its shape {list(shape)}")
    return dim, start, stop


def _check_slice(path: Path, idx_file: Path, name: str, shape, span, headers: dict) -> None:
    """The tensors file of ``idx_file`` holds the slice ``span`` of ``name`` (its header)."""
    file = _tensors_file(idx_file)
    if file not in headers:
        if not (path / file).is_file():
            raise CheckpointError(f"checkpoint {path}: {file} is missing ({idx_file.name} "
                                  f"lists its tensors)")
        headers[file] = safetensors_header(path / file)
    if name not in headers[file]:
        raise CheckpointError(f"checkpoint {path}: {file} lacks {name!r}, which its index lists")
    part = list(shape)
    if span is not None:
        part[span[0]] = span[2] - span[1]
    check_header_tensor(path / file, headers[file], name, part, idx_file.name)


def _check_covered(path: Path, name: str, shape, spans: list) -> None:
    """Together, the slices ``spans`` (None: a whole tensor) are all of ``name``."""
    if not spans:
        raise CheckpointError(f"checkpoint {path} holds no {name!r}, which the model needs")
    if None in spans:
        return
    dims = {dim for dim, _, _ in spans}
    if len(dims) > 1:
        raise CheckpointError(f"checkpoint {path}: {name!r} is split along dims {sorted(dims)}")
    reach = 0
    for _, start, stop in sorted(spans, key=lambda s: s[1]):
        if start > reach:
            break
        reach = max(reach, stop)
    dim = spans[0][0]
    if reach < shape[dim]:
        raise CheckpointError(f"checkpoint {path} does not hold all of {name!r}: no file holds "
                              f"index {reach} of its dim {dim} (of {shape[dim]})")
