"""Hugging Face checkpoints: Llama and GPT-2 directories load into fastpar's GPT on any layout
with transformers' own logits, export back to what transformers loads, and round-trip bit for
bit. transformers is a test-only dependency; every model is a tiny random config saved locally."""
import json

import pytest
import torch
import torch.distributed as dist
import transformers

from fastpar.models import GPT
from fastpar.models.hf import HFShardReader, config_from_hf, load_hf, save_hf
from fastpar.testing import run_ranks

VOCAB = 300         # not a multiple of the 128 fastpar pads to: the last shard holds padding


def _save(kind: str, path, tied: bool = False):
    torch.manual_seed(0)
    if kind == "llama":
        cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96,
                                       num_hidden_layers=2, num_attention_heads=4,
                                       num_key_value_heads=2, max_position_embeddings=64,
                                       rope_theta=5000.0, rms_norm_eps=1e-6,
                                       tie_word_embeddings=tied)
        model = transformers.LlamaForCausalLM(cfg)
    else:
        cfg = transformers.GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4,
                                      n_positions=64)
        model = transformers.GPT2LMHeadModel(cfg)
    model.eval().save_pretrained(path)
    return model


def _tokens():
    return torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(1))


def _fastpar(path, **kw):
    model = GPT(config_from_hf(json.loads((path / "config.json").read_text())), **kw).eval()
    load_hf(path, [model], kw.get("tp_group") and dist.get_world_size(kw["tp_group"]) or 1,
            kw.get("tp_group") and dist.get_rank(kw["tp_group"]) or 0)
    return model


@pytest.mark.parametrize("kind, tied", [("llama", False), ("llama", True), ("gpt2", True)])
def test_import_matches_transformers_and_export_round_trips(tmp_path, kind, tied):
    from safetensors.torch import load_file

    ref = _save(kind, tmp_path / "hf", tied)
    model = _fastpar(tmp_path / "hf")
    x = _tokens()
    with torch.no_grad():
        want = ref(x).logits
        torch.testing.assert_close(model(x)[..., :VOCAB], want, atol=1e-5, rtol=0)
        save_hf(model, tmp_path / "out")
        back = type(ref).from_pretrained(tmp_path / "out").eval()
        torch.testing.assert_close(back(x).logits, want, atol=1e-5, rtol=0)
    a, b = load_file(tmp_path / "hf" / "model.safetensors"), load_file(tmp_path / "out" /
                                                                        "model.safetensors")
    assert sorted(a) == sorted(b)
    for name in a:
        assert torch.equal(a[name], b[name]), name


def _tp2_ranks(rank, world_size, path, kind):
    from pathlib import Path

    path = Path(path)
    ref = (transformers.LlamaForCausalLM if kind == "llama" else
           transformers.GPT2LMHeadModel).from_pretrained(path).eval()
    model = _fastpar(path, tp_group=dist.group.WORLD)
    x = _tokens()
    with torch.no_grad():
        want, got = ref(x).logits, model(x)                    # got: this rank's vocab shard
    shard = got.shape[-1]
    lo, hi = rank * shard, min((rank + 1) * shard, VOCAB)
    torch.testing.assert_close(got[..., :hi - lo], want[..., lo:hi], atol=1e-5, rtol=0)
    assert torch.isinf(got[..., hi - lo:]).all()               # padding is never predicted


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_import_at_tp2_matches_transformers(tmp_path, kind):
    _save(kind, tmp_path)
    run_ranks(_tp2_ranks, 2, str(tmp_path), kind, timeout=120)


def test_import_into_two_pipeline_stages_matches_transformers(tmp_path):
    ref = _save("llama", tmp_path)
    cfg = config_from_hf(json.loads((tmp_path / "config.json").read_text()))
    first = GPT(cfg, layers=range(0, 1), post_process=False).eval()
    last = GPT(cfg, layers=range(1, 2), pre_process=False).eval()
    load_hf(tmp_path, [first])
    load_hf(tmp_path, [last])
    x = _tokens()
    with torch.no_grad():
        torch.testing.assert_close(last(first(x))[..., :VOCAB], ref(x).logits, atol=1e-5, rtol=0)


def test_sharded_checkpoint_with_index_loads(tmp_path):
    ref = _save("llama", tmp_path / "one")
    ref.save_pretrained(tmp_path / "many", max_shard_size="40KB")
    assert len(list((tmp_path / "many").glob("*.safetensors"))) > 1
    x = _tokens()
    with torch.no_grad():
        torch.testing.assert_close(_fastpar(tmp_path / "many")(x), _fastpar(tmp_path / "one")(x),
                                   atol=0, rtol=0)


@pytest.mark.parametrize("change, words", [
    (lambda c: c.update(model_type="mistral"), ["model_type='mistral'"]),
    (lambda c: c.update(hidden_act="gelu"), ["hidden_act='gelu'"]),
    (lambda c: c.update(rope_scaling={"rope_type": "linear", "factor": 2.0}), ["rope_scaling"]),
    (lambda c: c.update(intermediate_size=128), ["_proj.weight", "[96, 64]", "[128, 64]"]),
])
def test_unsupported_or_mismatched_config_is_one_clear_error(tmp_path, change, words):
    _save("llama", tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    change(cfg)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError) as err:
        model = GPT(config_from_hf(cfg))
        load_hf(tmp_path, [model])
    for w in words:
        assert w in str(err.value)


def test_missing_or_truncated_shard_is_one_clear_error(tmp_path):
    ref = _save("llama", tmp_path)
    ref.save_pretrained(tmp_path, max_shard_size="40KB")
    (tmp_path / "model.safetensors").unlink(missing_ok=True)
    shards = sorted(tmp_path.glob("model-*.safetensors"))
    shards[0].write_bytes(shards[0].read_bytes()[:100])
    with pytest.raises(ValueError, match="not a readable safetensors file"):
        _fastpar(tmp_path)
    shards[0].unlink()
    with pytest.raises(ValueError, match=f"shard {shards[0].name} named by the index is missing"):
        _fastpar(tmp_path)


def _train(rank, world_size, kwargs):
    from fastpar.train import TrainConfig, train

    return [r["loss"] for r in train(TrainConfig(**kwargs))]


FINE_TUNE = dict(seq_len=32, global_batch_size=4, micro_batch_size=2, steps=2, warmup_steps=1,
                 log_every=100)


@pytest.mark.parametrize("kind, tied, world, layout", [
    ("llama", False, 1, {}), ("llama", False, 2, {"tp": 2}),
    ("llama", False, 2, {"dp": 2, "zero": 3}),
    # tied heads across pipeline stages: the last stage's copy reads the embedding
    ("gpt2", True, 2, {"pp": 2}), ("llama", True, 2, {"pp": 2})])
def test_init_from_a_hugging_face_directory_starts_at_its_loss(tmp_path, kind, tied, world,
                                                              layout):
    import torch.nn.functional as F

    from fastpar.data.sources import BatchSampler, load_tokens

    ref = _save(kind, tmp_path / "hf", tied=tied)
    losses = run_ranks(_train, world, dict(FINE_TUNE, init_from=str(tmp_path / "hf"),
                                           out=str(tmp_path / "run"), no_save=True, **layout),
                       init_pg=False, timeout=180)[0]
    x, y = BatchSampler(load_tokens(None), 32, 4).batch(1)
    with torch.no_grad():
        want = F.cross_entropy(ref(x).logits.flatten(0, 1), y.flatten()).item()
    assert losses[0] == pytest.approx(want, abs=1e-5)


def _shard_ranks(rank, world_size, path):
    from pathlib import Path

    import fastpar
    from fastpar.data_parallel import DataParallel, DistributedOptimizer

    path, mesh = Path(path), fastpar.init(tp=2, dp=2)
    cfg = config_from_hf(json.loads((path / "config.json").read_text()))
    ref = GPT(cfg, tp_group=mesh.tp_group)
    load_hf(path, [ref], 2, mesh.tp_rank)
    model = GPT(cfg, tp_group=mesh.tp_group, device="meta")
    model.reset_buffers("cpu")
    reader = HFShardReader(path, [model], 2, mesh.tp_rank)
    everything = HFShardReader(path, [model], 2, mesh.tp_rank)
    ddp = DataParallel(model, dp_group=mesh.dp_group, units=list(model.layers.values()),
                       device="cpu")
    opt = DistributedOptimizer(ddp, torch.optim.AdamW, stage=3)
    opt.load_shards(reader)
    for p in model.parameters():               # what this TP rank would read whole
        everything(p, 0, p.numel())
    with opt.gathered():
        for (n, p), q in zip(model.named_parameters(), ref.parameters()):
            assert torch.equal(p, q), n
    return reader.bytes_read, everything.bytes_read


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_zero3_reads_only_its_shard_of_a_hugging_face_directory(tmp_path, kind):
    """tp2 x dp2, ZeRO-3 over a model built on the meta device: each rank's shards equal what
    load_hf gives the whole model (GPT-2's transposed and fused tensors, the vocabulary
    padding, row-parallel column slices), and each rank reads about half its TP rank's
    bytes."""
    _save(kind, tmp_path)
    out = run_ranks(_shard_ranks, 4, str(tmp_path), init_pg=False, timeout=120)
    for read, whole in out:
        assert 0.4 * whole <= read <= 0.6 * whole, (read, whole)


def test_export_of_a_tp2_checkpoint_loads_in_transformers(tmp_path):
    from fastpar.cli import main
    from fastpar.models import get_config
    from fastpar.train.checkpoint import latest_checkpoint, load_checkpoint

    run_ranks(_train, 2, dict(FINE_TUNE, model="tiny", tp=2, out=str(tmp_path / "run")),
              init_pg=False, timeout=180)
    ckpt = latest_checkpoint(tmp_path / "run" / "checkpoints")
    assert main(["export", "--format", "hf", str(ckpt), str(tmp_path / "hf")]) == 0
    model = GPT(get_config("tiny")).eval()
    load_checkpoint(ckpt, [model], None, None)
    back = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf").eval()
    x = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(back(x).logits, model(x), atol=1e-5, rtol=0)
    assert main(["export", str(tmp_path / "nothing"), str(tmp_path / "x")]) == 2
