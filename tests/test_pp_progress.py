"""The pipeline executor's overlap shown as progress, not as order: a message whose receive the
schedule posts before a compute action arrives during that compute.

1F1B at pp=2 posts stage 1's receive of micro-batch 1's activation before its backward of
micro-batch 0 (``RECV_F1 B0 SEND_B0 F1``). Stage 0's forward is light and stage 1's heavy, so the
activation is sent while stage 1 computes; with ``overlap=True`` it moves during B0 and F1 finds it
there: the executor's wait for it is a small fraction of what the transfer takes alone. With
``overlap=False`` the receive is waited for before B0, and that wait is the transfer. The probe
(every wait the executor makes, timed) tells the two apart. On a loaded machine the transfer may
outlast B0: each backward computes on until the receives posted before it are done (polled, see
``Pollable``), up to GRACE_S: the transfer, not the clock, is the test.
"""
import time

import torch
import torch.distributed as dist
import torch.nn as nn

from fastpar.pipeline import PipelineExecutor, build_schedule, p2p
from fastpar.testing import run_ranks
from pollable import Pollable

ROWS, WIDTH, OUT, M = 512, 8192, 128, 4        # a 16 MiB activation per micro-batch
GRACE_S = 30.0


class _Stage(nn.Module):
    def __init__(self, index: int):
        super().__init__()
        self.stage_index, self.num_stages = index, 2
        if index == 0:                            # light: a scale
            self.scale = nn.Parameter(torch.ones(()))
        else:                                     # heavy: a 1 GFLOP GEMM per micro-batch
            self.proj = nn.Parameter(torch.randn(WIDTH, OUT) / WIDTH ** 0.5)

    def forward(self, x):
        return x * self.scale if self.stage_index == 0 else x @ self.proj


def _transfer_alone(rank):
    """The fewest seconds of one blocking send/recv of a micro-batch's activation, both ends
    ready (load only makes a transfer slower: the fastest of a few is what it takes)."""
    t, times = torch.randn(ROWS, WIDTH), []
    for _ in range(5):
        dist.barrier()
        start = time.perf_counter()
        dist.send(t, 1) if rank == 0 else dist.recv(t, 0)
        times.append(time.perf_counter() - start)
    return min(times)


def _waits(rank, world):
    """Seconds stage 1 spent waiting for micro-batch 1's activation, overlap on and off, and
    what the transfer takes alone."""
    waited = {}
    plain_wait = p2p.wait

    def timed_wait(works, what):                  # the executor's one way to wait for a message
        start = time.perf_counter()
        plain_wait(works, what)
        waited[what] = waited.get(what, 0.0) + time.perf_counter() - start

    p2p.wait = timed_wait
    receives, plain_post, plain_backward = [], p2p.post, PipelineExecutor._backward

    def watched_post(ops, stream=None):
        posted = [[Pollable(w) for w in works] for works in plain_post(ops, stream)]
        receives.extend(w for op, works in zip(ops, posted) if op.op is dist.irecv for w in works)
        return posted

    def backward_until_received(self, st, a):    # B computes on until its receives are done
        plain_backward(self, st, a)
        m, give_up = torch.randn(256, 256), time.monotonic() + GRACE_S
        while not all(w.is_completed() for w in receives) and time.monotonic() < give_up:
            m = torch.tanh(m @ m)

    p2p.post, PipelineExecutor._backward = watched_post, backward_until_received
    torch.manual_seed(0)
    stage = _Stage(rank)
    out = {"transfer": _transfer_alone(rank)}
    x, t = torch.randn(M * ROWS, WIDTH), torch.zeros(M * ROWS, OUT)
    for overlap in (True, False):
        pipe = PipelineExecutor([stage], build_schedule("1f1b", 2, M, 1), dist.group.WORLD,
                                loss_fn=lambda y, t: (y - t).square().mean(), overlap=overlap,
                                recv_ahead=0)     # the schedule's own placement of receives
        for _ in range(2):                            # the second step counts
            dist.barrier()
            waited.clear()
            pipe.step(x if rank == 0 else None, t if rank == 1 else None)
        out[overlap] = [s for what, s in waited.items()
                        if "receiving the activation of micro-batch 1 " in what]
        stage.zero_grad()
    return out


def test_an_activation_arrives_while_the_receiver_computes():
    stage1 = run_ranks(_waits, 2, timeout=120)[1]
    transfer, [on], [off] = stage1["transfer"], stage1[True], stage1[False]
    # Overlap on: micro-batch 1's activation moved during B0, F1 found it there.
    assert on < 0.2 * transfer, (on, transfer)
    # Overlap off: the same receive was waited for before B0, for about a transfer.
    assert off > 0.5 * transfer, (off, transfer)
