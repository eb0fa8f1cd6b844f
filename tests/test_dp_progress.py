"""DataParallel's overlap shown as progress, not as order: a bucket's all-reduce is observed
complete (``work.is_completed()``) from inside backward, while the layers below still have
their backward to compute. With ``overlap=False`` nothing has even started at that point, so
the probe tells the two apart."""
import copy
import time

import torch
import torch.nn as nn

from fastpar.data_parallel import DataParallel
from fastpar.testing import run_ranks

WIDTH, LAYERS, ROWS = 512, 8, 2048
# On a loaded machine a bucket may need longer than the rest of the backward: the probe computes
# on (inside backward) until the started buckets are done, up to this long (the all-reduce's
# progress, not the clock, is the test).
GRACE_S = 30.0


def _busy_until(done):
    """Matmuls until ``done()`` holds, at most GRACE_S."""
    a, give_up = torch.randn(256, 256), time.monotonic() + GRACE_S
    while not done() and time.monotonic() < give_up:
        a = torch.tanh(a @ a)


def _progress(rank, world):
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)])
    one_layer_mb = WIDTH * (WIDTH + 1) * 4 / 2**20       # one bucket per layer
    x = torch.randn(ROWS, WIDTH)
    out = {}
    for overlap in (True, False):
        dp = DataParallel(copy.deepcopy(model), bucket_cap_mb=one_layer_mb, overlap=overlap)
        buckets = dp._reducer.buckets
        seen = []

        def probe(_p, buckets=buckets, seen=seen):
            # Registered after DataParallel's own hook: runs once layer 3's gradient is in,
            # with layers 2, 1, 0 still to go (about 3/8 of the backward); computes on (nobody
            # waits) until what has started is done.
            _busy_until(lambda: all(b.work.is_completed() for b in buckets if b.work is not None))
            seen.append([b.work is not None and b.work.is_completed() for b in buckets])
            seen.append([b.work is not None for b in buckets])
        dp.module[3].weight.register_post_accumulate_grad_hook(probe)
        for _ in range(2):                                 # the second one counts
            seen.clear()
            dp(x).square().mean().backward()
        out[overlap] = seen
    return out


def test_a_bucket_completes_while_backward_still_computes():
    for rank_out in run_ranks(_progress, 2, timeout=120):
        completed, started = rank_out[True]
        # The last layers' buckets (first in the list) were reduced while layers 3..0 still
        # computed their gradients.
        assert completed[0] and sum(completed) >= 2, completed
        assert started[:4] == [True] * 4 and not any(started[5:]), started
        completed, started = rank_out[False]
        assert not any(started) and not any(completed)
