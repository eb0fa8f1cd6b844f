"""The multi-rank harness: results on success, rank-numbered failures, timeouts, no leftovers."""
import os
import time

import pytest
import torch
import torch.distributed as dist

from fastpar.testing import RankError, RankTimeout, run_ranks


def _gone(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def _sum_ranks(rank, world_size, scale):
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    return (os.getpid(), os.environ["RANK"], t.item() * scale)


def _raise_on_rank_one(rank, world_size):
    if rank == 1:
        raise KeyError("boom on purpose")
    time.sleep(600)  # rank 0 would wait forever: the harness must kill it


def _hang_on_rank_zero(rank, world_size):
    if rank == 0:
        time.sleep(600)
    return rank


def _die_silently(rank, world_size):
    if rank == 1:
        os._exit(7)
    return rank


def test_pass_returns_results_in_rank_order_and_leaves_nothing():
    out = run_ranks(_sum_ranks, 3, 2.0, init_pg=True)
    assert [o[1] for o in out] == ["0", "1", "2"]
    assert [o[2] for o in out] == [6.0, 6.0, 6.0]
    assert all(_gone(pid) for pid, _, _ in out)


def test_failure_names_rank_and_traceback_and_kills_the_rest():
    start = time.monotonic()
    with pytest.raises(RankError) as err:
        run_ranks(_raise_on_rank_one, 2, timeout=30)
    msg = str(err.value)
    assert "rank 1 raised" in msg and "KeyError: 'boom on purpose'" in msg
    assert "_raise_on_rank_one" in msg               # the traceback, not only the message
    assert list(err.value.failures) == [1]
    assert time.monotonic() - start < 25             # did not wait for the timeout
    assert all(_gone(pid) for pid in err.value.pids)


def test_timeout_names_stuck_ranks_and_kills_them():
    start = time.monotonic()
    with pytest.raises(RankTimeout) as err:
        run_ranks(_hang_on_rank_zero, 2, timeout=4, init_pg=False)
    # Rank 0 hangs; rank 1 returns at once (unless a loaded machine kept it starting for 4 s).
    assert err.value.stuck in ([0], [0, 1])
    assert f"rank(s) {err.value.stuck} did not finish within 4s" in str(err.value)
    assert time.monotonic() - start < 30
    assert all(_gone(pid) for pid in err.value.pids)


def test_rank_that_dies_without_reporting_is_a_failure():
    with pytest.raises(RankError) as err:
        run_ranks(_die_silently, 2, timeout=30, init_pg=False)
    assert "exited with code 7" in err.value.failures[1]
    assert all(_gone(pid) for pid in err.value.pids)


def _env(rank, world_size):
    keys = ("OMP_NUM_THREADS", "MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_")
    return {k: os.environ.get(k) for k in keys}


def test_ranks_share_the_cores_and_keep_freed_memory(monkeypatch):
    from fastpar.train.host import worker_env

    for k in ("OMP_NUM_THREADS", "MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 8)
    assert worker_env(2)["OMP_NUM_THREADS"] == "4"
    assert worker_env(16)["OMP_NUM_THREADS"] == "1"
    assert int(worker_env(2)["MALLOC_MMAP_THRESHOLD_"]) == 2 ** 25    # glibc's largest
    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", "123")                # set by the user: kept
    assert "MALLOC_TRIM_THRESHOLD_" not in worker_env(2)
    out = run_ranks(_env, 2, init_pg=False)
    assert out[0] == out[1]
    assert out[0]["MALLOC_TRIM_THRESHOLD_"] == "123"
    assert out[0]["OMP_NUM_THREADS"] == "4" and int(out[0]["MALLOC_MMAP_THRESHOLD_"]) == 2 ** 25
    assert "MALLOC_MMAP_THRESHOLD_" not in os.environ                  # the parent is untouched


def _tensors(rank, world_size):
    t = torch.full((3, 4), float(rank), requires_grad=True) * 2
    return {"t": t, "parts": [t[0], (t.sum(), rank)]}


def test_ranks_return_tensors():
    # The queue would pass a tensor as shared memory, gone once the rank has exited.
    out = run_ranks(_tensors, 2)
    for rank, r in enumerate(out):
        assert torch.equal(r["t"], torch.full((3, 4), 2.0 * rank)) and not r["t"].requires_grad
        assert torch.equal(r["parts"][0], torch.full((4,), 2.0 * rank))
        assert r["parts"][1][0].item() == 24.0 * rank and r["parts"][1][1] == rank
