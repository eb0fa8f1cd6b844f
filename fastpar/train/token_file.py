"""The token-file format ``fastpar prepare-data`` writes and the trainer memory-maps.

A token file (little-endian) is a 64-byte header (``MAGIC``, then u32 format version and token
size in bytes, u64 vocabulary size, token and document counts, zero padding), each document's
start offset (u64), then the tokens: uint16 when the vocabulary fits, else uint32. A file whose
size disagrees with its header is refused as corrupt or truncated.
"""
from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

MAGIC = b"FPTOKENS"
FORMAT_VERSION = 1
HEADER_BYTES = 64
_HEADER = struct.Struct("<8sIIQQQ")     # magic, version, token bytes, vocab, tokens, documents
_DTYPES = {2: np.dtype("<u2"), 4: np.dtype("<u4")}


@dataclass(frozen=True)
class TokenHeader:
    """What a token file's header says."""

    vocab_size: int
    n_tokens: int
    n_docs: int
    dtype: np.dtype                 # uint16 when the vocabulary fits, else uint32
    version: int = FORMAT_VERSION

    @property
    def data_offset(self) -> int:
        """Byte offset of the first token (after the header and the document offsets)."""
        return HEADER_BYTES + 8 * self.n_docs

    @property
    def file_bytes(self) -> int:
        return self.data_offset + self.dtype.itemsize * self.n_tokens


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 when every id of the vocabulary fits in it, else uint32."""
    return _DTYPES[2] if vocab_size <= 2**16 else _DTYPES[4]


def read_header(path: str | os.PathLike) -> TokenHeader | None:
    """The header of a token file; None for a file without one (a legacy .bin, a text file).
    A damaged header, or a file whose size disagrees with it, is a ValueError."""
    with open(path, "rb") as f:
        raw = f.read(HEADER_BYTES)
    if not raw.startswith(MAGIC):
        return None
    size = Path(path).stat().st_size
    if len(raw) < HEADER_BYTES:
        raise ValueError(f"token file {str(path)!r} is truncated: {size} bytes, less than its "
                         f"{HEADER_BYTES}-byte header")
    _, version, itemsize, vocab, n_tokens, n_docs = _HEADER.unpack_from(raw)
    if version != FORMAT_VERSION or itemsize not in _DTYPES:
        raise ValueError(f"token file {str(path)!r} has format version {version} and "
                         f"{itemsize}-byte tokens; this fastpar reads version {FORMAT_VERSION} "
                         f"with 2- or 4-byte tokens")
    h = TokenHeader(vocab, n_tokens, n_docs, _DTYPES[itemsize], version)
    if size != h.file_bytes:
        raise ValueError(f"token file {str(path)!r} is corrupt or truncated: its header says "
                         f"{n_tokens} tokens in {n_docs} documents ({h.file_bytes} bytes), but "
                         f"the file has {size} bytes")
    return h


def read_token_file(path: str | os.PathLike) -> tuple[np.ndarray, np.ndarray]:
    """(tokens, document start offsets) of a token file, both memory-mapped."""
    h = read_header(path)
    if h is None:
        raise ValueError(f"{str(path)!r} is not a token file: it does not start with {MAGIC!r}")
    docs = np.memmap(path, "<u8", mode="r", offset=HEADER_BYTES, shape=(h.n_docs,)) \
        if h.n_docs else np.zeros(0, np.uint64)
    tokens = np.memmap(path, h.dtype, mode="r", offset=h.data_offset, shape=(h.n_tokens,)) \
        if h.n_tokens else np.zeros(0, h.dtype)
    return tokens, docs


class TokenFileWriter:
    """Streams ``n_docs`` documents into a token file: header and offsets are written last, and
    the file appears under its name only on :meth:`close` (``abort`` removes the partial one).
    With ``eos_id`` that token separates the documents."""

    def __init__(self, path, vocab_size: int, n_docs: int, eos_id: int | None = None):
        self.path, self.tmp = Path(path), Path(f"{path}.tmp")
        self.vocab_size, self.n_docs, self.eos_id = vocab_size, n_docs, eos_id
        self.dtype, self.starts, self.n_tokens = token_dtype(vocab_size), [], 0
        self.file = open(self.tmp, "wb")
        self.file.seek(HEADER_BYTES + 8 * n_docs)

    def add(self, tokens) -> None:
        """Append one document (a 1-D array of ids)."""
        tokens = np.asarray(tokens)
        if len(tokens) and (tokens.min() < 0 or tokens.max() >= self.vocab_size):
            bad = int(tokens.max() if tokens.max() >= self.vocab_size else tokens.min())
            raise ValueError(f"token id {bad} is outside the vocabulary of {self.vocab_size}")
        sep = bool(self.starts) and self.eos_id is not None     # EOS between documents
        self.starts.append(self.n_tokens + sep)
        if sep:
            tokens = np.concatenate([[self.eos_id], tokens])
        self.file.write(tokens.astype(self.dtype).tobytes())
        self.n_tokens += len(tokens)

    def close(self) -> TokenHeader:
        if len(self.starts) != self.n_docs:
            self.abort()
            raise ValueError(f"token file {str(self.path)!r} was opened for {self.n_docs} "
                             f"documents but {len(self.starts)} were added")
        h = TokenHeader(self.vocab_size, self.n_tokens, self.n_docs, self.dtype)
        self.file.seek(0)
        self.file.write(_HEADER.pack(MAGIC, h.version, h.dtype.itemsize, h.vocab_size, h.n_tokens,
                                     h.n_docs).ljust(HEADER_BYTES, b"\0"))
        self.file.write(np.asarray(self.starts, "<u8").tobytes())
        self.file.close()
        os.replace(self.tmp, self.path)
        return h

    def abort(self) -> None:
        self.file.close()
        self.tmp.unlink(missing_ok=True)


def write_token_file(path: str | os.PathLike, tokens, vocab_size: int | None = None,
                     doc_starts=(0,)) -> TokenHeader:
    """Write ``tokens`` (1-D) as a token file; ``doc_starts`` are the documents' offsets. The
    vocabulary defaults to 256 when the ids fit (bytes), else the largest id + 1."""
    tokens = np.asarray(tokens, dtype=np.int64)
    top = int(tokens.max()) if len(tokens) else 0
    bounds = [*doc_starts, len(tokens)]
    writer = TokenFileWriter(path, vocab_size or max(256, top + 1), len(doc_starts))
    try:
        for a, b in zip(bounds, bounds[1:]):
            writer.add(tokens[a:b])
    except BaseException:
        writer.abort()
        raise
    return writer.close()
