"""DataParallel against torch DDP and the single-process full batch, at dp 2 and 4 (gloo).

One rank function per world size runs every data-parallel check, since each spawn costs seconds
here: training equality, no_sync with its collectives counted, overlap seen in recorded events,
reduce dtypes, unused and frozen parameters, the deferred wait a pipeline schedule uses; then
ZeRO-1 (dp_zero_checks.py), bad input (dp_error_checks.py) and, on 4 ranks, tp=2 x dp=2
(dp_tp_checks.py).
"""
import copy
import time

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.profiler import ProfilerActivity, profile

from dp_error_checks import error_checks
from dp_tp_checks import tp_by_dp_checks
from dp_zero_checks import zero_checks
from dp_zero3_checks import zero3_checks
from fastpar.data_parallel import DataParallel, DistributedOptimizer
from fastpar.testing import run_ranks

CAP_MB = 500 / 2**20           # 500-byte buckets: one per layer


def _mlp(seed=0, widths=(12, 24, 24, 6), dtype=torch.float32):
    torch.manual_seed(seed)
    layers = []
    for a, b in zip(widths[:-1], widths[1:]):
        layers += [nn.Linear(a, b, dtype=dtype), nn.GELU()]
    return nn.Sequential(*layers[:-1])


def _copy(model):
    return copy.deepcopy(model)


def _data(step, world, rank, rows=4, dtype=torch.float32):
    """The full batch of a step (same on every rank) and this rank's slice of it."""
    g = torch.Generator().manual_seed(1000 + step)
    x, y = torch.randn(rows * world, 12, generator=g), torch.randn(rows * world, 6, generator=g)
    x, y = x.to(dtype), y.to(dtype)
    return (x, y), (x.chunk(world)[rank], y.chunk(world)[rank])


def _collectives(fn):
    """How many c10d collectives ``fn`` ran, as torch's dispatcher records them."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return sum(1 for e in prof.events() if e.name.startswith("c10d::"))


def _train_equals_ddp_and_full_batch(rank, world):
    ref = _mlp()
    models = {"on": DataParallel(_copy(ref), bucket_cap_mb=CAP_MB),
              "off": DataParallel(_copy(ref), bucket_cap_mb=CAP_MB, overlap=False),
              "ddp": DDP(_copy(ref), bucket_cap_mb=CAP_MB), "single": ref}
    assert len(models["on"].bucket_specs) >= 3
    opts = {k: torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1)
            for k, m in models.items()}
    for step in range(4):
        (x, y), (xs, ys) = _data(step, world, rank)
        for k, m in models.items():
            a, b = (x, y) if k == "single" else (xs, ys)
            F.mse_loss(m(a), b).backward()
            opts[k].step()
            opts[k].zero_grad()
    params = {k: list(m.parameters()) for k, m in models.items()}
    for name, (on, off, ddp, single) in zip(dict(ref.named_parameters()),
                                            zip(*params.values())):
        assert torch.equal(on, off), f"{name}: overlap on and off differ"
        assert torch.allclose(on, ddp, atol=1e-6, rtol=0), f"{name}: {(on - ddp).abs().max()}"
        assert torch.allclose(on, single, atol=2e-5, rtol=0), f"{name}: vs single process"
    # Gradients are views into the bucket buffers: nothing was packed.
    dp = models["on"]
    (x, y), (xs, ys) = _data(9, world, rank)
    F.mse_loss(dp(xs), ys).backward()
    buffers = {b.buffer.untyped_storage().data_ptr() for b in dp._reducer.buckets}
    assert all(p.grad.untyped_storage().data_ptr() in buffers for p in dp.parameters())


def _no_sync_accumulates_without_communication(rank, world):
    ref = _mlp(seed=1)
    dp = DataParallel(_copy(ref), bucket_cap_mb=CAP_MB)
    micro = [_data(10 + m, world, rank) for m in range(3)]
    with dp.no_sync():
        inside = _collectives(lambda: [F.mse_loss(dp(xs), ys).backward()
                                       for _, (xs, ys) in micro[:2]])
    assert inside == 0, f"{inside} collectives ran inside no_sync"
    last = _collectives(lambda: F.mse_loss(dp(micro[2][1][0]), micro[2][1][1]).backward())
    assert last == len(dp.bucket_specs), last      # the buckets; no used-map without
    #                                                find_unused_parameters
    for (x, y), _ in micro:                             # reference: mean over ranks of the sums
        (F.mse_loss(ref(x), y, reduction="sum") / (y.numel() // world) / world).backward()
    for (n, p), q in zip(dp.module.named_parameters(), ref.parameters()):
        assert torch.allclose(p.grad, q.grad, atol=1e-5), f"{n}: {(p.grad - q.grad).abs().max()}"


def _overlap_seen_in_events(rank, world):
    for overlap in (True, False):
        dp = DataParallel(_mlp(widths=(64,) * 7), bucket_cap_mb=64 * 65 * 4 / 2**20,
                          overlap=overlap)
        assert len(dp.bucket_specs) == 6                # one per layer
        x = torch.randn(32, 64, requires_grad=True)
        end = []
        x.register_hook(lambda g: end.append(time.perf_counter_ns()))  # the last grad computed
        dp.events.enable()
        dp(x).square().mean().backward()
        ev = dp.events.take()
        launches = [t for name, _, t in ev if name == "launch"]
        assert [i for name, i, _ in ev if name == "launch"] == list(range(6))
        if overlap:      # the first buckets travel while earlier layers still compute
            assert launches[0] < launches[1] < end[0], (launches, end)
            assert sum(t < end[0] for t in launches) >= 4
        else:
            assert all(t > end[0] for t in launches)


def _reduce_dtypes(rank, world):
    for model_dtype, reduce_dtype in ((torch.bfloat16, torch.float32),
                                      (torch.float32, torch.bfloat16),
                                      (torch.bfloat16, None)):
        model = _mlp(seed=2, dtype=model_dtype)
        plain = _mlp(seed=2, dtype=model_dtype)
        dp = DataParallel(model, bucket_cap_mb=CAP_MB, reduce_dtype=reduce_dtype)
        _, (xs, ys) = _data(20, world, rank, dtype=model_dtype)
        F.mse_loss(dp(xs), ys).backward()
        F.mse_loss(plain(xs), ys).backward()
        for (n, p), q in zip(model.named_parameters(), plain.parameters()):
            every = [torch.empty_like(q.grad) for _ in range(world)]
            dist.all_gather(every, q.grad)
            mean = torch.stack([g.float() for g in every]).mean(0)
            assert p.grad.dtype == model_dtype
            assert torch.allclose(p.grad.float(), mean, atol=2e-2, rtol=2e-2), \
                f"{n} {model_dtype}/{reduce_dtype}: {(p.grad.float() - mean).abs().max()}"
        assert all(b.as_views == (reduce_dtype is None) for b in dp._reducer.buckets)


class _Branchy(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(3)
        self.body, self.extra, self.dead = nn.Linear(6, 6), nn.Linear(6, 6), nn.Linear(6, 6)
        self.frozen = nn.Linear(6, 6).requires_grad_(False)

    def forward(self, x, use_extra):
        x = self.frozen(self.body(x))
        return self.extra(x) if use_extra else x


def _unused_and_frozen(rank, world):
    model, ref = _Branchy(), _Branchy()
    dp = DataParallel(model, bucket_cap_mb=CAP_MB, find_unused_parameters=True)
    assert all(i < 6 for b in dp.bucket_specs for i in b.indices)   # frozen: not bucketed
    x = torch.randn(8 * world, 6)
    dp(x.chunk(world)[rank], rank == 0).sum().backward()   # extra: used on rank 0 only
    for r in range(world):
        ref(x.chunk(world)[r], r == 0).sum().div(world).backward()
    for name in ("body.weight", "body.bias", "extra.weight", "extra.bias"):
        got, want = model.get_parameter(name).grad, ref.get_parameter(name).grad
        assert torch.allclose(got, want, atol=1e-5), name
    assert model.dead.weight.grad is None and model.frozen.weight.grad is None


def _deferred_wait_for_pipelines(rank, world):
    ref = _mlp(seed=4)
    acc = DataParallel(_copy(ref), bucket_cap_mb=CAP_MB)       # the no_sync reference
    micro = [_data(30 + m, world, rank)[1] for m in range(3)]
    with acc.no_sync():
        for xs, ys in micro[:-1]:
            F.mse_loss(acc(xs), ys).backward()
    F.mse_loss(acc(micro[-1][0]), micro[-1][1]).backward()
    want = [p.grad.clone() for p in acc.parameters()]

    def run(stage, last_backward):
        for m, (xs, ys) in enumerate(micro):   # as a schedule drives a stage
            out = stage(xs)
            grad = torch.autograd.grad(F.mse_loss(out, ys), out)[0]
            last = m == len(micro) - 1
            stage.set_requires_gradient_sync(last, wait_in_backward=False)
            (last_backward if last else torch.autograd.backward)(out, grad)
        stage.events.enable()

    # 1F1B: the last backward starts the buckets and returns; finish waits after the schedule.
    stage = DataParallel(_copy(ref), bucket_cap_mb=CAP_MB)
    run(stage, torch.autograd.backward)
    assert stage._reducer.in_flight and stage._reducer._next == len(stage.bucket_specs)
    stage.finish_gradient_sync()
    for p, q in zip(stage.parameters(), want):
        assert torch.equal(p.grad, q)
    # Split backward (the first layer's weights in a second call): buckets start across calls.
    stage = DataParallel(_copy(ref), bucket_cap_mb=CAP_MB)
    late = list(stage.module[0].parameters())
    early = [p for p in stage.parameters() if all(p is not q for q in late)]

    def split(out, grad):
        torch.autograd.backward(out, grad, inputs=early, retain_graph=True)
        assert 0 < stage._reducer._next < len(stage.bucket_specs)
        torch.autograd.backward(out, grad, inputs=late)
    run(stage, split)
    stage.finish_gradient_sync()
    for p, q in zip(stage.parameters(), want):
        assert torch.allclose(p.grad, q, atol=1e-6)
    # Gradients set by hand, no hooks: reduce_gradients() averages them.
    stage = DataParallel(_copy(ref), bucket_cap_mb=CAP_MB)
    stage.set_requires_gradient_sync(False)
    for xs, ys in micro:
        grads = torch.autograd.grad(F.mse_loss(stage(xs), ys), list(stage.parameters()))
        for p, g in zip(stage.parameters(), grads):
            p.grad = g if p.grad is None else p.grad + g
    stage.reduce_gradients()
    for p, q in zip(stage.parameters(), want):
        assert torch.allclose(p.grad, q, atol=1e-6)
    # The next forward waits for a reduction left in flight; a backward into a started bucket
    # before that is an error.
    stage.set_requires_gradient_sync(True, wait_in_backward=False)
    stage(micro[0][0]).sum().backward()
    stage(micro[0][0])
    assert not stage._reducer.in_flight
    stage(micro[0][0]).sum().backward()
    with pytest.raises(RuntimeError, match="after its bucket's reduction had started"):
        stage.module(micro[0][0]).sum().backward()
    stage.finish_gradient_sync()


def _each_gradient_divided_once(rank, world):
    """A fresh gradient is divided as it is copied into its bucket, one accumulated in place
    by the launch: buckets holding both (here every one: weight accumulated, bias fresh) must
    still give each parameter the mean once, as DDP does."""
    ref = _mlp(seed=2)
    dp, ddp = DataParallel(_copy(ref), bucket_cap_mb=CAP_MB), DDP(_copy(ref), bucket_cap_mb=CAP_MB)
    for step in range(3):
        (_, _), (xs, ys) = _data(20 + step, world, rank)
        for m in (dp, ddp):
            for j, p in enumerate(m.parameters()):
                if j % 2:
                    p.grad = None                   # fresh: divided on the copy
                elif p.grad is not None:
                    p.grad.zero_()                  # in place into the view: divided at launch
            F.mse_loss(m(xs), ys).backward()
        for (n, p), q in zip(dp.module.named_parameters(), ddp.parameters()):
            assert torch.allclose(p.grad, q.grad, atol=1e-6, rtol=0), \
                f"step {step} {n}: {(p.grad - q.grad).abs().max()}"


def _all_checks(rank, world):
    torch.set_num_threads(1)
    _train_equals_ddp_and_full_batch(rank, world)
    _no_sync_accumulates_without_communication(rank, world)
    _each_gradient_divided_once(rank, world)
    _overlap_seen_in_events(rank, world)
    _reduce_dtypes(rank, world)
    _unused_and_frozen(rank, world)
    _deferred_wait_for_pipelines(rank, world)
    zero_checks(rank, world)
    zero3_checks(rank, world)
    errors = error_checks(rank, world)
    if world == 4:
        tp_by_dp_checks(rank, world)
    return errors


@pytest.mark.parametrize("world", [2, 4])
def test_data_parallel(world):
    errors = run_ranks(_all_checks, world, timeout=150)
    # Every rank raised the same errors (one names the rank it runs on).
    assert all(e.keys() == errors[0].keys() for e in errors) and len(errors[0]) == 17
    for case in errors[0]:
        if case not in ("shapes differ", "unused on some ranks"):
            assert all(e[case] == errors[0][case] for e in errors), case
    # A parameter used on rank 0 only: an error on the ranks without its gradient, not on 0.
    some = [e["unused on some ranks"] for e in errors]
    assert some[0] is None and all(m is not None and m == some[1] for m in some[1:])


def test_single_process_without_torch_distributed():
    """No group and no process group: the wrapper is the plain module, ZeRO-1 plain AdamW."""
    assert not dist.is_initialized()
    ref = _mlp(seed=5)
    dp = DataParallel(_copy(ref), bucket_cap_mb=CAP_MB)
    zero = DataParallel(_copy(ref), bucket_cap_mb=CAP_MB)
    opts = [torch.optim.AdamW(ref.parameters(), lr=1e-2),
            torch.optim.AdamW(dp.parameters(), lr=1e-2),
            DistributedOptimizer(zero, torch.optim.AdamW, lr=1e-2)]
    assert dp.dp_size == 1 and dp.dp_group is None
    for step in range(3):
        (x, y), _ = _data(step, 1, 0)
        for model, opt in zip((ref, dp, zero), opts):
            with dp.no_sync():                       # only dp's flag: the others still sync
                F.mse_loss(model(x[:2]), y[:2]).backward()
            F.mse_loss(model(x[2:]), y[2:]).backward()
            opt.step()
            opt.zero_grad()
    for p, q, r in zip(ref.parameters(), dp.parameters(), zero.parameters()):
        assert torch.equal(p, q) and torch.allclose(p, r, atol=1e-6, rtol=0)
