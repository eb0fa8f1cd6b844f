"""``fastpar prepare-data``: text files, or fine-tuning examples, -> a data folder of token files.

Each input file is one document. The last documents (about ``--val-fraction`` of the input's
bytes, at least one) go to ``val.bin``, the rest to ``train.bin``; a single document is cut at
its last ``--val-fraction`` of tokens instead. With a tokenizer that has an end-of-text token,
that token separates the documents of a split. A ``.bin`` in an input folder is refused (a token
file is never read as text). The folder is written under a temporary name and renamed into place,
so an error leaves nothing behind; a destination that holds anything is refused unless
``--overwrite`` moves it aside (:func:`fastpar.train.outdir.fresh_folder`).

Inputs ending in ``.jsonl`` are fine-tuning examples instead, one per line, each one document
(:mod:`fastpar.data.sft`): the last ``--val-fraction`` of the examples go to val.bin, and each
split gets a loss mask beside it (``train.mask.bin``, ``val.mask.bin``: :mod:`fastpar.data.masks`).
Text files and ``.jsonl`` inputs are never mixed in one folder.

With ``--tokenizer PATH`` the folder also gets the tokenizer's ``tokenizer_config.json`` and
``chat_template.jinja`` when they lie beside its tokenizer.json (its special tokens and chat
template).
"""
from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .sources import VAL_FRACTION, text_files
from ..train.outdir import check_fresh, fresh_folder
from . import sft
from .token_file import TokenFileWriter, TokenHeader
from .tokenizer import (TOKENIZER_FILE, ByteTokenizer, HFTokenizer, chat_template,
                        copy_tokenizer_config, load_tokenizer, tokenizer_file)

DEFAULT_VOCAB = 8192                     # of the byte-level BPE that --tokenizer gpt2 trains
EOS = "<|endoftext|>"                    # GPT-2's end-of-text token, the BPE's only special
MIN_BPE_VOCAB = 256 + 1                  # every byte, and EOS


@dataclass(frozen=True)
class Prepared:
    """What :func:`prepare_data` wrote."""

    out: Path
    tokenizer: str                       # "bytes", "gpt2" or the tokenizer.json used
    train: TokenHeader
    val: TokenHeader
    trained: tuple[int, int] | None = None      # fine-tuning data: trained tokens of train, val


def add_prepare_data(sub) -> None:
    p = sub.add_parser("prepare-data", help="tokenize text files into fastpar token files",
                       description="Tokenize text files into a data folder for fastpar train "
                       "--data: DATA/train.bin, DATA/val.bin (the held-out split) and, unless "
                       "the tokenizer is bytes, DATA/tokenizer.json; from .jsonl fine-tuning "
                       "examples also DATA/train.mask.bin and DATA/val.mask.bin (which tokens "
                       "are trained).")
    p.add_argument("inputs", nargs="+", metavar="INPUT",
                   help="text files and folders of text files (recursively, hidden files "
                        "skipped); each file is one document. Or fine-tuning examples: .jsonl "
                        "files of {\"prompt\": ..., \"response\": ...} or {\"messages\": "
                        "[{\"role\": ..., \"content\": ...}, ...]} (rendered with the "
                        "tokenizer's chat template), one per line, the prompt not trained "
                        "(train.mask.bin, val.mask.bin)")
    p.add_argument("--tokenizer", required=True, metavar="{bytes,gpt2,PATH}",
                   help="bytes: UTF-8 bytes (vocabulary 256); gpt2: GPT-2's scheme, a "
                        "byte-level BPE with <|endoftext|>, trained here on the input (GPT-2's "
                        "own merges need a download, which fastpar never does); PATH: a "
                        "tokenizer.json, or a folder holding one (a Hugging Face model "
                        "directory), used as is")
    p.add_argument("--out", required=True, metavar="DATA",
                   help="the data folder to write (a new one: see --overwrite)")
    p.add_argument("--overwrite", action="store_true",
                   help="if DATA holds anything, move it aside to DATA.replaced-<time> once the "
                        "new folder is written")
    p.add_argument("--vocab-size", type=int, default=None, metavar="N",
                   help=f"vocabulary of the BPE that --tokenizer gpt2 trains (default "
                        f"{DEFAULT_VOCAB}, at least {MIN_BPE_VOCAB})")
    p.add_argument("--val-fraction", type=float, default=VAL_FRACTION, metavar="F",
                   help=f"share held out for validation, in (0, 1) (default {VAL_FRACTION})")
    p.add_argument("--seed", type=int, default=None, metavar="S",
                   help="shuffle the documents with this seed before splitting (default: "
                        "keep their order)")
    p.add_argument("--prompt-field", default=None, metavar="NAME",
                   help=f"the prompt's field in .jsonl examples (default {sft.PROMPT_FIELD!r})")
    p.add_argument("--response-field", default=None, metavar="NAME",
                   help=f"the response's field in .jsonl examples (default "
                        f"{sft.RESPONSE_FIELD!r})")


def run_prepare_data(args) -> int:
    try:
        done = prepare_data(args.inputs, args.tokenizer, args.out, args.vocab_size,
                            args.val_fraction, args.seed, args.overwrite, args.prompt_field,
                            args.response_field)
    except ValueError as e:
        print(f"fastpar prepare-data: error: {e}", file=sys.stderr)
        return 2
    t, v = done.train, done.val
    if done.trained is not None:
        print(f"fastpar prepare-data: wrote {done.out}: train.bin {t.n_tokens:,} tokens in "
              f"{t.n_docs} example(s), {done.trained[0]:,} trained; val.bin {v.n_tokens:,} "
              f"tokens in {v.n_docs}, {done.trained[1]:,} trained; vocabulary {t.vocab_size} "
              f"({done.tokenizer})")
        return 0
    print(f"fastpar prepare-data: wrote {done.out}: train.bin {t.n_tokens:,} tokens in "
          f"{t.n_docs} document(s), val.bin {v.n_tokens:,} tokens in {v.n_docs}; vocabulary "
          f"{t.vocab_size} ({done.tokenizer})")
    return 0


def prepare_data(inputs, tokenizer: str, out, vocab_size: int | None = None,
                 val_fraction: float = VAL_FRACTION, seed: int | None = None,
                 overwrite: bool = False, prompt_field: str | None = None,
                 response_field: str | None = None) -> Prepared:
    """Tokenize ``inputs`` into ``out``/{train,val}.bin (see the module docstring)."""
    if not 0 < val_fraction < 1:
        raise ValueError(f"--val-fraction={val_fraction} must be in (0, 1)")
    out = Path(out)
    files = input_files(inputs, exclude=out)
    _check_tokenizer(tokenizer, vocab_size)
    if _fine_tuning(files, prompt_field, response_field):
        return _prepare_sft(files, tokenizer, out, vocab_size, val_fraction, seed, overwrite,
                            prompt_field or sft.PROMPT_FIELD, response_field or sft.RESPONSE_FIELD)
    check_fresh(out, "--out", overwrite, "prepare-data")
    if seed is not None:
        files = [files[i] for i in np.random.default_rng(seed).permutation(len(files))]
    with fresh_folder(out, "--out", overwrite, "prepare-data") as tmp:
        tok = _make_tokenizer(tokenizer, files, vocab_size or DEFAULT_VOCAB)
        _save_tokenizer(tok, tokenizer, tmp)
        train, val = _write_splits(files, tok, tmp, val_fraction)
    return Prepared(out, tokenizer if tokenizer in ("bytes", "gpt2") else tok.name, train, val)


def _fine_tuning(files: list[Path], prompt_field: str | None,
                 response_field: str | None) -> bool:
    """Whether the inputs are fine-tuning examples (.jsonl), refusing a mix with text files."""
    jsonl = [f for f in files if f.suffix.lower() == ".jsonl"]
    text = next((f for f in files if f.suffix.lower() != ".jsonl"), None)
    if jsonl and text is not None:
        raise ValueError(f"the inputs mix fine-tuning examples ({str(jsonl[0])!r}) and text "
                         f"files ({str(text)!r}): prepare each kind into its own data folder")
    for flag, value in (("--prompt-field", prompt_field), ("--response-field", response_field)):
        if value is not None and not jsonl:
            raise ValueError(f"{flag} {value!r} is for .jsonl inputs only (fine-tuning "
                             "examples); the inputs are text files")
    return bool(jsonl)


def _prepare_sft(files, tokenizer: str, out: Path, vocab_size: int | None, val_fraction: float,
                 seed: int | None, overwrite: bool, prompt_field: str,
                 response_field: str) -> Prepared:
    """The data folder of the fine-tuning examples in the .jsonl ``files`` (module docstring)."""
    check_fresh(out, "--out", overwrite, "prepare-data")
    examples = sft.read_examples(files, prompt_field, response_field)
    if seed is not None:
        examples = [examples[i] for i in np.random.default_rng(seed).permutation(len(examples))]
    chat = chat_template(tokenizer) if tokenizer not in ("bytes", "gpt2") else None
    sft.check_chat(examples, chat, tokenizer)
    with fresh_folder(out, "--out", overwrite, "prepare-data") as tmp:
        texts = (t for ex in examples for t in ex.texts())
        tok = _make_tokenizer(tokenizer, files, vocab_size or DEFAULT_VOCAB, texts)
        _save_tokenizer(tok, tokenizer, tmp)
        train, val, trained = sft.write_sft_splits(examples, tok, chat, tmp, val_fraction)
    return Prepared(out, tokenizer if tokenizer in ("bytes", "gpt2") else tok.name, train, val,
                    trained)


def _save_tokenizer(tok, spec: str, folder: Path) -> None:
    """The tokenizer.json that decodes the data (none for bytes) and, from --tokenizer PATH,
    the config files beside it."""
    if isinstance(tok, ByteTokenizer):
        return
    tok.save(folder / TOKENIZER_FILE)
    if spec != "gpt2":
        copy_tokenizer_config(tokenizer_file(spec), folder)


def input_files(inputs, exclude: Path | None = None) -> list[Path]:
    """The documents: each input file, and each folder's files (see data.text_files), except
    those in ``exclude`` (the output folder, which may lie inside an input folder)."""
    files, skip = [], exclude.resolve() if exclude is not None else None
    for name in inputs:
        p = Path(name)
        if not p.exists():
            raise ValueError(f"input {str(name)!r} does not exist")
        if p.is_file() and p.stat().st_size == 0:       # named by the user: a mistake
            raise ValueError(f"input file {str(name)!r} is empty")
        # In a folder an empty file (a package's __init__.py, say) is no document: skipped.
        found = [f for f in (text_files(p) if p.is_dir() else [p])
                 if skip is None or skip not in f.resolve().parents]
        stray = next((f for f in found if p.is_dir() and f.suffix.lower() == ".bin"), None)
        if stray is not None:       # token files are no documents (the output folder aside)
            raise ValueError(f"input folder {str(name)!r} holds {str(stray)!r}: a .bin is a "
                             "token file, never read as text; leave it out of the inputs")
        files += [f for f in found if f.stat().st_size]
    if not files:
        raise ValueError(f"no input files with any text in "
                         f"{', '.join(map(repr, map(str, inputs)))}")
    return files


def _check_tokenizer(spec: str, vocab_size: int | None) -> None:
    if spec not in ("bytes", "gpt2") and tokenizer_file(spec) is None:
        raise ValueError(f"--tokenizer {spec!r} is neither bytes, gpt2, nor a {TOKENIZER_FILE} "
                         "file or a folder holding one")
    if vocab_size is not None and spec != "gpt2":
        raise ValueError(f"--vocab-size={vocab_size} is for --tokenizer gpt2 only (the "
                         f"vocabulary of {spec!r} is its own)")
    if spec == "gpt2" and vocab_size is not None and vocab_size < MIN_BPE_VOCAB:
        raise ValueError(f"--vocab-size={vocab_size} is too small for a byte-level BPE: it "
                         f"needs at least {MIN_BPE_VOCAB} (256 bytes + {EOS})")


def _progress(files, desc: str):
    """A progress bar over the input's bytes, on a terminal only (after a second)."""
    from tqdm import tqdm

    return tqdm(total=sum(f.stat().st_size for f in files), unit="B", unit_scale=True,
                desc=desc, delay=1.0, disable=not sys.stderr.isatty(), file=sys.stderr)


def _read(f: Path, as_bytes: bool) -> str | bytes:
    """One document: bytes for the byte tokenizer, else UTF-8 text."""
    data = f.read_bytes()
    if as_bytes:
        return data
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"input file {str(f)!r} is not UTF-8 text (byte {e.start}): use "
                         "--tokenizer bytes") from None


def _make_tokenizer(spec: str, files: list[Path], vocab_size: int, texts=None):
    """The tokenizer ``spec`` names; for gpt2 a BPE trained on ``texts`` (default: the files')."""
    if spec != "gpt2":
        return load_tokenizer(spec)
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, special_tokens=[EOS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    if texts is not None:
        bpe.train_from_iterator(texts, trainer)
        return HFTokenizer(bpe, "gpt2", EOS)
    with _progress(files, "training BPE") as bar:
        def file_texts():
            for f in files:
                yield _read(f, as_bytes=False)
                bar.update(f.stat().st_size)
        bpe.train_from_iterator(file_texts(), trainer, length=len(files))
    return HFTokenizer(bpe, "gpt2", EOS)


def _n_val_docs(files: list[Path], val_fraction: float) -> int:
    """How many documents at the end make the val split: the count whose bytes are closest to
    ``val_fraction`` of all, at least one, leaving at least one for training."""
    sizes = np.array([f.stat().st_size for f in files])
    tail = np.cumsum(sizes[::-1])[:len(files) - 1]       # bytes of the last 1, 2, ... documents
    return int(np.argmin(np.abs(tail - val_fraction * sizes.sum()))) + 1


def _write_splits(files, tok, folder: Path, val_fraction: float):
    """Encode every document into folder/train.bin and folder/val.bin; their headers."""
    n_val = _n_val_docs(files, val_fraction) if len(files) > 1 else 1
    n_train = len(files) - n_val if len(files) > 1 else 1
    train = TokenFileWriter(folder / "train.bin", tok.vocab_size, n_train, tok.eos_id)
    val = TokenFileWriter(folder / "val.bin", tok.vocab_size, n_val, tok.eos_id)
    try:
        with _progress(files, "tokenizing") as bar:
            for i, f in enumerate(files):
                ids = tok.encode_document(_read(f, isinstance(tok, ByteTokenizer)))
                if len(files) == 1:              # one document: its last tokens are val
                    cut = len(ids) - int(len(ids) * val_fraction)
                    train.add(ids[:cut])
                    val.add(ids[cut:])
                else:
                    (train if i < n_train else val).add(ids)
                bar.update(f.stat().st_size)
        for split, w in (("train", train), ("val", val)):
            if w.n_tokens == 0:
                total = train.n_tokens + val.n_tokens
                raise ValueError(f"the {split} split would be empty: {total} tokens in "
                                 f"{len(files)} document(s) with --val-fraction {val_fraction}; "
                                 "give more text or change --val-fraction")
        return train.close(), val.close()
    except BaseException:
        train.abort()
        val.abort()
        raise
