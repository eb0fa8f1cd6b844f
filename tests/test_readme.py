"""Every command README.md shows is run by a test: each is found in the README's text and must
have a handler here (a command added to the README without one fails), which runs it.

The runs are shortened the way docs/your_model.md's walk-through test shortens them (fewer
steps); the GPU line is checked as far as a CPU can: its layout, the ranks it starts and the
memory check against an 80 GB GPU. Commands' own behaviour is tested in their files
(test_train_cli, test_plan_cli, test_prepare_data, test_generate, test_user_work)."""
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

import fastpar.train.cli as train_cli
from fastpar.cli import main
from fastpar.train.launch import check_inputs
from fastpar.train.memory_check import check_memory

README = Path(__file__).resolve().parents[1] / "README.md"


def _env():
    return {k: v for k, v in os.environ.items()
            if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                         "MASTER_PORT")}


def readme_commands() -> list[str]:
    """Each command in a bash block (continuations joined, chains split at &&) and each
    `fastpar ...` / `python -m pytest ...` in backticks."""
    text = README.read_text()
    found = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        for line in block.replace("\\\n", " ").splitlines():
            found += [c.strip() for c in line.split("&&") if c.strip()]
    found += re.findall(r"`((?:fastpar|python -m pytest)(?: [^`]*)?)`", text)
    return list(dict.fromkeys(" ".join(c.split()) for c in found))


def _launched(argv, monkeypatch):
    """The TrainConfig and rank count a `fastpar train ...` line launches (its own parser)."""
    seen = {}
    monkeypatch.setattr(train_cli, "launch", lambda cfg, nproc, restarts: seen.update(
        cfg=cfg, nproc=nproc))
    assert main(argv) == 0
    return seen["cfg"], seen["nproc"]


def _run(*args, cwd, timeout=300):
    out = subprocess.run([sys.executable, "-m", *args], cwd=cwd, env=_env(),
                         capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, (args, out.stderr[-3000:])
    return out


def _rows(folder):
    return [json.loads(x) for x in (folder / "metrics.jsonl").read_text().splitlines()]


def _train_for_real(line, tmp_path, *shorter):
    out = _run(*line.split(), "--out", "run", *shorter, cwd=tmp_path)
    return out, _rows(tmp_path / "run")


def default_run(line, tmp_path, monkeypatch, capsys):
    """`fastpar train`: 2 ranks; README's loss figures (about 5.6 at step 1, about 2.8 at step
    30), the run folder it names and the sample after training, over its first 30 steps."""
    cfg, nproc = _launched(["train"], monkeypatch)
    assert nproc == 2 and cfg.steps == 200
    out, rows = _train_for_real(line, tmp_path, "--steps", "30")
    run = tmp_path / "run"
    assert [r["step"] for r in rows] == list(range(1, 31))
    assert {"step", "loss", "lr", "tokens_per_s", "step_time_s"} <= set(rows[0])
    assert 5.3 < rows[0]["loss"] < 5.9 and 2.5 < rows[29]["loss"] < 3.1, \
        [r["loss"] for r in rows]
    assert sum(r["loss"] for r in rows[-5:]) < sum(r["loss"] for r in rows[:5]) - 1.0
    assert (run / "loss.png").stat().st_size > 1000
    assert json.loads((run / "config.json").read_text())["dp"] == 2
    assert (run / "checkpoints" / "step_30" / "manifest.json").exists()
    assert "fastpar train: writing to run" in out.stdout
    # What the model writes after training: 48 tokens after a held-out prompt.
    head, sample = out.stdout.split("fastpar train: sample (48 tokens after a held-out prompt, "
                                    "after the '|'):\n")
    assert 16 < len(sample.rstrip("\n")) <= 16 + 1 + 48, sample     # a byte is at most a char


def layout_row(ranks):
    def check(line, tmp_path, monkeypatch, capsys):
        """A row of README's layout table: the ranks it starts, and two steps of it."""
        cfg, nproc = _launched(line.split()[1:], monkeypatch)
        assert nproc == ranks, (line, nproc)
        check_inputs(cfg, nproc, nproc)
        if ranks <= 4:
            _, rows = _train_for_real(line, tmp_path, "--steps", "2", "--no-save",
                                      "--sample-tokens", "0")
            assert len(rows) == 2
    return check


def gpu_line(line, tmp_path, monkeypatch, capsys):
    """README's torchrun line (8 GPUs): 8 ranks, a valid layout, and it fits an 80 GB GPU by the
    launcher's memory check (the data file is the user's)."""
    argv = line.split("-m fastpar ", 1)[1].split()
    assert "--nproc-per-node 8" in line
    monkeypatch.setenv("WORLD_SIZE", "8")
    cfg, nproc = _launched(argv, monkeypatch)
    assert nproc == 8 and cfg.check_layout(8).sizes() == {"tp": 2, "pp": 2, "dp": 2, "cp": 1}
    check_memory(cfg, cfg.check_layout(8), 8, device_type="cuda", limit_gb=80.0)


def help_of(line, tmp_path, monkeypatch, capsys):
    """A command of README's table, or `--help`: it runs and answers (in this process)."""
    words = shlex.split(line)[1:]
    if words in ([], ["prepare-data"], ["generate"], ["export"], ["plan"]):
        words.append("--help")
    try:
        code = main(words)
    except SystemExit as e:             # argparse's --help
        code = e.code
    assert code == 0 and capsys.readouterr().out.strip()


def fast_tier(line, tmp_path, monkeypatch, capsys):
    """`python -m pytest -m fast` selects the development tier: most tests, none of the slow
    files."""
    out = _run("pytest", "--collect-only", "-q", "-m", "fast", "-p", "no:cacheprovider",
               str(Path(__file__).parent), cwd=tmp_path, timeout=120)
    picked = [x for x in out.stdout.splitlines() if "::" in x]
    assert len(picked) > 400 and not any("test_train.py::" in x for x in picked)


EXAMPLES = README.parent / "docs" / "examples" / "arithmetic.jsonl"


def _prepare_sft(tmp_path):
    _run("fastpar", "prepare-data", str(EXAMPLES), "--tokenizer", "bytes", "--out", "sft",
         cwd=tmp_path)


def sft_prepare(line, tmp_path, monkeypatch, capsys):
    """The fine-tuning walk-through's prepare-data: examples with masks (the answers trained)."""
    from fastpar.data.masks import read_mask

    out = _run(*line.replace("docs/examples/arithmetic.jsonl", str(EXAMPLES)).split(),
               cwd=tmp_path)
    assert "1900 example(s)" in out.stdout and "trained" in out.stdout
    mask = read_mask(tmp_path / "sft" / "train.bin")
    assert 0.1 < mask.mean() < 0.3


def sft_train(line, tmp_path, monkeypatch, capsys):
    """Its training line: packed documents by default; a few steps for real train only the
    answers (about 1 target in 6)."""
    _prepare_sft(tmp_path)
    monkeypatch.chdir(tmp_path)
    cfg, nproc = _launched(line.split()[1:], monkeypatch)
    assert cfg.pack_documents and cfg.data == "sft" and nproc == 2
    argv = [a for a in line.split() if a not in ("--out", "runs/sft")]
    _, rows = _train_for_real(" ".join(argv), tmp_path, "--steps", "3", "--no-save",
                              "--sample-tokens", "0")
    per_step = cfg.global_batch_size * cfg.seq_len
    assert all(0.1 * per_step < r["trained_tokens"] < 0.3 * per_step for r in rows), rows


def sft_generate(line, tmp_path, monkeypatch, capsys):
    """Its generate line, on a run of a few steps: the prompt, continued."""
    _prepare_sft(tmp_path)
    _run("fastpar", "train", "--data", "sft", "--seq-len", "64", "--steps", "1", "--out",
         "runs/sft", "--sample-tokens", "0", cwd=tmp_path)
    out = _run(*shlex.split(line), cwd=tmp_path)
    assert out.stdout.startswith("Q: 12 + 7 = ? A: ")


HANDLERS = {
    "fastpar": help_of,
    "fastpar train": default_run,
    "fastpar train --zero 1": layout_row(2),
    "fastpar train --zero 3": layout_row(2),
    "fastpar train --dp 4 --zero 3 --dp-shard 2": layout_row(4),
    "fastpar train --tp 2 --pp 2 --schedule 1f1b": layout_row(8),
    "fastpar train --tp 2 --pp 2 --dp 1 --schedule 1f1b": layout_row(4),
    "fastpar train --model tiny-moe --ep 2": layout_row(2),
    "fastpar train --pp 2 --dp 1 --schedule zb-v": layout_row(2),
    "fastpar train --pp 2 --dp 1 --schedule dualpipe-v": layout_row(2),
    "fastpar train --help": help_of,
    "fastpar info": help_of,
    "fastpar prepare-data": help_of,
    "fastpar generate": help_of,
    "fastpar export": help_of,
    "fastpar plan": help_of,
    "python -m pytest -m fast": fast_tier,
    "fastpar prepare-data docs/examples/arithmetic.jsonl --tokenizer bytes --out sft":
        sft_prepare,
    "fastpar train --data sft --seq-len 64 --steps 300 --out runs/sft": sft_train,
    'fastpar generate runs/sft --prompt "Q: 12 + 7 = ? A: " --max-new-tokens 4 --temperature 0':
        sft_generate,
}
# Run by CI itself (.ci/run: a fresh venv, this install, the README's test command).
BY_CI = {"python3 -m venv .venv", ". .venv/bin/activate", "pip install -r requirements-ci.txt",
         "pip install --no-build-isolation -e .", "python -m pytest"}


def _handler(command):
    if command.startswith("torchrun "):
        return gpu_line
    return HANDLERS.get(command)


def test_every_readme_command_has_a_test():
    commands = readme_commands()
    assert "fastpar train" in commands and any(c.startswith("torchrun") for c in commands)
    missing = [c for c in commands if c not in BY_CI and _handler(c) is None]
    assert not missing, f"README commands no test runs: {missing}"


@pytest.mark.parametrize("command", [c for c in readme_commands() if c not in BY_CI])
def test_readme_command(command, tmp_path, monkeypatch, capsys):
    _handler(command)(command, tmp_path, monkeypatch, capsys)
