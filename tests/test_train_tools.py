"""`fastpar train`'s tools: the validation loss (its value checked against the held-out batches
recomputed from the final checkpoint), tensorboard logging, per-rank profiler traces with
fastpar's ranges named, and their bad inputs."""
import json
import math

import pytest

from fastpar.testing import run_ranks
from test_train_cli import SMALL, _one_error, _train


def _rows(folder):
    return [json.loads(x) for x in (folder / "metrics.jsonl").read_text().splitlines()]


def _held_out_loss(rank, world_size, ckpt, batches):
    """The mean loss of the final model on held-out batches, recomputed outside the trainer:
    the checkpoint loaded into a fresh GPT, plain cross-entropy over its logits."""
    import torch
    import torch.nn.functional as F

    import fastpar
    from fastpar.models import GPT, get_config
    from fastpar.train import load_checkpoint
    from fastpar.data.sources import BatchSampler, load_tokens

    mesh = fastpar.init(tp=1, pp=1, dp=1)
    model = GPT(get_config("tiny"))
    load_checkpoint(ckpt, [model], None, mesh)
    sampler = BatchSampler(load_tokens(None, split="val"), 32, 8, seed=0)
    losses = []
    with torch.no_grad():
        for k in range(batches):
            x, y = sampler.batch(k)
            z = model(x)[..., :256]                      # the padded vocabulary cut off
            losses.append(F.cross_entropy(z.reshape(-1, 256), y.reshape(-1)).item())
    return sum(losses) / len(losses)


def test_validation_loss_and_tensorboard(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run = tmp_path / "run"
    out = _train("--steps", "5", "--eval-every", "2", "--eval-batches", "3", "--tensorboard",
                 "--out", str(run), cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = _rows(run)
    evaluated = [r for r in rows if "val_loss" in r]
    assert [r["step"] for r in evaluated] == [2, 4, 5]        # every 2 steps, and the last
    for r in evaluated:
        assert r["val_ppl"] == pytest.approx(math.exp(r["val_loss"]), rel=1e-12)
    assert evaluated[-1]["val_loss"] < evaluated[0]["val_loss"]
    assert "val loss" in out.stdout
    # The number is the final model's mean loss over the split's first 3 held-out batches.
    direct = run_ranks(_held_out_loss, 1, str(run / "checkpoints" / "step_5"), 3)[0]
    assert evaluated[-1]["val_loss"] == pytest.approx(direct, rel=1e-5)
    # tensorboard holds the same scalars.
    acc = EventAccumulator(str(run / "tensorboard"))
    acc.Reload()
    assert {"loss", "lr", "val_loss", "val_ppl", "tokens_per_s"} <= set(acc.Tags()["scalars"])
    assert [e.step for e in acc.Scalars("loss")] == [1, 2, 3, 4, 5]
    assert [e.value for e in acc.Scalars("loss")] == pytest.approx([r["loss"] for r in rows],
                                                                   rel=1e-6)
    assert [e.step for e in acc.Scalars("val_loss")] == [r["step"] for r in evaluated]
    assert [e.value for e in acc.Scalars("val_loss")] == pytest.approx(
        [r["val_loss"] for r in evaluated], rel=1e-6)


def test_profile_steps_write_a_trace_per_rank_with_fastpar_ranges(tmp_path):
    run = tmp_path / "run"
    out = _train("--steps", "3", "--tp", "2", "--pp", "2", "--dp", "1", "--profile-steps", "2:3",
                 "--no-save", "--out", str(run), cwd=tmp_path, nproc=4, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "profiled steps 2:3" in out.stdout and "perfetto" in out.stdout
    for rank in range(4):
        events = json.loads((run / "profile" / "steps-2-3" / f"rank{rank}.json").read_text())[
            "traceEvents"]
        names = {e.get("name", "") for e in events}
        ours = {n for n in names if n.startswith("fastpar: ")}
        assert {"fastpar: step 2", "fastpar: step 3", "fastpar: optimizer step"} <= ours, rank
        assert "fastpar: step 1" not in ours                    # only the steps asked for
        assert {"fastpar: pipeline F0", "fastpar: pipeline B0"} <= ours, sorted(ours)
        assert any(n.startswith("fastpar: pipeline SEND_") or n.startswith("fastpar: pipeline RECV_")
                   for n in ours), sorted(ours)
        assert any(n.startswith("fastpar: tp ") for n in ours), sorted(ours)
        assert any("gloo" in n for n in names), "the collectives themselves are recorded"
    assert not list(run.rglob("*.tmp"))


@pytest.mark.parametrize("args,needle", [
    (["--profile-steps", "5:3"], "--profile-steps='5:3' must be A:B with 1 <= A <= B <= --steps"),
    (["--profile-steps", "2"], "--profile-steps='2' must be A:B"),
    (["--eval-batches", "0"], "--eval-batches=0 must be >= 1"),
    (["--eval-every", "-2"], "--eval-every=-2 must be >= 0"),
])
def test_bad_tool_flags_are_one_clear_error(tmp_path, capsys, args, needle):
    from fastpar.cli import main

    assert main(["train", "--steps", "4", *args, "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert needle in err and err.count("error") == 1, err
    assert not (tmp_path / "run").exists()


def test_tensorboard_missing_is_one_clear_error(tmp_path, capsys, monkeypatch):
    import importlib.util

    from fastpar.cli import main

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "tensorboard" else real(name, *a))
    assert main(["train", "--tensorboard", "--out", str(tmp_path / "run")]) == 2
    assert "--tensorboard needs the tensorboard package" in capsys.readouterr().err


def test_a_validation_split_too_short_is_refused_before_any_rank(tmp_path):
    text = tmp_path / "small.txt"
    text.write_text("x" * 400)            # 380 training tokens, 20 held out: fewer than 34
    out = _train("--data", str(text), "--eval-every", "2", "--out", str(tmp_path / "run"),
                 cwd=tmp_path)
    _one_error(out, "val")
    assert not (tmp_path / "run").exists()


def test_profile_window():
    from fastpar.train import TrainConfig

    assert TrainConfig(profile_steps="3:5", steps=10).profile_window == (3, 5)
    assert TrainConfig().profile_window is None


def test_prepared_data_trains_a_model_of_its_vocabulary(tmp_path):
    from fastpar.data.sources import data_vocab
    from fastpar.data.prepare import prepare_data

    texts = tmp_path / "texts"
    texts.mkdir()
    for i in range(6):
        (texts / f"doc{i}.txt").write_text(f"document {i}: the quick brown fox jumps. " * 40)
    prepare_data([str(texts)], "gpt2", tmp_path / "data", vocab_size=300)
    vocab = data_vocab(str(tmp_path / "data"))        # what BPE learned of this little text
    assert 256 < vocab <= 300
    out = _train("--data", "data", "--steps", "3", "--out", "a", cwd=tmp_path)
    _one_error(out, f"was tokenized with a vocabulary of {vocab}, but model 'tiny' has 256")
    assert f"--vocab-size {vocab}" in out.stderr
    out = _train("--data", "data", "--vocab-size", str(vocab), "--steps", "3", "--eval-every",
                 "3", "--out", "b", cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "val loss" in out.stdout and "fastpar train: sample" in out.stdout
    assert json.loads((tmp_path / "b" / "config.json").read_text())["model"]["vocab_size"] == vocab


def _layouts_made(rank, world_size, out, kwargs):
    """How many Layouts this rank makes through a whole launch (torchrun's path: the launcher's
    checks, then training), and the mesh's layout is the one the checks made."""
    import importlib

    import fastpar
    from fastpar.train import TrainConfig
    from fastpar.train.launch import launch

    module = importlib.import_module("fastpar.mesh.layout")
    made, meshes, original = [], [], module.Layout.__post_init__
    init = fastpar.init

    def counted(self, world_name):
        made.append(self)
        original(self, world_name)

    def recorded(**kw):
        meshes.append(init(**kw))
        return meshes[-1]
    module.Layout.__post_init__ = counted
    fastpar.init = recorded
    launch(TrainConfig(steps=1, seq_len=32, global_batch_size=4, micro_batch_size=2, out=out,
                       no_save=True, sample_tokens=0, no_memory_check=True, **kwargs),
           world_size)
    return len(made), meshes[0].layout is made[0], meshes[0].layout.sizes()


@pytest.mark.parametrize("kwargs", [dict(tp=2), dict(cp=2)])
def test_a_launch_sizes_its_layout_once(tmp_path, kwargs):
    """The launcher's checks make the run's Layout; training, fastpar.init and the checkpoint
    use that object (the memory estimate, left out here, goes through the planner's entry,
    which checks what it is given)."""
    out = run_ranks(_layouts_made, 2, str(tmp_path / "run"), kwargs, init_pg=False, timeout=120)
    sizes = {"tp": 1, "pp": 1, "dp": 1, "cp": 1, **kwargs}
    assert out == [(1, True, sizes)] * 2
