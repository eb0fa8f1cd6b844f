"""The GPT under context parallelism: each CP rank's logits are the full model's at its tokens'
true positions, and the CP ranks' gradients sum to the full model's, with rotary and with
learned positions (GPT-2), GQA, at cp 2 and 4."""
import pytest
import torch
import torch.distributed as dist

from fastpar.context_parallel import positions, shard_sequence
from fastpar.models import GPT, GPTConfig, KVCache
from fastpar.testing import run_ranks

CONFIGS = {
    "llama-gqa": GPTConfig(vocab_size=96, n_layers=2, d_model=64, n_heads=4, n_kv_heads=2,
                           max_seq_len=48),
    "gpt2": GPTConfig(vocab_size=96, n_layers=2, d_model=64, n_heads=4, max_seq_len=48,
                      norm="layernorm", activation="gelu", rotary=False, bias=True,
                      tie_embeddings=True),
}


def _cp_equals_full(rank, world_size, name):
    cfg = CONFIGS[name]
    torch.manual_seed(0)
    tokens = torch.randint(0, cfg.vocab_size, (2, 48))
    targets = torch.randint(0, cfg.vocab_size, (2, 48))
    full = GPT(cfg)
    z = full(tokens)
    full(tokens, targets).backward()
    model = GPT(cfg, cp_group=dist.group.WORLD)
    local = shard_sequence(tokens, rank, world_size, dim=1)
    z_local = model(local)
    mine = positions(48, rank, world_size)
    torch.testing.assert_close(z_local, z[:, mine], atol=1e-5, rtol=1e-5)
    # Each rank's loss is the mean over its tokens; averaged over the CP ranks it is the full
    # model's mean, so the averaged gradients are the full model's.
    model(local, shard_sequence(targets, rank, world_size, dim=1)).backward()
    for (n, p), q in zip(model.named_parameters(), full.parameters()):
        g = p.grad.clone()
        dist.all_reduce(g)
        torch.testing.assert_close(g / world_size, q.grad, atol=1e-5, rtol=1e-4, msg=n)
    with pytest.raises(ValueError, match="dropout=0.1 with context parallelism"):
        GPT(cfg.replace(dropout=0.1), cp_group=dist.group.WORLD)
    with pytest.raises(ValueError, match="does not run a context-parallel model"):
        KVCache(model)
    return True


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("cp", [2, 4])
def test_context_parallel_gpt_equals_the_full_model(name, cp):
    assert all(run_ranks(_cp_equals_full, cp, name, timeout=120))
