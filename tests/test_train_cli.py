"""`fastpar train` as a user types it: one folder per run, resume that says what it does, bad
output folders and token files refused before any rank starts, Ctrl-C, quiet logs."""
import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

SMALL = ["--seq-len", "32", "--global-batch-size", "8", "--micro-batch-size", "2",
         "--warmup-steps", "2", "--log-every", "2"]


def _env():
    return {k: v for k, v in os.environ.items()
            if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                         "MASTER_PORT")}


def _train(*args, cwd, nproc=1, timeout=240):
    return subprocess.run([sys.executable, "-m", "fastpar", "train", "--nproc", str(nproc),
                           *SMALL, *args], cwd=cwd, env=_env(), capture_output=True, text=True,
                          timeout=timeout)


def _one_error(out, needle):
    """Exit code 2 and exactly one line on stderr, naming the problem; no traceback."""
    assert out.returncode == 2, (out.returncode, out.stderr[-2000:])
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0] and "Traceback" not in out.stderr, out.stderr


def _snapshot(folder):
    return {str(p.relative_to(folder)): (p.stat().st_size, p.stat().st_mtime_ns)
            for p in sorted(folder.rglob("*")) if p.is_file()}


def _losses(folder):
    return [json.loads(x)["loss"] for x in (folder / "metrics.jsonl").read_text().splitlines()]


def test_a_folder_holds_one_run(tmp_path):
    first = _train("--steps", "3", "--out", "run", cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-2000:]
    assert "writing to run" in first.stdout
    before = _snapshot(tmp_path / "run")
    # A second run into it is refused, and nothing of the first changes.
    again = _train("--steps", "2", "--out", "run", "--tp", "1", cwd=tmp_path)
    _one_error(again, "--out run already holds a run (metrics.jsonl, config.json, "
                      "checkpoints/step_3)")
    assert "--resume" in again.stderr and "--overwrite" in again.stderr
    assert _snapshot(tmp_path / "run") == before
    # --overwrite moves it aside, whole, and starts anew.
    over = _train("--steps", "2", "--out", "run", "--overwrite", cwd=tmp_path)
    assert over.returncode == 0, over.stderr[-2000:]
    aside = [p for p in tmp_path.iterdir() if p.name.startswith("run.replaced-")]
    assert len(aside) == 1 and _snapshot(aside[0]) == before, over.stdout
    assert f"moved the earlier run in run to {aside[0].name}" in over.stdout
    assert len(_losses(tmp_path / "run")) == 2
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").glob("step_*")) == ["step_2"]


def test_default_out_is_a_fresh_folder_per_run(tmp_path):
    runs = [_train("--steps", "1", "--no-save", cwd=tmp_path) for _ in range(2)]
    folders = []
    for r in runs:
        assert r.returncode == 0, r.stderr[-2000:]
        line = next(x for x in r.stdout.splitlines() if "writing to" in x)
        folders.append(line.split("writing to ")[1].strip())
    assert folders[0] != folders[1] and all(f.startswith("runs/run-") for f in folders)
    assert all(len(_losses(tmp_path / f)) == 1 for f in folders)


def test_resume_says_what_it_does(tmp_path):
    _one_error(_train("--steps", "2", "--out", "empty", "--resume", cwd=tmp_path),
               "--resume: empty has no complete checkpoint: there is nothing to resume")
    auto = _train("--steps", "2", "--out", "auto", "--resume", "auto", cwd=tmp_path)
    assert auto.returncode == 0 and "no checkpoint in auto, starting fresh" in auto.stdout
    # A real resume names the checkpoint; a `latest` naming a missing one is reported.
    assert _train("--steps", "4", "--out", "r", "--save-every", "2", cwd=tmp_path).returncode == 0
    ckpt = tmp_path / "r" / "checkpoints"
    (ckpt / "latest").write_text("step_6")
    _one_error(_train("--steps", "6", "--out", "r", "--resume", cwd=tmp_path),
               "--steps 4 (the run) -> 6 (now)")            # a longer run is another schedule
    res = _train("--steps", "6", "--out", "r", "--resume", "--adopt-changes", cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "--adopt-changes: --steps 4 (the run) -> 6 (now)" in res.stdout
    assert f"{ckpt.relative_to(tmp_path) / 'latest'} names step_6, which is missing; using " \
           "step_4, the newest complete checkpoint" in res.stdout, res.stdout
    assert "resuming from r/checkpoints/step_4 (step 4 of 6)" in res.stdout
    assert len(_losses(tmp_path / "r")) == 6        # one history: steps 1-6


@pytest.mark.parametrize("out,needle", [
    ("afile", "--out afile is a file, not a folder"),
    ("/proc/fastpar-run", "--out /proc/fastpar-run cannot be created or written"),
])
def test_bad_out_is_one_line_before_any_rank(tmp_path, out, needle):
    (tmp_path / "afile").write_text("x")
    _one_error(_train("--steps", "1", "--out", out, cwd=tmp_path, nproc=2), needle)


def test_token_ids_beyond_the_vocabulary_are_refused(tmp_path):
    tokens = np.arange(0, 50257, dtype=np.uint16)          # GPT-2 ids
    tokens.tofile(tmp_path / "gpt2.bin")
    _one_error(_train("--steps", "1", "--out", "run", "--data", "gpt2.bin", cwd=tmp_path,
                      nproc=2),
               "has token ids up to 50256, but model 'tiny' has a vocabulary of 256 (ids 0-255)")
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_steps_zero_and_short_runs(tmp_path):
    _one_error(_train("--steps", "0", "--out", "z", cwd=tmp_path), "--steps=0 must be >= 1")
    short = _train("--steps", "4", "--warmup-steps", "20", "--out", "s", cwd=tmp_path)
    assert short.returncode == 0 and "warming up for 2 steps, then decaying" in short.stdout
    rows = (tmp_path / "s" / "metrics.jsonl").read_text().splitlines()
    lrs = [json.loads(x)["lr"] for x in rows]
    assert lrs[-1] < max(lrs)


def test_logs_without_a_terminal_are_one_line_per_log_interval(tmp_path):
    out = _train("--steps", "6", "--out", "q", cwd=tmp_path)
    assert out.returncode == 0
    assert "\r" not in out.stderr + out.stdout             # no progress-bar redraws
    steps = [x for x in out.stdout.splitlines() if x.startswith("step ")]
    assert len(steps) == 4, out.stdout                      # steps 1, 2, 4, 6


def test_ctrl_c_stops_every_rank_and_resume_is_exact(tmp_path):
    args = ["--steps", "24", "--save-every", "4", "--log-every", "100"]
    whole = _train(*args, "--out", "whole", cwd=tmp_path, nproc=2)
    assert whole.returncode == 0, whole.stderr[-2000:]
    proc = subprocess.Popen([sys.executable, "-m", "fastpar", "train", "--nproc", "2", *SMALL,
                             *args, "--out", "cut"], cwd=tmp_path, env=_env(), text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True)
    metrics = tmp_path / "cut" / "metrics.jsonl"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        if metrics.exists() and len(metrics.read_text().splitlines()) >= 9:
            break
        time.sleep(0.05)
    assert proc.poll() is None, "the run ended before it could be interrupted"
    os.killpg(proc.pid, signal.SIGINT)                      # Ctrl-C: the terminal's whole group
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "interrupted after step" in lines[0], err
    assert "--out cut --resume" in lines[0] and "Traceback" not in err
    deadline = time.monotonic() + 15         # the ranks and the launcher's helpers exit
    while True:
        left = subprocess.run(["ps", "-o", "pid=,args=", "-g", str(proc.pid)],
                              capture_output=True, text=True).stdout.strip()
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert left == "", f"processes of the run still running 15 s after it stopped:\n{left}"
    resumed = _train(*args, "--out", "cut", "--resume", cwd=tmp_path, nproc=2)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "resuming from cut/checkpoints/step_" in resumed.stdout
    assert _losses(tmp_path / "cut") == _losses(tmp_path / "whole")     # bit for bit


def test_every_train_flag_has_the_help_of_its_config_field():
    import dataclasses
    import re

    from fastpar.train import TrainConfig
    from fastpar.train.flags import field_help

    helps = field_help(TrainConfig)
    out = subprocess.run([sys.executable, "-m", "fastpar", "train", "--help"], env=_env(),
                         capture_output=True, text=True, timeout=60, check=True).stdout
    flat = re.sub(r"\s+", " ", out)
    for f in dataclasses.fields(TrainConfig):
        assert helps.get(f.name), f"TrainConfig.{f.name} has no comment to serve as its help"
        flag = "--" + f.name.replace("_", "-")
        assert flag in flat and re.sub(r"\s+", " ", helps[f.name]) in flat, flag
