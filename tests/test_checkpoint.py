"""Sharded checkpoints: atomic, and a checkpoint saved with one TP layout loads into another."""
import json

import pytest
import torch
import torch.distributed as dist

import fastpar
from fastpar.models import GPT, GPTConfig
from fastpar.testing import run_ranks
from fastpar.train.checkpoint import latest_checkpoint, load_checkpoint
from fastpar.train.checkpoint_writer import save_checkpoint

CFG = dict(vocab_size=64, n_layers=2, d_model=32, n_heads=4, max_seq_len=8, pad_vocab_to=64)


def _train_one_step(model):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    tokens = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(1))
    model(tokens[:, :-1], tokens[:, 1:]).backward()
    opt.step()
    return opt


def _save_tp(rank, world_size, out):
    mesh = fastpar.init(tp=world_size)
    model = GPT(GPTConfig(**CFG), tp_group=mesh.tp_group)
    opt = _train_one_step(model)
    save_checkpoint(out, 1, [model], opt, mesh, {"config": CFG, "data_step": 1})
    # Reload into a fresh model of the same layout: identical tensors and optimizer state.
    fresh = GPT(GPTConfig(**CFG, init_seed=9), tp_group=mesh.tp_group)
    opt2 = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    manifest = load_checkpoint(latest_checkpoint(out), [fresh], opt2, mesh)
    assert manifest["step"] == 1 and manifest["data_step"] == 1
    for (n, a), b in zip(model.named_parameters(), fresh.parameters()):
        assert torch.equal(a, b), n
        assert torch.equal(opt.state[a]["exp_avg_sq"], opt2.state[b]["exp_avg_sq"]), n
    return True


@pytest.mark.parametrize("tp", [2])
def test_save_with_tp_load_single_and_back(tmp_path, tp):
    out = tmp_path / "ckpt"
    assert run_ranks(_save_tp, tp, str(out), init_pg=False, timeout=90) == [True] * tp
    path = latest_checkpoint(out)
    assert path.name == "step_1" and not list(out.glob("*.tmp"))
    assert (out / "latest").read_text() == "step_1"
    assert json.loads((path / "manifest.json").read_text())["config"] == CFG
    # The single-process model loads the TP checkpoint and equals a single-process step.
    ref = GPT(GPTConfig(**CFG))
    ref_opt = _train_one_step(ref)
    loaded = GPT(GPTConfig(**CFG, init_seed=3))
    opt = torch.optim.AdamW(loaded.parameters(), lr=1e-2)
    load_checkpoint(path, [loaded], opt, None)
    for (n, a), b in zip(ref.named_parameters(), loaded.parameters()):
        assert torch.allclose(a, b, atol=1e-6), n
        assert torch.allclose(ref_opt.state[a]["exp_avg"], opt.state[b]["exp_avg"], atol=1e-7), n


def test_other_model_shape_is_refused(tmp_path):
    model = GPT(GPTConfig(**CFG))
    save_checkpoint(tmp_path, 3, [model], None, None, {})
    other = GPT(GPTConfig(**dict(CFG, d_model=64)))
    with pytest.raises(ValueError, match="another model shape"):
        load_checkpoint(tmp_path / "step_3", [other], None, None)


def test_fused_projections_are_saved_per_part(tmp_path):
    """q / k / v and up / gate are one linear each in the model but separate tensors on disk
    (named as separate linears would be), so separate weights load into the fused layout."""
    from safetensors.torch import load_file
    cfg = GPTConfig(**CFG, n_kv_heads=2)
    model = GPT(cfg)
    opt = _train_one_step(model)
    path = save_checkpoint(tmp_path, 1, [model], opt, None, {"data_step": 1})
    saved = load_file(str(path / "model_tp0_pp0.safetensors"))
    qkv = model.layers["0"].attn.qkv
    hd = cfg.head_dim
    rows = {"q": cfg.n_heads * hd, "k": 2 * hd, "v": 2 * hd}
    start = 0
    for part in ("q", "k", "v"):
        w = saved[f"layers.0.attn.{part}.weight"]
        assert torch.equal(w, qkv.weight[start:start + rows[part]].detach()), part
        state = opt.state[qkv.weight]["exp_avg"][start:start + rows[part]]
        assert torch.equal(saved[f"optim.exp_avg.layers.0.attn.{part}.weight"], state), part
        start += rows[part]
    assert not any("qkv" in k or "fc1" in k for k in saved)
    # Separate weights (here: the file's own, edited) load into the fused parameter's rows.
    saved["layers.0.attn.k.weight"] += 1.0
    from safetensors.torch import save_file
    save_file(saved, str(path / "model_tp0_pp0.safetensors"))
    manifest = json.loads((path / "manifest.json").read_text())
    from fastpar.train.checkpoint import file_digest
    manifest["files"]["model_tp0_pp0.safetensors"] = file_digest(path / "model_tp0_pp0.safetensors")
    (path / "manifest.json").write_text(json.dumps(manifest))
    fresh = GPT(cfg.replace(init_seed=3))
    opt2 = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    load_checkpoint(path, [fresh], opt2, None)
    k = fresh.layers["0"].attn.qkv.weight[rows["q"]:rows["q"] + rows["k"]]
    assert torch.equal(k, saved["layers.0.attn.k.weight"])
    assert torch.equal(opt2.state[fresh.layers["0"].attn.qkv.weight]["exp_avg"],
                       opt.state[qkv.weight]["exp_avg"])


def _load_reads_only_slices(rank, world_size, out):
    """Loading a tp checkpoint into the same or another tp layout reads, of every sharded
    tensor, only the rows this rank holds: no whole tensor is assembled but the unsharded ones
    (norms, biases of row linears)."""
    from fastpar.train import checkpoint as ck

    mesh = fastpar.init(tp=world_size)
    whole = []
    real = ck._read_full

    def spy(path, index, name, shape, verify):
        whole.append(name)
        return real(path, index, name, shape, verify)
    ck._read_full, block = spy, ck._BLOCK_BYTES
    ck._BLOCK_BYTES = 1024              # a row-parallel weight's slice read in several blocks
    try:
        fresh = GPT(GPTConfig(**CFG, init_seed=9), tp_group=mesh.tp_group)
        opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
        load_checkpoint(latest_checkpoint(out), [fresh], opt, mesh)
    finally:
        ck._read_full, ck._BLOCK_BYTES = real, block
    # every state tensor as the optimizer's kernels need it: contiguous, not a view of rows
    assert all(v.is_contiguous() for st in opt.state.values() for v in st.values()
               if torch.is_tensor(v))
    from fastpar.tensor_parallel.sharding import shard_specs
    sharded = {n for n, spec in shard_specs([fresh], world_size, mesh.tp_rank).items()
               if spec[2] is not None}
    read_whole = {n.split(".", 2)[-1] if n.startswith("optim.") else n for n in whole
                  if not n.startswith("optim.step.")}      # (a step count is one number)
    assert sharded and not read_whole & sharded, sorted(read_whole & sharded)
    # the values: each the slice of the whole tensor, read whole for comparison
    path = latest_checkpoint(out)
    verify = ck.Verifier(path)
    index = ck._read_indexes(path, verify)
    for name, (t, shape, dim, start, stop, _, _) in shard_specs(
            [fresh], world_size, mesh.tp_rank).items():
        want = real(path, index, name, shape, verify)
        if dim is not None:
            want = want.narrow(dim, start, stop - start)
        assert torch.equal(t, want), name
    return True


@pytest.mark.parametrize("load_tp", [2, 4])
def test_loading_reads_only_this_ranks_rows(tmp_path, load_tp):
    assert all(run_ranks(_save_tp, 2, str(tmp_path), init_pg=False, timeout=120))
    assert all(run_ranks(_load_reads_only_slices, load_tp, str(tmp_path), init_pg=False,
                         timeout=120))
