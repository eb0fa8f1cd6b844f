"""Wrong configurations and inputs: each is one clear error and a non-zero exit, from every rank,
within seconds, before any collective runs - through the command line and the Python API."""
import json
import os
import shutil
import subprocess
import sys
import time

import pytest

from fastpar.models import GPT
from fastpar.testing import RankError, run_ranks
from fastpar.train import TrainConfig, save_checkpoint, write_token_file

SMALL = ["--seq-len", "32", "--global-batch-size", "8", "--micro-batch-size", "2"]


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    """Bad data files, and runs whose latest checkpoint is damaged in one way each."""
    root = tmp_path_factory.mktemp("inputs")
    (root / "empty.txt").write_bytes(b"")
    (root / "odd.bin").write_bytes(b"\x01\x00\x02")
    (root / "short.txt").write_text("ten bytes!")
    write_token_file(root / "tokens.bin", list(range(200)))
    cfg = TrainConfig(model="tiny")
    good = root / "good" / "checkpoints"
    save_checkpoint(good, 2, [GPT(cfg.model_config)], None, None,
                    {"data_step": 2, "model_config": cfg.model_config.to_dict(),
                     "layout": {"tp": 1, "pp": 1, "dp": 1}, "zero1": False})
    for name in ("corrupt", "truncated", "bad_manifest", "other_shape", "missing_shard"):
        shutil.copytree(root / "good", root / name)
    shard = "checkpoints/step_2/model_tp0_pp0.safetensors"
    data = bytearray((root / "corrupt" / shard).read_bytes())
    data[-10] ^= 0x55
    (root / "corrupt" / shard).write_bytes(bytes(data))
    (root / "truncated" / shard).write_bytes(bytes(data[:len(data) // 2]))
    (root / "missing_shard" / shard).unlink()
    (root / "bad_manifest/checkpoints/step_2/manifest.json").write_text('{"step": 2, ')
    manifest = root / "other_shape/checkpoints/step_2/manifest.json"
    m = json.loads(manifest.read_text())
    m["model_config"]["d_model"] = 64
    manifest.write_text(json.dumps(m))
    return root


# (arguments, what the one error line says); {data} is the inputs folder, {run} a run folder.
CLI_CASES = {
    "heads-not-divisible-by-tp": (["--tp", "3"], "n_heads=4 is not divisible by tp=3"),
    "batch-not-divisible": (["--global-batch-size", "10"],
                            "global batch 10 is not divisible by micro-batch size x dp"),
    "world-not-divisible": (["--tp", "2", "--nproc", "3"],
                            "world size 3 is not divisible by tp*pp = 2*1"),
    "world-size-mismatch": (["--dp", "4", "--nproc", "2"], "tp*pp*dp = 1*1*4 = 4 != world size 2"),
    "too-few-layers": (["--pp", "8", "--nproc", "8"], "fewer than pp x virtual stages = 8 x 1"),
    "virtual-without-interleaved": (["--virtual-stages", "2"], "needs --schedule interleaved"),
    "sp-seq-not-divisible": (["--tp", "2", "--sequence-parallel", "--seq-len", "33"],
                             "--seq-len=33 is not divisible by tp=2"),
    "negative-steps": (["--steps", "-1"], "--steps=-1 must be >= 1"),
    "zero-micro-batch": (["--micro-batch-size", "0"], "--micro-batch-size=0 must be >= 1"),
    "zero-seq-len": (["--seq-len", "0"], "--seq-len=0 must be >= 1"),
    "negative-save-every": (["--save-every", "-4"], "--save-every=-4 must be >= 0"),
    "negative-keep-last": (["--keep-last", "-1"], "--keep-last=-1 must be >= 0"),
    "zero-timeout": (["--timeout", "0"], "--timeout=0.0 must be > 0"),
    "zero-max-skipped": (["--max-skipped-steps", "0"], "--max-skipped-steps=0 must be >= 1"),
    "negative-restarts": (["--max-restarts", "-1"], "--max-restarts=-1 must be >= 0"),
    "zero-nproc": (["--nproc", "0"], "--nproc=0 must be >= 1"),
    "negative-lr": (["--lr", "-0.1"], "--lr=-0.1 must be > 0"),
    "unknown-model": (["--model", "gpt5"], "unknown model 'gpt5'"),
    "unknown-schedule": (["--schedule", "pipedream"], "--schedule='pipedream' is not one of"),
    "unknown-recompute": (["--recompute", "some"], "--recompute='some' is not one of"),
    "missing-data": (["--data", "{data}/nothing.txt"], "nothing.txt' does not exist"),
    "empty-data": (["--data", "{data}/empty.txt"], "empty.txt' is empty"),
    "odd-token-file": (["--data", "{data}/odd.bin"], "has an odd size: not uint16 tokens"),
    "data-shorter-than-seq": (["--data", "{data}/short.txt", "--seq-len", "64"],
                              "has 10 tokens, fewer than --seq-len + 2 = 66"),
    "tokens-shorter-than-seq": (["--data", "{data}/tokens.bin", "--seq-len", "256"],
                                "has 200 tokens, fewer than --seq-len + 2 = 258"),
    "corrupt-checkpoint": (["--resume", "--out", "{data}/corrupt"],
                           "model_tp0_pp0.safetensors is corrupt: its sha256 differs"),
    "truncated-checkpoint": (["--resume", "--out", "{data}/truncated"],
                             "the file is truncated or was replaced"),
    "missing-shard": (["--resume", "--out", "{data}/missing_shard"],
                      "model_tp0_pp0.safetensors is missing"),
    "bad-manifest": (["--resume", "--out", "{data}/bad_manifest"],
                     "manifest.json is not valid JSON"),
    "checkpoint-of-another-shape": (["--resume", "--out", "{data}/other_shape"],
                                    "is of another model shape: d_model 64 (saved) != 128"),
}


@pytest.mark.parametrize("name", list(CLI_CASES))
def test_cli_wrong_input_is_one_clear_error(name, inputs, tmp_path, capsys):
    from fastpar.cli import main

    args, needle = CLI_CASES[name]
    args = [a.replace("{data}", str(inputs)) for a in args]
    out = [] if "--out" in args else ["--out", str(tmp_path / "run")]
    t0 = time.monotonic()
    assert main(["train", *SMALL, *args, *out]) == 2
    err = capsys.readouterr().err
    assert needle in err and err.count("error") == 1 and len(err.splitlines()) == 1, err
    assert time.monotonic() - t0 < 10
    assert not (tmp_path / "run").exists()               # nothing started


@pytest.mark.parametrize("args,needle", [
    (["--stepz", "5"], "unrecognized arguments: --stepz"),
    (["--steps", "ten"], "argument --steps: invalid int value: 'ten'"),
])
def test_cli_unknown_option_or_bad_number(args, needle, capsys):
    from fastpar.cli import main

    with pytest.raises(SystemExit) as info:
        main(["train", *args])
    assert info.value.code == 2 and needle in capsys.readouterr().err


def test_command_exits_nonzero_within_seconds(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    t0 = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "fastpar", "train", "--dp", "4", "--nproc", "2",
                           "--out", str(tmp_path / "run")], env=env, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 2
    assert done.stderr.strip() == ("fastpar train: error: tp*pp*dp = 1*1*4 = 4 != world size 2")
    assert time.monotonic() - t0 < 30                    # mostly importing torch


def _api_cases(rank, world_size, data):
    """Each wrong call on every rank: (case, the error's type and message)."""
    import fastpar
    from fastpar.train import train

    small = dict(seq_len=32, global_batch_size=8, micro_batch_size=2, out=f"{data}/api{rank}")
    cases = {
        "train-world-mismatch": lambda: train(TrainConfig(dp=4, **small)),
        "config-unknown-field": lambda: TrainConfig(model="tiny", n_heads=3),
        "config-zero-tp": lambda: TrainConfig(tp=0),
        "config-unknown-model": lambda: TrainConfig(model="nope"),
        "config-min-lr-above-lr": lambda: TrainConfig(lr=1e-3, min_lr=1e-2),
        "train-missing-data": lambda: train(TrainConfig(data=f"{data}/nothing", **small)),
        "train-truncated-checkpoint": lambda: train(TrainConfig(
            **dict(small, out=f"{data}/truncated", resume=True))),
        "init-tp-does-not-divide": lambda: fastpar.init(tp=3),
        "init-unknown-backend": lambda: fastpar.init(backend="mpi"),
        "init-zero-timeout": lambda: fastpar.init(timeout=0),
    }
    out = {}
    for name, call in cases.items():
        t0 = time.monotonic()
        try:
            call()
            out[name] = "no error"
        except Exception as e:  # noqa: BLE001 - the type is part of the answer
            out[name] = (type(e).__name__, str(e), time.monotonic() - t0)
    out["collectives-started"] = torch_distributed_initialized()
    return out


def torch_distributed_initialized():
    import torch.distributed as dist

    return dist.is_initialized()


API_NEEDLES = {
    "train-world-mismatch": "tp*pp*dp = 1*1*4 = 4 != world size 2",
    "config-unknown-field": "unexpected keyword argument 'n_heads'",
    "config-zero-tp": "--tp=0 must be >= 1",
    "config-unknown-model": "unknown model 'nope'",
    "config-min-lr-above-lr": "--min-lr=0.01 is above --lr=0.001",
    "train-missing-data": "nothing' does not exist",
    "train-truncated-checkpoint": "the file is truncated or was replaced",
    "init-tp-does-not-divide": "world_size=2 is not divisible by tp*pp = 3*1 = 3",
    "init-unknown-backend": "backend='mpi' is not one of",
    "init-zero-timeout": "timeout=0s must be > 0",
}


def test_python_api_wrong_input_is_one_clear_error_on_every_rank(inputs):
    results = run_ranks(_api_cases, 2, str(inputs), init_pg=False, timeout=60)
    for rank, out in enumerate(results):
        assert out.pop("collectives-started") is False, rank     # all refused before init
        for name, needle in API_NEEDLES.items():
            kind, msg, took = out[name]
            assert needle in msg, (rank, name, msg)
            assert kind in ("ValueError", "CheckpointError", "TypeError"), (rank, name, kind)
            assert took < 5, (rank, name, took)
    assert len(API_NEEDLES) + len(CLI_CASES) >= 20


def _train_world_mismatch(rank, world_size, out):
    from fastpar.train import train

    train(TrainConfig(dp=4, out=out))


def test_every_rank_exits_nonzero_on_a_wrong_layout(tmp_path):
    t0 = time.monotonic()
    with pytest.raises(RankError) as info:
        run_ranks(_train_world_mismatch, 2, str(tmp_path), init_pg=False, timeout=60)
    assert sorted(info.value.failures) == [0, 1]
    for msg in info.value.failures.values():
        assert "ValueError: tp*pp*dp = 1*1*4 = 4 != world size 2" in msg
    assert time.monotonic() - t0 < 30
