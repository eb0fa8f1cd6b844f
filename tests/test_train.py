"""The trainer: every layout's loss curve and validation loss equal the single-process ones;
resume; the CLI."""
import json
import shutil

import pytest
import torch

from fastpar.testing import run_ranks
from fastpar.train import TrainConfig

BASE = dict(model="tiny", seq_len=32, global_batch_size=8, micro_batch_size=2, steps=20,
            warmup_steps=3, log_every=100)
# The layouts' curves: 10 steps, validation after steps 5 and 10.
EVAL = dict(steps=10, eval_every=5, eval_batches=2)


def _train(rank, world_size, kwargs):
    from fastpar.train import train

    return [{k: r[k] for k in ("loss", "val_loss") if k in r} for r in train(TrainConfig(**kwargs))]


def _rows(world, out, **kwargs):
    cfg = dict(BASE, out=str(out), **kwargs)
    return run_ranks(_train, world, cfg, init_pg=False, timeout=240)[0]


def _losses(world, out, **kwargs):
    return [r["loss"] for r in _rows(world, out, **kwargs)]


@pytest.fixture(scope="module")
def reference_rows(tmp_path_factory):
    return _rows(1, tmp_path_factory.mktemp("ref"), **EVAL)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The single process's 20 steps (what the checkpoint tests resume at step 10)."""
    return _losses(1, tmp_path_factory.mktemp("ref20"))


LAYOUTS = {
    "tp2": (2, dict(tp=2)),
    # 4 micro-batches: 3 interleaved, then 1 (the groups' backwards accumulate)
    "tp2-il3": (2, dict(tp=2, interleave=3)),
    "pp2-1f1b": (2, dict(pp=2, schedule="1f1b")),
    "pp2-zbh1": (2, dict(pp=2, schedule="zb-h1")),
    "dp2": (2, dict(dp=2)),
    "tp2-pp2": (4, dict(tp=2, pp=2)),
    "dp2-tp2-sp": (4, dict(tp=2, dp=2, sequence_parallel=True)),
    "dp2-tp2-pp2": (8, dict(tp=2, pp=2, dp=2)),
    # Context parallelism: each sequence split over cp ranks, attention by the key/value ring
    # (cp4: tests/test_cp_model.py; cp x dp: cp2-dp2-zero3 below).
    "cp2": (2, dict(cp=2)),
    "cp2-tp2-sp": (4, dict(cp=2, tp=2, sequence_parallel=True)),
    "cp2-pp2": (4, dict(cp=2, pp=2)),
    # ZeRO-2 (dp2 with 2 micro-batches accumulated whole: resumed under it in
    # test_zero_checkpoints_...): one micro-batch per step (whole gradients freed before every
    # forward), and with pp.
    "dp4-zero2": (4, dict(dp=4, zero=2)),
    "pp2-dp2-zero2": (4, dict(pp=2, dp=2, zero=2)),
    # ZeRO-3: every block a unit gathered around its use; with tp and sequence parallelism,
    # and with pp (each stage's blocks; zero-bubble's split backward) and full recompute.
    "tp2-dp2-sp-zero3": (4, dict(tp=2, dp=2, sequence_parallel=True, zero=3)),
    "pp2-dp2-zbh1-zero3": (4, dict(pp=2, dp=2, schedule="zb-h1", zero=3, recompute="full")),
    # (HSDP's curve: test_zero_checkpoints_..., resumed under it)
    # ZeRO under context parallelism: sharded over dp x cp, the ranks whose gradients are averaged.
    "cp2-dp2-zero3": (4, dict(cp=2, dp=2, zero=3)),
    # HSDP under CP: each dp rank's two cp ranks shard, the two dp ranks replicate.
    "cp2-dp2-zero3-hsdp1": (4, dict(cp=2, dp=2, zero=3, dp_shard=1)),
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_loss_curve_equals_single_process(name, reference_rows, tmp_path):
    world, kwargs = LAYOUTS[name]
    rows = _rows(world, tmp_path, **EVAL, **kwargs)
    assert len(rows) == len(reference_rows)
    for step, (a, b) in enumerate(zip(rows, reference_rows), 1):
        assert abs(a["loss"] - b["loss"]) <= 1e-5 * b["loss"], f"{name} step {step}: {a} vs {b}"
        assert a.keys() == b.keys() == ({"loss", "val_loss"} if step % 5 == 0 else {"loss"})
        if "val_loss" in b:     # the held-out loss, forward only (the pipeline's too)
            assert abs(a["val_loss"] - b["val_loss"]) <= 1e-5 * b["val_loss"], (name, step, a, b)
    assert reference_rows[-1]["loss"] < reference_rows[0]["loss"]
    assert reference_rows[-1]["val_loss"] < reference_rows[4]["val_loss"]


def _params(ckpt):
    from safetensors.torch import load_file

    return load_file(str(ckpt / "model_tp0_pp0.safetensors"))


def test_resume_continues_exactly_and_across_layouts(tmp_path):
    ckpt = tmp_path / "checkpoints"
    whole = _losses(1, tmp_path, steps=40, save_every=20)       # uninterrupted, 40 steps
    final = _params(ckpt / "step_40")
    # Stop after step 20: only its checkpoint is left. Resume on the same layout...
    shutil.rmtree(ckpt / "step_40")
    resumed = _losses(1, tmp_path, steps=40, resume=True)
    assert resumed == pytest.approx(whole[20:], rel=1e-6)
    for name, t in _params(ckpt / "step_40").items():
        assert torch.allclose(t, final[name], atol=1e-6), name
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 41))
    # ... and on a tp=2 x pp=2 layout: the same losses.
    shutil.rmtree(ckpt / "step_40")
    resumed = _losses(4, tmp_path, steps=40, tp=2, pp=2, resume=True)
    for a, b in zip(resumed, whole[20:], strict=True):
        assert abs(a - b) <= 1e-5 * abs(b)
    assert whole[:20] != pytest.approx(resumed, rel=1e-3)         # not the first half again


@pytest.mark.parametrize("args,needle", [
    (["--tp", "3"], "n_heads=4 is not divisible by tp=3"),
    (["--pp", "8", "--nproc", "8"], "fewer than pp x virtual stages = 8 x 1"),
    (["--global-batch-size", "10"], "global batch 10 is not divisible by micro-batch size x dp"),
    (["--steps", "-1"], "--steps=-1 must be >= 1"),
    (["--schedule", "pipedream"], "--schedule='pipedream'"),
    (["--data", "/nonexistent/corpus.txt"], "does not exist"),
    (["--model", "gpt5"], "unknown model 'gpt5'"),
    (["--cp", "2", "--seq-len", "30"], "sequence length 30 is not divisible by 2 x cp = 4"),
    (["--dp-shard", "2"], "--dp-shard=2 shards ZeRO state: it needs --zero 1, 2 or 3"),
    (["--dp", "4", "--zero", "3", "--dp-shard", "3"], "--dp-shard=3 must divide dp=4"),
    (["--zero", "4"], "--zero=4 is not one of (0, 1, 2, 3)"),
])
def test_cli_bad_input_is_one_clear_error(tmp_path, capsys, args, needle):
    from fastpar.cli import main

    # Every check runs before any rank starts, so the command returns at once.
    assert main(["train", *args, "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert needle in err and err.count("error") == 1, err


def test_zero_checkpoints_resume_in_any_layout_and_zero_stage(reference, tmp_path,
                                                              tmp_path_factory):
    """A sharded optimizer saves its masters and moments per parameter (gathered over dp): a
    ZeRO-3 run at dp=2 (its curve the single-process one) fine-tunes from its checkpoint under
    ZeRO-3 as one process does, resumes on the same curve at ZeRO-1
    dp=4 and without ZeRO at dp=1, and a run without ZeRO resumes under ZeRO-2 (the
    moments sliced into the new shards) and under HSDP (ZeRO-3 over pairs of dp ranks, replicated
    across the two pairs)."""
    ckpt = tmp_path / "checkpoints"
    first = _losses(2, tmp_path, dp=2, zero=3, save_every=10)
    for a, b in zip(first, reference, strict=True):
        assert abs(a - b) <= 1e-5 * abs(b)
    manifest = json.loads((ckpt / "step_10" / "manifest.json").read_text())
    assert not manifest["zero1"] and not list((ckpt / "step_10").glob("rank*.safetensors"))
    # Fine-tuning from it under ZeRO-3 (each unit filled from the checkpoint in turn on a
    # model built on the meta device) follows the single process's fine-tuning curve.
    tune = dict(init_from=str(ckpt / "step_10"), steps=4, warmup_steps=1, no_save=True)
    alone = _losses(1, tmp_path_factory.mktemp("tune1"), **tune)
    sharded = _losses(2, tmp_path_factory.mktemp("tune3"), dp=2, zero=3, **tune)
    for a, b in zip(sharded, alone, strict=True):
        assert abs(a - b) <= 1e-5 * abs(b)
    for kwargs in (dict(dp=4, zero=1), dict(dp=1)):
        shutil.rmtree(ckpt / "step_20")
        world = kwargs.get("dp", 1) * kwargs.get("tp", 1)
        resumed = _losses(world, tmp_path, resume=True, **kwargs)
        for a, b in zip(resumed, reference[10:], strict=True):
            assert abs(a - b) <= 1e-5 * abs(b), kwargs
    # The older per-rank shard format is refused with one message, not loaded half-way.
    manifest_file = ckpt / "step_10" / "manifest.json"
    manifest_file.write_text(json.dumps({**manifest, "zero1": True}))
    shutil.rmtree(ckpt / "step_20", ignore_errors=True)
    with pytest.raises(Exception, match="per-rank shard files, a format no longer read"):
        _losses(2, tmp_path, resume=True, dp=2, zero=1)
    plain = tmp_path / "plain"             # written without ZeRO, resumed under ZeRO-2 and 3
    _losses(1, plain, save_every=10)
    for kwargs in (dict(dp=2, zero=2), dict(dp=4, zero=3, dp_shard=2)):
        shutil.rmtree(plain / "checkpoints" / "step_20")
        resumed = _losses(kwargs["dp"], plain, resume=True, **kwargs)
        for a, b in zip(resumed, reference[10:], strict=True):
            assert abs(a - b) <= 1e-5 * abs(b), kwargs


def test_cp_checkpoint_resumes_without_cp(reference, tmp_path):
    """CP ranks hold the same weights: a cp=2 checkpoint (written by cp rank 0) resumes at
    cp=1 on the same curve."""
    first = _losses(2, tmp_path, cp=2, save_every=10)
    for a, b in zip(first, reference, strict=True):
        assert abs(a - b) <= 1e-5 * abs(b)
    manifest = json.loads((tmp_path / "checkpoints" / "step_10" / "manifest.json").read_text())
    assert manifest["layout"]["cp"] == 2
    shutil.rmtree(tmp_path / "checkpoints" / "step_20")
    resumed = _losses(1, tmp_path, resume=True)
    for a, b in zip(resumed, reference[10:], strict=True):
        assert abs(a - b) <= 1e-5 * abs(b)


# bf16 autocast over fp32 weights (--precision amp), per layout; --precision bf16 (bf16
# parameters, fp32 main gradients and masters) is tests/test_mixed_precision.py.
AMP_LAYOUTS = {
    "tp2": (2, dict(tp=2)),
    "tp2-sp": (2, dict(tp=2, sequence_parallel=True)),
    "pp2": (2, dict(pp=2, schedule="1f1b")),
    "zero1": (2, dict(dp=2, zero=1)),
}
SHORT = dict(steps=5, warmup_steps=2)


@pytest.fixture(scope="module")
def reference_short(tmp_path_factory):
    return _losses(1, tmp_path_factory.mktemp("ref_short"), **SHORT)


@pytest.mark.parametrize("name", list(AMP_LAYOUTS))
def test_layout_trains_under_bf16_autocast_close_to_fp32(name, reference_short, tmp_path):
    world, kwargs = AMP_LAYOUTS[name]
    losses = _losses(world, tmp_path, precision="amp", **SHORT, **kwargs)
    errors = [abs(a - b) / b for a, b in zip(losses, reference_short, strict=True)]
    # bf16 rounding of the GEMMs moves a tiny model's loss by ~0.1-0.3% over 5 steps.
    assert all(e < 1e-2 for e in errors), f"{name}: bf16 {losses} vs fp32 {reference_short}"
    assert max(errors) > 1e-6, f"{name}: identical to fp32, autocast did not run"


def test_precision_is_checked():
    with pytest.raises(ValueError, match="--precision='fp16' is not one of"):
        TrainConfig(precision="fp16")
    assert TrainConfig(precision="auto").autocast("cuda") and not TrainConfig().autocast("cpu")
    assert TrainConfig(precision="amp").autocast("cpu")
    assert not TrainConfig(precision="fp32").autocast("cuda")


def test_no_save_writes_no_checkpoint(tmp_path):
    losses = _losses(1, tmp_path, steps=2, no_save=True)
    assert len(losses) == 2
    ckpt = tmp_path / "checkpoints"
    assert not ckpt.exists() or not any(ckpt.iterdir())
    with pytest.raises(ValueError, match="--no-save contradicts --save-every=5"):
        TrainConfig(no_save=True, save_every=5)
