"""Failures during training: a stuck rank, a killed worker (elastic restart), non-finite steps;
and determinism (the same seed and layout give bit-identical losses)."""
import json
import os
import subprocess
import sys
import time

import pytest
from safetensors.torch import load_file

from fastpar.mesh.flight import read_dumps
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
    assert "hang at" not in run.stderr and "Traceback" not in run.stderr  # a kill, not a stall
    assert took < 120
    assert latest_checkpoint(tmp_path / "checkpoints").name == "step_2"
    verify_checkpoint(tmp_path / "checkpoints" / "step_2")


def test_stuck_rank_makes_the_other_fail_naming_collective_group_and_rank(tmp_path):
    # Rank 1 stops before step 3. The stall watchdog of the first rank to go --timeout without
    # progress ends it (exit code 124) once both have dumped their record; rank 0's message
    # (printed, and kept in its dump) names the region, the group and the missing rank,
    # whether its watchdog spoke first or its gloo collective failed when rank 1 left.
    t0 = time.monotonic()
    with pytest.raises(RankError) as info:
        _run(2, tmp_path, env={"FASTPAR_FAULT": "hang@3:1"}, dp=2, steps=5, timeout=5)
    assert any("code 124" in f for f in info.value.failures.values()), info.value
    dumps = read_dumps(tmp_path / "hang")
    assert sorted(dumps) == [0, 1]
    msg = dumps[0]["message"]
    assert "rank 0, step 3: forward and backward did not complete within 5s" in msg, msg
    assert "gradient reduction over the dp group (ranks [0, 1])" in msg, msg
    assert "rank(s) [1] did not arrive (rank 1 was last at step 2" in msg, msg
    assert dumps[1]["step"] == 2 and dumps[0]["step"] == 3
    assert time.monotonic() - t0 < 90            # spawn, two steps, the 5 s timeout, teardown


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


SMALL = dict(seq_len=16, global_batch_size=2, micro_batch_size=1, sample_tokens=0)


def _stop(tmp_path, name, **kwargs):
    """A run whose steps 3, 6 and 7 have a NaN loss: 6-7 reach --max-skipped-steps 2."""
    out = tmp_path / name
    with pytest.raises(RankError) as info:
        _run(1, out, env={"FASTPAR_FAULT": "nan-loss@3,nan-loss@6-7"}, steps=10, save_every=4,
             max_skipped_steps=2, **{**kwargs, **SMALL})
    msg = info.value.failures[0].strip().splitlines()[-1].replace(str(out), "OUT")
    rows = [{k: v for k, v in r.items() if k not in ("step_time_s", "tokens_per_s")}
            for r in _rows(out)]
    return msg, rows, sorted(p.name for p in (out / "checkpoints").iterdir())


def test_steps_read_back_late_give_the_same_rows_stop_and_checkpoints(tmp_path):
    # Read after every step, or only at the first step, before checkpoints and at log steps:
    # the host learns of steps 6-7 at step 8 then, before the checkpoint of step 8 is written.
    every = _stop(tmp_path, "every", log_every=1)
    late = _stop(tmp_path, "late", log_every=100)
    assert late == every
    msg, rows, kept = late
    assert "NonFiniteError" in msg and "2 steps in a row (steps 6-7" in msg and \
        "OUT/checkpoints/step_4" in msg, msg
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    assert [r.get("skipped", False) for r in rows] == [False, False, True, False, False, True]
    assert kept == ["latest", "step_4"]
