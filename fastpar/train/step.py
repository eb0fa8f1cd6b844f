"""One training step's forward and backward, and evaluation, on any (tp, pp, dp) layout.

:func:`forward_backward` runs one global batch share (micro-batches accumulated, or the pipeline
schedule) with the data-parallel reduction overlapped, then sums the partial gradients of the
parameters replicated over TP (under sequence parallelism) in one collective, as Megatron's
``finalize_model_grads`` does; :func:`evaluate` computes the mean loss of
held-out batches forward only (the pipeline's forward-only schedule under PP). Both return the
loss averaged exactly as the single-process model averages it: every micro-batch has the same
number of tokens, so the mean of micro-batch means over micro-batches and DP ranks is the mean
over the global batch.
"""
from __future__ import annotations

import functools

import torch
import torch.distributed as dist

from ..data_parallel import DataParallel
from ..mesh import collectives
from ..mesh.profiling import span
from ..models.gpt import overlap_forward_backward, token_loss, tokens_per_loss
from ..models.moe import aux_scale
from ..pipeline.tied import reduce_tied_grads, tied_params
from ..tensor_parallel import partial_grad_params, reduce_replicated_grads


def loss_fn(tp_group):
    """The pipeline's loss: the model's own (:func:`fastpar.models.gpt.token_loss`)."""
    return functools.partial(token_loss, tp_group=tp_group)


def forward_backward(chunks, ddp, pipe, x, y, M: int, mesh, overlap: bool = True,
                     interleave: int = 1, fb_overlap: bool = False, docs: list | None = None,
                     per_loss: float | None = None) -> torch.Tensor:
    """Forward and backward of one global batch share; returns this DP rank's mean loss.

    Under a pipeline with ``overlap``, each chunk's last backward (its last B, and its last W
    with a split backward) runs with gradient sync on: a DP bucket starts reducing from inside
    that backward as soon as it is complete, while the rest of the cool-down still computes.
    Every bucket is waited for at the end of the step. ``overlap=False``: the whole step
    accumulates, then every bucket is reduced (same numbers). Last, after the DP sync and
    before any clipping, one all-reduce over TP sums the replicated parameters' partial
    gradients (:func:`fastpar.tensor_parallel.reduce_replicated_grads`), and one over the
    embedding group sums a tied embedding's two copies' (:func:`fastpar.pipeline.tied.
    reduce_tied_grads`).

    ``interleave`` (no pipeline): micro-batches run forward this many at a time, interleaved
    block by block (:meth:`fastpar.models.GPT.interleaved`), then backward together.
    ``fb_overlap`` (no pipeline, ``interleave`` 1, 2 or more micro-batches): each micro-batch's
    forward runs inside the previous one's backward
    (:func:`fastpar.models.gpt.overlap_forward_backward`; ``TrainConfig.fb_overlapped`` says
    where the trainer asks for it).

    ``docs``: each micro-batch's packed documents (:class:`fastpar.models.documents.Documents`).
    ``per_loss``: what each micro-batch's summed loss is divided by
    (:func:`fastpar.models.gpt.tokens_per_loss`): the global batch's trained targets / (M x
    dp x cp ranks), so that masked or packed batches give the single process's mean."""
    grads = replicated_grads_of(ddp, chunks)
    # an MoE auxiliary loss weighs as the micro-batch's loss
    with aux_scale(1.0 / M), tokens_per_loss(per_loss):
        loss = _step(chunks, ddp, pipe, x, y, M, mesh, overlap, interleave, fb_overlap, docs)
    reduce_replicated_grads(chunks, mesh.tp_group, grads)
    reduce_tied_grads(chunks, getattr(mesh, "embed_group", None),
                      ddp.mean_grad_views if ddp is not None and tied_params(chunks) else None)
    return loss


def _step(chunks, ddp, pipe, x, y, M, mesh, overlap, interleave, fb_overlap, docs):
    if pipe is None and fb_overlap and interleave == 1 and M >= 2:
        sync = (lambda i: ddp.set_requires_gradient_sync(i == M - 1)) if ddp is not None \
            else None
        loss = overlap_forward_backward(chunks[0], x.chunk(M), y.chunk(M), M, sync, docs)
    else:
        loss = _accumulate(chunks[0], ddp, x, y, M, mesh, interleave, docs) if pipe is None \
            else _pipeline(ddp, pipe, x, y, mesh, overlap, docs)
    return loss


def _pipeline(ddp, pipe, x, y, mesh, overlap: bool, docs=None) -> torch.Tensor:
    """The pipeline schedule's step, its DP buckets started from its final backwards."""
    if ddp is not None:
        ddp.set_requires_gradient_sync(False, wait_in_backward=False)
        pipe.before_backward = _sync_final_backward(ddp) if overlap else None
        pipe.grads_set = (lambda _chunk, params: ddp.grads_accumulated(params)) if overlap \
            else None
    local = pipe.step(x, y, docs)
    loss = local.detach().float() if local is not None else torch.zeros((), device=mesh.device)
    if ddp is not None:     # start the buckets no hook started (e.g. .grad set by hand in B)
        ddp.reduce_gradients(wait=False)
    collectives.all_reduce(loss, group=mesh.pp_group)   # only the last stage holds it
    if ddp is not None:
        with span("dp wait for every bucket"):
            ddp.finish_gradient_sync()
    return loss


def replicated_grads_of(ddp: DataParallel | None, chunks):
    """What ``reduce_replicated_grads`` sums: ``ddp``'s views of the marked parameters' mean
    gradients (:meth:`DataParallel.mean_grad_views`); ``None`` without ``ddp`` (each
    ``main_grad`` or ``.grad``) or when nothing is marked."""
    if ddp is None or not partial_grad_params(chunks):
        return None
    ddp.mean_grad_views([])         # refuses overlap_step before the step runs
    return ddp.mean_grad_views


def _sync_final_backward(ddp: DataParallel):
    """The executor's ``before_backward``: sync on only for a chunk's final backward actions."""
    def before_backward(chunk: int, final: bool) -> None:
        ddp.set_requires_gradient_sync(final, wait_in_backward=False)
    return before_backward


def _accumulate(model, ddp, x, y, M: int, mesh, interleave: int = 1, docs=None
                ) -> torch.Tensor:
    """Forward and backward of M micro-batches, ``interleave`` at a time (one backward per
    group, of the sum of its losses); gradients reduced over DP in the last group's backward."""
    total = torch.zeros((), device=mesh.device)
    xs, ys, docs = x.chunk(M), y.chunk(M), docs or [None] * M
    for i in range(0, M, interleave):
        j = min(i + interleave, M)
        if ddp is not None:
            ddp.set_requires_gradient_sync(j == M)
        with span("forward of micro-batch", i if j == i + 1 else f"{i}..{j - 1}"):
            if j == i + 1:
                loss = model(xs[i], ys[i], docs=docs[i]) / M
            else:
                loss = sum(model.interleaved(xs[i:j], ys[i:j], docs[i:j])) / M
        with span("backward of micro-batch", i if j == i + 1 else f"{i}..{j - 1}"):
            loss.backward()
        total += loss.detach()
    return total


@torch.no_grad()
def evaluate(chunks, pipe, batches, M: int, mesh) -> float:
    """The mean loss over ``batches`` (this DP rank's (inputs, targets, docs, per_loss) shares
    of each held-out global batch: see :func:`forward_backward`), averaged over the DP group;
    the same number on every rank. Dropout is off while it runs."""
    modes = [m.training for m in chunks]
    for m in chunks:
        m.eval()
    total = torch.zeros((), device=mesh.device)
    try:
        for x, y, docs, per_loss in batches:
            x, y = x.to(mesh.device), y.to(mesh.device)
            with tokens_per_loss(per_loss):
                if pipe is None:
                    total += sum(chunks[0](xm, ym, docs=d) for xm, ym, d in
                                 zip(x.chunk(M), y.chunk(M), docs or [None] * M)) / M
                else:
                    local = pipe.evaluate(x, y, docs)
                    if local is not None:
                        total += local.float()
    finally:
        for m, mode in zip(chunks, modes):
            m.train(mode)
    if pipe is not None:
        collectives.all_reduce(total, group=mesh.pp_group)      # only the last stage holds it
    collectives.all_reduce(total, group=mesh.dp_cp_group)      # CP ranks: the other tokens
    return total.item() / (len(batches) * dist.get_world_size(mesh.dp_cp_group))
