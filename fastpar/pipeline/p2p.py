"""Pipeline point-to-point: message tags, posting batches, waiting with a useful error, and the
one-time shape handshake that sizes the receive buffers.

Every message of a step has its own tag (gloo matches on source and tag, so a receive posted
early cannot take the wrong message; NCCL ignores tags and matches in order, which the schedule's
channel-order check guarantees). A wait that fails (the process group's timeout, a closed peer)
raises :class:`PipelineTimeoutError` naming this stage, the peer stage and the micro-batch.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..mesh import collectives

_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64,
           torch.int32, torch.uint8, torch.bool)
_META_LEN = 16          # [status, dtype, ndim, dims...]; status 0 ok, >0 an error code + numbers
HANDSHAKE_TAG = 0


class PipelineTimeoutError(RuntimeError):
    """A pipeline send or receive did not complete: the peer is dead, stuck or out of step."""


def message_tag(kind: str, microbatch: int, stage: int, num_stages: int) -> int:
    """A tag unique to one message of a step (> 0; 0 is the handshake's)."""
    return 1 + 2 * (microbatch * num_stages + stage) + (kind == "B")


def describe(kind: str, microbatch: int, stage: int) -> str:
    return (f"the activation of micro-batch {microbatch} into stage {stage}" if kind == "F"
            else f"the gradient of micro-batch {microbatch} out of stage {stage}")


def sends_wait(group) -> bool:
    """Whether a send on ``group`` waits for its receive, in order with the pair's other
    messages (NCCL), rather than going out buffered and matched by tag (gloo). A group can say
    so itself (``sends_wait_for_receives``, as the tests' NCCL-rules group does)."""
    own = getattr(group, "sends_wait_for_receives", None)
    if own is not None:
        return bool(own)
    return dist.get_backend(group) != dist.Backend.GLOO


def post(ops: list[dist.P2POp], stream=None) -> list[list[dist.Work]]:
    """Start a batch; returns, per op, the works to wait on. On CUDA the batch is issued from
    the dedicated comm stream once it has waited for the compute stream (sent tensors ready)."""
    if not ops:
        return []
    if stream is not None:
        stream.wait_stream(torch.cuda.current_stream(stream.device))
        with torch.cuda.stream(stream):
            works = collectives.batch_isend_irecv(ops)
        for op in ops:
            op.tensor.record_stream(stream)
    else:
        works = collectives.batch_isend_irecv(ops)
    # gloo returns one work per op; a coalesced NCCL batch may return one for the whole batch.
    return [[w] for w in works] if len(works) == len(ops) else [list(works)] * len(ops)


def wait(works: list[dist.Work], what: str) -> None:
    """Wait for ``works``; a failure raises :class:`PipelineTimeoutError` naming ``what``.

    ``Work.wait`` gets no timeout: under NCCL a wait with one spins the host until the work is
    done, where a plain wait only queues the dependency on the current stream. The process
    group's own timeout (``fastpar.init`` gives one to every group) bounds the wait and makes it
    fail, and the trainer's watchdog names a stuck collective.
    """
    try:
        for w in works:
            w.wait()
    except RuntimeError as e:
        raise PipelineTimeoutError(f"{what} did not complete: {e}") from e


def encode_meta(t: torch.Tensor | None, status: int = 0, numbers=()) -> torch.Tensor:
    meta = torch.zeros(_META_LEN, dtype=torch.int64)
    if status:
        meta[0] = status
        meta[1:1 + len(numbers)] = torch.tensor(list(numbers), dtype=torch.int64)
        return meta
    if t.dtype not in _DTYPES or t.dim() > _META_LEN - 3:
        raise ValueError(f"pipeline: a stage passes a {t.dtype} tensor of {t.dim()} dims; "
                         f"supported are {_DTYPES} with at most {_META_LEN - 3} dims")
    meta[1], meta[2] = _DTYPES.index(t.dtype), t.dim()
    meta[3:3 + t.dim()] = torch.tensor(t.shape, dtype=torch.int64)
    return meta


def decode_meta(meta: torch.Tensor):
    """``(status, numbers)`` for an error, else ``(0, (shape, dtype))``."""
    values = meta.tolist()
    if values[0]:
        return values[0], values[1:]
    ndim = values[2]
    return 0, (torch.Size(values[3:3 + ndim]), _DTYPES[values[1]])


def send_meta(meta: torch.Tensor, peer: int, group, device, what: str) -> None:
    """Send the handshake's message as a batch of one: under NCCL a lone ``isend`` would create
    a communicator for this pair of ranks (another rendezvous, more GPU memory) where a batch
    runs on the pipeline group's own, the one every later step uses."""
    op = dist.P2POp(dist.isend, meta.to(device), peer, group, HANDSHAKE_TAG)
    wait(collectives.batch_isend_irecv([op]), what)


def recv_meta(peer: int, group, device, what: str) -> torch.Tensor:
    meta = torch.zeros(_META_LEN, dtype=torch.int64, device=device)
    op = dist.P2POp(dist.irecv, meta, peer, group, HANDSHAKE_TAG)
    wait(collectives.batch_isend_irecv([op]), what)
    return meta.cpu()
