"""Hugging Face mixture-of-experts checkpoints: tiny random Mixtral and Qwen2-MoE directories
(transformers 4's per-expert tensors) load into fastpar's GPT with transformers' own logits and
greedy tokens, export back to what transformers loads (the same tensors, bit for bit), are read
by the ZeRO-3 reader and the ``--init-from`` checks, and what fastpar cannot represent is one
clear error."""
import json
from pathlib import Path

import pytest
import torch

from fastpar.models import GPT, generate
from fastpar.models.hf import (HFShardReader, config_from_hf, config_to_hf, hf_state_dict,
                               load_hf, save_hf)

transformers = pytest.importorskip("transformers")

VOCAB = 300         # not a multiple of the 128 fastpar pads to
PROMPT = [17, 250, 3, 99, 42, 7, 123]


def _save(kind: str, path, norm_topk: bool = False, init: float = 0.02):
    """A tiny random model of ``kind`` saved at ``path`` (safetensors); the model."""
    torch.manual_seed(0)
    common = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64, rope_theta=5000.0,
                  rms_norm_eps=1e-6, num_experts_per_tok=2, initializer_range=init)
    if kind == "mixtral":
        model = transformers.MixtralForCausalLM(transformers.MixtralConfig(
            intermediate_size=48, num_local_experts=4, **common))
    else:       # 6 experts of 32, a gated shared expert of 2 experts' size, q/k/v biases
        model = transformers.Qwen2MoeForCausalLM(transformers.Qwen2MoeConfig(
            intermediate_size=96, moe_intermediate_size=32, shared_expert_intermediate_size=64,
            num_experts=6, norm_topk_prob=norm_topk, **common))
        with torch.no_grad():       # biases that matter (transformers' init zeroes them)
            for name, p in model.named_parameters():
                if name.endswith("_proj.bias"):
                    p.normal_(0, 0.1)
    model.eval().save_pretrained(path)
    return model


def _fastpar(path):
    model = GPT(config_from_hf(json.loads((path / "config.json").read_text()))).eval()
    load_hf(path, [model])
    return model


def _tokens():
    return torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(1))


CASES = [("mixtral", True), ("qwen2_moe", False), ("qwen2_moe", True)]
IDS = ["mixtral", "qwen2_moe", "qwen2_moe-norm_topk"]


@pytest.mark.parametrize("kind, norm_topk", CASES, ids=IDS)
def test_import_matches_transformers_and_export_round_trips(tmp_path, kind, norm_topk):
    from safetensors.torch import load_file

    ref = _save(kind, tmp_path / "hf", norm_topk)
    model = _fastpar(tmp_path / "hf")
    c = model.config
    assert (c.n_experts, c.moe_top_k, c.moe_norm_topk) == (4 if kind == "mixtral" else 6, 2,
                                                           norm_topk)
    assert (c.moe_shared_experts, c.moe_shared_gate, c.bias) == \
        ((0, False, False) if kind == "mixtral" else (2, True, True))
    assert config_from_hf(config_to_hf(c)) == c
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


@pytest.mark.parametrize("kind", ["mixtral", "qwen2_moe"])
def test_greedy_matches_transformers(tmp_path, kind):
    # initializer_range 0.3: attention sharp enough that a wrong position changes the tokens
    ref = _save(kind, tmp_path, norm_topk=True, init=0.3)
    x = torch.tensor([PROMPT])
    eos = ref.generation_config.eos_token_id
    want = ref.generate(x, attention_mask=torch.ones_like(x), do_sample=False,
                        max_new_tokens=24, pad_token_id=0)[0, len(PROMPT):].tolist()
    got = generate(_fastpar(tmp_path), PROMPT, 24, temperature=0, eos_id=eos)
    assert got == want and len(set(got)) > 1


def test_zero3_reader_and_init_from_checks_read_the_stacked_experts(tmp_path):
    """HFShardReader (what ZeRO-3 loads with) gives any flat range of each parameter as
    load_hf does, reading only the experts that range covers; check_source passes, and names
    any one expert's tensor missing; load_hf zeroes the loss-free bias."""
    from fastpar.train.init_from import check_source

    _save("qwen2_moe", tmp_path)
    want = _fastpar(tmp_path)
    model = GPT(want.config)
    reader = HFShardReader(tmp_path, [model])
    for (name, p), q in zip(model.named_parameters(), want.parameters()):
        n = p.numel()
        for start, count in ((0, n), (n // 3, n // 3 + 1), (n - 5, 5)):
            before = reader.bytes_read
            got = reader(p, start, count)
            assert torch.equal(got, q.detach().reshape(-1)[start:start + count]), (name, start)
            if name.endswith("experts.gate_up") and count == 5:   # the last expert's only
                assert reader.bytes_read - before == 4 * n // 6
    assert check_source(tmp_path) == want.config
    want.layers["1"].mlp.router.bias.fill_(1.0)
    load_hf(tmp_path, [want])                           # the loss-free bias back to zero
    assert not want.layers["1"].mlp.router.bias.any()
    from safetensors.torch import load_file, save_file
    tensors = load_file(tmp_path / "model.safetensors")
    gone = "model.layers.1.mlp.experts.5.up_proj.weight"        # the last expert's, one of them
    del tensors[gone]
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=f"no shard holds tensor '{gone}'"):
        check_source(tmp_path)


@pytest.mark.parametrize("kind, change, words", [
    ("qwen2_moe", dict(decoder_sparse_step=2), ["decoder_sparse_step=2"]),
    ("qwen2_moe", dict(mlp_only_layers=[1]), ["mlp_only_layers=[1]"]),
    ("qwen2_moe", dict(shared_expert_intermediate_size=48),
     ["shared_expert_intermediate_size=48", "multiple of moe_intermediate_size=32"]),
    ("qwen2_moe", dict(use_sliding_window=True, sliding_window=16), ["use_sliding_window"]),
    ("qwen2_moe", dict(num_experts=0), ["num_experts=0"]),
    ("mixtral", dict(sliding_window=16), ["sliding_window=16", "max_position_embeddings=64"]),
    ("mixtral", dict(router_jitter_noise=0.1), ["router_jitter_noise=0.1"]),
    ("mixtral", dict(hidden_act="gelu"), ["hidden_act='gelu'"]),
    ("mixtral", dict(rope_scaling={"rope_type": "linear", "factor": 2.0}), ["rope_scaling"]),
    ("mixtral", dict(num_local_experts=None), ["num_local_experts is missing"]),
])
def test_what_fastpar_cannot_represent_is_one_clear_error(kind, change, words):
    cfg = (transformers.MixtralConfig if kind == "mixtral" else transformers.Qwen2MoeConfig)(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=64, moe_intermediate_size=32).to_dict()
    cfg.update(change)
    with pytest.raises(ValueError) as err:
        config_from_hf(cfg)
    assert all(w in str(err.value) for w in words), str(err.value)


@pytest.mark.parametrize("change, words", [
    (dict(num_local_experts=8), ["block_sparse_moe.gate.weight'", "[4, 64]", "[8, 64]"]),
    (dict(intermediate_size=64), ["experts.0.w1.weight'", "[48, 64]", "[64, 64]"]),
])
def test_a_checkpoint_the_config_does_not_fit_is_one_clear_error(tmp_path, change, words):
    _save("mixtral", tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg.update(change)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError) as err:
        load_hf(tmp_path, [GPT(config_from_hf(cfg))])
    assert all(w in str(err.value) for w in words), str(err.value)


def test_experts_stored_fused_are_one_clear_error(tmp_path):
    """transformers 5's layout (one (E, 2F, D) gate_up_proj per layer) is named, not read."""
    from safetensors.torch import load_file, save_file

    _save("mixtral", tmp_path)
    file = tmp_path / "model.safetensors"
    tensors = {k: v for k, v in load_file(file).items() if ".experts." not in k}
    for i in range(2):
        tensors[f"model.layers.{i}.mlp.experts.gate_up_proj"] = torch.zeros(4, 96, 64)
    save_file(tensors, str(file), metadata={"format": "pt"})
    with pytest.raises(ValueError, match="stored fused .*gate_up_proj.* transformers 5"):
        _fastpar(tmp_path)


def test_what_the_formats_cannot_hold_is_refused_on_export():
    from fastpar.models import GPTConfig

    base = GPTConfig(vocab_size=96, n_layers=1, d_model=32, n_heads=2, max_seq_len=16,
                     n_experts=4, moe_ffn=16)
    assert config_to_hf(base)["model_type"] == "mixtral"
    assert config_to_hf(base.replace(moe_shared_experts=1, moe_shared_gate=True,
                                     bias=True))["model_type"] == "qwen2_moe"
    for bad in (dict(moe_shared_experts=1), dict(moe_norm_topk=False), dict(bias=True)):
        with pytest.raises(ValueError, match="neither Mixtral-shaped .* nor Qwen2-MoE-shaped"):
            config_to_hf(base.replace(**bad))
    model = GPT(base)
    hf_state_dict(model)
    model.layers["0"].mlp.router.bias[1] = 0.5          # the loss-free bias: no HF home
    with pytest.raises(ValueError, match=r"layers.0.mlp.router.bias \(the loss-free bias"):
        hf_state_dict(model)
    qwen = GPT(base.replace(moe_shared_experts=1, moe_shared_gate=True, bias=True))
    with torch.no_grad():
        qwen.layers["0"].attn.o.bias.zero_()
        assert "model.layers.0.self_attn.q_proj.bias" in hf_state_dict(qwen)
        qwen.layers["0"].attn.o.bias[0] = 1.0           # Qwen2-MoE's o_proj has no bias
    with pytest.raises(ValueError, match="layers.0.attn.o.bias is not zero"):
        hf_state_dict(qwen)


def _ep_logits(rank, world_size, path):
    import torch.distributed as dist
    model = GPT(config_from_hf(json.loads((Path(path) / "config.json").read_text())),
                ep_group=dist.group.WORLD).eval()
    load_hf(path, [model])
    with pytest.raises(ValueError, match="expert parallelism.*export the whole model"):
        save_hf(model, Path(path) / f"out{rank}")
    with torch.no_grad():
        return model(_tokens())[..., :VOCAB], model.layers["0"].mlp.experts.first


@pytest.mark.parametrize("kind", ["mixtral", "qwen2_moe"])
def test_import_at_ep2_matches_transformers(tmp_path, kind):
    """Each of two expert-parallel ranks reads only its half of the experts; the logits (the
    tokens dispatched to the rank holding their experts) equal transformers' within 1e-5."""
    from fastpar.testing import run_ranks
    ref = _save(kind, tmp_path / "hf", True)
    with torch.no_grad():
        want = ref(_tokens()).logits
    got = run_ranks(_ep_logits, 2, str(tmp_path / "hf"), timeout=90)
    assert [first for _, first in got] == [0, 2 if kind == "mixtral" else 3]
    for logits, _ in got:
        torch.testing.assert_close(logits, want, atol=1e-5, rtol=0)
