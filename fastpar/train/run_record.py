"""What a run is, kept in its folder so that the folder stands on its own, and the check that a
resume continues exactly that run.

A run's folder holds, besides its metrics and checkpoints:

- ``config.json``: every option, with the paths (``out``, ``data``, ``init_from``) absolute;
- ``data.json``: the data's description (:func:`fastpar.data.sources.describe_data`: format,
  vocabulary, split sizes and a fingerprint of its content that does not depend on where it
  lies);
- ``tokenizer.json``: a copy of the tokenizer that decodes the run's token ids (the prepared
  data's, else the ``--init-from`` directory's); none for bytes.

So ``export``, ``generate`` and ``--resume`` work from any directory, also after the data folder
has moved (a resume names the data's new place with ``--data``; the fingerprint says it is the
same data).

Every checkpoint's manifest records the options the learning-rate schedule and the data order
depend on (:data:`RESUME_KEYS`) and the data's fingerprint. A resume that changes any of them is
refused, naming the old and new values, unless ``--adopt-changes`` takes the new ones (each change
is then printed): Megatron refuses a changed scheduler the same way unless told which to keep.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from .config import TrainConfig
from ..data.sources import describe_data
from ..data.tokenizer import TOKENIZER_FILE, copy_tokenizer_config, source_tokenizer_file

# What the schedule (steps, lr, min_lr, warm-up), the optimization (decay, clipping) and the data
# order (seed, batch sizes, sequence length, how documents fill a sequence) of a run depend on.
RESUME_KEYS = ("steps", "lr", "min_lr", "warmup_steps", "weight_decay", "grad_clip",
               "global_batch_size", "micro_batch_size", "seq_len", "seed", "pack_documents",
               "pad_documents")
DATA_FILE = "data.json"


def absolute(path: str | None) -> str | None:
    return None if path is None else str(Path(path).resolve())


def run_record(cfg: TrainConfig) -> dict:
    """What a checkpoint's manifest keeps of the run: :data:`RESUME_KEYS` and the data."""
    return {"train": {k: getattr(cfg, k) for k in RESUME_KEYS}, "data": describe_data(cfg.data)}


def _data_label(d: dict | None) -> str:
    if not d:
        return "unknown data"
    where = "the stdlib corpus" if d.get("format") == "stdlib" else d.get("path", "?")
    return f"{where} ({d.get('format')}, fingerprint {str(d.get('fingerprint'))[:12]})"


def changes(saved: dict, cfg: TrainConfig) -> list[str]:
    """How ``cfg`` differs from a checkpoint's :func:`run_record` (``saved``), one phrase per
    option, e.g. ``--steps 200 (the run) -> 300 (now)``. Empty when it continues the run."""
    now = run_record(cfg)
    out = [f"--{k.replace('_', '-')} {saved['train'][k]} (the run) -> {now['train'][k]} (now)"
           for k in RESUME_KEYS if k in saved.get("train", {})
           and saved["train"][k] != now["train"][k]]
    old = saved.get("data")
    if old is not None and old.get("fingerprint") != now["data"].get("fingerprint"):
        out.append(f"--data {_data_label(old)} (the run) -> {_data_label(now['data'])} (now)")
    return out


def check_changes(saved: dict | None, cfg: TrainConfig, path, say=None) -> None:
    """Refuse a resume from checkpoint ``path`` whose options differ from the run's (one
    ValueError naming each), unless ``cfg.adopt_changes``; then ``say`` each change."""
    if not saved:               # a checkpoint written before runs were recorded
        return
    diff = changes(saved, cfg)
    if diff and not cfg.adopt_changes:
        raise ValueError(f"--resume from {path} would not continue the run: "
                         + "; ".join(diff) + ". Resume with the run's values, or pass "
                         "--adopt-changes to continue with the new ones")
    for change in diff if say else ():
        say(f"fastpar train: --adopt-changes: {change}")


def legacy_record(out) -> dict | None:
    """For a checkpoint written before manifests kept :func:`run_record`: the options in its
    run's ``config.json`` (the data unknown), or None."""
    try:
        train = json.loads((Path(out) / "config.json").read_text())["train"]
        return {"train": {k: train[k] for k in RESUME_KEYS if k in train}}
    except (OSError, ValueError, KeyError, TypeError):
        return None


def write_run_files(cfg: TrainConfig, layout, fresh: bool) -> None:
    """``config.json`` (always: the options this part of the run was started with), and on a
    fresh start or with adopted changes ``data.json`` and ``tokenizer.json`` (rank 0 only)."""
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    train = dict(cfg.to_dict(), **{k: absolute(getattr(cfg, k)) for k in
                                   ("out", "data", "init_from")})
    _write_json(out / "config.json", {"train": train, "model": cfg.model_config.to_dict(),
                                      "world_size": layout.world_size, "dp": layout.dp})
    if not fresh and not cfg.adopt_changes and (out / DATA_FILE).exists():
        return
    _write_json(out / DATA_FILE, describe_data(cfg.data))
    tok = source_tokenizer_file(cfg.data, cfg.init_from)
    if tok is not None:
        tmp = out / f".{TOKENIZER_FILE}.tmp"
        shutil.copyfile(tok, tmp)
        os.replace(tmp, out / TOKENIZER_FILE)
    else:
        (out / TOKENIZER_FILE).unlink(missing_ok=True)      # bytes: the ids are the text
    copy_tokenizer_config(tok, out)     # its chat template beside it (None removes a stale one)


def _write_json(path: Path, obj) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(obj, indent=2))
    os.replace(tmp, path)
