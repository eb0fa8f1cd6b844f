"""The first step's shape exchange: every stage learns the shape and dtype of what it receives.

Each stage, in model order, gets its input's shape from the previous stage, runs its forward once
under ``no_grad`` on zeros of that shape (stage 0 on the real first micro-batch; the RNG is
restored afterwards, so dropout masks are unchanged) and sends its output's shape on. A gradient
has the shape of the activation it belongs to, so this sizes every receive buffer. Then the last
stage's check of the targets travels back, rank by rank, to rank 0.

Errors ride along: a bad batch found on stage 0's rank or on the last stage's rank reaches every
rank of the pipeline, which all raise the same ``ValueError`` instead of waiting on a peer that
has given up.
"""
from __future__ import annotations

import torch

from . import p2p


def batch_error(code: int, numbers) -> ValueError:
    """The same message on every rank, whichever rank found the problem."""
    what = "inputs" if code in (1, 2) else "targets"
    where = "stage 0" if what == "inputs" else "the last stage"
    if code in (1, 3):
        return ValueError(f"pipeline step: the rank holding {where} needs {what} (a tensor whose "
                          f"dim 0 is the batch), got none")
    return ValueError(f"pipeline step: {what} have {numbers[0]} samples in dim 0, which do not "
                      f"split into num_microbatches={numbers[1]} equal micro-batches")


def exchange_shapes(stages, schedule, rank, peers, group, device, xs, x_err,
                    t_err) -> dict:
    """``{("in" | "out", stage): (shape, dtype)}`` for this rank's stages, or the batch's error.

    ``x_err`` / ``t_err`` are ``(code, numbers)`` for a problem this rank found in the inputs /
    targets (see :func:`batch_error`), else None.
    """
    s, meta = schedule, {}
    if s.pp_size == 1 and (x_err or t_err):
        raise batch_error(*(x_err or t_err))
    for c, stage in enumerate(stages):
        idx = s.stage_index(rank, c)
        nxt = peers[(idx + 1) % s.pp_size]
        if idx == 0:
            status, value = x_err if x_err else (0, None)
            x = None if x_err else xs[0]
        else:
            what = f"pipeline stage {idx} (pp rank {rank}) waiting for stage {idx - 1}'s shapes"
            got = p2p.recv_meta(peers[(idx - 1) % s.pp_size], group, device, what)
            status, value = p2p.decode_meta(got)
            if not status:
                x = torch.zeros(value[0], dtype=value[1], device=device)
        if status:
            if idx + 1 < s.pp_size:              # pass it on to the ranks that have not seen it
                p2p.send_meta(p2p.encode_meta(None, status, value), nxt, group, device,
                              f"pipeline stage {idx} passing on an error")
            raise batch_error(status, value)
        meta[("in", idx)] = (x.shape, x.dtype)
        if idx < s.num_stages - 1:
            with torch.no_grad(), torch.random.fork_rng(
                    devices=[device] if device.type == "cuda" else []):
                y = stage(x)
            meta[("out", idx)] = (y.shape, y.dtype)
            p2p.send_meta(p2p.encode_meta(y), nxt, group, device,
                          f"pipeline stage {idx} sending its shapes to stage {idx + 1}")
    _targets_verdict(schedule, rank, peers, group, device, t_err)
    return meta


def _targets_verdict(schedule, rank, peers, group, device, t_err) -> None:
    """The last rank's check of the targets goes back to rank 0, rank by rank."""
    if schedule.pp_size > 1:
        if rank < schedule.pp_size - 1:
            got = p2p.recv_meta(peers[rank + 1], group, device,
                                f"pipeline pp rank {rank} waiting for the last stage's check of "
                                f"the targets")
            status, value = p2p.decode_meta(got)
            t_err = (status, value) if status else None
        if rank > 0:
            verdict = p2p.encode_meta(None, *t_err) if t_err else p2p.encode_meta(torch.zeros(0))
            p2p.send_meta(verdict, peers[rank - 1], group, device,
                          f"pipeline pp rank {rank} passing on the targets check")
    if t_err:
        raise batch_error(*t_err)
