"""DistributedOptimizer.step: one optimizer launch per parameter group, whatever the number of
buckets; a non-finite step skipped on the device; clipping without a host sync.

On a GPU every launch and every host sync of a step delays the next step's launches. Launches are
counted here by wrapping ``torch._fused_adamw_`` (torch's fused AdamW kernel, which
``torch.optim.AdamW(fused=True)`` calls once per parameter group and device), host syncs with
:func:`fastpar.testing.count_host_syncs`.
"""
import contextlib

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from fastpar.data_parallel import DataParallel, DistributedOptimizer
from fastpar.testing import count_host_syncs, run_ranks

CAP_MB = 200 / 2**20            # 200-byte buckets: one per layer


def _mlp(seed=0, dtype=torch.float32):
    torch.manual_seed(seed)
    widths = [10, 12, 11, 9, 13, 7, 8, 5]              # 7 layers: 7 buckets of 200 bytes
    layers = [m for a, b in zip(widths, widths[1:]) for m in (nn.Linear(a, b), nn.GELU())]
    return nn.Sequential(*layers[:-1]).to(dtype)


def _groups(model):
    """Two parameter groups, as the trainer's: weights decay, biases do not."""
    named = list(model.named_parameters())
    return [{"params": [p for n, p in named if n.endswith("weight")], "weight_decay": 0.1},
            {"params": [p for n, p in named if n.endswith("bias")], "weight_decay": 0.0}]


def _batch(step, world, rank):
    g = torch.Generator().manual_seed(700 + step)
    x, y = torch.randn(4 * world, 10, generator=g), torch.randn(4 * world, 5, generator=g)
    return x.chunk(world)[rank], y.chunk(world)[rank]


@contextlib.contextmanager
def _count_fused_adamw():
    """Count calls of torch's fused AdamW kernel (adam.py looks it up on each call)."""
    calls, inner = [], torch._fused_adamw_

    def counted(params, *args, **kwargs):
        calls.append(len(params))
        return inner(params, *args, **kwargs)

    torch._fused_adamw_ = counted
    try:
        yield calls
    finally:
        torch._fused_adamw_ = inner


def _one_launch_per_group(rank, world):
    torch.set_num_threads(1)
    plain = DataParallel(_mlp().to(torch.float32), bucket_cap_mb=CAP_MB)
    ref = torch.optim.AdamW(_groups(plain.module), lr=1e-2, fused=True)
    models, opts = {}, {}
    for name, kw in (("sharded", dict(shard=True)), ("unsharded", dict(shard=False)),
                     ("per bucket", dict(shard=True, overlap_step=True))):
        models[name] = DataParallel(_mlp(), bucket_cap_mb=CAP_MB)
        opts[name] = DistributedOptimizer(models[name], torch.optim.AdamW,
                                          [{"params": [p for n, p in models[name].module.
                                                       named_parameters() if n.endswith("bias")],
                                            "weight_decay": 0.0}],
                                          lr=1e-2, weight_decay=0.1, fused=True, **kw)
    buckets = len(models["sharded"].bucket_specs)
    launches = {name: [] for name in ("plain", *models)}
    for step in range(3):
        x, y = _batch(step, world, rank)
        F.mse_loss(plain(x), y).backward()
        with _count_fused_adamw() as calls:
            ref.step()
        launches["plain"].append(len(calls))
        ref.zero_grad()
        for name, model in models.items():
            with _count_fused_adamw() as calls:      # overlap_step steps inside backward
                F.mse_loss(model(x), y).backward()
                opts[name].step()
            launches[name].append(len(calls))
            opts[name].zero_grad()
    for o in opts.values():
        o.finish_param_sync()
    # Weights and moments equal torch's fused AdamW on the plain model: to rounding for the
    # sharded ones (a flat shard and a parameter split the CPU kernel's vector body and scalar
    # tail at other elements, which rounds differently on some CPUs; bit for bit on others).
    same = {name: all(torch.allclose(p, q, rtol=1e-6, atol=1e-9)
                      for p, q in zip(plain.parameters(), m.parameters()))
            for name, m in models.items()}
    same["unsharded bits"] = all(torch.equal(p, q) for p, q in
                                 zip(plain.parameters(), models["unsharded"].parameters()))
    moments = all(torch.equal(ref.state[p]["exp_avg"], opts["unsharded"].state[q]["exp_avg"])
                  for p, q in zip(plain.parameters(), models["unsharded"].parameters()))
    return {"buckets": buckets, "launches": launches, "same": same, "moments": moments,
            "groups": len(opts["sharded"].param_groups)}


def test_one_fused_adamw_launch_per_param_group_per_step():
    out = run_ranks(_one_launch_per_group, 2, timeout=60)
    for rank, r in enumerate(out):
        assert r["buckets"] == 7, r["buckets"]             # many buckets...
        launches = r["launches"]
        assert launches["plain"] == [2, 2, 2]               # torch's own: one per group
        # ... yet one launch per parameter group and step, sharded and unsharded.
        assert launches["sharded"] == launches["unsharded"] == [r["groups"]] * 3 == [2] * 3, \
            (rank, launches)
        # Stepping bucket by bucket (overlap_step, the opt-in exception) launches per bucket.
        assert all(n >= r["buckets"] for n in launches["per bucket"]), (rank, launches)
        assert r["same"] == {"sharded": True, "unsharded": True, "per bucket": True,
                             "unsharded bits": True}, r["same"]
        assert r["moments"]


def _step_state(model, opt):
    """Copies of the weights, fp32 masters and every optimizer state tensor."""
    state = [t.clone() for s in opt.optimizer.state.values() for t in s.values()]
    return ([p.detach().clone() for p in model.parameters()],
            [m.clone() for m in opt._master], state)


def _equal(a, b):
    return all(torch.equal(x, y) for xs, ys in zip(a, b) for x, y in zip(xs, ys, strict=True))


@pytest.mark.parametrize("shard", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_nonfinite_step_is_skipped_on_the_device(shard, dtype):
    """found_inf set: weights, masters, moments and step counts stay as they were, and the
    host never waits; found_inf clear: the step is an ordinary one."""
    model = DataParallel(_mlp(dtype=dtype), bucket_cap_mb=CAP_MB,
                         reduce_dtype=torch.float32 if dtype != torch.float32 else None)
    opt = DistributedOptimizer(model, torch.optim.AdamW, _groups(model.module), shard=shard,
                               lr=1e-2, fused=True)
    x, y = _batch(0, 1, 0)

    def backward(poison):
        F.mse_loss(model(x.to(dtype)).float(), y).backward()
        if poison:
            model._reducer.mean_grads(model._reducer.buckets[0]).view(-1)[0] = float("nan")
        norm = opt.clip_grad_norm_(1.0)
        return (~torch.isfinite(norm)).float()

    opt.step(found_inf=backward(False))                # the state exists from here on
    opt.zero_grad()
    before = _step_state(model, opt)
    with count_host_syncs() as syncs:
        opt.step(found_inf=backward(True))
    opt.zero_grad()
    assert syncs == []
    assert _equal(_step_state(model, opt), before)
    assert all(s["step"].item() == 1 for s in opt.optimizer.state.values())
    opt.step(found_inf=backward(False))
    assert not _equal(_step_state(model, opt)[:2], before[:2])
    assert all(s["step"].item() == 2 for s in opt.optimizer.state.values())


def test_found_inf_without_a_fused_optimizer_is_read_on_the_host():
    model = DataParallel(_mlp(), bucket_cap_mb=CAP_MB)
    opt = DistributedOptimizer(model, torch.optim.AdamW, lr=1e-2, foreach=True)
    before = [p.detach().clone() for p in model.parameters()]
    F.mse_loss(model(torch.randn(3, 10)), torch.randn(3, 5)).backward()
    with count_host_syncs() as syncs:
        opt.step(found_inf=torch.ones(()))
    assert len(syncs) == 1 and syncs[0].startswith("item"), syncs
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
    assert opt.optimizer.state == {}                   # never stepped
    model = DataParallel(_mlp())
    opt = DistributedOptimizer(model, torch.optim.AdamW, overlap_step=True, fused=True)
    F.mse_loss(model(torch.randn(3, 10)), torch.randn(3, 5)).backward()
    with pytest.raises(ValueError, match="found_inf cannot skip a step with overlap_step"):
        opt.step(found_inf=torch.zeros(()))


def test_clipping_stays_on_the_device_and_equals_torch():
    ref, model = _mlp(), DataParallel(_mlp(), bucket_cap_mb=CAP_MB)
    opt = DistributedOptimizer(model, torch.optim.AdamW, shard=False, lr=1e-2)
    x, y = _batch(1, 1, 0)
    for m in (ref, model):
        F.mse_loss(m(x), y).backward()
    want = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)
    with count_host_syncs() as syncs:
        got = opt.clip_grad_norm_(0.05)
    assert syncs == [] and torch.is_tensor(got)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
    for p, q in zip(ref.parameters(), model.parameters()):
        torch.testing.assert_close(opt.master_of(q).grad, p.grad, rtol=1e-6, atol=1e-9)
    assert got > 0.05                                  # the gradients were scaled down


def test_a_loaded_step_count_is_placed_where_its_optimizer_steps():
    """A checkpoint loader writes ``state[p]["step"]``: a fused optimizer steps it on the
    parameters' device in fp32 (as torch's load_state_dict places it), a foreach one on the
    host, as given."""
    for kernel, dtype in ((dict(fused=True), torch.float32), (dict(foreach=True), torch.float64)):
        model = DataParallel(_mlp())
        opt = DistributedOptimizer(model, torch.optim.AdamW, shard=False, **kernel)
        p = next(model.parameters())
        opt.state[p]["step"] = torch.tensor(3.0, dtype=torch.float64)
        step = opt.optimizer.state[opt.master_of(p)]["step"]
        assert step.dtype == dtype and step.device == opt.master_of(p).device and step == 3
