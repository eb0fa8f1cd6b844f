"""``--init-from`` sources: a Hugging Face directory (:mod:`fastpar.models.hf`) or a fastpar
checkpoint, told apart, their config read, and everything loading them needs checked before any
rank starts (:func:`check_source`)."""
from __future__ import annotations

from pathlib import Path

import torch

from ..mesh.layout import require_positive
from ..models.config import GPTConfig
from ..models.gpt import GPT
from ..models.hf import hf_config, hf_index, hf_shards, hf_source, is_hf_dir
from ..tensor_parallel.sharding import shard_specs
from .checkpoint import check_checkpoint, check_header_tensor, checkpoint_config, \
    read_manifest, safetensors_header


def source_config(path) -> GPTConfig:
    """The model config of a Hugging Face directory or of a fastpar checkpoint; anything else,
    or anything wrong with what it reads, is one ValueError saying what is wrong."""
    path = Path(path)
    if not path.exists():
        raise ValueError(f"{path} does not exist")
    if not path.is_dir():
        raise ValueError(f"{path} is not a folder")
    if is_hf_dir(path):
        return hf_config(path)[1]
    if (path / "manifest.json").is_file():
        return checkpoint_config(path, read_manifest(path))
    why = "; its config.json has no model_type" if (path / "config.json").is_file() else ""
    raise ValueError(f"{path} is neither a Hugging Face directory (config.json with a "
                     f"model_type) nor a fastpar checkpoint (manifest.json){why}")


def check_source(path, tp: int = 1, pp: int = 1) -> GPTConfig:
    """Everything loading ``path`` (HF directory or fastpar checkpoint) into a (tp, pp) layout
    needs, checked without reading tensor data; returns its GPTConfig. Raises ValueError (one
    line) naming the file and the value at fault.

    The launcher calls it before any rank starts, so a bad ``--init-from`` is one line there
    rather than a failure inside every rank: the config, every shard present and complete
    (safetensors headers against file sizes; a fastpar checkpoint's sha256 too), every tensor
    the model needs there with its shape, and the layout."""
    path = Path(path)
    config = source_config(path)            # what the folder is, and its config
    # The layout before the tensors: it is cheap, and a checkpoint's sha256 is not.
    require_positive({"tp": tp, "pp": pp})
    try:
        config.check_tp(tp)
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None
    if pp > config.n_layers:
        raise ValueError(f"{path}: n_layers={config.n_layers} is fewer than pp={pp} stages")
    with torch.device("meta"):      # every tensor the model holds, shapes only: nothing allocated
        model = GPT(config)
    shapes = {name: spec.shape for name, spec in shard_specs([model], 1, 0).items()}
    if is_hf_dir(path):
        _check_hf_tensors(path, shapes)
    else:
        check_checkpoint(path, shapes)
    return config


def _check_hf_tensors(path: Path, shapes: dict[str, list[int]]) -> None:
    """Every shard's header against its file size, and every tensor the model needs (by
    :func:`hf_source`) in the shard the index names, of its shape, floating point."""
    hf, config = hf_config(path)
    weight_map = hf_index(path)
    headers = {f: safetensors_header(path / f) for f in hf_shards(path, weight_map)}
    where = weight_map if weight_map is not None else \
        {name: f for f, header in headers.items() for name in header}
    for name, shape in shapes.items():
        source = hf_source(hf["model_type"], config, name, shape)
        if source is None:
            continue
        for stored in source.pieces or (source.name,):      # stacked experts: each one's
            file = where.get(stored)
            if file is None:
                holder = "the index names no shard for" if weight_map else "no shard holds"
                raise ValueError(f"{path}: {holder} tensor {stored!r}, which the model needs")
            if stored not in headers[file]:
                raise ValueError(f"{path / file} lacks tensor {stored!r}, which the index "
                                 f"places there")
            check_header_tensor(path / file, headers[file], stored, source.shape,
                                "the config")
