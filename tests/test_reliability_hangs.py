"""Hangs named without relying on a collective to raise (as on NCCL, whose collectives never
raise in Python): each rank's stall watchdog dumps its flight record and ends the rank, and the
launcher prints one line naming the first rank and collective that differ.

Whole runs of ``fastpar train`` on 2 gloo ranks with a 5 s ``--timeout``: a rank that stops
(``hang@3:1``) and a rank that skips the loss all-reduce (``skip@3:1``); and the watchdog thread
alone, while the main thread waits inside a gloo collective."""
import os
import re
import subprocess
import sys
import time

import pytest
import torch

from fastpar.mesh.flight import read_dumps
from fastpar.testing import RankError, run_ranks

ARGS = ["--steps", "5", "--seq-len", "32", "--global-batch-size", "8", "--micro-batch-size", "2",
        "--warmup-steps", "2", "--log-every", "100", "--nproc", "2", "--timeout", "5",
        "--no-save"]


def _cli(out, fault):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["FASTPAR_FAULT"] = fault
    t0 = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "fastpar", "train", *ARGS, "--out", str(out)],
                          env=env, capture_output=True, text=True, timeout=150)
    return done, time.monotonic() - t0


def _hang_line(stderr: str) -> str:
    lines = [x for x in stderr.splitlines() if x.startswith("fastpar train: hang at")]
    assert len(lines) == 1, stderr[-4000:]
    return lines[0]


def _dumps_of_one_run(out):
    dumps = read_dumps(out / "hang")
    assert sorted(dumps) == [0, 1]
    assert dumps[0]["run_id"] and dumps[0]["run_id"] == dumps[1]["run_id"]
    return dumps


def test_a_stopped_rank_is_named_with_the_collective_the_other_waits_in(tmp_path):
    run, took = _cli(tmp_path, "hang@3:1")
    assert run.returncode == 1, run.stderr[-4000:]
    assert "ended by its watchdog (code 124" in run.stderr, run.stderr[-4000:]
    m = re.fullmatch(r"fastpar train: hang at step 3: rank 1 stopped after dp all_reduce #(\d+) "
                     r"\(1 x fp32\); ranks \[0\] wait in dp all_reduce #(\d+) \((\d+) x fp32\) "
                     r"over ranks \[0, 1\]; records: (.+)/rank\*\.json", _hang_line(run.stderr))
    assert m, run.stderr[-4000:]
    assert int(m[2]) == int(m[1]) + 1 and int(m[3]) > 1000      # a gradient bucket
    assert m[4] == str(tmp_path / "hang")
    # Rank 1's own line (from its watchdog, or none if rank 0's ended the job first) names
    # where it stopped; every rank dumped, rank 1 from the step before.
    if "fastpar: error: rank 1," in run.stderr:
        assert "rank 1, after step 2 ('the optimizer step'): no collective issued" in run.stderr
    dumps = _dumps_of_one_run(tmp_path)
    assert dumps[1]["step"] == 2 and dumps[0]["step"] == 3
    assert "Traceback" not in run.stderr
    assert took < 60, took


def test_a_skipped_collective_is_named_with_the_one_issued_instead(tmp_path):
    run, took = _cli(tmp_path, "skip@3:1")
    assert run.returncode == 1, run.stderr[-4000:]
    m = re.fullmatch(r"fastpar train: hang at step 3: rank 1 issued world all_reduce #3 "
                     r"\(1 x fp32\) where ranks \[0\] issued dp all_reduce #(\d+) \(1 x fp32\) "
                     r"over ranks \[0, 1\] \(rank 1's last dp collective: all_reduce #(\d+)\); "
                     r"records: .+", _hang_line(run.stderr))
    assert m and int(m[2]) == int(m[1]) - 1, run.stderr[-4000:]
    dumps = _dumps_of_one_run(tmp_path)
    skipped = [e for e in dumps[0]["entries"] if e["seq"] == int(m[1]) and e["numel"] == 1]
    assert len(skipped) == 1 and skipped[0]["step"] == 3       # the loss all-reduce, rank 0's
    assert took < 60, took


def _stall_in_gloo(rank, world_size, out):
    """Rank 0: a watchdog of 2 s, then a blocking all-reduce rank 1 never joins. Rank 1: a
    check that a dropped watchdog stops its thread, then one of 60 s, and it sleeps."""
    import gc

    import fastpar
    import torch.distributed as dist
    from fastpar.mesh.watchdog import Watchdog, group_timeout

    mesh = fastpar.init(dp=2, timeout=group_timeout(2.0))
    if rank == 1:
        wd = Watchdog(mesh, 0.5, out=out / "other")
        thread = wd.monitor
        alive = thread.is_alive()
        del wd
        gc.collect()
        thread.join(timeout=3)
        (out / "rank1.txt").write_text(f"{alive} {thread.is_alive()}")
        wd = Watchdog(mesh, 60.0, out=out)     # dumps when rank 0's raises the alarm
        time.sleep(60)
    wd = Watchdog(mesh, 2.0, out=out)
    t0 = time.monotonic()
    with wd.region(1, "the all-reduce nobody joins", ("dp",)):
        dist.all_reduce(torch.ones(4), group=mesh.dp_group)     # main thread waits in C++
    return time.monotonic() - t0


def test_the_watchdog_thread_ends_a_rank_whose_main_thread_waits_in_a_collective(tmp_path):
    t0 = time.monotonic()
    with pytest.raises(RankError) as info:
        run_ranks(_stall_in_gloo, 2, tmp_path, init_pg=False, timeout=40)
    assert info.value.failures[0] == "process exited with code 124 without reporting", \
        info.value
    dumps = read_dumps(tmp_path / "hang")
    dump = dumps[0]
    assert dump["reason"] == "stalled" and dump["idle_s"] >= 2.0
    assert dumps[1]["reason"] == "another rank stalled"
    assert dump["message"].startswith("rank 0, step 1: the all-reduce nobody joins did not "
                                      "complete within 2s, stuck in the gradient reduction "
                                      "over the dp group (ranks [0, 1])"), dump["message"]
    assert (tmp_path / "rank1.txt").read_text() == "True False"     # stopped once dropped
    assert not (tmp_path / "other").exists()                          # and never dumped
    assert time.monotonic() - t0 < 30    # start, 2 s, two polls: long before gloo's 17 s
