"""Fine-tuning data for ``fastpar prepare-data``: JSONL examples -> token files and loss masks.

Each non-blank line of a ``.jsonl`` input is one example, and each example one document:

- ``{"prompt": P, "response": R}`` (the field names are ``--prompt-field`` and
  ``--response-field``): the tokens of P, then the tokens of R (each tokenized on its own, a
  special token's text in them plain text), then the tokenizer's end-of-text token if it has one.
  R and the end-of-text token are trained.
- ``{"messages": [{"role": "system" | "user" | "assistant", "content": C}, ...]}``: the
  conversation as the tokenizer's chat template renders it (:func:`fastpar.data.tokenizer.
  chat_template`), cut into pieces tokenized on their own (a special token's text in them is
  that token, as when transformers tokenizes a rendering). The piece of assistant message i is
  what the rendering of messages[:i+1] adds to the rendering of messages[:i] with the generation
  prompt: it is trained, with whatever the template closes the turn with. Everything else
  (system and user turns, generation prompts, text after the last assistant turn) is not. No
  end-of-text token is added: the template ends turns its own way, as at inference.

Each example is written whole as its own document of ``<split>.bin``, its end-of-text token
included (the writer adds no separator), and its mask - one value per token, 1 where the token is
trained - as the same document of ``<split>.mask.bin`` (:mod:`fastpar.data.masks`). So the two
files agree token for token, in their token counts and in their document offsets; the last
example of a split ends with its end-of-text token like the others.

The examples are held in memory; the last ``--val-fraction`` of them (at least one, leaving at
least one) are the val split.
"""
from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .masks import MASK_VOCAB, mask_file
from .token_file import TokenFileWriter, TokenHeader
from .tokenizer import TOKENIZER_CONFIG, ChatTemplate

ROLES = ("system", "user", "assistant")
PROMPT_FIELD, RESPONSE_FIELD = "prompt", "response"


@dataclass(frozen=True)
class Example:
    """One line of a JSONL input: a prompt and its response, or a conversation."""

    where: str                                  # "'file.jsonl' line N", for errors
    prompt: str = ""
    response: str = ""
    messages: tuple[dict, ...] | None = None

    def texts(self):
        """Its text, for training a tokenizer on."""
        if self.messages is None:
            return [self.prompt, self.response]
        return [m["content"] for m in self.messages]


def read_examples(files, prompt_field: str = PROMPT_FIELD,
                  response_field: str = RESPONSE_FIELD) -> list[Example]:
    """Every example of the JSONL ``files``, in order; a line that is not one is a ValueError
    naming the file, the line and what is wrong."""
    examples = []
    for f in files:
        with open(f, "rb") as fh:
            for n, raw in enumerate(fh, 1):
                where = f"{str(f)!r} line {n}"
                try:
                    line = raw.decode("utf-8").rstrip("\r\n")
                except UnicodeDecodeError as e:
                    raise ValueError(f"{where}: not UTF-8 text (byte {e.start})") from None
                if line.strip():
                    examples.append(_example(line, where, prompt_field, response_field))
    return examples


def _example(line: str, where: str, prompt_field: str, response_field: str) -> Example:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"{where}: not valid JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(record, dict):
        raise ValueError(f"{where}: must be a JSON object, not {_short(record)}")
    if "messages" in record:
        return Example(where, messages=_messages(record["messages"], where))
    for field in (prompt_field, response_field):
        if field not in record:
            raise ValueError(f"{where}: no {field!r} field (an example is {{{prompt_field!r}: "
                             f"..., {response_field!r}: ...}} or {{'messages': [...]}})")
        if not isinstance(record[field], str):
            raise ValueError(f"{where}: field {field!r} must be a string, not "
                             f"{_short(record[field])}")
    if not record[response_field]:
        raise ValueError(f"{where}: field {response_field!r} is empty: nothing to train on")
    return Example(where, record[prompt_field], record[response_field])


def _messages(messages, where: str) -> tuple[dict, ...]:
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"{where}: field 'messages' must be a non-empty list of "
                         f"{{'role': ..., 'content': ...}}, not {_short(messages)}")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            role = m.get("role") if isinstance(m, dict) else m
            raise ValueError(f"{where}: messages[{i}] has role {role!r}: a message is "
                             f"{{'role': one of {', '.join(ROLES)}, 'content': a string}}")
        if not isinstance(m.get("content"), str):
            raise ValueError(f"{where}: messages[{i}] content must be a string, not "
                             f"{_short(m.get('content'))}")
        if m["role"] == "assistant" and not m["content"]:
            raise ValueError(f"{where}: messages[{i}] is an empty assistant message: nothing "
                             "to train on")
    if not any(m["role"] == "assistant" for m in messages):
        raise ValueError(f"{where}: messages holds no assistant message: nothing to train on")
    return tuple(messages)


def _short(value) -> str:
    """A JSON value as the input spells it, cut to 40 characters."""
    text = json.dumps(value, ensure_ascii=False)
    return text if len(text) <= 40 else text[:37] + "..."


def check_chat(examples: list[Example], chat: ChatTemplate | None, tokenizer: str) -> None:
    """A conversation needs a chat template: without one, one ValueError naming the first."""
    first = next((ex for ex in examples if ex.messages is not None), None)
    if first is not None and chat is None:
        raise ValueError(f"{first.where}: a 'messages' example needs a chat template, and "
                         f"--tokenizer {tokenizer!r} has none: pass a Hugging Face tokenizer "
                         f"folder whose {TOKENIZER_CONFIG} has chat_template")


def encode_example(ex: Example, tok, chat: ChatTemplate | None) -> tuple[np.ndarray, np.ndarray]:
    """(token ids, mask) of one example: the mask 1 where the token is trained (module
    docstring), both 1-D int64 of one length."""
    if ex.messages is None:
        ids = [tok.encode_document(ex.prompt), tok.encode_document(ex.response)]
        if tok.eos_id is not None:
            ids.append([tok.eos_id])
        trained = [False, True, True]
    else:
        pieces = _chat_pieces(ex, chat)
        ids = [tok.encode(text) for text, _ in pieces]
        trained = [t for _, t in pieces]
    ids = [np.asarray(i, dtype=np.int64) for i in ids]
    mask = np.concatenate([np.full(len(i), int(t), dtype=np.int64) for i, t in zip(ids, trained)])
    if not mask.any():
        raise ValueError(f"{ex.where}: its trained text is no token of tokenizer {tok.name!r}: "
                         "nothing to train on")
    return np.concatenate(ids), mask


def _chat_pieces(ex: Example, chat: ChatTemplate) -> list[tuple[str, bool]]:
    """The rendered conversation as (text, trained) pieces: each assistant turn trained."""
    msgs = [dict(m) for m in ex.messages]

    def render(k: int, generation: bool) -> str:
        try:
            return chat.render(msgs[:k], add_generation_prompt=generation)
        except ValueError as e:
            raise ValueError(f"{ex.where}: {e} ({chat.path})") from None

    def after(done: str, k: int, text: str, what: str) -> str:
        if not text.startswith(done):
            raise ValueError(f"{ex.where}: the chat template ({chat.path}) renders "
                             f"messages[:{k}]{what} not as a continuation of what comes before "
                             "it: the assistant turns cannot be told apart")
        return text[len(done):]

    pieces, done = [], ""
    for i, m in enumerate(msgs):
        if m["role"] == "assistant":
            prompt, turn = render(i, True), render(i + 1, False)
            pieces += [(after(done, i, prompt, " with the generation prompt"), False),
                       (after(prompt, i + 1, turn, ""), True)]
            done = turn
    pieces.append((after(done, len(msgs), render(len(msgs), False), ""), False))
    return [(text, trained) for text, trained in pieces if text]


def write_sft_splits(examples: list[Example], tok, chat: ChatTemplate | None, folder: Path,
                     val_fraction: float) -> tuple[TokenHeader, TokenHeader, tuple[int, int]]:
    """Write folder/{train,val}.bin and their masks; their headers and trained-token counts."""
    n = len(examples)
    if n < 2:
        raise ValueError(f"the inputs hold {n} example(s): fine-tuning data needs at least 2, "
                         "one for each split")
    n_val = min(n - 1, max(1, round(n * val_fraction)))
    splits = {"train": n - n_val, "val": n_val}
    writers = {s: (TokenFileWriter(folder / f"{s}.bin", tok.vocab_size, k),
                   TokenFileWriter(mask_file(folder / f"{s}.bin"), MASK_VOCAB, k))
               for s, k in splits.items()}
    trained = {s: 0 for s in splits}
    try:
        from tqdm import tqdm

        bar = tqdm(examples, desc="tokenizing", unit="example", delay=1.0, file=sys.stderr,
                   disable=not sys.stderr.isatty())
        for i, ex in enumerate(bar):
            split = "train" if i < splits["train"] else "val"
            ids, mask = encode_example(ex, tok, chat)
            tokens, masks = writers[split]
            tokens.add(ids)
            masks.add(mask)
            trained[split] += int(mask.sum())
        headers = {s: (w.close(), m.close())[0] for s, (w, m) in writers.items()}
    except BaseException:
        for w, m in writers.values():
            w.abort()
            m.abort()
        raise
    return headers["train"], headers["val"], (trained["train"], trained["val"])
