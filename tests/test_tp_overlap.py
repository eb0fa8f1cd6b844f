"""The extension's GEMM <-> collective ops: results, bad input, and proof that they overlap."""
import time

import pytest
import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode

from fastpar import extension
from fastpar.testing import run_ranks


def _close(a, b, what):
    assert a.shape == b.shape, f"{what}: {tuple(a.shape)} != {tuple(b.shape)}"
    assert torch.allclose(a, b, atol=1e-5, rtol=1e-5), f"{what}: {(a - b).abs().max()}"


def _results(rank, tp):
    g = dist.new_group(list(range(tp)))
    torch.manual_seed(100 + rank)                  # different data on every rank
    w = torch.randn(6, 5)
    for rows, chunks in ((10, 3), (7, 1), (3, 8), (1, 4)):   # uneven, more chunks than rows
        x = torch.randn(rows, 5)
        ref = x @ w.t()
        dist.all_reduce(ref, group=g)
        _close(extension.matmul_allreduce(x, w, g, chunks), ref, f"matmul_allreduce {rows}/{chunks}")
    for m in (1, 3):
        x = torch.randn(m, 5)
        full = torch.empty(tp * m, 5)
        dist.all_gather_into_tensor(full, x, group=g)
        out, gathered = extension.allgather_matmul(x, w, g)
        assert torch.equal(gathered, full)
        _close(out, full @ w.t(), f"allgather_matmul m={m}")
        # A transposed (non-contiguous) weight, as the Row backward passes it.
        out, _ = extension.allgather_matmul(x, w.t().contiguous().t(), g)
        _close(out, full @ w.t(), "allgather_matmul strided w")
        xs = torch.randn(tp * m, 5)
        ref = torch.empty(m, 6)
        dist.reduce_scatter_tensor(ref, xs @ w.t(), group=g)
        _close(extension.matmul_reducescatter(xs, w, g), ref, f"matmul_reducescatter m={m}")
    # Column backward, all four (sequence_parallel, needed grads) combinations.
    for sp in (False, True):
        rows = 4 * tp
        go = torch.randn(rows, 6)
        inp = torch.randn(rows // tp if sp else rows, 5)
        total = torch.empty(rows, 5) if sp else inp
        if sp:
            dist.all_gather_into_tensor(total, inp, group=g)
        partial = go @ w
        ref_gi = torch.empty(rows // tp, 5) if sp else partial.clone()
        if sp:
            dist.reduce_scatter_tensor(ref_gi, partial, group=g)
        else:
            dist.all_reduce(ref_gi, group=g)
        for need_i, need_w in ((True, True), (True, False), (False, True)):
            gi, gw = extension.column_linear_backward(go, inp, w, g, sp, need_i, need_w)
            assert (gi is None) != need_i and (gw is None) != need_w
            if need_i:
                _close(gi, ref_gi, f"column bwd sp={sp} dgrad")
            if need_w:
                _close(gw, go.t() @ total, f"column bwd sp={sp} wgrad")
    # Fake implementations: shapes without running anything (what torch.compile traces).
    with FakeTensorMode():
        fx, fw = torch.empty(4 * tp, 5), torch.empty(6, 5)
        assert extension.matmul_reducescatter(fx, fw, g).shape == (4, 6)
        out, gathered = extension.allgather_matmul(fx, fw, g)
        assert out.shape == (4 * tp * tp, 6) and gathered.shape == (4 * tp * tp, 5)
    # Bad input: one clear error naming the argument, before any collective.
    errors = []
    for bad in (lambda: extension.matmul_allreduce(torch.ones(3, 4), w, g),
                lambda: extension.matmul_allreduce(torch.ones(3, 5), w, g, 0),
                lambda: extension.matmul_reducescatter(torch.ones(tp + 1, 5), w, g),
                lambda: extension.allgather_matmul(torch.ones(3, 5, dtype=torch.float64), w, g)):
        try:
            bad()
        except RuntimeError as e:
            errors.append(str(e).splitlines()[0])
    assert len(errors) == 4, errors
    assert "x has K=4 but w has K=5" in errors[0]
    assert "chunks must be >= 1" in errors[1]
    assert f"rows={tp + 1} not divisible by tp={tp}" in errors[2]
    assert "x is Double, w is Float" in errors[3]
    return errors


@pytest.mark.parametrize("tp", [2, 4])
def test_ops_match_plain_collectives(tp):
    out = run_ranks(_results, tp, timeout=90)
    assert all(o == out[0] for o in out)


def _trace(fn):
    """The (event, index, ns) tuples the extension records over one run of ``fn``."""
    extension.events.enable()
    fn()
    ev = extension.events.take()
    extension.events.enable(False)
    return ev


def _events(fn):
    return {(name, i): t for name, i, t in _trace(fn)}


def _overlap(rank, tp):
    g = dist.new_group(list(range(tp)))
    x, w = torch.randn(512, 256), torch.randn(256, 256)
    # Chunked GEMM + all-reduce: chunk i's all-reduce is started before GEMM i+1 begins and is
    # waited for only after GEMM i+1 has ended, i.e. it is in flight while that GEMM runs.
    ev = _events(lambda: extension.matmul_allreduce(x, w, g, 4))
    for i in range(3):
        assert ev[("comm_start", i)] < ev[("gemm_begin", i + 1)], f"chunk {i} started late"
        assert ev[("comm_done", i)] > ev[("gemm_end", i + 1)], f"chunk {i} waited early"
    # Ring all-gather + GEMM: step s's transfer is in flight during GEMM s.
    ev = _events(lambda: extension.allgather_matmul(x[:128], w, g))
    for s in range(tp - 1):
        assert ev[("comm_start", s)] < ev[("gemm_begin", s)] < ev[("gemm_end", s)]
        assert ev[("gemm_end", s)] < ev[("comm_done", s)]
    # GEMM + ring reduce-scatter: the transfer of step s overlaps the GEMM of step s+1.
    ev = _events(lambda: extension.matmul_reducescatter(x, w, g))
    for s in range(tp - 1):
        assert ev[("comm_start", s)] < ev[("gemm_begin", s + 1)]
        assert ev[("gemm_end", s + 1)] < ev[("comm_done", s)]
    # Column backward without SP: each dgrad chunk's all-reduce runs across the next dgrad chunk
    # GEMM, and the last one across the weight-grad GEMM (index 3).
    ev = _events(lambda: extension.column_linear_backward(x, x, w, g, False, True, True, 3))
    for i in range(3):
        assert ev[("comm_start", i)] < ev[("gemm_begin", i + 1)]
        assert ev[("gemm_end", i + 1)] < ev[("comm_done", i)]
    # Under SP the input all-gather (0) runs across the dgrad GEMM (0), and the dgrad
    # reduce-scatter (1) across the weight-grad GEMM (1).
    ev = _events(lambda: extension.column_linear_backward(x, x[:512 // tp], w, g, True, True, True))
    for i in (0, 1):
        assert ev[("comm_start", i)] < ev[("gemm_begin", i)] < ev[("gemm_end", i)] \
            < ev[("comm_done", i)]
    return True


@pytest.mark.parametrize("tp", [2, 4])
def test_collectives_are_in_flight_during_the_next_gemm(tp):
    assert run_ranks(_overlap, tp, timeout=90) == [True] * tp


def _seen(fn):
    """Which indices' collectives were pending right after issue, which had finished before
    anyone waited for them, and when each was issued (ns), over one run of ``fn``."""
    ev = _trace(fn)
    return ({i for name, i, _ in ev if name == "comm_pending"},
            {i for name, i, _ in ev if name == "comm_ready"},
            {i: t for name, i, t in ev if name == "comm_start"})


# The ranks but one start each run LEAD_S late (doubled while the one issued nothing first, up to
# GRACE_S): what it issued before any peer cannot have finished, unless the issue waited for it.
# Runs go on (up to MAX_RUNS) while a rank saw no collective finish during the GEMMs.
LEAD_S, GRACE_S, MAX_RUNS = 0.1, 30.0, 16


def _progress(rank, tp):
    g = dist.new_group(list(range(tp)))
    # Each GEMM below takes milliseconds; each collective moves about 1 MB.
    x, w = torch.randn(2048, 512), torch.randn(512, 512)
    cases = {
        # chunk 0's all-reduce: only GEMMs 1..3 run between its issue and its wait.
        "matmul_allreduce": (lambda: extension.matmul_allreduce(x, w, g, 4), range(4), {0}),
        # ring step s: only GEMM s runs between the exchange's issue and its wait.
        "allgather_matmul": (lambda: extension.allgather_matmul(x[:512], w, g), range(tp - 1),
                             set(range(tp - 1))),
        # ring step s: only GEMM s+1 (and the add) runs in between.
        "matmul_reducescatter": (lambda: extension.matmul_reducescatter(x, w, g), range(tp - 1),
                                 set(range(tp - 1))),
        # chunk 0's dgrad all-reduce: dgrad GEMMs 1, 2 and the wgrad GEMM run in between.
        "column_backward": (lambda: extension.column_linear_backward(x, x, w, g, False, True, True, 3),
                            range(3), {0}),
        # SP: the input all-gather (0) across the dgrad GEMM, the dgrad reduce-scatter (1) across
        # the wgrad GEMM.
        "column_backward_sp": (lambda: extension.column_linear_backward(
            x, x[:2048 // tp], w, g, True, True, True), (0, 1), {0, 1}),
    }
    out = {}
    for name, (fn, issued, may_finish) in cases.items():
        first, pending, finished, run, all_finished = 0, 0, set(), 0, False
        while run < 4 or (run < MAX_RUNS and not all_finished):
            lead, delay = run % tp, LEAD_S              # each rank in turn starts on time
            while True:
                dist.barrier(group=g)
                if rank != lead:
                    time.sleep(delay)
                seen_pending, ready, starts = _seen(fn)
                every = [None] * tp
                dist.all_gather_object(every, (starts, bool(finished | ready & may_finish)),
                                       group=g)
                ahead = [[i for i in issued if all(every[r][0][i] < s[i] for q, (s, _) in
                                                   enumerate(every) if q != r)] for r in range(tp)]
                if ahead[lead] or delay > GRACE_S:
                    break
                delay *= 2
            # Issued before every peer: still in flight, unless the issue blocked.
            first, pending = first + len(ahead[rank]), pending + len(seen_pending & {*ahead[rank]})
            finished |= ready & may_finish
            all_finished, run = all(f for _, f in every), run + 1
        out[name] = (pending / max(first, 1), sorted(finished))
    return out


@pytest.mark.parametrize("tp", [2, 4])
def test_collectives_progress_while_the_gemms_run(tp):
    """Progress, not order: the collectives are still in flight right after they are issued (the
    issue did not block), and at least one is observed finished (``work.is_completed()``) at
    the moment the op comes to wait for it, with only GEMMs run in between. An op that waited
    right after issuing, or whose collective only moved when waited on, fails here."""
    for rank_out in run_ranks(_progress, tp, timeout=120):
        for name, (pending_share, finished) in rank_out.items():
            assert pending_share >= 0.5, f"{name}: collectives had finished when issue returned"
            assert finished, f"{name}: no collective progressed while the GEMMs ran"
