"""The GPT model: every TP layout (SP on/off) equals the single-device model; stages compose."""
import pytest
import torch
import torch.distributed as dist

from fastpar.models import GPT, GPTConfig, get_config
from fastpar.tensor_parallel import (ColumnParallelLinear, RowParallelLinear,
                                     VocabParallelEmbedding, reduce_replicated_grads)
from fastpar.testing import run_ranks

TINY = dict(vocab_size=200, n_layers=2, d_model=32, n_heads=4, max_seq_len=16, pad_vocab_to=64)


def _shard(module, name, full, tp, rank):
    """The slice of the single-device parameter ``full`` that this rank's ``module`` holds."""
    if isinstance(module, ColumnParallelLinear):       # each fused part (q, k, v) on its own
        blocks = full.split([n for _, n in module.parts], 0)
        return torch.cat([b.chunk(tp, 0)[rank] for b in blocks])
    if isinstance(module, VocabParallelEmbedding):
        return full.chunk(tp, 0)[rank]
    if isinstance(module, RowParallelLinear) and name == "weight":
        return full.chunk(tp, 1)[rank]
    return full


def _params(model, ref, tp, rank):
    """(name, shard, expected) for every parameter, via the module that owns it."""
    refs = dict(ref.named_parameters())
    for mname, module in model.named_modules():
        for pname, p in module.named_parameters(recurse=False):
            full = refs[f"{mname}.{pname}" if mname else pname]
            yield f"{mname}.{pname}", p, full, _shard(module, pname, full, tp, rank)


def _compare(rank, tp, cfg_kwargs, sp):
    g = dist.new_group(list(range(tp)))
    cfg = GPTConfig(**cfg_kwargs)
    ref = GPT(cfg)
    model = GPT(cfg, tp_group=g, sequence_parallel=sp)
    for name, p, _, expected in _params(model, ref, tp, rank):
        assert torch.equal(p, expected), f"init of {name} is not the slice of the full model"
    torch.manual_seed(5)
    tokens = torch.randint(0, cfg.vocab_size, (3, cfg.max_seq_len + 1))
    targets = tokens[:, 1:].clone()
    targets[0, :3] = -100                                     # some ignored positions
    loss_ref = ref(tokens[:, :-1], targets)
    loss = model(tokens[:, :-1], targets)
    loss_ref.backward()
    loss.backward()
    reduce_replicated_grads([model], g)      # the step's sum of SP's partial gradients
    assert torch.allclose(loss, loss_ref, rtol=1e-5, atol=1e-6), (loss.item(), loss_ref.item())
    for name, p, full, expected in _params(model, ref, tp, rank):
        grad = _shard(dict(model.named_modules())[name.rsplit(".", 1)[0]],
                      name.rsplit(".", 1)[1], full.grad, tp, rank)
        assert torch.allclose(p.grad, grad, rtol=1e-4, atol=1e-5), \
            f"{name} grad (tp={tp} sp={sp}): {(p.grad - grad).abs().max()}"
    return loss.item()


@pytest.mark.parametrize("tp", [2, 4])
def test_tp_gpt_equals_single_device(tp):
    # rmsnorm + swiglu + rotary + GQA, untied; then layernorm + gelu + learned positions, tied.
    a = dict(TINY, n_kv_heads=4 if tp == 4 else 2)
    b = dict(TINY, norm="layernorm", activation="gelu", rotary=False, tie_embeddings=True,
             bias=True)
    out = run_ranks(_all_layouts, tp, a, b, timeout=120)
    assert all(o == out[0] for o in out)


def _all_layouts(rank, tp, a, b):
    return [_compare(rank, tp, cfg, sp) for cfg in (a, b) for sp in (False, True)]


def test_stages_compose_to_the_full_model_and_recompute_matches():
    cfg = GPTConfig(**dict(TINY, n_layers=4))
    torch.manual_seed(0)
    tokens = torch.randint(0, cfg.vocab_size, (2, 9))
    full = GPT(cfg)
    first = GPT(cfg, layers=range(0, 2), post_process=False)
    last = GPT(cfg, layers=range(2, 4), pre_process=False)
    assert torch.equal(first.layers["1"].mlp.fc1.weight, full.layers["1"].mlp.fc1.weight)
    assert torch.equal(last.layers["3"].attn.qkv.weight, full.layers["3"].attn.qkv.weight)
    loss = full(tokens[:, :-1], tokens[:, 1:])
    assert torch.allclose(last(first(tokens[:, :-1]), tokens[:, 1:]), loss)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in full.named_parameters()}
    for mode in ("full", "selective"):
        full.zero_grad()
        full.recompute = mode
        full(tokens[:, :-1], tokens[:, 1:]).backward()
        for n, p in full.named_parameters():
            assert torch.allclose(p.grad, grads[n], atol=1e-6), f"recompute={mode}: {n}"


def test_padding_is_never_predicted():
    cfg = GPTConfig(**TINY)
    assert cfg.padded_vocab == 256
    logits = GPT(cfg)(torch.randint(0, 200, (1, 5)))
    assert logits.shape == (1, 5, 256)
    assert torch.isinf(logits[..., 200:]).all() and torch.isfinite(logits[..., :200]).all()


def test_bad_config():
    cases = [(lambda: GPTConfig(d_model=30, n_heads=4), "d_model=30 is not divisible"),
             (lambda: GPTConfig(n_heads=4, n_kv_heads=3), "n_kv_heads=3"),
             (lambda: GPTConfig(norm="batchnorm"), "norm='batchnorm'"),
             (lambda: get_config("huge"), "unknown model 'huge'"),
             (lambda: GPTConfig(n_heads=6, d_model=48).check_tp(4), "n_heads=6 is not divisible "
                                                                      "by tp=4"),
             (lambda: GPT(GPTConfig(**TINY), recompute="some"), "recompute='some'")]
    for make, needle in cases:
        with pytest.raises(ValueError, match=needle):
            make()


@pytest.mark.parametrize("extra", [{}, {"rotary": False, "tie_embeddings": True}])
def test_a_meta_build_and_init_weights_give_the_constructors_values(extra):
    cfg = GPTConfig(**TINY, **extra)
    ref = GPT(cfg)
    meta = GPT(cfg, device="meta")
    assert all(p.is_meta for p in meta.parameters())
    meta.reset_buffers("cpu")
    for (n, b), c in zip(meta.named_buffers(), ref.buffers()):
        assert not b.is_meta and torch.equal(b, c), n
    model = GPT(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_()
    one = model.layers["1"].mlp.down.weight
    rng = torch.get_rng_state()
    model.init_weights_([one])                      # only the parameters asked for
    assert torch.equal(one, ref.layers["1"].mlp.down.weight)
    assert not torch.equal(model.layers["0"].mlp.down.weight, ref.layers["0"].mlp.down.weight)
    model.init_weights_()
    assert torch.equal(torch.get_rng_state(), rng)  # the caller's RNG stream is not touched
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        assert torch.equal(p, q), n
