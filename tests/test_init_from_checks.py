"""``--init-from`` is checked completely before any rank starts: :func:`check_source` finds
every fault loading a Hugging Face directory or a fastpar checkpoint would hit (config, shards
present and complete, tensor shapes, the layout) from headers and manifests alone, as one
ValueError line naming the file and the value; ``fastpar train`` turns it into one error line,
exit 2, nothing created, the source untouched. Every source is a tiny one built here."""
import hashlib
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from fastpar.models import GPT, GPTConfig
from fastpar.train.checkpoint import file_digest
from fastpar.train.checkpoint_writer import save_checkpoint
from fastpar.models.hf import config_from_hf
from fastpar.train.init_from import check_source, source_config

FASTPAR = GPTConfig(vocab_size=256, n_layers=2, d_model=64, n_heads=4, max_seq_len=64)


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """Good sources: Llama in one file and in shards (with an index), GPT-2, and a fastpar
    checkpoint."""
    root = tmp_path_factory.mktemp("sources")
    torch.manual_seed(0)
    llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64))
    llama.save_pretrained(root / "llama")
    llama.save_pretrained(root / "sharded", max_shard_size="40KB")
    transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=300, n_embd=64, n_layer=2, n_head=4, n_positions=64)).save_pretrained(
            root / "gpt2")
    save_checkpoint(root / "fastpar", 2, [GPT(FASTPAR)], None, None,
                    {"data_step": 2, "model_config": FASTPAR.to_dict(),
                     "layout": {"tp": 1, "pp": 1, "dp": 1}, "zero1": False})
    return root


def _copy(sources, name, tmp_path):
    src = sources / name if name != "fastpar" else sources / "fastpar" / "step_2"
    return shutil.copytree(src, tmp_path / name)


def _error(path, **layout) -> str:
    """check_source's error: a ValueError of one line."""
    with pytest.raises(ValueError) as err:
        check_source(path, **layout)
    msg = str(err.value)
    assert "\n" not in msg and msg, msg
    return msg


def _shards(path):
    return sorted(path.glob("model-*.safetensors"))


def _rewrite(file, change):
    """Write safetensors ``file`` again with its tensors changed by ``change(dict)``."""
    tensors = load_file(file)
    change(tensors)
    save_file(tensors, file, metadata={"format": "pt"})


# -- good sources ---------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["llama", "sharded", "gpt2"])
def test_good_hugging_face_directory_passes_with_its_config(sources, name):
    want = config_from_hf(json.loads((sources / name / "config.json").read_text()))
    assert check_source(sources / name) == want == source_config(sources / name)
    assert check_source(sources / name, tp=2, pp=2) == want
    assert want.d_model == 64 and want.vocab_size == 300
    assert want.norm == ("layernorm" if name == "gpt2" else "rmsnorm")


def test_good_fastpar_checkpoint_passes_with_its_config(sources):
    assert check_source(sources / "fastpar" / "step_2", tp=2, pp=2) == FASTPAR


def test_only_headers_are_read_not_tensors(sources, monkeypatch):
    import safetensors

    import fastpar.train.checkpoint as checkpoint

    def refuse(*args, **kwargs):
        raise AssertionError("check_source opened a safetensors file to read tensors")

    monkeypatch.setattr(safetensors, "safe_open", refuse)
    monkeypatch.setattr(checkpoint, "safe_open", refuse)
    for name in ("llama", "sharded", "gpt2", "fastpar/step_2"):
        check_source(sources / name)


# -- Hugging Face directories ---------------------------------------------------------------

def test_deleted_shard(sources, tmp_path):
    path = _copy(sources, "sharded", tmp_path)
    gone = _shards(path)[3]
    gone.unlink()
    msg = _error(path)
    assert f"shard {gone.name} named by the index is missing" in msg and str(path) in msg


@pytest.mark.parametrize("name", ["llama", "sharded"])
@pytest.mark.parametrize("cut", ["few-bytes", "half"])
def test_truncated_shard(sources, tmp_path, name, cut):
    path = _copy(sources, name, tmp_path)
    file = (_shards(path) or [path / "model.safetensors"])[-1]
    data = file.read_bytes()
    keep = len(data) - 3 if cut == "few-bytes" else len(data) // 2
    file.write_bytes(data[:keep])
    msg = _error(path)
    assert f"{file} holds {keep} bytes" in msg and "truncated" in msg, msg
    if cut == "few-bytes":
        assert f"its header needs {len(data)}" in msg, msg


def test_file_shorter_than_a_header_length(sources, tmp_path):
    path = _copy(sources, "llama", tmp_path)
    (path / "model.safetensors").write_bytes(b"\x01\x02\x03")
    msg = _error(path)
    assert "model.safetensors holds 3 bytes" in msg and "truncated" in msg, msg


def test_corrupt_header(sources, tmp_path):
    path = _copy(sources, "llama", tmp_path)
    data = bytearray((path / "model.safetensors").read_bytes())
    data[9] = ord("}")                  # inside the JSON header
    (path / "model.safetensors").write_bytes(bytes(data))
    msg = _error(path)
    assert "model.safetensors: the safetensors header is not valid JSON" in msg, msg


def test_index_naming_a_missing_file(sources, tmp_path):
    path = _copy(sources, "sharded", tmp_path)
    index = path / "model.safetensors.index.json"
    data = json.loads(index.read_text())
    data["weight_map"]["model.norm.weight"] = "model-99999-of-99999.safetensors"
    index.write_text(json.dumps(data))
    msg = _error(path)
    assert "shard model-99999-of-99999.safetensors named by the index is missing" in msg, msg


@pytest.mark.parametrize("text, words", [("{}", "holds no weight_map"),
                                         ('{"weight_map": ', "is not valid JSON")])
def test_bad_index(sources, tmp_path, text, words):
    path = _copy(sources, "sharded", tmp_path)
    (path / "model.safetensors.index.json").write_text(text)
    msg = _error(path)
    assert "model.safetensors.index.json" in msg and words in msg, msg


def test_index_placing_a_tensor_in_the_wrong_shard(sources, tmp_path):
    path = _copy(sources, "sharded", tmp_path)
    index = path / "model.safetensors.index.json"
    data = json.loads(index.read_text())
    right = data["weight_map"]["model.norm.weight"]
    wrong = next(f.name for f in _shards(path) if f.name != right)
    data["weight_map"]["model.norm.weight"] = wrong
    index.write_text(json.dumps(data))
    msg = _error(path)
    assert f"{wrong} lacks tensor 'model.norm.weight'" in msg, msg


def test_config_json_invalid(sources, tmp_path):
    path = _copy(sources, "llama", tmp_path)
    (path / "config.json").write_text('{"model_type": "llama", ')
    for call in (check_source, source_config):
        with pytest.raises(ValueError, match="config.json is not valid JSON") as err:
            call(path)
        assert str(path / "config.json") in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("name, key", [("llama", "hidden_size"), ("llama", "vocab_size"),
                                       ("gpt2", "n_embd"), ("gpt2", "n_layer")])
def test_config_missing_a_required_key(sources, tmp_path, name, key):
    path = _copy(sources, name, tmp_path)
    cfg = json.loads((path / "config.json").read_text())
    del cfg[key]
    (path / "config.json").write_text(json.dumps(cfg))
    msg = _error(path)
    assert f"{key} is missing" in msg and str(path / "config.json") in msg, msg
    with pytest.raises(ValueError, match=f"{key} is missing"):
        config_from_hf(cfg)             # not a KeyError


@pytest.mark.parametrize("content, words", [
    ("[1, 2]", "config.json is not a JSON object"),
    ('"model_type"', "config.json is not a JSON object"),
    ('{"model_type": "llama", "hidden_size": "64"}', "hidden_size='64' is not a positive integer"),
    ('{"model_type": "llama", "hidden_size": 64, "num_attention_heads": 0}',
     "num_attention_heads=0 is not a positive integer"),
    ('{"model_type": "bert"}', "model_type='bert' is not supported"),
    ('{"architectures": []}', "config.json has no model_type"),
])
def test_source_config_of_a_bad_config_is_only_ever_a_value_error(tmp_path, content, words):
    (tmp_path / "config.json").write_text(content)
    for call in (source_config, check_source):
        with pytest.raises(ValueError) as err:
            call(tmp_path)
        assert words in str(err.value) and "\n" not in str(err.value), str(err.value)


def test_not_a_source(tmp_path):
    assert "does not exist" in _error(tmp_path / "nothing")
    (tmp_path / "file").write_text("x")
    assert "is not a folder" in _error(tmp_path / "file")
    msg = _error(tmp_path)
    assert "is neither a Hugging Face directory" in msg and "nor a fastpar checkpoint" in msg


def test_tensor_of_the_wrong_shape(sources, tmp_path):
    path = _copy(sources, "llama", tmp_path)
    name = "model.layers.1.mlp.up_proj.weight"
    _rewrite(path / "model.safetensors", lambda t: t.update({name: torch.zeros(128, 64)}))
    msg = _error(path)
    assert f"tensor {name!r} has shape [128, 64], the config needs [96, 64]" in msg, msg


def test_gpt2_fused_attention_of_the_wrong_shape(sources, tmp_path):
    path = _copy(sources, "gpt2", tmp_path)
    name = "transformer.h.0.attn.c_attn.weight"       # Conv1D: (in, 3 * out)
    _rewrite(path / "model.safetensors", lambda t: t.update({name: torch.zeros(64, 128)}))
    msg = _error(path)
    assert f"tensor {name!r} has shape [64, 128], the config needs [64, 192]" in msg, msg


def test_required_tensor_missing(sources, tmp_path):
    path = _copy(sources, "llama", tmp_path)
    name = "model.layers.1.post_attention_layernorm.weight"
    _rewrite(path / "model.safetensors", lambda t: t.pop(name))
    msg = _error(path)
    assert f"no shard holds tensor {name!r}, which the model needs" in msg, msg


def test_tensor_not_floating_point(sources, tmp_path):
    path = _copy(sources, "llama", tmp_path)
    name = "model.norm.weight"
    _rewrite(path / "model.safetensors", lambda t: t.update({name: t[name].to(torch.int32)}))
    msg = _error(path)
    assert f"tensor {name!r} is I32, not floating point" in msg, msg


# -- fastpar checkpoints --------------------------------------------------------------------

SHARD = "model_tp0_pp0.safetensors"


def _damage_flip(path):
    data = bytearray((path / SHARD).read_bytes())
    data[-10] ^= 0x55
    (path / SHARD).write_bytes(bytes(data))


def _damage_truncate(path):
    data = (path / SHARD).read_bytes()
    (path / SHARD).write_bytes(data[:len(data) // 2])


def _damage_manifest(change):
    def damage(path):
        manifest = json.loads((path / "manifest.json").read_text())
        change(manifest)
        (path / "manifest.json").write_text(json.dumps(manifest))
    return damage


def _damage_index(path):
    index = path / "index_tp0_pp0.json"
    entries = json.loads(index.read_text())
    del entries["layers.1.attn.o.weight"]
    index.write_text(json.dumps(entries))
    manifest = json.loads((path / "manifest.json").read_text())
    manifest["files"][index.name] = file_digest(index)   # consistent, but short of a tensor
    (path / "manifest.json").write_text(json.dumps(manifest))


@pytest.mark.parametrize("damage, words", [
    (_damage_flip, f"{SHARD} is corrupt: its sha256 differs from the manifest's"),
    (_damage_truncate, f"{SHARD} holds"),
    (lambda p: (p / SHARD).unlink(), f"{SHARD} is missing"),
    (lambda p: (p / "manifest.json").write_text('{"step": 2, '), "manifest.json is not valid JSON"),
    (lambda p: (p / "index_tp0_pp0.json").unlink(), "index_tp0_pp0.json is missing"),
    (_damage_manifest(lambda m: m["model_config"].update(width=3)),
     "model_config has unknown field(s) width"),
    (_damage_manifest(lambda m: m["model_config"].pop("d_model")),
     "model_config has no field(s) d_model"),
    (_damage_manifest(lambda m: m.pop("model_config")), "holds no model_config"),
    (_damage_manifest(lambda m: m["model_config"].update(d_model=32)),
     "embed.weight has shape [256, 64], the model [256, 32]"),
    (_damage_manifest(lambda m: m.update(files=[1])), "files are malformed"),
    (_damage_index, "holds no 'layers.1.attn.o.weight', which the model needs"),
])
def test_damaged_fastpar_checkpoint(sources, tmp_path, damage, words):
    path = _copy(sources, "fastpar", tmp_path)
    damage(path)
    msg = _error(path)
    assert words in msg and str(path) in msg, msg


def _split_in_two(path):
    """The checkpoint as two tensor-parallel-like files, each matrix's rows split between them
    (what a tp=2 save writes), the manifest listing the new files."""
    tensors, index = load_file(path / SHARD), json.loads((path / "index_tp0_pp0.json").read_text())
    manifest = json.loads((path / "manifest.json").read_text())
    for f in (SHARD, "index_tp0_pp0.json"):
        (path / f).unlink()
        del manifest["files"][f]
    for part in (0, 1):
        held, entries = {}, {}
        for name, t in tensors.items():
            if t.dim() == 2:
                rows = t.shape[0] // 2
                held[name] = t[part * rows:(part + 1) * rows].clone()
                entries[name] = dict(index[name], dim=0, start=part * rows,
                                     stop=(part + 1) * rows)
            elif part == 0:
                held[name], entries[name] = t, index[name]
        save_file(held, path / f"model_tp{part}_pp0.safetensors")
        (path / f"index_tp{part}_pp0.json").write_text(json.dumps(entries))
        for f in (f"model_tp{part}_pp0.safetensors", f"index_tp{part}_pp0.json"):
            manifest["files"][f] = file_digest(path / f)
    (path / "manifest.json").write_text(json.dumps(manifest))


def test_split_fastpar_checkpoint_is_checked_as_the_loader_reads_it(sources, tmp_path):
    from fastpar.train.checkpoint import load_checkpoint

    path = _copy(sources, "fastpar", tmp_path)
    _split_in_two(path)
    assert check_source(path) == FASTPAR
    saved, model = GPT(FASTPAR), GPT(FASTPAR.replace(init_seed=1))    # saved: the weights
    assert not torch.equal(model.embed.weight, saved.embed.weight)
    load_checkpoint(path, [model], None, None)          # what check_source passed does load
    for a, b in zip(model.parameters(), saved.parameters()):
        assert torch.equal(a, b)
    index = path / "index_tp1_pp0.json"                 # the second half of one matrix gone
    entries = json.loads(index.read_text())
    del entries["layers.0.mlp.up.weight"]
    index.write_text(json.dumps(entries))
    manifest = json.loads((path / "manifest.json").read_text())
    manifest["files"][index.name] = file_digest(index)
    (path / "manifest.json").write_text(json.dumps(manifest))
    rows = FASTPAR.ffn_dim // 2
    msg = _error(path)
    assert f"does not hold all of 'layers.0.mlp.up.weight': no file holds index {rows} of its " \
        f"dim 0" in msg, msg


def test_index_listing_a_tensor_its_file_lacks(sources, tmp_path):
    path = _copy(sources, "fastpar", tmp_path)
    _rewrite(path / SHARD, lambda t: t.pop("norm.weight"))
    manifest = json.loads((path / "manifest.json").read_text())
    manifest["files"][SHARD] = file_digest(path / SHARD)
    (path / "manifest.json").write_text(json.dumps(manifest))
    msg = _error(path)
    assert f"{SHARD} lacks 'norm.weight', which its index lists" in msg, msg


def test_source_config_of_a_bad_manifest_is_a_value_error(sources, tmp_path):
    path = _copy(sources, "fastpar", tmp_path)
    _damage_manifest(lambda m: m.pop("model_config"))(path)
    with pytest.raises(ValueError, match="holds no model_config"):
        source_config(path)


# -- the layout -----------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["llama", "fastpar/step_2"])
def test_layout_the_model_cannot_take(sources, name):
    assert "n_heads=4 is not divisible by tp=3" in _error(sources / name, tp=3)
    assert "n_layers=2 is fewer than pp=3" in _error(sources / name, pp=3)


# -- through the command line, as a user types it -------------------------------------------

def _digests(path) -> dict:
    return {str(f.relative_to(path)): hashlib.sha256(f.read_bytes()).hexdigest()
            for f in sorted(path.rglob("*")) if f.is_file()}


@pytest.mark.parametrize("name, damage, words", [
    ("sharded", lambda p: _shards(p)[2].unlink(), "named by the index is missing"),
    ("sharded", lambda p: _shards(p)[-1].write_bytes(_shards(p)[-1].read_bytes()[:-5]),
     "truncated"),
    ("fastpar", _damage_flip, "is corrupt: its sha256 differs"),
])
def test_cli_bad_init_from_is_one_line_exit_2_nothing_created(sources, tmp_path, name, damage,
                                                             words):
    path = _copy(sources, name, tmp_path)
    damage(path)
    before = _digests(path)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    done = subprocess.run([sys.executable, "-m", "fastpar", "train", "--init-from", str(path),
                           "--out", str(tmp_path / "run"), "--steps", "2", "--seq-len", "32",
                           "--global-batch-size", "8", "--micro-batch-size", "2"],
                          env=env, capture_output=True, text=True, timeout=120)
    err = done.stderr
    assert done.returncode == 2, err
    assert len(err.splitlines()) == 1 and err.startswith("fastpar train: error:"), err
    assert words in err and "Traceback" not in err, err
    assert not (tmp_path / "run").exists()
    assert _digests(path) == before
