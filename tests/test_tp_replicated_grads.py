"""Parameters replicated over TP whose gradients are partial under sequence parallelism (norms,
row biases, learned positions): summed over TP once per step in one all-reduce, after the DP
sync, wherever the gradient lives (``.grad``, fp32 main gradients, packed buckets, ZeRO-1
shards), and the step's gradients equal the single-process model's."""
import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import fastpar
from fastpar.data_parallel import DataParallel, DistributedOptimizer
from fastpar.models import GPT, GPTConfig
from fastpar.tensor_parallel import (mark_partial_grads, partial_grad_params,
                                     reduce_replicated_grads)
from fastpar.tensor_parallel.sharding import tp_params
from fastpar.testing import run_ranks
from fastpar.train.step import forward_backward

BASE = dict(vocab_size=64, d_model=32, n_heads=4, max_seq_len=16, pad_vocab_to=32)
# rmsnorm, rotary, no bias: the norms only; layernorm + bias + learned positions: all three kinds.
CONFIGS = {"rms": {}, "ln-bias-pos": dict(norm="layernorm", activation="gelu", bias=True,
                                          rotary=False)}


def _marked(cfg: GPTConfig) -> int:
    """How many parameters of the whole model get partial gradients under SP."""
    if cfg.norm == "rmsnorm":
        return 2 * cfg.n_layers + 1                       # norm1, norm2 per layer, final norm
    return 2 * (2 * cfg.n_layers + 1) + 2 * cfg.n_layers + (0 if cfg.rotary else 1)


def _expected_grads(model, ref, tp, rank):
    """name -> (this rank's parameter, the slice of the single-process gradient it holds)."""
    from test_model import _params, _shard             # how test_model slices the full model
    modules = dict(model.named_modules())
    return {name: (p, _shard(modules[name.rsplit(".", 1)[0]], name.rsplit(".", 1)[1],
                             full.grad, tp, rank))
            for name, p, full, _ in _params(model, ref, tp, rank)}


def _batch(rows):
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, BASE["vocab_size"], (rows, BASE["max_seq_len"] + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def _count_tp_all_reduces(tp_group, fn):
    """(result of fn(), sizes of the all-reduces fn issued over ``tp_group``)."""
    sizes, original = [], dist.all_reduce

    def counting(tensor, *args, group=None, **kwargs):
        if group is tp_group:
            sizes.append(tensor.numel())
        return original(tensor, *args, group=group, **kwargs)
    dist.all_reduce = counting
    try:
        return fn(), sizes
    finally:
        dist.all_reduce = original


def _one_all_reduce_per_step(rank, world):
    mesh = fastpar.init(tp=2)
    out = {}
    for name, extra in CONFIGS.items():
        for layers, M in ((2, 2), (3, 1)):
            cfg = GPTConfig(**BASE, **extra, n_layers=layers)
            ref, model = GPT(cfg), GPT(cfg, tp_group=mesh.tp_group, sequence_parallel=True)
            marked = partial_grad_params([model])
            assert len(marked) == _marked(cfg), (name, len(marked))
            x, y = _batch(2 * M)
            ddp = DataParallel(model, dp_group=mesh.dp_group)          # dp=1, as the trainer
            _, sizes = _count_tp_all_reduces(
                mesh.tp_group, lambda: forward_backward([model], ddp, None, x, y, M, mesh))
            # One all-reduce, of every marked gradient at once, whatever L and M.
            out[(name, layers, M)] = sizes
            assert sizes == [sum(p.numel() for p in marked)], (name, layers, M, sizes)
            ref(x, y).backward()
            for pname, (p, want) in _expected_grads(model, ref, 2, mesh.tp_rank).items():
                assert torch.allclose(p.grad, want, rtol=1e-4, atol=1e-5), \
                    f"{name} L={layers} M={M} {pname}: {(p.grad - want).abs().max()}"
        # Without SP nothing is marked and the reduction sends nothing.
        plain = GPT(GPTConfig(**BASE, **extra, n_layers=2), tp_group=mesh.tp_group)
        plain(*_batch(2)).backward()
        assert partial_grad_params([plain]) == []
        n, sizes = _count_tp_all_reduces(
            mesh.tp_group, lambda: reduce_replicated_grads([plain], mesh.tp_group))
        assert (n, sizes) == (0, []), (n, sizes)
    return out


def test_replicated_grads_are_one_all_reduce_per_step_and_exact():
    out = run_ranks(_one_all_reduce_per_step, 2, init_pg=False, timeout=120)
    assert out[0] == out[1] and all(len(v) == 1 for v in out[0].values()), out


def _pipeline_step(rank, world):
    from fastpar.pipeline import PipelineExecutor, build_schedule
    from fastpar.train.step import loss_fn
    mesh = fastpar.init(tp=2, pp=2)
    M, first = 2, mesh.pp_rank == 0
    x, y = _batch(4)
    out = []
    # zb-h1: a split backward, each W after its B (with the rotary config: learned positions
    # get no gradient under zb-h1 whatever the layout).
    for schedule, name in (("1f1b", "ln-bias-pos"), ("zb-h1", "rms")):
        cfg = GPTConfig(**BASE, **CONFIGS[name], n_layers=2)
        ref = GPT(cfg)
        ref(x, y).backward()
        stage = GPT(cfg, tp_group=mesh.tp_group, sequence_parallel=True,
                    layers=[mesh.pp_rank], pre_process=first, post_process=not first)
        ddp = DataParallel(nn.ModuleList([stage]), dp_group=mesh.dp_group)
        pipe = PipelineExecutor([stage], build_schedule(schedule, 2, M), mesh.pp_group,
                                loss_fn=loss_fn(mesh.tp_group))
        _, sizes = _count_tp_all_reduces(
            mesh.tp_group, lambda: forward_backward([stage], ddp, pipe, x, y, M, mesh))
        assert sizes == [sum(p.numel() for p in partial_grad_params([stage]))], sizes
        for pname, (p, want) in _expected_grads(stage, ref, 2, mesh.tp_rank).items():
            assert torch.allclose(p.grad, want, rtol=1e-4, atol=1e-5), \
                f"{schedule} stage {mesh.pp_rank} {pname}: {(p.grad - want).abs().max()}"
        out.append(len(partial_grad_params([stage])))
    return out


def test_pipeline_step_reduces_once_after_the_schedule():
    # 1f1b, layernorm + biases + positions: stage 0 holds the positions and layer 0 (2 norms
    # with biases, 2 row biases), stage 1 layer 1 and the final norm. zb-h1, rmsnorm: layer 0's
    # 2 norms; layer 1's and the final norm.
    counts = run_ranks(_pipeline_step, 4, init_pg=False, timeout=120)
    assert sorted(map(tuple, counts)) == [(7, 2), (7, 2), (8, 3), (8, 3)], counts


# DataParallel / optimizer variants of a tp=2 x dp=2 step: where the reduced gradient lives.
VARIANTS = {
    "grad views": (dict(), None),                                   # .grad views of buckets
    "packed fp64 buckets": (dict(reduce_dtype=torch.float64), None),  # .grad copies
    "packed, DistributedOptimizer": (dict(reduce_dtype=torch.float64), dict(shard=False)),
    "fp32 main grads": (dict(main_grads=True), dict(shard=False)),  # p.main_grad
    "ZeRO-1": (dict(), dict(shard=True)),                           # this rank's bucket shards
    "ZeRO-1, main grads": (dict(main_grads=True), dict(shard=True)),
}


def _step_equals_single_process(rank, world):
    mesh = fastpar.init(tp=2)
    assert (mesh.tp_size, mesh.dp_size) == (2, 2)
    cfg = GPTConfig(**BASE, **CONFIGS["ln-bias-pos"], n_layers=2)
    M, rows = 2, 8
    x, y = _batch(rows)
    ref = GPT(cfg)
    ref(x, y).backward()                      # equal micro-batches: the mean over all tokens
    ref_norm = torch.nn.utils.get_total_norm([p.grad for p in ref.parameters()])
    share = slice(mesh.dp_rank * rows // 2, (mesh.dp_rank + 1) * rows // 2)
    for name, (dp_kw, opt_kw) in VARIANTS.items():
        model = GPT(cfg, tp_group=mesh.tp_group, sequence_parallel=True)
        ddp = DataParallel(model, dp_group=mesh.dp_group, bucket_cap_mb=4096 / 2**20, **dp_kw)
        opt = torch.optim.SGD(model.parameters(), lr=1.0) if opt_kw is None else \
            DistributedOptimizer(ddp, torch.optim.SGD, lr=1.0, **opt_kw)
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        forward_backward([model], ddp, None, x[share], y[share], M, mesh)
        if opt_kw is not None:                # the optimizer's norm: whole gradients, TP summed
            split = {id(p) for p, is_split in tp_params([model]) if is_split}
            norm = opt.clip_grad_norm_(1e9, groups=[mesh.tp_group],
                                       counted=lambda p: id(p) in split or mesh.tp_rank == 0)
            assert torch.allclose(norm, ref_norm, rtol=1e-4), (name, norm, ref_norm)
        opt.step()                            # SGD, lr 1: each parameter moves by its gradient
        for pname, (p, want) in _expected_grads(model, ref, 2, mesh.tp_rank).items():
            got = before[pname] - p.detach()
            assert torch.allclose(got, want, rtol=1e-4, atol=2e-5), \
                f"{name}: {pname} moved by {(got - want).abs().max()} off its gradient"
    return len(VARIANTS)


def test_tp2_dp2_every_gradient_home_steps_as_single_process():
    assert run_ranks(_step_equals_single_process, 4, init_pg=False, timeout=120) == \
        [len(VARIANTS)] * 4


def test_bad_marks_and_modules_are_one_clear_error():
    norm = nn.LayerNorm(4)
    with pytest.raises(ValueError, match=r"LayerNorm has no parameter\(s\) \['scale'\]"):
        mark_partial_grads(norm, "weight", "scale")
    mark_partial_grads(norm, "weight")
    mark_partial_grads(norm, "weight", "bias")
    assert partial_grad_params([norm, norm]) == [norm.weight, norm.bias]
    with pytest.raises(ValueError, match="modules must be nn.Module"):
        reduce_replicated_grads([norm, "head"], None)
    assert reduce_replicated_grads(norm, None) == 0       # one process: nothing to sum
