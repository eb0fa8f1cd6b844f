"""Loss masks of fine-tuning data: ``<split>.mask.bin`` beside a split's token file.

``fastpar prepare-data`` writes one for each split of JSONL examples (:mod:`fastpar.data.sft`):
a token file (:mod:`fastpar.data.token_file`) of vocabulary 2 with the split's documents - the
same token count, the same document offsets - holding one value per token of the split: 1 when
the token is a trained target (the loss of predicting it from the tokens before it counts), else
0. Text data has no mask file: every token is a target.
"""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from .token_file import check_token_file, read_token_file

MASK_SUFFIX = ".mask.bin"
MASK_VOCAB = 2                          # values 0 and 1


def mask_file(split_file: str | os.PathLike) -> Path:
    """The mask file beside a split's token file: ``train.bin`` -> ``train.mask.bin``."""
    p = Path(split_file)
    return p.with_name(p.stem + MASK_SUFFIX)


def read_mask(split_file: str | os.PathLike) -> np.ndarray | None:
    """The loss mask of the token file ``split_file``: (n_tokens,) uint16 values 0 or 1,
    memory-mapped, aligned with its tokens; None when it has no :func:`mask_file`. A mask whose
    vocabulary is not 2, whose token count, document count or offsets differ from the split's,
    that holds a value above 1 or no 1 at all is a ValueError. Reads the whole mask once."""
    path = mask_file(split_file)
    if not path.is_file():
        return None
    where = f"mask file {str(path)!r}"
    split, h = check_token_file(split_file), check_token_file(path)
    if h.vocab_size != MASK_VOCAB:
        raise ValueError(f"{where}: header field vocab_size={h.vocab_size} must be {MASK_VOCAB} "
                         "(values 0 and 1)")
    if (h.n_tokens, h.n_docs) != (split.n_tokens, split.n_docs):
        raise ValueError(f"{where} does not match {str(split_file)!r}: n_tokens={h.n_tokens}, "
                         f"n_docs={h.n_docs} against n_tokens={split.n_tokens}, "
                         f"n_docs={split.n_docs}; prepare the data again")
    mask, mask_starts = read_token_file(path)
    _, starts = read_token_file(split_file)
    differ = np.flatnonzero(mask_starts != starts)
    if len(differ):
        i = int(differ[0])
        raise ValueError(f"{where} does not match {str(split_file)!r}: document offset {i} is "
                         f"{int(mask_starts[i])} against {int(starts[i])}; prepare the data "
                         "again")
    if len(mask) and int(mask.max()) >= MASK_VOCAB:
        i = int(np.argmax(mask >= MASK_VOCAB))
        raise ValueError(f"{where}: token {i} has value {int(mask[i])}; a mask holds 0 or 1")
    if len(mask) and not mask.any():
        raise ValueError(f"{where} holds no 1: no token of {str(split_file)!r} is trained")
    return mask
