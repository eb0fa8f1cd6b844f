"""Nothing a user already has is replaced unasked, a run's folder stands on its own, a resume
continues exactly the run it names or says why not, and a signal at any moment is one line.
Everything through the command line as a user types it: exit code, the one line, and the
checksums of every earlier folder."""
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from fastpar.data.token_file import read_header

SMALL = ["--seq-len", "32", "--global-batch-size", "8", "--micro-batch-size", "2",
         "--warmup-steps", "2", "--log-every", "1", "--sample-tokens", "0"]
WORDS = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta", "\n", ". "]


def _env():
    return {k: v for k, v in os.environ.items()
            if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                         "MASTER_PORT")}


def _fastpar(*args, cwd, timeout=240):
    return subprocess.run([sys.executable, "-m", "fastpar", *args], cwd=cwd, env=_env(),
                          capture_output=True, text=True, timeout=timeout)


def _train(*args, cwd, nproc=1):
    return _fastpar("train", "--nproc", str(nproc), *SMALL, *args, cwd=cwd)


def _one_error(out, *needles):
    """Exit code 2 and exactly one line on stderr naming the problem; no traceback."""
    assert out.returncode == 2, (out.returncode, out.stderr[-3000:])
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in out.stderr, out.stderr
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])


def _sums(root):
    """sha256 of every file under ``root``: what must stay as it was."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def _steps(run):
    return [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines()]


def _losses(run):
    return [json.loads(x)["loss"] for x in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    """A prepared data folder with a trained BPE (vocabulary 300) and its tokenizer.json."""
    root = tmp_path_factory.mktemp("user")
    rng = np.random.default_rng(0)
    (root / "txt").mkdir()
    for i in range(6):
        (root / "txt" / f"doc{i}.txt").write_text(" ".join(rng.choice(WORDS, 600 + 50 * i)))
    out = _fastpar("prepare-data", "txt", "--tokenizer", "gpt2", "--vocab-size", "300",
                   "--out", "data", cwd=root)
    assert out.returncode == 0, out.stderr
    return root


def test_train_out_holding_a_users_files_is_refused_and_overwrite_moves_it_aside(tmp_path):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("my notes")
    (mine / "config.json").write_text("{}")     # a name a run writes, among the user's own
    before = _sums(mine)
    for extra in ([], ["--resume"]):
        _one_error(_train("--steps", "1", "--out", "mine", *extra, cwd=tmp_path),
                   "--out mine holds 'notes.txt', which fastpar train does not write")
        assert _sums(mine) == before
    over = _train("--steps", "1", "--out", "mine", "--overwrite", "--no-save", cwd=tmp_path)
    assert over.returncode == 0, over.stderr[-3000:]
    aside = [p for p in tmp_path.iterdir() if p.name.startswith("mine.replaced-")]
    assert len(aside) == 1 and _sums(aside[0]) == before and str(aside[0].name) in over.stdout
    assert not (mine / "notes.txt").exists() and _steps(mine) == [1]


def test_run_folder_stands_on_its_own_and_resume_continues_exactly(prepared, tmp_path):
    run, data = tmp_path / "run", prepared / "data"
    vocab = read_header(data / "train.bin").vocab_size      # the BPE's (at most 300)
    common = ["--vocab-size", str(vocab), "--steps", "4", "--save-every", "2", "--out", str(run)]
    whole = _train("--data", str(data), *common[:-1], str(tmp_path / "whole"), cwd=prepared)
    assert whole.returncode == 0, whole.stderr[-3000:]
    first = _train("--data", "data", *common, cwd=prepared)    # a relative --data
    assert first.returncode == 0, first.stderr[-3000:]
    # The run keeps its own tokenizer and the data's description, and no relative path.
    assert (run / "tokenizer.json").read_bytes() == (data / "tokenizer.json").read_bytes()
    described = json.loads((run / "data.json").read_text())
    assert described["format"] == "prepared"
    assert described["vocab_size"] == vocab
    config = json.loads((run / "config.json").read_text())["train"]
    assert config["data"] == str(data) and config["out"] == str(run)
    # The data folder moves; export and generate run from another directory.
    moved = tmp_path / "elsewhere" / "data"
    moved.parent.mkdir()
    shutil.move(str(data), str(moved))
    try:
        elsewhere = tmp_path / "elsewhere"
        hf = _fastpar("export", str(run / "checkpoints" / "step_4"), "hf", cwd=elsewhere)
        assert hf.returncode == 0, hf.stderr
        assert (elsewhere / "hf" / "tokenizer.json").read_bytes() == \
            (moved / "tokenizer.json").read_bytes()
        gen = _fastpar("generate", str(run), "--prompt", "alpha beta", "--max-new-tokens", "4",
                       "--temperature", "0", cwd=elsewhere)
        assert gen.returncode == 0 and gen.stdout.startswith("alpha beta"), gen.stderr
        # A resume from the latest complete checkpoint (step 2; step 4 lost) with the data in
        # its new place: the same data by its fingerprint, the same curve, no step twice.
        shutil.rmtree(run / "checkpoints" / "step_4")
        res = _train("--data", str(moved), *common, "--resume", cwd=elsewhere)
        assert res.returncode == 0, res.stderr[-3000:]
        assert "resuming from" in res.stdout and "step 2 of 4" in res.stdout
        assert _steps(run) == [1, 2, 3, 4]
        assert _losses(run) == _losses(tmp_path / "whole")          # bit for bit
    finally:
        shutil.move(str(moved), str(data))


RESUMABLE = ["--steps", "4", "--save-every", "2", "--out", "run"]


@pytest.fixture(scope="module")
def resumable_run(tmp_path_factory):
    """A 4-step run whose step-4 checkpoint is lost: resumable from step 2 (each test copies)."""
    where = tmp_path_factory.mktemp("resumable")
    assert _train(*RESUMABLE, cwd=where).returncode == 0
    shutil.rmtree(where / "run" / "checkpoints" / "step_4")
    return where / "run"


CHANGES = [
    (["--steps", "6"], "--steps 4 (the run) -> 6 (now)"),
    (["--lr", "0.001"], "--lr 0.003 (the run) -> 0.001 (now)"),
    (["--global-batch-size", "16"], "--global-batch-size 8 (the run) -> 16 (now)"),
    (["--data", "{other}"], "--data the stdlib corpus (stdlib"),
]


def test_a_resume_that_changes_the_run_is_refused_unless_adopted(tmp_path, resumable_run):
    """Each change alone is refused, naming it, the run's files untouched; all of them
    adopted at once are each named, and the run continues after its checkpoint."""
    (tmp_path / "other.txt").write_text("some other text, " * 200)
    shutil.copytree(resumable_run, tmp_path / "run")
    before = _sums(tmp_path / "run")
    every = []
    for change, needle in CHANGES:
        change = [c.replace("{other}", str(tmp_path / "other.txt")) for c in change]
        every += change
        refused = _train(*RESUMABLE, *change, "--resume", cwd=tmp_path)  # the later flag wins
        _one_error(refused, "would not continue the run", needle, "--adopt-changes")
        assert _sums(tmp_path / "run") == before
    adopted = _train(*RESUMABLE, *every, "--resume", "--adopt-changes", cwd=tmp_path)
    assert adopted.returncode == 0, adopted.stderr[-3000:]
    for _, needle in CHANGES:
        assert f"fastpar train: --adopt-changes: {needle}" in adopted.stdout, adopted.stdout
    steps = _steps(tmp_path / "run")
    assert steps == sorted(set(steps)) and steps[:2] == [1, 2]       # nothing twice


def test_export_never_replaces_a_folder_unasked(tmp_path):
    assert _train("--steps", "1", "--out", "run", cwd=tmp_path).returncode == 0
    ckpt = str(tmp_path / "run" / "checkpoints" / "step_1")
    (tmp_path / "afile").write_text("not a folder")
    _one_error(_fastpar("export", ckpt, "afile", cwd=tmp_path), "OUT afile is a file")
    assert (tmp_path / "afile").read_text() == "not a folder"
    dest = tmp_path / "hf"
    dest.mkdir()
    (dest / "config.json").write_text('{"mine": true}')
    before = _sums(dest)
    _one_error(_fastpar("export", ckpt, "hf", cwd=tmp_path), "OUT hf already holds "
               "'config.json'", "--overwrite")
    assert _sums(dest) == before
    done = _fastpar("export", ckpt, "hf", "--overwrite", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    aside = [p for p in tmp_path.iterdir() if p.name.startswith("hf.replaced-")]
    assert len(aside) == 1 and _sums(aside[0]) == before
    assert {"config.json", "model.safetensors"} <= set(os.listdir(dest))
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".hf.tmp")]


def test_resumed_profile_of_the_same_steps_is_refused(tmp_path):
    args = ["--steps", "4", "--save-every", "2", "--out", "run", "--profile-steps", "2:3"]
    assert _train(*args, cwd=tmp_path).returncode == 0
    traces = tmp_path / "run" / "profile" / "steps-2-3"
    assert (traces / "rank0.json").exists()
    shutil.rmtree(tmp_path / "run" / "checkpoints" / "step_4")
    before = _sums(tmp_path / "run")
    _one_error(_train(*args, "--resume", cwd=tmp_path), "--profile-steps 2:3",
               "already holds the traces of these steps")
    assert _sums(tmp_path / "run") == before


def test_sizes_that_cannot_fit_are_refused_before_launch(tmp_path):
    """The user's case: `tiny` at --seq-len 100000 with the default 2 ranks and micro-batch 4
    needs about 23 GB per rank (tests/test_memory_check.py), more than half of this 24 GB host
    (the limit itself is read from the machine: on a host with over 40 GB, 10x the length)."""
    from fastpar.train.memory_check import host_memory

    seq = "100000" if host_memory()[0] < 40 else "1000000"
    out = _fastpar("train", "--seq-len", seq, "--steps", "1", "--out", "run", cwd=tmp_path,
                   timeout=120)
    _one_error(out, "GB per rank", "ranks on this host has", "--no-memory-check")
    assert not (tmp_path / "run").exists()


def _start(tmp_path, *args):
    """`fastpar train` in a session of its own (a terminal's process group) with SIGINT at its
    default, as a shell in a terminal starts it."""
    return subprocess.Popen([sys.executable, "-m", "fastpar", "train", "--nproc", "2", *SMALL,
                             *args], cwd=tmp_path, env=_env(), text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


def _stopped_cleanly(proc, code, needle):
    _, err = proc.communicate(timeout=90)
    assert proc.returncode == code, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0] and "Traceback" not in err, err
    deadline = time.monotonic() + 15          # and no rank is left behind
    while subprocess.run(["ps", "-o", "pid=", "-g", str(proc.pid)], capture_output=True,
                         text=True).stdout.strip():
        assert time.monotonic() < deadline, "ranks still running 15 s after the stop"
        time.sleep(0.2)
    return lines[0]


@pytest.mark.parametrize("delay", [0.3, 2.5, 4.0])
def test_ctrl_c_while_the_ranks_start_is_one_line(tmp_path, delay):
    """0.3 s: the launcher imports torch; 2.5 and 4 s: the ranks are spawned and importing
    (on this 2-core machine) - each rank's traceback was printed here before."""
    proc = _start(tmp_path, "--steps", "50", "--out", "run")
    time.sleep(delay)
    os.killpg(proc.pid, signal.SIGINT)
    _stopped_cleanly(proc, 130, "interrupted")


def test_sigterm_after_a_checkpoint_leaves_it_intact(tmp_path):
    from fastpar.train.checkpoint import latest_checkpoint, verify_checkpoint

    proc = _start(tmp_path, "--steps", "400", "--save-every", "2", "--out", "run")
    ckpts = tmp_path / "run" / "checkpoints"
    deadline = time.monotonic() + 120
    while latest_checkpoint(ckpts) is None or int(latest_checkpoint(ckpts).name[5:]) < 4:
        assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGTERM)               # the launcher alone, as a scheduler does
    line = _stopped_cleanly(proc, 143, "terminated after step")
    last = latest_checkpoint(ckpts)
    verify_checkpoint(last, full=True)              # every file's size and sha256
    assert f"the last complete checkpoint is {last.relative_to(tmp_path)}" in line, line
