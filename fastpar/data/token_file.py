"""The token-file format ``fastpar prepare-data`` writes and the trainer memory-maps.

A token file (little-endian) is a 64-byte header (``MAGIC``, then u32 format version and token
size in bytes, u64 vocabulary size, token and document counts, zero padding), each document's
start offset (u64), then the tokens: uint16 when the vocabulary fits, else uint32. Every document
holds at least one token (:class:`TokenFileWriter` refuses an empty one).

:func:`check_token_file` is the one validation every reader goes through (``read_header``,
``read_token_file``, and so ``fastpar.data.sources``'s ``check_data`` before launch and
``load_tokens`` in each rank). It checks each header field - magic, version, token size, a
vocabulary that is >= 1 and whose ids fit the token size, token and document counts, zero
padding - the file's size against the header, and the document offsets (0 first, increasing,
below the token count). Each failure is one single-line ValueError naming the file, the field
and its value. Token ids are not scanned here (``data.check_vocab`` does it against the model).
"""
from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

MAGIC = b"FPTOKENS"
TOKENIZER_FILE = "tokenizer.json"    # beside the token files of a prepared folder
FORMAT_VERSION = 1
HEADER_BYTES = 64
_HEADER = struct.Struct("<8sIIQQQ")     # magic, version, token bytes, vocab, tokens, documents
_DTYPES = {2: np.dtype("<u2"), 4: np.dtype("<u4")}
_MAX_VOCAB = {2: 2**16, 4: 2**32}       # ids 0 .. vocab-1 must fit the token's bytes
_NEAR_MAGIC = 2                         # bytes of MAGIC that may differ in a damaged one


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


def looks_like_token_file(path: str | os.PathLike) -> bool:
    """Whether a file starts with ``MAGIC`` or something close to it: a token file, perhaps with
    a damaged header. Such a file is validated (and so refused when damaged), never taken for a
    headerless legacy file - whose first 8 bytes are 4 token ids, hardly ever this close."""
    with open(path, "rb") as f:
        head = f.read(len(MAGIC))
    near = len(head) == len(MAGIC) and sum(a != b for a, b in zip(head, MAGIC)) <= _NEAR_MAGIC
    return head.startswith(MAGIC[:5]) or near


def check_token_file(path: str | os.PathLike) -> TokenHeader:
    """The header of a valid token file; anything else is one ValueError (module docstring).
    Reads the header and the document offsets only."""
    where = f"token file {str(path)!r}"
    size = os.stat(path).st_size
    with open(path, "rb") as f:
        raw = f.read(HEADER_BYTES)
    h = _check_header(raw, size, where)
    _check_offsets(path, h, where)
    return h


def read_header(path: str | os.PathLike) -> TokenHeader:
    """The header of a token file, validated by :func:`check_token_file` (a file that is not a
    token file, or a damaged one, is a ValueError)."""
    return check_token_file(path)


def _check_header(raw: bytes, size: int, where: str) -> TokenHeader:
    """Each field of the 64-byte header, then the file's size against it."""
    if raw[:len(MAGIC)] != MAGIC:
        raise ValueError(f"{where}: header field magic={raw[:len(MAGIC)]!r} must be {MAGIC!r}: "
                         "the file is damaged or is not a token file (prepare-data writes them; "
                         "a headerless uint16 .bin is read only when passed on its own, under a "
                         "name other than train.bin or val.bin)")
    if len(raw) < HEADER_BYTES:
        raise ValueError(f"{where} is truncated: file size={size} bytes, less than its "
                         f"{HEADER_BYTES}-byte header")
    _, version, itemsize, vocab, n_tokens, n_docs = _HEADER.unpack_from(raw)
    if version != FORMAT_VERSION:
        raise ValueError(f"{where}: header field version={version} must be {FORMAT_VERSION}: the "
                         f"file has format version {version}, this fastpar reads version "
                         f"{FORMAT_VERSION}")
    if itemsize not in _DTYPES:
        raise ValueError(f"{where}: header field token_bytes={itemsize} must be 2 or 4")
    if vocab < 1:
        raise ValueError(f"{where}: header field vocab_size={vocab} must be >= 1")
    if vocab > _MAX_VOCAB[itemsize]:
        raise ValueError(f"{where}: header field vocab_size={vocab} must be <= "
                         f"{_MAX_VOCAB[itemsize]}: ids of {itemsize}-byte tokens are below that")
    _check_counts(n_tokens, n_docs, where)
    pad = raw[_HEADER.size:]
    if any(pad):                    # the writer zeroes it: anything else is damage
        i = next(i for i, b in enumerate(pad) if b)
        raise ValueError(f"{where}: header padding (bytes {_HEADER.size}-{HEADER_BYTES - 1}) must "
                         f"be zero: byte {_HEADER.size + i} is {pad[i]:#04x}")
    h = TokenHeader(vocab, n_tokens, n_docs, _DTYPES[itemsize], version)
    if size != h.file_bytes:
        raise ValueError(f"{where} is corrupt or truncated: its header says n_tokens={n_tokens} "
                         f"in n_docs={n_docs} documents ({HEADER_BYTES} + 8 x {n_docs} + "
                         f"{itemsize} x {n_tokens} = {h.file_bytes} bytes), but the file size is "
                         f"{size} bytes")
    return h


def _check_counts(n_tokens: int, n_docs: int, where: str) -> None:
    """Tokens belong to documents, and every document holds at least one token."""
    if n_tokens and not n_docs:
        raise ValueError(f"{where}: header field n_docs=0 must be >= 1: the file holds "
                         f"n_tokens={n_tokens} tokens")
    if n_docs > n_tokens:
        raise ValueError(f"{where}: header field n_docs={n_docs} must be <= n_tokens={n_tokens}: "
                         "every document holds at least one token")


def _check_offsets(path, h: TokenHeader, where: str) -> None:
    """The documents' start offsets: 0 first, then increasing (no document is empty), all below
    the token count. Vectorised over the memory-mapped offsets: cheap for millions."""
    if not h.n_docs:
        return
    starts = np.memmap(path, "<u8", mode="r", offset=HEADER_BYTES, shape=(h.n_docs,))
    if starts[0] != 0:
        raise ValueError(f"{where}: document offsets: offset 0 (= {int(starts[0])}) must be 0")
    bad = np.flatnonzero(starts[1:] <= starts[:-1])
    if len(bad):
        i = int(bad[0]) + 1
        a, b = int(starts[i]), int(starts[i - 1])
        how = "is smaller than" if a < b else "equals (an empty document)"
        raise ValueError(f"{where}: document offsets: offset {i} (= {a}) {how} offset {i - 1} "
                         f"(= {b}); they must increase")
    if starts[-1] >= h.n_tokens:    # increasing: the last is the largest
        i = int(np.argmax(starts >= h.n_tokens))
        raise ValueError(f"{where}: document offsets: offset {i} (= {int(starts[i])}) must be "
                         f"< n_tokens={h.n_tokens}")


def read_token_file(path: str | os.PathLike) -> tuple[np.ndarray, np.ndarray]:
    """(tokens, document start offsets) of a token file, both memory-mapped."""
    h = check_token_file(path)
    docs = np.memmap(path, "<u8", mode="r", offset=HEADER_BYTES, shape=(h.n_docs,)) \
        if h.n_docs else np.zeros(0, np.uint64)
    tokens = np.memmap(path, h.dtype, mode="r", offset=h.data_offset, shape=(h.n_tokens,)) \
        if h.n_tokens else np.zeros(0, h.dtype)
    return tokens, docs


class TokenFileWriter:
    """Streams ``n_docs`` documents into a token file: header and offsets are written last, and
    the file appears under its name only on :meth:`close` (``abort`` removes the partial one).
    With ``eos_id`` that token separates the documents. An empty document is refused at
    :meth:`close` (not in :meth:`add`, so that a caller can first say why a whole split is
    empty): the offsets of a valid file increase and stay below the token count."""

    def __init__(self, path, vocab_size: int, n_docs: int, eos_id: int | None = None):
        self.path, self.tmp = Path(path), Path(f"{path}.tmp")
        self.vocab_size, self.n_docs, self.eos_id = vocab_size, n_docs, eos_id
        self.dtype, self.starts, self.n_tokens = token_dtype(vocab_size), [], 0
        self.first_empty: int | None = None         # index of the first empty document
        self.file = open(self.tmp, "wb")
        self.file.seek(HEADER_BYTES + 8 * n_docs)

    def add(self, tokens) -> None:
        """Append one document (a 1-D array of ids)."""
        tokens = np.asarray(tokens)
        if len(tokens) and (tokens.min() < 0 or tokens.max() >= self.vocab_size):
            bad = int(tokens.max() if tokens.max() >= self.vocab_size else tokens.min())
            raise ValueError(f"token id {bad} is outside the vocabulary of {self.vocab_size}")
        if not len(tokens) and self.first_empty is None:
            self.first_empty = len(self.starts)
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
        if self.first_empty is not None:
            self.abort()
            raise ValueError(f"token file {str(self.path)!r}: document {self.first_empty} is "
                             "empty; every document must hold at least one token")
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
    vocabulary defaults to 256 when the ids fit (bytes), else the largest id + 1. No tokens
    make a file of no documents (a document is never empty)."""
    tokens = np.asarray(tokens, dtype=np.int64)
    if not len(tokens) and tuple(doc_starts) == (0,):
        doc_starts = ()
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
