"""Checkpoint safety: checksums, corrupt and truncated files, killed saves, retention, async."""
import json
import threading

import pytest
import torch

from fastpar.models import GPT, GPTConfig
from fastpar.testing import RankError, run_ranks
from fastpar.train import TrainConfig
from fastpar.train.checkpoint import CheckpointError, latest_checkpoint, load_checkpoint, \
    read_manifest, verify_checkpoint
from fastpar.train.checkpoint_writer import CheckpointWriter, save_checkpoint

CFG = dict(vocab_size=64, n_layers=2, d_model=32, n_heads=4, max_seq_len=8, pad_vocab_to=64)


def _model_and_opt(seed=0):
    model = GPT(GPTConfig(**CFG, init_seed=seed))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    tokens = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(1))
    model(tokens[:, :-1], tokens[:, 1:]).backward()
    opt.step()
    return model, opt


@pytest.fixture
def saved(tmp_path):
    model, opt = _model_and_opt()
    path = save_checkpoint(tmp_path, 3, [model], opt, None, {"data_step": 3})
    return path, model


def test_manifest_holds_size_and_sha256_of_every_file(saved):
    path, _ = saved
    files = read_manifest(path)["files"]
    on_disk = {f.name for f in path.iterdir()} - {"manifest.json"}
    assert set(files) == on_disk == {"model_tp0_pp0.safetensors", "index_tp0_pp0.json",
                                     "rng_rank0.safetensors"}
    for name, entry in files.items():
        assert entry["bytes"] == (path / name).stat().st_size and len(entry["sha256"]) == 64
    verify_checkpoint(path)


@pytest.mark.parametrize("damage,needle", [
    ("flip", "model_tp0_pp0.safetensors is corrupt: its sha256 differs"),
    ("truncate", "model_tp0_pp0.safetensors holds 100 bytes, the manifest says"),
    ("delete", "model_tp0_pp0.safetensors is missing"),
])
def test_damaged_shard_is_one_clear_error_naming_the_file(saved, damage, needle):
    path, model = saved
    shard = path / "model_tp0_pp0.safetensors"
    data = bytearray(shard.read_bytes())
    if damage == "flip":
        data[len(data) // 2] ^= 0xFF
        shard.write_bytes(bytes(data))
    elif damage == "truncate":
        shard.write_bytes(bytes(data[:100]))
    else:
        shard.unlink()
    fresh = GPT(GPTConfig(**CFG, init_seed=5))
    with pytest.raises(CheckpointError, match=needle):
        load_checkpoint(path, [fresh], None, None)
    with pytest.raises(CheckpointError, match=needle):
        verify_checkpoint(path)


def test_bad_manifest_is_a_clear_error(saved):
    path, _ = saved
    (path / "manifest.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="manifest.json is not valid JSON"):
        load_checkpoint(path, [GPT(GPTConfig(**CFG))], None, None)


def test_keep_last_n_and_partial_folders_are_ignored_then_removed(tmp_path):
    model, opt = _model_and_opt()
    writer = CheckpointWriter(tmp_path, None, keep_last=2)
    (tmp_path / "step_9.tmp-4").mkdir()          # a save that was killed
    assert latest_checkpoint(tmp_path) is None
    for step in (1, 2, 3, 4):
        writer.save(step, [model], opt, {"data_step": step})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step_3", "step_4"]
    assert (tmp_path / "latest").read_text() == "step_4"


def test_async_save_copies_first_and_writes_in_the_background(tmp_path):
    model, opt = _model_and_opt()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    release = threading.Event()
    writer = CheckpointWriter(tmp_path, None, async_save=True,
                              before_commit=lambda step: release.wait(30))
    writer.save(1, [model], opt, {"data_step": 1})
    assert latest_checkpoint(tmp_path) is None           # still being written
    with torch.no_grad():                                  # training goes on meanwhile
        for p in model.parameters():
            p.add_(1.0)
    release.set()
    assert writer.wait() == tmp_path / "step_1"
    loaded = GPT(GPTConfig(**CFG, init_seed=7))
    load_checkpoint(tmp_path / "step_1", [loaded], None, None)
    for name, p in loaded.named_parameters():
        assert p.equal(before[name]), name


def _train(rank, world_size, kwargs):
    from fastpar.train import train

    return [r["loss"] for r in train(TrainConfig(**kwargs))]


def test_killed_save_leaves_the_previous_checkpoint_and_resume_skips_the_partial(tmp_path):
    cfg = dict(model="tiny", seq_len=32, global_batch_size=4, micro_batch_size=2, steps=4,
               warmup_steps=1, log_every=100, save_every=2, out=str(tmp_path))
    with pytest.raises(RankError, match="without reporting"):
        run_ranks(_train, 1, cfg, init_pg=False, timeout=90,
                  env={"FASTPAR_FAULT": "kill-save@4"})
    ckpts = tmp_path / "checkpoints"
    partial = [p.name for p in ckpts.glob("step_4.tmp-*")]
    assert partial and (ckpts / partial[0] / "model_tp0_pp0.safetensors").exists()
    assert latest_checkpoint(ckpts).name == "step_2"
    verify_checkpoint(ckpts / "step_2")
    resumed = run_ranks(_train, 1, dict(cfg, resume=True), init_pg=False, timeout=90)[0]
    assert len(resumed) == 2
    assert sorted(p.name for p in ckpts.iterdir()) == ["latest", "step_2", "step_4"]
    assert json.loads((ckpts / "step_4" / "manifest.json").read_text())["data_step"] == 4
