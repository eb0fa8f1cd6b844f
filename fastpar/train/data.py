"""Training data: a byte-level tokenizer, token sources, and the global batch of every step.

Sources: by default the Python standard library's own source files (on every machine, nothing to
download); a text file; a folder of text files; or a uint16 token file (``.bin``, memory-mapped).
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

DEFAULT_MAX_BYTES = 8 * 2**20   # of the stdlib corpus: plenty for the tiny model, quick to read


class ByteTokenizer:
    """UTF-8 bytes as tokens: vocabulary 256, no unknowns, lossless."""

    vocab_size = 256

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8)

    def decode(self, tokens) -> str:
        return bytes(int(t) for t in tokens).decode("utf-8", errors="replace")


def _read_files(files, max_bytes) -> np.ndarray:
    chunks, total = [], 0
    for f in files:
        data = Path(f).read_bytes()
        chunks.append(np.frombuffer(data, dtype=np.uint8))
        total += len(data)
        if max_bytes and total >= max_bytes:
            break
    return np.concatenate(chunks)[:max_bytes] if chunks else np.zeros(0, np.uint8)


def load_tokens(path: str | None = None, max_bytes: int | None = DEFAULT_MAX_BYTES) -> np.ndarray:
    """The token stream of a source (see the module docstring) as a 1-D uint8/uint16 array."""
    if path is None:
        stdlib = Path(sysconfig.get_paths()["stdlib"])
        files = sorted(p for p in stdlib.glob("*.py") if p.is_file())
        tokens = _read_files(files, max_bytes)
    else:
        p = Path(path)
        if not p.exists():
            raise ValueError(f"data path {path!r} does not exist")
        if p.is_dir():
            files = sorted(f for f in p.rglob("*") if f.is_file() and not f.name.startswith("."))
            tokens = _read_files(files, None)
        elif p.suffix == ".bin":
            if p.stat().st_size % 2:
                raise ValueError(f"token file {path!r} has an odd size: not uint16 tokens")
            tokens = np.memmap(p, dtype=np.uint16, mode="r") if p.stat().st_size else \
                np.zeros(0, np.uint16)
        else:
            tokens = _read_files([p], None)
    if len(tokens) == 0:
        raise ValueError(f"data {path or 'stdlib corpus'!r} is empty")
    return tokens


def check_data(path: str | None, seq_len: int = 0, vocab_size: int | None = None,
               model: str = "") -> None:
    """Fail fast (ValueError) on a data path that is missing, holds no bytes, is a token file of
    an odd size, holds fewer than ``seq_len + 2`` tokens, or (with ``vocab_size``) a token id
    the model has no embedding for. Reads sizes only, and a token file's ids."""
    if path is None:
        return
    p = Path(path)
    if not p.exists():
        raise ValueError(f"data path {path!r} does not exist")
    files = [p] if p.is_file() else [f for f in p.rglob("*") if f.is_file()
                                     and not f.name.startswith(".")]
    size = sum(f.stat().st_size for f in files)
    if not size:
        raise ValueError(f"data {path!r} is empty")
    if p.is_file() and p.suffix == ".bin":
        if size % 2:
            raise ValueError(f"token file {path!r} has an odd size: not uint16 tokens")
        size //= 2
        if vocab_size is not None:
            check_vocab(np.memmap(p, dtype=np.uint16, mode="r"), vocab_size, model, path)
    check_length(size, seq_len, path)


def check_vocab(tokens: np.ndarray, vocab_size: int, model: str, path: str | None) -> None:
    """Every token id must be an index of the model's embedding: one error naming the largest."""
    if tokens.dtype == np.uint8 and vocab_size >= 256:
        return                                   # bytes: nothing to scan
    top = int(tokens.max()) if len(tokens) else 0
    if top >= vocab_size:
        raise ValueError(f"data {path or 'stdlib corpus'!r} has token ids up to {top}, but model "
                         f"{model!r} has a vocabulary of {vocab_size} (ids 0-{vocab_size - 1}): "
                         "pick a model whose vocabulary holds them, or re-tokenize the data")


def check_length(n_tokens: int, seq_len: int, path: str | None) -> None:
    if n_tokens < seq_len + 2:
        raise ValueError(f"data {path or 'stdlib corpus'!r} has {n_tokens} tokens, fewer than "
                         f"--seq-len + 2 = {seq_len + 2}")


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


def write_token_file(path: str | os.PathLike, tokens) -> None:
    """Write tokens as the uint16 ``.bin`` format :func:`load_tokens` memory-maps."""
    np.asarray(tokens, dtype=np.uint16).tofile(path)
