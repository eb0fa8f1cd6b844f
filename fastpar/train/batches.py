"""The trainer's batches: which sampler a run's data gets, and one step's share on the device.

Prepared data with two or more documents is packed (``--pack-documents``, the default;
:mod:`fastpar.data.packing`), or padded one document per sequence (``--pad-documents``), or cut
anywhere (``--no-pack-documents``, as raw sources always are). A loss mask beside a split
(``prepare-data`` on prompt / response pairs) masks the targets it marks 0 in every mode.

:func:`step_inputs` turns a rank's :class:`~fastpar.data.packing.Batch` into what
:func:`fastpar.train.step.forward_backward` takes: inputs and targets on the device (this CP
rank's chunks), each micro-batch's :class:`~fastpar.models.documents.Documents` (built on the
host from host positions: no device sync), and the loss divisor that makes the mean over
micro-batches and ranks the global batch's mean over trained targets.
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from ..context_parallel import shard_sequence
from ..data.packing import Batch, DocumentSampler
from ..data.sources import check_length, check_vocab, load_documents
from ..models.documents import Documents


class StepInputs(NamedTuple):
    inputs: torch.Tensor
    targets: torch.Tensor
    docs: list | None            # per micro-batch
    per_loss: float              # see fastpar.models.gpt.tokens_per_loss


def documents_mode(cfg, doc_starts) -> str:
    """"packed", "padded" or "stream" for a run's data (module docstring)."""
    has_docs = doc_starts is not None and len(doc_starts) >= 2
    if cfg.pad_documents:
        if not has_docs:
            raise ValueError(f"--pad-documents needs prepared data of two or more documents; "
                             f"data {cfg.data or 'stdlib corpus'!r} has none recorded")
        return "padded"
    return "packed" if cfg.pack_documents and has_docs else "stream"


def make_sampler(cfg, split: str, dp_rank: int, dp: int) -> DocumentSampler:
    """The sampler of ``split`` of the run's data, checked against the sequence length and the
    model's vocabulary."""
    tokens, starts, mask = load_documents(cfg.data, split)
    where = cfg.data if split == "train" else f"{cfg.data or 'stdlib corpus'} (validation split)"
    check_length(len(tokens), cfg.seq_len, where)
    check_vocab(tokens, cfg.model_config.vocab_size, cfg.model, cfg.data)
    return DocumentSampler(tokens, starts if starts is not None else np.zeros(1, np.int64),
                           cfg.seq_len, cfg.global_batch_size, cfg.seed, dp_rank, dp,
                           documents_mode(cfg, starts), mask)


def step_inputs(batch: Batch, mesh, M: int, to_device, cp_balance: str = "work"
                ) -> StepInputs:
    """This rank's share of a step (module docstring); ``to_device`` moves a host tensor.
    ``cp_balance``: how packed documents are dealt out over CP ranks
    (:class:`~fastpar.models.documents.Documents`)."""
    x, y, docs = batch.inputs, batch.targets, None
    if batch.positions is not None:
        docs = [Documents(p, mesh.device, cp_balance) for p in batch.positions.chunk(M)]
    if mesh.cp_group is not None and docs is None:
        x, y = (shard_sequence(t, mesh.cp_rank, mesh.cp_size, dim=1) for t in (x, y))
    elif mesh.cp_group is not None:         # each micro-batch's own layout
        x, y = (torch.cat([d.shard(part, mesh.cp_rank, mesh.cp_size)
                           for d, part in zip(docs, t.chunk(M))]) for t in (x, y))
    per_loss = max(batch.trained, 1) / (M * mesh.dp_size * mesh.cp_size)
    return StepInputs(to_device(x), to_device(y), docs, per_loss)
