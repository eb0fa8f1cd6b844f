"""Tokenizers: UTF-8 bytes, or any Hugging Face ``tokenizer.json`` (e.g. the byte-level BPE that
``fastpar prepare-data --tokenizer gpt2`` trains), behind one small interface:
``encode(text) -> list[int]``, ``decode(ids) -> str``, ``vocab_size`` and ``eos_id`` (or None).
``encode_document`` is what a data file holds: a special token's text in a document is plain text,
so the only end-of-text tokens are the document boundaries ``prepare-data`` puts there.

A Hugging Face tokenizer may come with a chat template (:func:`chat_template`): the Jinja
``chat_template`` of the ``tokenizer_config.json`` beside its ``tokenizer.json``, rendered as
``transformers``' ``apply_chat_template`` renders it (:func:`render_chat`).
"""
from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np

from .token_file import TOKENIZER_FILE

# End-of-text tokens of common tokenizers, tried in order when tokenizer_config.json names none.
EOS_NAMES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eot_id|>")
TOKENIZER_CONFIG = "tokenizer_config.json"      # beside tokenizer.json: special tokens, template
CHAT_TEMPLATE_FILE = "chat_template.jinja"       # newer model directories keep the template here
CONFIG_FILES = (TOKENIZER_CONFIG, CHAT_TEMPLATE_FILE)   # go wherever their tokenizer.json goes


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
    return _configured_token(_tokenizer_config(folder), "eos_token")


def _tokenizer_config(folder: Path) -> dict:
    """A model directory's tokenizer_config.json; {} when it has none (or an unreadable one)."""
    try:
        config = json.loads((folder / TOKENIZER_CONFIG).read_text())
    except (OSError, ValueError):
        return {}
    return config if isinstance(config, dict) else {}


def _configured_token(config: dict, key: str) -> str | None:
    """A special token of tokenizer_config.json: a string, or an AddedToken's ``content``."""
    tok = config.get(key)
    return tok.get("content") if isinstance(tok, dict) else tok if isinstance(tok, str) else None


def copy_tokenizer_config(src: str | Path | None, folder: str | Path) -> None:
    """Make ``folder`` (where a copy of the tokenizer.json ``src`` goes) hold the
    :data:`CONFIG_FILES` beside ``src``, so that its special tokens and chat template travel
    with it: each is copied (written under a temporary name, then renamed), and one that ``src``
    lacks, or all of them for ``src`` None (bytes), is removed from ``folder``."""
    for name in CONFIG_FILES:
        there, here = Path(src).parent / name if src else None, Path(folder) / name
        if there is not None and there.is_file():
            tmp = here.with_name(f".{name}.tmp")
            shutil.copyfile(there, tmp)
            os.replace(tmp, here)
        else:
            here.unlink(missing_ok=True)


@dataclass(frozen=True)
class ChatTemplate:
    """A chat template and the special tokens it is rendered with."""

    source: str                 # the Jinja text
    path: str                   # the file it was read from
    bos_token: str = ""
    eos_token: str = ""

    def render(self, messages: list[dict], add_generation_prompt: bool = False) -> str:
        return render_chat(self.source, messages, add_generation_prompt, self.bos_token,
                           self.eos_token)


def chat_template(spec: str | Path) -> ChatTemplate | None:
    """The chat template of the tokenizer ``spec`` (a tokenizer.json or a folder holding one):
    ``chat_template.jinja`` beside it, else the ``chat_template`` of the ``tokenizer_config.json``
    beside it (a string, or the one named "default" of a list of named templates); None when it
    has none."""
    path = tokenizer_file(spec)
    if path is None:
        return None
    config = _tokenizer_config(path.parent)
    special = {k: _configured_token(config, k) or "" for k in ("bos_token", "eos_token")}
    if (path.parent / CHAT_TEMPLATE_FILE).is_file():
        where = path.parent / CHAT_TEMPLATE_FILE
        return ChatTemplate(where.read_text(encoding="utf-8"), str(where), **special)
    source = config.get("chat_template")
    if isinstance(source, list):        # [{"name": "default", "template": ...}, ...]
        source = next((t.get("template") for t in source
                       if isinstance(t, dict) and t.get("name") == "default"), None)
    if not isinstance(source, str) or not source:
        return None
    return ChatTemplate(source, str(path.parent / TOKENIZER_CONFIG), **special)


def render_chat(template: str, messages: list[dict], add_generation_prompt: bool = False,
                bos_token: str = "", eos_token: str = "") -> str:
    """``messages`` rendered with the Jinja chat ``template`` as ``transformers`` renders it
    (sandboxed, ``trim_blocks`` and ``lstrip_blocks``, ``raise_exception``, an unescaped
    ``tojson``). A template that does not compile or raises is a ValueError."""
    import jinja2

    try:
        return _compile_chat(template).render(
            messages=messages, add_generation_prompt=add_generation_prompt,
            bos_token=bos_token, eos_token=eos_token)
    except jinja2.TemplateError as e:
        raise ValueError(f"chat template error: {e}") from None


@lru_cache(maxsize=8)
def _compile_chat(template: str):
    import jinja2
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    return env.from_string(template)


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
