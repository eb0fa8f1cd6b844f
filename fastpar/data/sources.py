"""Training data: token sources, the token-file format, and the global batch of every step.

Sources: by default the Python standard library's own source files (on every machine, nothing to
download); a text file or a folder of them (UTF-8 bytes, vocabulary 256); a folder ``fastpar
prepare-data`` wrote (train.bin, val.bin, maybe tokenizer.json); one token file; or a legacy
headerless uint16 ``.bin``. A raw (not prepared) source's last ``VAL_FRACTION`` of tokens is its
"val" split, the rest "train". Token files: :mod:`.token_file`.

A ``.bin`` is never read as text. A folder holding train.bin or val.bin is prepared data whatever
their content, and each split file is validated field by field (``token_file.check_token_file``)
by :func:`check_data` (before launch) and :func:`load_tokens` alike, so a damaged file is one
error naming the file and the field. A folder of text files that holds any other ``.bin`` is
refused. A ``.bin`` passed on its own is a token file when it starts with the magic (or nearly:
a damaged one) or is named train.bin / val.bin, else a legacy headerless uint16 file.
:func:`describe_data` fingerprints a source, wherever it lives, for a run to record.

The global batch of step ``s`` is a fixed function of (seed, s): ``global_batch`` windows of
``seq_len + 1`` tokens at offsets drawn from ``numpy.random.default_rng((seed, s))``. It is the
same whatever the layout; each data-parallel rank reads only its contiguous share of it, so the
data position to save in a checkpoint is just the step.
"""
from __future__ import annotations

import hashlib
import os
import platform
import sysconfig
from pathlib import Path

import numpy as np
import torch

from .token_file import (MAGIC, TOKENIZER_FILE, TokenFileWriter,  # noqa: F401 (re-exported)
                         TokenHeader, check_token_file, looks_like_token_file, read_header,
                         read_token_file, token_dtype, write_token_file)

DEFAULT_MAX_BYTES = 8 * 2**20   # of the stdlib corpus: plenty for the tiny model, quick to read
VAL_FRACTION = 0.05             # of a raw source's tokens, at its end: the "val" split
SPLITS = ("train", "val")
SPLIT_FILES = tuple(f"{s}.bin" for s in SPLITS)
# describe_data's fingerprint reads this much of each end of a file, and no more than this many
# text files' contents (evenly spaced over the sorted list): cheap, yet any real edit shows.
TOKEN_SAMPLE_BYTES = 2**20
TEXT_SAMPLE_BYTES = 2**16
MAX_SAMPLED_FILES = 10_000


def prepared_folder(path: str | os.PathLike | None) -> Path | None:
    """The folder ``prepare-data`` wrote that ``path`` is (or holds a token file of), else None:
    its train.bin or val.bin starts with the token-file magic. This decides what prepare-data
    may replace and where a tokenizer.json is; whether a folder is *read* as prepared data is
    :func:`_holds_splits` (any train.bin / val.bin, damaged or not)."""
    p = Path(path) if path is not None else None
    folder = p if p and p.is_dir() else p.parent if p and _has_magic(p) else None
    return folder if folder and any(_has_magic(folder / f) for f in SPLIT_FILES) else None


def _has_magic(p: Path) -> bool:
    if not p.is_file() or p.suffix != ".bin":
        return False
    with open(p, "rb") as f:
        return f.read(len(MAGIC)) == MAGIC


def _holds_splits(p: Path) -> bool:
    """A folder with train.bin or val.bin is prepared data, whatever their content: they are
    validated as token files (a damaged one is an error), never read as text."""
    return p.is_dir() and any((p / f).is_file() for f in SPLIT_FILES)


def _is_token_file(p: Path) -> bool:
    """Whether a .bin passed on its own is a token file (validated as one): it starts with the
    magic or a damaged one, or bears a split's name. Any other .bin is a legacy uint16 file."""
    if not p.is_file() or p.suffix != ".bin":
        return False
    return p.name in SPLIT_FILES or looks_like_token_file(p)


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
    if p is not None and _holds_splits(p):
        if not (p / f"{split}.bin").is_file():
            raise ValueError(f"prepared data {path!r} has no {split}.bin")
        return p / f"{split}.bin"
    return None


def _token_files(path: str) -> dict[str, Path]:
    """Every split file of a prepared source (one for a single token file); {} for a raw one."""
    p = Path(path)
    if _is_token_file(p):
        return {"train": p}
    return {s: p / f"{s}.bin" for s in SPLITS if (p / f"{s}.bin").is_file()} \
        if _holds_splits(p) else {}


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


def _text_folder(p: Path) -> list[Path]:
    """The files of a text-folder source; a .bin among them is refused, not read as text (it
    is a token file, or a legacy one: either way its bytes are no text to train on)."""
    files = text_files(p)
    stray = next((f for f in files if f.suffix.lower() == ".bin"), None)
    if stray is not None:
        rel = stray.relative_to(p).as_posix()
        raise ValueError(f"data folder {str(p)!r} holds {rel!r}: a .bin is a token file, never "
                         f"read as text; pass it on its own (--data {p / rel}) or remove it")
    return files


def _stdlib_files() -> list[Path]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    return sorted(p for p in stdlib.glob("*.py") if p.is_file())


def _legacy_tokens(p: Path) -> int:
    """How many uint16 tokens a legacy headerless .bin holds (an odd size is an error)."""
    size = p.stat().st_size
    if size % 2:
        raise ValueError(f"token file {str(p)!r} has an odd size: not uint16 tokens")
    return size // 2


def _raw_tokens(path: str | None, max_bytes: int | None) -> np.ndarray:
    if path is None:
        return _read_files(_stdlib_files(), max_bytes)
    p = Path(path)
    if p.is_dir():
        return _read_files(_text_folder(p), None)
    if p.suffix == ".bin":              # not a token file (see _split_file): legacy uint16
        return np.memmap(p, dtype=np.uint16, mode="r") if _legacy_tokens(p) else \
            np.zeros(0, np.uint16)
    return _read_files([p], None)


def load_tokens(path: str | None = None, max_bytes: int | None = DEFAULT_MAX_BYTES,
                split: str = "train") -> np.ndarray:
    """The tokens of one split ("train" or "val") of a source (see the module docstring) as a
    1-D array. ``max_bytes`` caps the stdlib corpus before it is split. A damaged token file is
    the same ValueError :func:`check_data` gives."""
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


def load_documents(path: str | None, split: str = "train"
                   ) -> tuple[np.ndarray, np.ndarray | None, np.ndarray | None]:
    """(tokens, document start offsets, loss mask) of one split: the offsets of a token file
    (None for a raw source) and the mask ``prepare-data`` wrote beside it
    (:func:`fastpar.data.masks.read_mask`; None when there is none)."""
    tokens = load_tokens(path, split=split)
    f = _split_file(path, split)
    if f is None:
        return tokens, None, None
    from .masks import read_mask

    return tokens, read_token_file(f)[1], read_mask(f)


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
    that is damaged (any split file of a prepared folder: see the module docstring) or a legacy
    one of an odd size, is a text folder holding a .bin, whose ``split`` holds fewer than
    ``seq_len + 2`` tokens, or (with ``vocab_size``) that was tokenized with a larger vocabulary
    than the model's or holds a token id it has no embedding for. Reads token files' headers and
    document offsets, sizes, and a legacy file's ids."""
    f = _split_file(path, split)
    if path is None:
        return
    p = Path(path)
    if not p.exists():
        raise ValueError(f"data path {path!r} does not exist")
    if f is not None:
        # Every split file, not only ``split``'s: the trainer also reads val.bin (its sample
        # after training), and a damaged one must stop the run before it starts.
        h = read_header(f)
        for other in [g for g in _token_files(path).values() if g != f]:
            read_header(other)
        if vocab_size is not None and h.vocab_size > vocab_size:
            raise ValueError(f"data {path!r} was tokenized with a vocabulary of {h.vocab_size}, "
                             f"but model {model!r} has {vocab_size}: train a model of that "
                             f"vocabulary (--vocab-size {h.vocab_size}), or prepare the data "
                             "with the model's tokenizer")
        check_length(h.n_tokens, seq_len, path, split if p.is_dir() else None)
        return
    size = sum(f.stat().st_size for f in ([p] if p.is_file() else _text_folder(p)))
    if not size:
        raise ValueError(f"data {path!r} is empty")
    if p.is_file() and p.suffix == ".bin":
        size = _legacy_tokens(p)
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


def describe_data(path: str | os.PathLike | None) -> dict:
    """A JSON-able description of a source for a run to record: ``format`` ("prepared",
    "token-file", "legacy-bin", "text" or "stdlib"), ``vocab_size`` (None for a legacy .bin),
    ``splits`` ({"train": {"tokens": n}, "val": ...}), ``fingerprint`` (sha256 hex of cheap
    identifying content: headers, document offsets, sizes, relative names and each file's ends -
    never the location, so a moved folder keeps it) and, for information only, ``path``. A
    damaged source is the ValueError :func:`check_data` gives. Reads a few MiB at most per token
    file and 128 KiB per text file (of at most ``MAX_SAMPLED_FILES``)."""
    if path is None:
        return _describe_stdlib()
    p = Path(path)
    if not p.exists():
        raise ValueError(f"data path {str(path)!r} does not exist")
    digest = hashlib.sha256()
    files = _token_files(str(p))
    if files:
        fmt = "prepared" if p.is_dir() else "token-file"
        headers = {s: _hash_token_file(digest, s, f) for s, f in files.items()}
        from .masks import mask_file

        for s, f in files.items():      # a loss mask changes what is trained
            if mask_file(f).is_file():
                _hash_token_file(digest, f"{s} mask", mask_file(f))
        if p.is_dir() and (p / TOKENIZER_FILE).is_file():  # how the ids decode is part of it
            _hash_file(digest, TOKENIZER_FILE, p / TOKENIZER_FILE, None)
        vocab = next(iter(headers.values())).vocab_size
        splits = {s: {"tokens": h.n_tokens, "documents": h.n_docs} for s, h in headers.items()}
    elif p.is_file() and p.suffix == ".bin":
        fmt, vocab = "legacy-bin", None
        splits = _raw_splits(_legacy_tokens(p))
        _hash_file(digest, ".", p, TOKEN_SAMPLE_BYTES)
    else:
        fmt, vocab = "text", 256
        splits = _raw_splits(_hash_text(digest, p))
    digest.update(fmt.encode())
    return {"format": fmt, "path": str(p.resolve()), "vocab_size": vocab, "splits": splits,
            "fingerprint": digest.hexdigest()}


def _describe_stdlib() -> dict:
    """The stdlib corpus is identified by the Python version and how many bytes are read."""
    n = min(DEFAULT_MAX_BYTES, sum(f.stat().st_size for f in _stdlib_files()))
    python = platform.python_version()
    digest = hashlib.sha256(f"stdlib\0{python}\0{n}".encode())
    return {"format": "stdlib", "path": sysconfig.get_paths()["stdlib"], "vocab_size": 256,
            "python": python, "bytes": n, "splits": _raw_splits(n),
            "fingerprint": digest.hexdigest()}


def _raw_splits(n_tokens: int) -> dict:
    n_val = int(n_tokens * VAL_FRACTION)
    return {"train": {"tokens": n_tokens - n_val}, "val": {"tokens": n_val}}


def _hash_token_file(digest, name: str, f: Path) -> TokenHeader:
    """Feed a (validated) token file's size, header and offsets, and its tokens' ends."""
    h = read_header(f)
    digest.update(f"{name}\0{h.file_bytes}\0".encode())
    with open(f, "rb") as fh:
        digest.update(fh.read(h.data_offset))                # header + document offsets
        _hash_ends(digest, fh, h.data_offset, h.file_bytes, TOKEN_SAMPLE_BYTES)
    return h


def _hash_text(digest, p: Path) -> int:
    """Feed the relative names and sizes of a text source's files, and the ends of (evenly
    spaced) up to MAX_SAMPLED_FILES of them; returns their total bytes (= tokens)."""
    files = [p] if p.is_file() else _text_folder(p)
    sizes = [f.stat().st_size for f in files]
    for f, size in zip(files, sizes):
        digest.update(f"{f.relative_to(p).as_posix()}\0{size}\0".encode())
    every = -(-len(files) // MAX_SAMPLED_FILES) or 1         # ceil: a deterministic stride
    for f in files[::every]:
        _hash_file(digest, f.relative_to(p).as_posix(), f, TEXT_SAMPLE_BYTES)
    return sum(sizes)


def _hash_file(digest, name: str, f: Path, ends: int | None) -> None:
    """Feed a file's name, size and its first and last ``ends`` bytes (all of it for None)."""
    size = f.stat().st_size
    digest.update(f"{name}\0{size}\0".encode())
    with open(f, "rb") as fh:
        _hash_ends(digest, fh, 0, size, ends)


def _hash_ends(digest, fh, start: int, end: int, n: int | None) -> None:
    """Feed bytes [start, end) of an open file: all, or its first and last ``n``."""
    fh.seek(start)
    if n is None or end - start <= 2 * n:
        digest.update(fh.read(end - start))
        return
    digest.update(fh.read(n))
    fh.seek(end - n)
    digest.update(fh.read(n))


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
