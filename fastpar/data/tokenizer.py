"""Tokenizers: UTF-8 bytes, or any Hugging Face ``tokenizer.json`` (e.g. the byte-level BPE that
``fastpar prepare-data --tokenizer gpt2`` trains), behind one small interface:
``encode(text) -> list[int]``, ``decode(ids) -> str``, ``vocab_size`` and ``eos_id`` (or None).
``encode_document`` is what a data file holds: a special token's text in a document is plain text,
so the only end-of-text tokens are the document boundaries ``prepare-data`` puts there.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from .token_file import TOKENIZER_FILE

# End-of-text tokens of common tokenizers, tried in order when tokenizer_config.json names none.
EOS_NAMES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eot_id|>")


class ByteTokenizer:
    """UTF-8 bytes as tokens: vocabulary 256, no unknowns, lossless, no end-of-text token."""

    vocab_size = 256
    eos_id = None
    name = "bytes"

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_document(self, text: str | bytes) -> np.ndarray:
        data = text if isinstance(text, bytes) else text.encode("utf-8")
        return np.frombuffer(data, dtype=np.uint8)

    def decode(self, ids) -> str:
        return bytes(int(t) for t in ids).decode("utf-8", errors="replace")


class HFTokenizer:
    """A Hugging Face ``tokenizers.Tokenizer``, used as is (no special tokens added on encode)."""

    def __init__(self, tokenizer, name: str, eos_token: str | None = None):
        self.tokenizer, self.name = tokenizer, name
        names = ([eos_token] if eos_token else []) + list(EOS_NAMES)
        self.eos_id = next((i for i in map(tokenizer.token_to_id, names) if i is not None), None)
        added = tokenizer.get_added_tokens_decoder()
        # ids 0 .. vocab_size-1 cover the model's vocabulary and every added token
        self.vocab_size = max([tokenizer.get_vocab_size(with_added_tokens=True),
                               *(i + 1 for i in added)])

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def encode_document(self, text: str) -> np.ndarray:
        before, self.tokenizer.encode_special_tokens = self.tokenizer.encode_special_tokens, True
        try:
            ids = self.tokenizer.encode(text, add_special_tokens=False).ids
        finally:
            self.tokenizer.encode_special_tokens = before
        return np.asarray(ids, dtype=np.int64)

    def decode(self, ids) -> str:
        return self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=False)

    def save(self, path: str | Path) -> None:
        self.tokenizer.save(str(path))


def tokenizer_file(spec: str | Path) -> Path | None:
    """The ``tokenizer.json`` that ``spec`` names: the file, or one inside the folder ``spec``."""
    p = Path(spec)
    if p.is_dir():
        p = p / TOKENIZER_FILE
    return p if p.is_file() and p.suffix == ".json" else None


def source_tokenizer_file(data, init_from=None) -> Path | None:
    """The ``tokenizer.json`` that decodes the token ids of a run on ``data``: the prepared data
    folder's; for token files prepared without one (ids of a vocabulary other than bytes) the
    ``--init-from`` directory's; None for bytes (text sources, a byte-tokenized folder)."""
    from .sources import data_vocab, prepared_folder

    folder = prepared_folder(data) if data else None
    if folder is not None and tokenizer_file(folder) is not None:
        return tokenizer_file(folder)
    if init_from and data and data_vocab(data) not in (None, 256):
        return tokenizer_file(init_from)
    return None


def run_tokenizer_file(ckpt: str | Path) -> Path | None:
    """The ``tokenizer.json`` of the run a checkpoint (``runs/x/checkpoints/step_N``) belongs
    to: the copy in the run's folder (:mod:`fastpar.train.run_record`); for a run written before
    runs kept one, the one its ``config.json`` points at; None for bytes."""
    run = Path(ckpt).parent.parent
    if (run / TOKENIZER_FILE).is_file():
        return run / TOKENIZER_FILE
    if not (run / "config.json").is_file():
        return None
    try:
        train = json.loads((run / "config.json").read_text())["train"]
        data, init = train.get("data"), train.get("init_from")
    except (ValueError, KeyError, TypeError, AttributeError):
        raise ValueError(f"{run / 'config.json'} is not the config.json of a fastpar "
                         "run") from None
    return source_tokenizer_file(data, init) if data is None or Path(data).exists() else None


def load_tokenizer(spec: str | Path):
    """``"bytes"``, a ``tokenizer.json``, or a folder holding one (a prepared data folder, a
    Hugging Face model directory) -> a tokenizer with encode / decode / vocab_size / eos_id."""
    if str(spec) == "bytes":
        return ByteTokenizer()
    path = tokenizer_file(spec)
    if path is None:
        raise ValueError(f"unknown tokenizer {str(spec)!r}: expected 'bytes', a {TOKENIZER_FILE} "
                         f"file, or a folder holding one")
    from tokenizers import Tokenizer

    try:
        tok = Tokenizer.from_file(str(path))
    except Exception as e:  # noqa: BLE001 - tokenizers raises a bare Exception on bad JSON
        raise ValueError(f"tokenizer {str(path)!r} cannot be read: {e}") from None
    return HFTokenizer(tok, str(path), _configured_eos(path.parent))


def _configured_eos(folder: Path) -> str | None:
    """The eos_token a Hugging Face model directory's tokenizer_config.json names, if any."""
    try:
        eos = json.loads((folder / "tokenizer_config.json").read_text()).get("eos_token")
    except (OSError, ValueError, AttributeError):
        return None
    return eos.get("content") if isinstance(eos, dict) else eos if isinstance(eos, str) else None


def tokenizer_for_data(path: str | Path | None):
    """The tokenizer a data source was prepared with: a prepared folder's tokenizer.json (or the
    one beside a prepared token file), else bytes. A source tokenized with a vocabulary other
    than 256 and no tokenizer.json beside it is an error (its ids cannot be decoded)."""
    from .sources import data_vocab, prepared_folder

    if path is None:
        return ByteTokenizer()
    folder = prepared_folder(path)
    if folder is not None and (folder / TOKENIZER_FILE).is_file():
        return load_tokenizer(folder / TOKENIZER_FILE)
    vocab = data_vocab(path)
    if vocab not in (None, 256):
        raise ValueError(f"data {str(path)!r} was tokenized with a vocabulary of {vocab} but has "
                         f"no {TOKENIZER_FILE} beside it to decode its ids")
    return ByteTokenizer()
