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
    real = ck._Reader.box

    def spy(self, name, shape, box):
        if all(tuple(b) == (0, n) for b, n in zip(box, shape)):
            whole.append(name)
        return real(self, name, shape, box)
    ck._Reader.box, block = spy, ck._BLOCK_BYTES
    ck._BLOCK_BYTES = 1024              # a row-parallel weight's slice read in several blocks
    try:
        fresh = GPT(GPTConfig(**CFG, init_seed=9), tp_group=mesh.tp_group)
        opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
        load_checkpoint(latest_checkpoint(out), [fresh], opt, mesh)
    finally:
        ck._Reader.box, ck._BLOCK_BYTES = real, block
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
    reader = ck._Reader(path, ck.Verifier(path))
    for name, (t, shape, dim, start, stop, _, _) in shard_specs(
            [fresh], world_size, mesh.tp_rank).items():
        want = reader.slice(name, shape, None, 0, 0)
        if dim is not None:
            want = want.narrow(dim, start, stop - start)
        assert torch.equal(t, want), name
    return True


@pytest.mark.parametrize("load_tp", [2, 4])
def test_loading_reads_only_this_ranks_rows(tmp_path, load_tp):
    assert all(run_ranks(_save_tp, 2, str(tmp_path), init_pg=False, timeout=120))
    assert all(run_ranks(_load_reads_only_slices, load_tp, str(tmp_path), init_pg=False,
                         timeout=120))


def _zero_model(mesh, stage: int, seed: int = 0):
    from fastpar.data_parallel import DataParallel, DistributedOptimizer

    model = GPT(GPTConfig(**CFG, init_seed=seed))
    ddp = DataParallel(model, dp_group=mesh.dp_group, bucket_cap_mb=0.004,
                       units=list(model.layers.values()) if stage == 3 else None)
    return model, DistributedOptimizer(ddp, torch.optim.AdamW, stage=stage, lr=1e-2)


def _zero_save(rank, world_size, out, stage):
    """A ZeRO run at dp=``world_size`` trains a step and saves: each rank its own shard."""
    mesh = fastpar.init(dp=world_size)
    model, opt = _zero_model(mesh, stage)
    tokens = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(1 + rank))
    model(tokens[:, :-1], tokens[:, 1:]).backward()
    opt.step()
    save_checkpoint(out, 1, [model], opt, mesh, {"config": CFG, "data_step": 1})
    with opt.gathered():
        return {n: p.detach().clone() for n, p in model.named_parameters()}


def _zero_load(rank, world_size, out, stage, same):
    """Loading it at another dp size (another cut into shards): each rank reads exactly the
    flat ranges its shard covers, from the one file that holds them, and gets the saved masters
    and moments: those of the same checkpoint loaded whole into one process's model."""
    from fastpar.train import checkpoint as ck

    mesh = fastpar.init(dp=world_size)
    model, opt = _zero_model(mesh, stage, seed=9)
    read = {}
    real = ck._Reader._flat

    def spy(self, src, name, a, b):
        kind = name.split(".")[1] if name.startswith("optim.") else "master"
        read[kind] = read.get(kind, 0) + b - a
        return real(self, src, name, a, b)
    opened, verify = [], ck.Verifier.__call__
    ck._Reader._flat = spy
    ck.Verifier.__call__ = lambda self, name, full=True: (opened.append(name),
                                                          verify(self, name, full))
    try:
        load_checkpoint(latest_checkpoint(out), [model], opt, mesh)
    finally:
        ck._Reader._flat, ck.Verifier.__call__ = real, verify
    held = sum(pc.hi - pc.lo for pc in opt._pieces)
    assert read == {"master": held, "exp_avg": held, "exp_avg_sq": held}, (read, held)
    # Each file is checked against its sha256 by the ranks that read it: resumed on the same
    # layout, a rank reads (and checks) only its own shard's file.
    if same:
        assert [n for n in opened if n.startswith("model_")] == \
            [f"model_tp0_pp0_dp{rank}.safetensors"], opened
    plain = GPT(GPTConfig(**CFG, init_seed=5))
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=1e-2)
    load_checkpoint(latest_checkpoint(out), [plain], plain_opt, None)
    whole = dict(plain.named_parameters())
    names = {id(p): n for n, p in model.named_parameters()}
    for pc, sp in zip(opt._pieces, opt._shard_params):
        name, n = names[id(opt._reducer.params[pc.param])], pc.hi - pc.lo
        state, want = opt.optimizer.state[sp], plain_opt.state[whole[name]]
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(state[key], want[key].reshape(-1)[pc.start:pc.start + n]), name
        assert float(state["step"]) == float(want["step"]) == 1.0
    with opt.gathered():
        return {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("save_stage,load_stage,load_dp", [(1, 3, 4), (3, 1, 4), (3, 3, 2)])
def test_zero_checkpoint_is_each_ranks_shard(tmp_path, save_stage, load_stage, load_dp):
    """Saved at dp=2 as two shard files (no rank holds or writes the whole state), loaded at
    dp=4 under another ZeRO stage, on the same layout, and into one process: the same weights
    everywhere."""
    saved = run_ranks(_zero_save, 2, str(tmp_path), save_stage, init_pg=False, timeout=120)
    path = latest_checkpoint(tmp_path)
    assert sorted(f.name for f in path.glob("model_*")) == \
        ["model_tp0_pp0_dp0.safetensors", "model_tp0_pp0_dp1.safetensors"]
    loaded = run_ranks(_zero_load, load_dp, str(tmp_path), load_stage,
                       (load_stage, load_dp) == (save_stage, 2), init_pg=False, timeout=120)
    one = GPT(GPTConfig(**CFG, init_seed=7))
    load_checkpoint(path, [one], None, None)
    for n, p in one.named_parameters():
        assert torch.equal(p, saved[0][n]) and torch.equal(p, saved[1][n]), n
        assert all(torch.equal(p, got[n]) for got in loaded), n


def test_a_missing_zero_shard_is_named(tmp_path):
    """A checkpoint whose dp shard is gone (its files and manifest entries removed) is refused
    by the launch check, naming the tensor and the first element no shard holds."""
    from fastpar.train.checkpoint import CheckpointError, check_checkpoint

    run_ranks(_zero_save, 2, str(tmp_path), 1, init_pg=False, timeout=120)
    path = latest_checkpoint(tmp_path)
    manifest = json.loads((path / "manifest.json").read_text())
    for name in ("model_tp0_pp0_dp1.safetensors", "index_tp0_pp0_dp1.json"):
        (path / name).unlink()
        del manifest["files"][name]
    (path / "manifest.json").write_text(json.dumps(manifest))
    shapes = {n: list(p.shape) for n, p in GPT(GPTConfig(**CFG)).named_parameters()}
    with pytest.raises(CheckpointError, match=r"does not hold all of '.*': no dp shard of "
                                              r"index_tp0_pp0 holds element \d+ of its \d+"):
        check_checkpoint(path, shapes)
