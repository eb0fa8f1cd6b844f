"""Generation with a KV cache: greedy decoding equals transformers' own ``generate`` token for
token (Llama with GQA, GPT-2 with learned positions; tp=1 and tp=2), the cached path equals the
full forward at every step (a multi-token chunk after a prefix included), sampling is seeded and
the same on every TP rank, and ``fastpar generate`` runs on a checkpoint, a run folder and a
Hugging Face directory (tp=2 under the torchrun environment), one clear error for bad input."""
import contextlib
import io
import json

import pytest
import torch
import torch.distributed as dist

from fastpar.cli import main
from fastpar.models import GPT, GPTConfig, KVCache, generate
from fastpar.models.hf import config_from_hf, load_hf
from fastpar.testing import run_ranks

VOCAB = 300         # not a multiple of 128: the last vocabulary shard holds -inf padding
PROMPT = [17, 250, 3, 99, 42, 7, 123]
LLAMA = GPTConfig(vocab_size=VOCAB, n_layers=2, d_model=64, n_heads=4, n_kv_heads=2, d_ff=96,
                  max_seq_len=64)
GPT2 = GPTConfig(vocab_size=VOCAB, n_layers=2, d_model=64, n_heads=4, max_seq_len=64,
                 norm="layernorm", activation="gelu", rotary=False, tie_embeddings=True,
                 bias=True)


def _save_hf(kind: str, path, vocab: int = VOCAB):
    import transformers     # here, not at module level: the ranks need not import it

    # initializer_range 0.3, not 0.02: attention sharp enough that a token at a wrong position
    # (rotary or learned) changes the greedy tokens.
    torch.manual_seed(0)
    if kind == "llama":
        cfg = transformers.LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=96,
                                       num_hidden_layers=2, num_attention_heads=4,
                                       num_key_value_heads=2, max_position_embeddings=64,
                                       rope_theta=5000.0, rms_norm_eps=1e-6,
                                       tie_word_embeddings=False, initializer_range=0.3)
        model = transformers.LlamaForCausalLM(cfg)
    else:
        cfg = transformers.GPT2Config(vocab_size=vocab, n_embd=64, n_layer=2, n_head=4,
                                      n_positions=64, initializer_range=0.3)
        model = transformers.GPT2LMHeadModel(cfg)
    model.eval().save_pretrained(path)
    return model


def _hf_greedy(path, kind: str, n: int) -> tuple[list[int], int | None]:
    """transformers' greedy tokens after PROMPT, and the eos id it stops at."""
    import transformers

    ref = (transformers.LlamaForCausalLM if kind == "llama" else
           transformers.GPT2LMHeadModel).from_pretrained(path).eval()
    x = torch.tensor([PROMPT])
    eos = ref.generation_config.eos_token_id
    out = ref.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=n,
                       pad_token_id=0)
    return out[0, len(PROMPT):].tolist(), eos


def _fastpar_hf(path, tp_group=None):
    model = GPT(config_from_hf(json.loads((path / "config.json").read_text())),
                tp_group=tp_group)
    tp = dist.get_world_size(tp_group) if tp_group else 1
    load_hf(path, [model], tp, dist.get_rank(tp_group) if tp_group else 0)
    return model


def _cached_logits(model, tokens, prefix: int, chunk: int) -> torch.Tensor:
    """Logits of every position of ``tokens`` (B, S) through the cache: the prefix in one go,
    a multi-token chunk after it, then one token at a time."""
    cache = KVCache(model, tokens.shape[1])
    cuts = [0, prefix, prefix + chunk] + list(range(prefix + chunk + 1, tokens.shape[1] + 1))
    with torch.no_grad():
        out = torch.cat([model(tokens[:, a:b], cache=cache) for a, b in zip(cuts, cuts[1:])], 1)
    tp = dist.get_world_size(model.tp_group) if model.tp_group else 1
    hd = model.config.head_dim
    assert cache.length == tokens.shape[1]
    assert cache.layers["0"].k.shape == (tokens.shape[0], model.config.kv_heads // tp,
                                         tokens.shape[1], hd)      # only the kv heads
    return out


def _check_cache_matches_full(model):
    tokens = torch.randint(0, VOCAB, (2, 20), generator=torch.Generator().manual_seed(2))
    model.eval()
    with torch.no_grad():
        full = model(tokens)
    got = _cached_logits(model, tokens, prefix=5, chunk=4)
    real = torch.isfinite(full)                 # the padded vocabulary is -inf in both
    assert torch.equal(real, torch.isfinite(got))
    torch.testing.assert_close(got[real], full[real], atol=1e-5, rtol=0)


@pytest.mark.parametrize("config", [LLAMA, GPT2], ids=["llama-gqa", "gpt2"])
def test_cache_equals_the_full_forward(config):
    _check_cache_matches_full(GPT(config))


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_greedy_matches_transformers(tmp_path, kind):
    _save_hf(kind, tmp_path)
    want, eos = _hf_greedy(tmp_path, kind, 24)
    got = generate(_fastpar_hf(tmp_path), PROMPT, 24, temperature=0, eos_id=eos)
    assert got == want and len(got) > 1


def _tp2_greedy(rank, world_size, path, kind, eos):
    from pathlib import Path

    _check_cache_matches_full(GPT(LLAMA if kind == "llama" else GPT2, tp_group=dist.group.WORLD))
    model = _fastpar_hf(Path(path), dist.group.WORLD)
    return generate(model, PROMPT, 24, temperature=0, eos_id=eos)


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_greedy_at_tp2_matches_transformers(tmp_path, kind):
    _save_hf(kind, tmp_path)
    want, eos = _hf_greedy(tmp_path, kind, 24)
    assert run_ranks(_tp2_greedy, 2, str(tmp_path), kind, eos, timeout=120) == [want, want]
    assert len(want) > 1


def _samples(model) -> dict:
    def run(**kw):
        return generate(model, PROMPT, 20, **kw)
    return {"seed3": run(temperature=0.9, seed=3), "seed3_again": run(temperature=0.9, seed=3),
            "seed4": run(temperature=0.9, seed=4), "top5": run(temperature=1.5, top_k=5, seed=3),
            "top1": run(temperature=1.0, top_k=1, seed=5), "greedy": run(temperature=0)}


def _tp2_samples(rank, world_size):
    return _samples(GPT(LLAMA, tp_group=dist.group.WORLD))


def test_sampling_is_seeded_and_the_same_on_every_tp_rank():
    one = _samples(GPT(LLAMA))
    ranks = run_ranks(_tp2_samples, 2, timeout=120)
    assert ranks[0] == ranks[1] == one      # every rank draws the same tokens, as tp=1 does
    assert one["seed3"] == one["seed3_again"] and one["seed3"] != one["seed4"]
    assert one["top1"] == one["greedy"]
    top5 = GPT(LLAMA).eval()
    with torch.no_grad():                   # each top-5 draw is one of the 5 likeliest tokens
        z = top5(torch.tensor([PROMPT + one["top5"]]))[0, len(PROMPT) - 1:-1]
    allowed = z.topk(5, dim=-1).indices
    assert all(t in allowed[i] for i, t in enumerate(one["top5"]))


def test_stops_at_eos_and_restores_training_mode():
    model = GPT(LLAMA).train()
    greedy = generate(model, PROMPT, 12, temperature=0)
    assert model.training
    stop = greedy[4]
    assert generate(model, PROMPT, 12, temperature=0, eos_id=stop) == \
        greedy[:greedy.index(stop) + 1]


@pytest.mark.parametrize("kw, words", [
    (dict(prompt_ids=PROMPT, max_new_tokens=60),
     ["7 tokens", "max_new_tokens=60", "= 67", "max_seq_len=64"]),
    (dict(prompt_ids=[], max_new_tokens=4), ["prompt is empty"]),
    (dict(prompt_ids=[1, VOCAB], max_new_tokens=4), [f"token {VOCAB}", f"0 .. {VOCAB - 1}"]),
    (dict(prompt_ids=PROMPT, max_new_tokens=0), ["max_new_tokens=0"]),
    (dict(prompt_ids=PROMPT, max_new_tokens=4, temperature=-0.5), ["temperature=-0.5"]),
    (dict(prompt_ids=PROMPT, max_new_tokens=4, temperature=float("nan")), ["temperature=nan"]),
    (dict(prompt_ids=PROMPT, max_new_tokens=4, top_k=-1), ["top_k=-1"]),
])
def test_bad_arguments_are_one_clear_error(kw, words):
    with pytest.raises(ValueError) as err:
        generate(GPT(LLAMA), **kw)
    for w in words:
        assert w in str(err.value)


def test_pipeline_stages_and_sequence_parallel_models_are_refused():
    with pytest.raises(ValueError, match="pipeline stage"):
        generate(GPT(LLAMA, post_process=False), PROMPT, 4)
    with pytest.raises(ValueError, match="sequence-parallel"):
        KVCache(GPT(LLAMA, sequence_parallel=True))
    cache = KVCache(GPT(LLAMA), 8)
    with pytest.raises(ValueError, match=r"0 cached \+ 9 new positions > max_len=8"):
        GPT(LLAMA)(torch.zeros(1, 9, dtype=torch.long), cache=cache)


def _run_cli(argv) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(argv)
    return rc, out.getvalue(), err.getvalue()


BYTES = GPTConfig(vocab_size=256, n_layers=2, d_model=64, n_heads=4, max_seq_len=64)


@pytest.fixture
def run_folder(tmp_path):
    """A fastpar run folder: config.json (stdlib data: bytes) and one checkpoint."""
    from fastpar.train import save_checkpoint

    model = GPT(BYTES.replace(init_seed=3))
    run = tmp_path / "run"
    save_checkpoint(run / "checkpoints", 5, [model], None, None,
                    {"data_step": 5, "model_config": model.config.to_dict()})
    (run / "config.json").write_text(json.dumps({"train": {"data": None}}))
    return run, model


def test_cli_generates_from_a_checkpoint_and_its_run_folder(run_folder):
    run, model = run_folder
    prompt = list(b"def main(")
    want = bytes(prompt + generate(model, prompt, 12, temperature=0)).decode(errors="replace")
    for where in (run, run / "checkpoints" / "step_5"):
        rc, out, err = _run_cli(["generate", str(where), "--prompt", "def main(",
                                 "--max-new-tokens", "12", "--temperature", "0"])
        assert (rc, err) == (0, "") and out == want + "\n"
    sampled = [_run_cli(["generate", str(run), "--prompt", "x = ", "--max-new-tokens", "10",
                         "--top-k", "20", "--seed", "7"])[1] for _ in range(2)]
    assert sampled[0] == sampled[1] and sampled[0].startswith("x = ")


@pytest.mark.parametrize("args, words", [
    (["MISSING", "--prompt", "a"], ["is not a folder"]),
    (["EMPTY", "--prompt", "a"], ["neither a Hugging Face directory"]),
    (["RUN", "--prompt", "a" * 60, "--max-new-tokens", "10"], ["60 tokens", "max_seq_len=64"]),
    (["RUN", "--prompt", ""], ["prompt is empty"]),
    (["RUN", "--prompt", "a", "--max-new-tokens", "4", "--temperature", "-1"],
     ["temperature=-1.0"]),
    (["RUN", "--prompt", "a", "--max-new-tokens", "4", "--top-k", "-3"], ["top_k=-3"]),
    (["RUN", "--prompt", "a", "--tokenizer", "nonsense"], ["unknown tokenizer 'nonsense'"]),
])
def test_cli_bad_input_is_one_error_and_exit_2(run_folder, tmp_path, args, words):
    run, _ = run_folder
    (tmp_path / "EMPTY").mkdir()
    paths = {"RUN": str(run), "MISSING": str(tmp_path / "nope"), "EMPTY": str(tmp_path / "EMPTY")}
    rc, out, err = _run_cli(["generate", paths[args[0]], *args[1:]])
    assert rc == 2 and out == "" and len(err.strip().splitlines()) == 1
    assert err.startswith("fastpar generate: error: ")
    for w in words:
        assert w in err


def _cli_ranks(rank, world_size, argv):
    return _run_cli(argv)


def test_cli_on_a_hugging_face_dir_at_tp2_prints_once(tmp_path):
    _save_hf("llama", tmp_path, vocab=256)
    argv = ["generate", str(tmp_path), "--prompt", "hello", "--max-new-tokens", "16",
            "--temperature", "0.8", "--seed", "1"]
    one = _run_cli(argv)
    assert one[0] == 0 and one[1].startswith("hello")
    (rc0, out0, err0), (rc1, out1, err1) = run_ranks(_cli_ranks, 2, argv, init_pg=False,
                                                     timeout=120)
    assert (rc0, out0) == one[:2] and (rc1, out1) == (0, "")
    _save_hf("gpt2", tmp_path / "gpt2")             # vocabulary 300, no tokenizer.json: bytes
    rc, _, err = _run_cli(["generate", str(tmp_path / "gpt2"), "--prompt", "a"])
    assert rc == 2 and "vocabulary of 256, the model 300" in err
