"""Training data: token sources, the token-file format, and the global batch of every step.

Sources: by default the Python standard library's own source files (on every machine, nothing to
download); a text file or a folder of them (UTF-8 bytes, vocabulary 256); a folder ``fastpar
prepare-data`` wrote (train.bin, val.bin, maybe tokenizer.json); one token file; or a legacy
headerless uint16 ``.bin``. A raw (not prepared) source's last ``VAL_FRACTION`` of tokens is its
"val" split, the rest "train". Token files: :mod:`.token_file`.

The global batch of step ``s`` is a fixed function of (seed, s): ``global_batch`` windows of
``seq_len + 1`` tokens at offsets drawn from ``numpy.random.default_rng((seed, s))``. It is the
same whatever the layout; each data-parallel rank reads only its contiguous share of it, so the
data position to save in a checkpoint is just the step.
"""
from __future__ import annotations

import os
import sysconfig
from pathlib import Path

import numpy as np
import torch

from .token_file import (MAGIC, TokenFileWriter, TokenHeader, read_header,  # noqa: F401
                         read_token_file, token_dtype, write_token_file)    # (re-exported)
from .tokenizer import ByteTokenizer  # noqa: F401 - re-exported: fastpar.train.data.ByteTokenizer

DEFAULT_MAX_BYTES = 8 * 2**20   # of the stdlib corpus: plenty for the tiny model, quick to read
VAL_FRACTION = 0.05             # of a raw source's tokens, at its end: the "val" split
SPLITS = ("train", "val")
def prepared_folder(path: str | os.PathLike | None) -> Path | None:
    """The folder ``prepare-data`` wrote that ``path`` is (or holds a token file of), else None."""
    p = Path(path) if path is not None else None
    folder = p if p and p.is_dir() else p.parent if p and _is_token_file(p) else None
    return folder if folder and any(_is_token_file(folder / f"{s}.bin") for s in SPLITS) else None


def _is_token_file(p: Path) -> bool:
    if not p.is_file() or p.suffix != ".bin":
        return False
    with open(p, "rb") as f:
        return f.read(len(MAGIC)) == MAGIC


def _split_file(path: str | None, split: str) -> Path | None:
    """The token file holding ``split`` of a prepared source; None for a raw source."""
    if split not in SPLITS:
        raise ValueError(f"split={split!r} is not one of {', '.join(SPLITS)}")
    p = Path(path) if path is not None else None
    if p is not None and _is_token_file(p):
        if split == "train":
            return p
        raise ValueError(f"token file {path!r} is one file with no held-out {split} split: "
                         "pass the folder prepare-data wrote")
    if p is not None and p.is_dir() and prepared_folder(p) is not None:
        if not (p / f"{split}.bin").is_file():
            raise ValueError(f"prepared data {path!r} has no {split}.bin")
        return p / f"{split}.bin"
    return None


def _split_range(n_tokens: int, split: str, path: str | None) -> slice:
    """The tokens of ``split`` in a raw source's stream of ``n_tokens``: val is the last part."""
    n_val = int(n_tokens * VAL_FRACTION)
    if split == "val" and n_val == 0:
        raise ValueError(f"data {path or 'stdlib corpus'!r} has {n_tokens} tokens, too few to "
                         f"hold out the last {VAL_FRACTION:.0%} for validation")
    return slice(0, n_tokens - n_val) if split == "train" else slice(n_tokens - n_val, n_tokens)


def _read_files(files, max_bytes) -> np.ndarray:
    chunks, total = [], 0
    for f in files:
        data = Path(f).read_bytes()
        chunks.append(np.frombuffer(data, dtype=np.uint8))
        total += len(data)
        if max_bytes and total >= max_bytes:
            break
    return np.concatenate(chunks)[:max_bytes] if chunks else np.zeros(0, np.uint8)


def text_files(p: Path) -> list[Path]:
    """A folder's files, recursively, in path order, hidden files and folders skipped."""
    return sorted(f for f in p.rglob("*") if f.is_file()
                  and not any(part.startswith(".") for part in f.relative_to(p).parts))


def _raw_tokens(path: str | None, max_bytes: int | None) -> np.ndarray:
    if path is None:
        stdlib = Path(sysconfig.get_paths()["stdlib"])
        return _read_files(sorted(p for p in stdlib.glob("*.py") if p.is_file()), max_bytes)
    p = Path(path)
    if p.is_dir():
        return _read_files(text_files(p), None)
    if p.suffix == ".bin":
        if p.stat().st_size % 2:
            raise ValueError(f"token file {path!r} has an odd size: not uint16 tokens")
        return np.memmap(p, dtype=np.uint16, mode="r") if p.stat().st_size else \
            np.zeros(0, np.uint16)
    return _read_files([p], None)


def load_tokens(path: str | None = None, max_bytes: int | None = DEFAULT_MAX_BYTES,
                split: str = "train") -> np.ndarray:
    """The tokens of one split ("train" or "val") of a source (see the module docstring) as a
    1-D array. ``max_bytes`` caps the stdlib corpus before it is split."""
    f = _split_file(path, split)
    if path is not None and not Path(path).exists():
        raise ValueError(f"data path {path!r} does not exist")
    if f is not None:
        tokens = read_token_file(f)[0]
    else:
        tokens = _raw_tokens(path, max_bytes)
        if len(tokens):
            tokens = tokens[_split_range(len(tokens), split, path)]
    if len(tokens) == 0:
        raise ValueError(f"data {path or 'stdlib corpus'!r} is empty")
    return tokens


def data_vocab(path: str | None) -> int | None:
    """The vocabulary size a source was tokenized with: its header's, 256 for text (bytes),
    None for a legacy headerless .bin."""
    f = _split_file(path, "train")
    if f is not None:
        return read_header(f).vocab_size
    return None if path is not None and Path(path).suffix == ".bin" else 256


def check_data(path: str | None, seq_len: int = 0, vocab_size: int | None = None,
               model: str = "", split: str = "train") -> None:
    """Fail fast (ValueError) on a data path that is missing, holds no bytes, is a token file
    that is damaged or of an odd size, whose ``split`` holds fewer than ``seq_len + 2`` tokens,
    or (with ``vocab_size``) that was tokenized with a larger vocabulary than the model's or
    holds a token id it has no embedding for. Reads headers and sizes, and a legacy file's ids."""
    f = _split_file(path, split)
    if path is None:
        return
    p = Path(path)
    if not p.exists():
        raise ValueError(f"data path {path!r} does not exist")
    if f is not None:
        h = read_header(f)
        if vocab_size is not None and h.vocab_size > vocab_size:
            raise ValueError(f"data {path!r} was tokenized with a vocabulary of {h.vocab_size}, "
                             f"but model {model!r} has {vocab_size}: train a model of that "
                             f"vocabulary (--vocab-size {h.vocab_size}), or prepare the data "
                             "with the model's tokenizer")
        check_length(h.n_tokens, seq_len, path, split if p.is_dir() else None)
        return
    size = sum(f.stat().st_size for f in ([p] if p.is_file() else text_files(p)))
    if not size:
        raise ValueError(f"data {path!r} is empty")
    if p.is_file() and p.suffix == ".bin":
        if size % 2:
            raise ValueError(f"token file {path!r} has an odd size: not uint16 tokens")
        size //= 2
        if vocab_size is not None:
            check_vocab(np.memmap(p, dtype=np.uint16, mode="r"), vocab_size, model, path)
    check_length(size, seq_len, path)
    part = _split_range(size, split, path)
    check_length(part.stop - part.start, seq_len, path, split)


def check_vocab(tokens: np.ndarray, vocab_size: int, model: str, path: str | None) -> None:
    """Every token id must be an index of the model's embedding: one error naming the largest."""
    if tokens.dtype == np.uint8 and vocab_size >= 256:
        return                                   # bytes: nothing to scan
    top = int(tokens.max()) if len(tokens) else 0
    if top >= vocab_size:
        raise ValueError(f"data {path or 'stdlib corpus'!r} has token ids up to {top}, but model "
                         f"{model!r} has a vocabulary of {vocab_size} (ids 0-{vocab_size - 1}): "
                         "pick a model whose vocabulary holds them, or re-tokenize the data")


def check_length(n_tokens: int, seq_len: int, path: str | None, split: str | None = None) -> None:
    """At least ``seq_len + 2`` tokens (in ``split``, when named)."""
    where = f" in its {split} split" if split else ""
    if n_tokens < seq_len + 2:
        raise ValueError(f"data {path or 'stdlib corpus'!r} has {n_tokens} tokens{where}, fewer "
                         f"than --seq-len + 2 = {seq_len + 2}")


class BatchSampler:
    """The (inputs, targets) of one data-parallel rank's share of each step's global batch."""

    def __init__(self, tokens: np.ndarray, seq_len: int, global_batch: int, seed: int = 0,
                 dp_rank: int = 0, dp_size: int = 1):
        if global_batch % dp_size:
            raise ValueError(f"global batch {global_batch} is not divisible by dp={dp_size}")
        if len(tokens) < seq_len + 2:
            raise ValueError(f"data has {len(tokens)} tokens, fewer than seq_len + 2 = "
                             f"{seq_len + 2}")
        self.tokens, self.seq_len, self.global_batch = tokens, seq_len, global_batch
        self.seed, self.dp_rank, self.dp_size = seed, dp_rank, dp_size

    def offsets(self, step: int) -> np.ndarray:
        """Start offsets of the whole global batch of ``step`` (identical on every rank)."""
        rng = np.random.default_rng((self.seed, step))
        return rng.integers(0, len(self.tokens) - self.seq_len - 1, size=self.global_batch)

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's (B_local, seq_len) inputs and targets (int64) for ``step``."""
        per = self.global_batch // self.dp_size
        mine = self.offsets(step)[self.dp_rank * per:(self.dp_rank + 1) * per]
        rows = np.stack([np.asarray(self.tokens[o:o + self.seq_len + 1], dtype=np.int64)
                         for o in mine])
        rows = torch.from_numpy(rows)
        return rows[:, :-1], rows[:, 1:]
