"""Sharded checkpoints that load into any (tp, pp, dp) layout and ZeRO stage.

``OUT/checkpoints/step_N/`` holds one safetensors file per (tp, pp) shard, written in parallel by
the first data-parallel replica, plus ``index_tp{t}_pp{p}.json`` saying for each tensor its global
shape and which slice the file holds, ``rng_rank{r}.safetensors`` per rank, and ``manifest.json``
(step, data position, configuration, layout, and the size and sha256 of every file). Under a
sharded (ZeRO) optimizer each dp rank of the first replica writes its own shard instead,
``model_tp{t}_pp{p}_dp{d}.safetensors``: the fp32 masters and moments of the flat range of each
parameter it holds, which its index entry's ``flat`` names. Nothing is gathered to save. Everything
is written into ``step_N.tmp-*`` and renamed when complete (see :mod:`.checkpoint_writer`), so a
crash never leaves a broken latest checkpoint and a partial one is ignored. Loading checks each
file against the manifest before reading it (a truncated or corrupt file is one clear
:class:`CheckpointError` naming it), then reads, for each local tensor, only the parts of
whatever files overlap it (lazy safetensors slices; a ZeRO rank only its shard's flat range): a
checkpoint saved with one layout loads into another. Only tensors are read back (safetensors,
JSON), never pickled objects.
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

from ..models.config import GPTConfig
from ..models.moe import Router
from ..mesh.groups import group_rank, group_size
from ..tensor_parallel.sharding import shard_specs

_OPTIM_KEYS = ("exp_avg", "exp_avg_sq")


def per_param(optimizer):
    """The optimizer whose state is saved and loaded per parameter as it is, or None: a sharded
    (ZeRO) optimizer's is saved and loaded as each rank's flat shard (see the module doc)."""
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

    # A sharded (ZeRO) optimizer's masters are what is saved, each rank its own shard: the
    # parameters need not be whole (at ZeRO-3 no rank ever holds the whole model).
    sharded = getattr(optimizer, "shard", False)
    with contextlib.nullcontext() if sharded else \
            getattr(optimizer, "gathered", contextlib.nullcontext)():
        return _snapshot(modules, optimizer, mesh, rank_tensors, cpu)


def _state_buffers(modules) -> dict[str, torch.Tensor]:
    """The buffers a resumed run needs that are not parameters: each MoE router's loss-free
    bias (the same on every replica), by name (``buffer.layers.<i>.mlp.router.bias``)."""
    return {f"buffer.{mname}.{bname}": b for root in modules
            for mname, module in root.named_modules() if isinstance(module, Router)
            for bname, b in module.named_buffers(recurse=False)}


def _add_buffers(tensors, index, modules, cpu) -> None:
    for name, b in _state_buffers(modules).items():
        tensors[name] = cpu(b)
        index[name] = {"shape": list(b.shape), "dim": None, "start": 0, "stop": 0}


def _snapshot(modules, optimizer, mesh, rank_tensors, cpu) -> dict[str, dict | str]:
    rank = mesh.rank if mesh is not None else 0
    tp, pp = _coords(mesh)
    specs = {n: s for n, s in shard_specs(modules, mesh.tp_size if mesh else 1, tp).items()
             if not getattr(s.param, "tied_copy", False)}   # the first stage's is saved
    files: dict[str, dict | str] = {}
    zero = optimizer if optimizer is not None and per_param(optimizer) is None else None
    if zero is not None and zero.saves_shards:   # (HSDP: the first replica's shard group)
        d = zero.model.dp_rank
        tensors, index = _shard_tensors(specs, zero, cpu, others=d == 0)
        if d == 0:
            _add_buffers(tensors, index, modules, cpu)
        files[f"model_tp{tp}_pp{pp}_dp{d}.safetensors"] = tensors
        files[f"index_tp{tp}_pp{pp}_dp{d}.json"] = json.dumps(index)
    elif zero is None and (mesh is None or mesh.replica_rank == 0):  # one copy of each shard
        tensors, index = {}, {}
        for name, (t, shape, dim, start, stop, p, rows) in specs.items():
            _whole_tensors(tensors, index, name, t, shape, dim, start, stop, optimizer, p, rows,
                           cpu)
        _add_buffers(tensors, index, modules, cpu)
        files[f"model_tp{tp}_pp{pp}.safetensors"] = tensors
        files[f"index_tp{tp}_pp{pp}.json"] = json.dumps(index)
    elif zero is None and group_size(getattr(mesh, "ep_group", None)) > 1 and \
            group_rank(mesh.expert_dp_group) == 0:  # the other experts of the first replicas
        tensors, index = {}, {}
        for name, (t, shape, dim, start, stop, p, rows) in specs.items():
            if getattr(p, "expert_parallel", False):
                _whole_tensors(tensors, index, name, t, shape, dim, start, stop, optimizer, p,
                               rows, cpu)
        e = group_rank(mesh.ep_group)
        files[f"model_tp{tp}_pp{pp}_ep{e}.safetensors"] = tensors
        files[f"index_tp{tp}_pp{pp}_ep{e}.json"] = json.dumps(index)
    files[f"rng_rank{rank}.safetensors"] = {"cpu": torch.get_rng_state()}
    if rank_tensors:
        files[f"rank{rank}.safetensors"] = {k: cpu(v) for k, v in rank_tensors.items()}
    return files


def _whole_tensors(tensors, index, name, t, shape, dim, start, stop, optimizer, p, rows, cpu):
    """``name``'s slice (its fp32 master where there is one) and its optimizer state."""
    state, master = _state_of(optimizer, p, rows)
    tensors[name] = cpu(t if master is None else master)
    index[name] = {"shape": shape, "dim": dim, "start": start, "stop": stop}
    for key in _OPTIM_KEYS:
        if key in state:
            st = state[key] if rows is None else state[key].narrow(0, *rows)
            tensors[f"optim.{key}.{name}"] = cpu(st)
            index[f"optim.{key}.{name}"] = index[name]
    if "step" in state:
        _step(tensors, index, name, state["step"])


def _step(tensors, index, name, step) -> None:
    tensors[f"optim.step.{name}"] = torch.as_tensor(step).reshape(1).float().cpu().clone()
    index[f"optim.step.{name}"] = {"shape": [1], "dim": None, "start": 0, "stop": 0}


def _shard_tensors(specs, zero, cpu, others: bool):
    """A sharded optimizer's files on this rank: the flat pieces of its shard (masters,
    moments, steps), each entry's ``flat`` saying which elements of the slice it holds;
    ``others``: also the tensors the optimizer does not hold (frozen), whole."""
    tensors, index = {}, {}
    parts = _parts(specs)
    for p, start, held in zero.shard_pieces():
        end = start + held["master"].numel()
        for name, shape, dim, lo, hi, first, last in parts.get(id(p), ()):
            a, b = max(start, first), min(end, last)
            if a >= b:
                continue
            entry = {"shape": shape, "dim": dim, "start": lo, "stop": hi,
                     "flat": [a - first, b - first]}
            for key in ("master",) + _OPTIM_KEYS:
                if key in held:
                    full = name if key == "master" else f"optim.{key}.{name}"
                    tensors[full] = cpu(held[key][a - start:b - start])
                    index[full] = entry
            if "step" in held:
                _step(tensors, index, name, held["step"])
    if others:
        for name, (t, shape, dim, lo, hi, p, rows) in specs.items():
            if not zero.holds(p):
                _whole_tensors(tensors, index, name, t, shape, dim, lo, hi, None, p, rows, cpu)
    return tensors, index


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
    """The safetensors file whose tensors ``index_tp{t}_pp{p}[_dp{d}].json`` describes."""
    return index_file.name.replace("index_", "model_").replace(".json", ".safetensors")


_INDEX = re.compile(r"index_tp(\d+)_pp(\d+)(?:_dp(\d+))?\.json")


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


@dataclasses.dataclass
class _Source:
    """One slice of a global tensor as a checkpoint holds it: ``box`` (``[lo, hi)`` per dim)
    whole in one file, or in flat pieces (a sharded optimizer's, one file per dp rank):
    ``pieces`` lists ``(file, (a, b))``, elements ``[a, b)`` of the slice flattened, or
    ``(file, None)`` for all of it."""

    box: tuple
    files: str                      # the (tp, pp) shard whose files hold it
    pieces: list = dataclasses.field(default_factory=list)

    @property
    def shape(self) -> list[int]:
        return [hi - lo for lo, hi in self.box]


class _Reader:
    """Reads any box of a checkpoint's global tensors from whichever files hold it, each file
    only where it overlaps: a rank reads the rows of its own slice of a tensor (or, for a
    sharded optimizer, the flat range of its shard), never a whole tensor it holds a part of.
    Files are verified against the manifest when first opened. ``mine``: this rank's (tp, pp)
    coordinates, whose files are preferred where several hold the same slice (a tensor
    replicated over tp)."""

    def __init__(self, path, verify: Verifier, mine: tuple = (0, 0)):
        self.path, self.verify = Path(path), verify
        index = _read_indexes(self.path, verify)

        def rank(f: Path):
            m = _INDEX.fullmatch(f.name)
            return (not m or (int(m[1]), int(m[2])) != tuple(mine)), f.name
        self.index = {f: index[f] for f in sorted(index, key=rank)}
        self._open: dict[str, object] = {}
        self._sources: dict[str, list[_Source]] = {}

    def has(self, name: str) -> bool:
        return any(name in entries for entries in self.index.values())

    def _slice(self, file: str, name: str):
        if file not in self._open:
            self._open[file] = _open(self.path, file, self.verify).st
        st = self._open[file]
        if name not in st.keys():
            raise CheckpointError(f"checkpoint {self.path}: {file} lacks {name!r}, which its "
                                  f"index lists")
        return st.get_slice(name)

    def sources(self, name: str, shape) -> list[_Source]:
        if name in self._sources:
            return self._sources[name]
        by_box: dict[tuple, _Source] = {}
        for idx_file, entries in self.index.items():
            entry = entries.get(name)
            if entry is None:
                continue
            if list(entry["shape"]) != list(shape):
                raise ValueError(f"checkpoint {self.path}: {name} has shape {entry['shape']}, "
                                 f"the model {list(shape)}: a checkpoint of another model shape")
            box = tuple((entry["start"], entry["stop"]) if d == entry["dim"] else (0, n)
                        for d, n in enumerate(shape))
            files = re.sub(r"_dp\d+\.json$", "", idx_file.name)
            src = by_box.setdefault(box, _Source(box, files))
            if src.files == files:       # (another shard's copy of the same slice: not read)
                flat = entry.get("flat")
                src.pieces.append((_tensors_file(idx_file), None if flat is None else
                                   tuple(flat)))
        self._sources[name] = list(by_box.values())
        return self._sources[name]

    def box(self, name: str, shape, box) -> torch.Tensor:
        """The part ``box`` (``[lo, hi)`` per dim) of global tensor ``name`` of ``shape``."""
        box = [tuple(b) for b in box]
        size = [hi - lo for lo, hi in box]
        out, covered = None, 0
        for src in self.sources(name, shape):
            cut = [(max(a, c), min(b, d)) for (a, b), (c, d) in zip(box, src.box)]
            if any(lo >= hi for lo, hi in cut):
                continue
            piece = self._local(src, name, [(lo - c, hi - c) for (lo, hi), (c, _)
                                            in zip(cut, src.box)])
            if cut == box:
                return piece
            if out is None:
                out = torch.empty(size, dtype=piece.dtype)
            out[tuple(slice(lo - a, hi - a) for (lo, hi), (a, _) in zip(cut, box))].copy_(piece)
            covered += math.prod(hi - lo for lo, hi in cut)
            if covered == math.prod(size):
                return out
        raise ValueError(f"checkpoint {self.path} does not hold all of {name!r}")

    def slice(self, name: str, shape, dim, start: int, stop: int) -> torch.Tensor:
        """``[start, stop)`` along ``dim`` of global tensor ``name`` (all of it: dim None)."""
        return self.box(name, shape, [(start, stop) if d == dim else (0, n)
                                      for d, n in enumerate(shape)])

    def flat(self, name: str, shape, dim, start: int, stop: int, a: int, b: int) -> torch.Tensor:
        """Elements ``[a, b)`` of the slice ``[start, stop)`` along ``dim`` of ``name``,
        flattened: the rows of the slice that hold them are read, no more."""
        local = list(shape)
        if dim is not None:
            local[dim] = stop - start
        box = tuple((start, stop) if d == dim else (0, n) for d, n in enumerate(shape))
        for src in self.sources(name, shape):
            if src.box == box and src.pieces[0][1] is not None:     # the same slice, in
                return self._flat(src, name, a, b)                  # flat pieces: just those
        inner = math.prod(local[1:])
        if not local or not inner:
            return self.slice(name, shape, dim, start, stop).reshape(-1)[a:b]
        r0, r1 = a // inner, -(-b // inner)
        rows = list(box)
        rows[0] = (box[0][0] + r0, box[0][0] + r1)
        return self.box(name, shape, rows).reshape(-1)[a - r0 * inner:b - r0 * inner]

    def _local(self, src: _Source, name: str, local: list) -> torch.Tensor:
        """The part ``local`` (relative to the slice) of ``src``, contiguous. Along dim 0 it is
        one read; cut along a later dim it is read a block of whole rows at a time (at most
        :data:`_BLOCK_BYTES`), each cut down before the next is read."""
        shape = src.shape
        if not shape:
            return self._rows(src, name, 0, 1, ()).reshape(())
        (r0, r1), rest = local[0], tuple(slice(lo, hi) for lo, hi in local[1:])
        if all(lo == 0 and hi == n for (lo, hi), n in zip(local[1:], shape[1:])):
            return self._rows(src, name, r0, r1, ())
        dtype = self._slice(src.pieces[0][0], name).get_dtype()
        step = max(1, _BLOCK_BYTES // max(1, math.prod(shape[1:]) * _DTYPE_BYTES.get(dtype, 4)))
        parts = [self._rows(src, name, r, min(r + step, r1), rest) for r in range(r0, r1, step)]
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def _rows(self, src: _Source, name: str, r0: int, r1: int, rest: tuple) -> torch.Tensor:
        """Rows ``[r0, r1)`` along dim 0 of ``src``'s slice, cut by ``rest`` in later dims."""
        file, flat = src.pieces[0]
        if flat is None:        # (copies of it in several dp shards' files: one already open)
            file = next((f for f, _ in src.pieces if f in self._open), file)
            return self._slice(file, name)[(slice(r0, r1),) + rest].contiguous()
        shape = src.shape
        inner = math.prod(shape[1:])
        rows = self._flat(src, name, r0 * inner, r1 * inner).view([r1 - r0] + shape[1:])
        return rows[(slice(None),) + rest].contiguous() if rest else rows

    def _flat(self, src: _Source, name: str, a: int, b: int) -> torch.Tensor:
        """Elements ``[a, b)`` of ``src``'s flat pieces."""
        out, covered = None, 0
        for file, (fa, fb) in src.pieces:
            lo, hi = max(a, fa), min(b, fb)
            if lo >= hi:
                continue
            part = self._slice(file, name)[lo - fa:hi - fa]
            if (lo, hi) == (a, b):
                return part.contiguous()
            if out is None:
                out = torch.empty(b - a, dtype=part.dtype)
            out[lo - a:hi - a].copy_(part)
            covered += hi - lo
            if covered == b - a:
                return out
        raise ValueError(f"checkpoint {self.path} does not hold all of {name!r}: no file of "
                         f"{src.files} holds some of its elements [{a}, {b})")


# A slice along a dim other than the first is read this many bytes of whole rows at a time.
_BLOCK_BYTES = 16 << 20


def _coords(mesh) -> tuple[int, int]:
    return (mesh.tp_rank, mesh.pp_rank) if mesh is not None else (0, 0)


def _parts(specs) -> dict[int, list]:
    """The tensors a checkpoint names per parameter (several for a fused one), in row order:
    ``(name, shape, dim, start, stop, first element, end)`` within the flattened parameter."""
    out: dict[int, list] = {}
    for name, (t, shape, dim, start, stop, base, rows) in specs.items():
        inner = base.numel() // base.shape[0] if base.dim() else 1
        first, n = (0, base.numel()) if rows is None else (rows[0] * inner, rows[1] * inner)
        out.setdefault(id(base), []).append((name, shape, dim, start, stop, first, first + n))
    return {k: sorted(v, key=lambda part: part[5]) for k, v in out.items()}


def shard_reader(reader: _Reader, specs):
    """``read(param, start, count, key="master")`` over a checkpoint, as
    :meth:`~fastpar.data_parallel.DistributedOptimizer.load_state_shards` (and, for the
    weights, ``load_shards``) call it: ``count`` elements from ``start`` of ``param``'s
    flattened value, from every tensor the checkpoint stores it as; None where the checkpoint
    holds no optimizer state for it."""
    parts = _parts(specs)

    def read(p: torch.Tensor, start: int, count: int, key: str = "master"):
        mine = [(name, shape, dim, lo, hi, a - first, b - first)
                for name, shape, dim, lo, hi, first, end in parts[id(p)]
                for a, b in [(max(start, first), min(start + count, end))] if a < b]
        if key != "master" and not reader.has(f"optim.step.{mine[0][0]}"):
            return None
        if key == "step":       # (of a part in the range: in the files read for it)
            return reader.slice(f"optim.step.{mine[0][0]}", [1], None, 0, 0).reshape(())
        prefix = "" if key == "master" else f"optim.{key}."
        out = [reader.flat(prefix + name, *rest) for name, *rest in mine]
        return out[0] if len(out) == 1 else torch.cat(out)
    return read


def checkpoint_shard_reader(path, modules, mesh):
    """``read(param, start, count)`` of the weights in checkpoint ``path`` (what ZeRO-3's
    ``load_shards`` reads with, fine-tuning from it): each rank reads only its shard."""
    path = Path(path)
    reader = _Reader(path, Verifier(path, read_manifest(path)), _coords(mesh))
    specs = shard_specs(modules, mesh.tp_size if mesh else 1, mesh.tp_rank if mesh else 0)
    read = shard_reader(reader, specs)
    return lambda p, start, count: read(p, start, count)


def load_checkpoint(path, modules, optimizer, mesh) -> dict:
    """Load ``path`` into this rank's modules (and optimizer state); returns the manifest.
    A sharded (ZeRO) optimizer's masters and moments are read as the flat ranges of its own
    shard, and its parameters gathered from them."""
    path = Path(path)
    manifest = read_manifest(path)
    zero, optimizer = optimizer, per_param(optimizer)
    if zero is not None and optimizer is None and manifest.get("zero1"):
        raise CheckpointError(f"checkpoint {path} holds its ZeRO optimizer state in per-rank "
                              f"shard files, a format no longer read: load its weights with "
                              f"--init-from (the moments start afresh)")
    if optimizer is not None or zero is None:
        zero = None
    reader = _Reader(path, Verifier(path, manifest), _coords(mesh))
    if optimizer is not None and hasattr(optimizer, "finish_param_sync"):
        optimizer.finish_param_sync()     # no gather lands on what is loaded
    specs = shard_specs(modules, mesh.tp_size if mesh else 1, mesh.tp_rank if mesh else 0)
    with torch.no_grad():
        for name, (t, shape, dim, start, stop, base, rows) in specs.items():
            if zero is not None and zero.holds(base):
                continue                    # from its master shards, below
            weight = reader.slice(name, shape, dim, start, stop)
            if not t.is_meta:
                t.copy_(weight)
            _, master = _state_of(optimizer, base, rows)
            if master is not None:
                master.copy_(weight)
            if optimizer is None or not reader.has(f"optim.step.{name}"):
                continue
            state = optimizer.state[base]
            for key in _OPTIM_KEYS:
                got = reader.slice(f"optim.{key}.{name}", shape, dim, start, stop).to(
                    t.device, t.dtype if master is None else master.dtype)
                if rows is None:
                    state[key] = got
                else:                      # one part of a fused parameter's state
                    full = state.setdefault(key, torch.zeros_like(base, dtype=got.dtype,
                                                                   device=got.device))
                    full.narrow(0, *rows).copy_(got)
            state["step"] = reader.slice(f"optim.step.{name}", [1], None, 0, 0) \
                .reshape(()).clone()
        if zero is not None:
            zero.load_state_shards(shard_reader(reader, specs))
        for name, b in _state_buffers(modules).items():
            if reader.has(name):            # (a checkpoint from before they were saved: kept)
                b.copy_(reader.slice(name, list(b.shape), None, 0, 0))
    rng = f"rng_rank{mesh.rank if mesh is not None else 0}.safetensors"
    if (path / rng).exists():
        with _open(path, rng, reader.verify) as st:
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
        spans, flats = [], {}
        for idx_file, entries in index.items():
            if name in entries:
                span, flat = _span(path, idx_file, name, entries[name], shape)
                _check_slice(path, idx_file, name, shape, span, flat, headers)
                if flat is None:
                    spans.append(span)
                else:            # a dp shard's flat range of the slice: all of them, below
                    files = re.sub(r"_dp\d+\.json$", "", idx_file.name)
                    flats.setdefault((files, span), []).append(flat)
        for (files, span), ranges in flats.items():
            _check_flat_covered(path, name, shape, files, span, ranges)
            spans.append(span)
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


def _local_shape(shape, span) -> list[int]:
    part = list(shape)
    if span is not None:
        part[span[0]] = span[2] - span[1]
    return part


def _span(path: Path, idx_file: Path, name: str, entry, shape):
    """The ``(dim, start, stop)`` of tensor ``name`` an index entry says its file holds (None:
    all of it), and the ``(a, b)`` flat range of that slice (None: all of it)."""
    where = f"checkpoint {path}: {idx_file.name}"
    if not isinstance(entry, dict) or not isinstance(entry.get("shape"), list):
        raise CheckpointError(f"{where}: the entry of {name!r} is malformed")
    if entry["shape"] != list(shape):
        raise CheckpointError(f"checkpoint {path}: {name} has shape {entry['shape']}, the "
                              f"model {list(shape)}: a checkpoint of another model shape")
    dim, start, stop = entry.get("dim"), entry.get("start"), entry.get("stop")
    span = None
    if dim is not None:
        if not all(_natural(v) for v in (dim, start, stop)) or dim >= len(shape) or \
                not start < stop <= shape[dim]:
            raise CheckpointError(f"{where}: {name!r} is split at dim={dim!r} [{start!r}, "
                                  f"{stop!r}), outside its shape {list(shape)}")
        span = (dim, start, stop)
    flat = entry.get("flat")
    if flat is None:
        return span, None
    n = math.prod(_local_shape(shape, span))
    if not (isinstance(flat, list) and len(flat) == 2 and all(_natural(v) for v in flat)
            and flat[0] < flat[1] <= n):
        raise CheckpointError(f"{where}: {name!r} holds the flat range {flat!r}, outside its "
                              f"{n} elements")
    return span, tuple(flat)


def _check_slice(path: Path, idx_file: Path, name: str, shape, span, flat, headers) -> None:
    """The tensors file of ``idx_file`` holds the slice ``span`` of ``name`` (its header),
    or its flat range ``flat``."""
    file = _tensors_file(idx_file)
    if file not in headers:
        if not (path / file).is_file():
            raise CheckpointError(f"checkpoint {path}: {file} is missing ({idx_file.name} "
                                  f"lists its tensors)")
        headers[file] = safetensors_header(path / file)
    if name not in headers[file]:
        raise CheckpointError(f"checkpoint {path}: {file} lacks {name!r}, which its index lists")
    part = _local_shape(shape, span) if flat is None else [flat[1] - flat[0]]
    check_header_tensor(path / file, headers[file], name, part, idx_file.name)


def _check_flat_covered(path: Path, name: str, shape, files: str, span, ranges) -> None:
    """The dp shards' flat ranges ``ranges`` of one slice are all of it."""
    n, reach = math.prod(_local_shape(shape, span)), 0
    for a, b in sorted(ranges):
        if a > reach:
            break
        reach = max(reach, b)
    if reach < n:
        raise CheckpointError(f"checkpoint {path} does not hold all of {name!r}: no dp shard "
                              f"of {files} holds element {reach} of its {n}")


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
