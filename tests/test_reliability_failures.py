"""Failures during training: a stuck rank, a killed worker (elastic restart), non-finite steps;
and determinism (the same seed and layout give bit-identical losses)."""
import json
import os
import subprocess
import sys
import time

import pytest
from safetensors.torch import load_file

from fastpar.testing import RankError, run_ranks
from fastpar.train import TrainConfig
from fastpar.train.checkpoint import latest_checkpoint, verify_checkpoint

BASE = dict(model="tiny", seq_len=32, global_batch_size=8, micro_batch_size=2, warmup_steps=3,
            log_every=100)
# The same run on the command line: 2 data-parallel ranks, checkpoints every 4 steps.
ARGS = ["--steps", "12", "--save-every", "4", "--seq-len", "32", "--global-batch-size", "8",
        "--micro-batch-size", "2", "--warmup-steps", "3", "--log-every", "100", "--nproc", "2",
        "--timeout", "30"]


def _train(rank, world_size, kwargs):
    from fastpar.train import train

    return [r["loss"] for r in train(TrainConfig(**kwargs))]


def _run(world, out, env=None, **kwargs):
    return run_ranks(_train, world, dict(BASE, out=str(out), **kwargs), init_pg=False,
                     timeout=120, env=env)


def _cli(out, *args, fault=None):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    if fault:
        env["FASTPAR_FAULT"] = fault
    t0 = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "fastpar", "train", *ARGS, "--out", str(out),
                           *args], env=env, capture_output=True, text=True, timeout=170)
    return done, time.monotonic() - t0


def _rows(out):
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


def _params(out, step=12):
    return load_file(str(out / "checkpoints" / f"step_{step}" / "model_tp0_pp0.safetensors"))


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    out = tmp_path_factory.mktemp("uninterrupted")
    done, _ = _cli(out)
    assert done.returncode == 0, done.stderr[-3000:]
    return out


def test_same_seed_and_layout_give_bit_identical_losses(uninterrupted, tmp_path):
    again = _run(2, tmp_path, dp=2, steps=12, save_every=4, timeout=30)[0]
    assert again == [r["loss"] for r in _rows(uninterrupted)]      # exactly, no tolerance
    for name, t in _params(tmp_path).items():
        assert t.equal(_params(uninterrupted)[name]), name


def test_killed_worker_is_restarted_and_the_run_equals_an_uninterrupted_one(uninterrupted,
                                                                            tmp_path):
    # Rank 1 dies (SIGKILL) right after step 6; the launcher restarts both ranks, which resume
    # from step 4 (saved in the background, the last two kept) and redo steps 5-12.
    run, _ = _cli(tmp_path, "--max-restarts", "1", "--async-save", "--keep-last", "2",
                  fault="kill@6:1")
    assert run.returncode == 0, run.stderr[-3000:]
    rows = _rows(tmp_path)
    assert [r["step"] for r in rows] == list(range(1, 13))
    assert [r["loss"] for r in rows] == [r["loss"] for r in _rows(uninterrupted)]
    ref = _params(uninterrupted)
    assert _params(tmp_path).keys() == ref.keys()
    for name, t in _params(tmp_path).items():
        assert t.equal(ref[name]), name
    kept = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert kept == ["latest", "step_12", "step_8"]


def test_without_restarts_the_job_exits_nonzero_quickly(tmp_path):
    run, took = _cli(tmp_path, "--max-restarts", "0", "--save-every", "2", fault="kill@3:1")
    assert run.returncode == 1, run.stderr[-3000:]
    assert "rank 1 was killed by SIGKILL" in run.stderr, run.stderr[-3000:]
    assert "no restarts allowed" in run.stderr
    assert took < 120
    assert latest_checkpoint(tmp_path / "checkpoints").name == "step_2"
    verify_checkpoint(tmp_path / "checkpoints" / "step_2")


def test_stuck_rank_makes_the_other_fail_naming_collective_group_and_rank(tmp_path):
    t0 = time.monotonic()
    with pytest.raises(RankError) as info:
        _run(2, tmp_path, env={"FASTPAR_FAULT": "hang@3:1"}, dp=2, steps=5, timeout=8)
    msg = info.value.failures[0]
    assert "CollectiveTimeoutError" in msg and "step 3" in msg, msg
    assert "gradient reduction over the dp group (ranks [0, 1])" in msg, msg
    assert "rank(s) [1] did not arrive (rank 1 was last at step 2" in msg, msg
    assert "within 8s" in msg, msg
    assert time.monotonic() - t0 < 90            # spawn, two steps, the 8 s timeout, teardown


def test_nonfinite_steps_are_skipped_everywhere_and_too_many_stop_the_run(tmp_path):
    # Step 3: a NaN gradient on rank 1 only, after the gradients were reduced; rank 0's own
    # loss and norm are finite, yet it skips the step too (else the replicas would drift).
    # Steps 5 on: a NaN loss everywhere; the second in a row stops the run.
    with pytest.raises(RankError) as info:
        _run(2, tmp_path, env={"FASTPAR_FAULT": "nan@3:1,nan-loss@5-9"}, dp=2, steps=8,
             save_every=2, max_skipped_steps=2)
    assert sorted(info.value.failures) == [0, 1]
    for msg in info.value.failures.values():
        assert "NonFiniteError" in msg and "2 steps in a row (steps 5-6" in msg, msg
        assert "step_4" in msg, msg
    rows = _rows(tmp_path)
    assert [r.get("skipped", False) for r in rows] == [False, False, True, False, True]
    assert rows[2]["loss"] == rows[2]["loss"]                # finite on rank 0
    assert latest_checkpoint(tmp_path / "checkpoints").name == "step_4"
    verify_checkpoint(tmp_path / "checkpoints" / "step_4")
