"""Point-to-point code under NCCL's rules (tests/nccl_rules.py), which gloo alone forgives.

The rules group catches an ungrouped ring (a deadlock at tp=2, a communicator-creation cycle at
tp>=3) with a clear error within its timeout; the extension's TP ring ops and the pipeline
executor's schedules run on it, with shards of several MB."""
import time
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from fastpar import extension
from fastpar.testing import run_ranks
from nccl_rules import NCCLRulesError, nccl_rules_group, patch_batch_isend_irecv

MB = 2 ** 20


def _naive_ring(group, x):
    """One all-gather ring step as the extension once issued it: send, then receive, ungrouped."""
    r, n = group.rank(), group.size()
    got = torch.empty_like(x)
    works = [group.send([x], (r + 1) % n, 0), group.recv([got], (r - 1) % n, 0)]
    for w in works:
        w.wait()
    return got


def _grouped_ring(group, x):
    r, n = group.rank(), group.size()
    got = torch.empty_like(x)
    ops_ = [dist.P2POp(dist.isend, x, (r + 1) % n, group),
            dist.P2POp(dist.irecv, got, (r - 1) % n, group)]
    for w in dist.batch_isend_irecv(ops_):
        w.wait()
    return got


def _ring(rank, world, kind):
    patch_batch_isend_irecv()
    group = nccl_rules_group(timeout=3) if kind != "gloo" else dist.new_group()
    x = torch.full((MB // 4,), float(rank))                 # 1 MB
    t0 = time.monotonic()
    try:
        got = (_grouped_ring if kind == "grouped" else _naive_ring)(group, x)
    except NCCLRulesError as e:
        return "error", str(e), time.monotonic() - t0
    assert torch.equal(got, torch.full_like(x, float((rank - 1) % world)))
    return "ok", "", time.monotonic() - t0


@pytest.mark.parametrize("world", [2, 3])
def test_rules_catch_an_ungrouped_ring_quickly(world):
    # gloo buffers the send: the naive ring passes there...
    assert {r[0] for r in run_ranks(_ring, world, "gloo", timeout=30)} == {"ok"}
    # ... under NCCL's rules it is a deadlock (tp=2: both pair streams start with a send) or a
    # cycle of pair-communicator creations (tp=3): a clear error on every rank, within seconds.
    results = run_ranks(_ring, world, "naive", timeout=30)
    assert [status for status, _, _ in results] == ["error"] * world, results
    for _, msg, seconds in results:
        if world == 2:
            assert "was not matched by a receive on rank" in msg and "deadlock" in msg, msg
        else:
            assert "creating the communicator of ranks" in msg, msg
        assert seconds < 10, f"the error took {seconds:.1f}s"
    # The same exchange as one group progresses.
    grouped = run_ranks(_ring, world, "grouped", timeout=30)
    assert {r[0] for r in grouped} == {"ok"}, grouped


def _close(a, b, what, tol=1e-4):
    assert a.shape == b.shape, f"{what}: {tuple(a.shape)} != {tuple(b.shape)}"
    err = ((a - b).abs().max() / b.abs().max()).item()
    assert err < tol, f"{what}: relative error {err:.2e}"


def _tp_ring_ops(rank, tp):
    group = nccl_rules_group(timeout=20)
    gloo = dist.new_group()
    torch.manual_seed(rank)
    m, k, n = 512, 1024, 256                      # a 2 MB shard of x, 0.5 MB blocks of output
    w = torch.randn(n, k)
    x = torch.randn(m, k)
    full = torch.empty(tp * m, k)
    dist.all_gather_into_tensor(full, x, group=gloo)
    out, gathered = extension.allgather_matmul(x, w, group)
    assert torch.equal(gathered, full)
    _close(out, full @ w.t(), f"allgather_matmul tp={tp}")
    xs = torch.randn(tp * m, k)
    ref = torch.empty(m, n)
    dist.reduce_scatter_tensor(ref, xs @ w.t(), group=gloo)
    _close(extension.matmul_reducescatter(xs, w, group), ref, f"matmul_reducescatter tp={tp}")
    assert not any(grouped is False for _, _, grouped in group.events), group.events
    return True


@pytest.mark.parametrize("tp", [2, 3, 4])
def test_tp_ring_ops_run_under_nccl_rules(tp):
    assert run_ranks(_tp_ring_ops, tp, timeout=90) == [True] * tp


def _tp_layers(rank, tp):
    """Column -> Row with sequence parallelism and overlap, forward and backward, on the rules
    group: every ring and collective of the layers' paths."""
    from fastpar.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    group = nccl_rules_group(timeout=20)
    torch.manual_seed(0)
    fc1 = ColumnParallelLinear(64, 128, tp_group=group, sequence_parallel=True)
    fc2 = RowParallelLinear(128, 64, tp_group=group, sequence_parallel=True)
    x = torch.randn(8 * tp, 2, 64)
    shard = x.chunk(tp)[rank].clone().requires_grad_()
    y = fc2(torch.nn.functional.gelu(fc1(shard)))
    y.square().sum().backward()
    torch.manual_seed(0)
    ref1, ref2 = torch.nn.Linear(64, 128), torch.nn.Linear(128, 64)
    xr = x.clone().requires_grad_()
    yr = ref2(torch.nn.functional.gelu(ref1(xr)))
    yr.square().sum().backward()
    _close(y, yr.chunk(tp)[rank], "output")
    _close(shard.grad, xr.grad.chunk(tp)[rank], "input grad")
    _close(fc1.weight.grad, ref1.weight.grad.chunk(tp)[rank], "fc1 weight grad")
    _close(fc2.weight.grad, ref2.weight.grad.chunk(tp, dim=1)[rank], "fc2 weight grad")
    return True


@pytest.mark.parametrize("tp", [2, 4])
def test_tp_layers_run_under_nccl_rules(tp):
    assert run_ranks(_tp_layers, tp, timeout=90) == [True] * tp


def _schedules(rank, pp):
    from test_pp_executor import CONFIGS, _one_schedule
    patch_batch_isend_irecv()
    group = nccl_rules_group(timeout=20)
    mesh = SimpleNamespace(pp_size=pp, pp_rank=rank, pp_group=group)
    for name, v in CONFIGS:
        _one_schedule(mesh, name, v, m=2 * pp)
    kinds = {grouped for _, _, grouped in group.events}
    return kinds, sorted(group._pairs)


@pytest.mark.parametrize("pp", [2, 4])
def test_pipeline_schedules_run_under_nccl_rules(pp):
    results = run_ranks(_schedules, pp, timeout=150)
    # Every transfer, the first step's shape handshake included, went as a batch on the
    # pipeline group's communicator: no rank created a communicator for a pair of ranks.
    assert [kinds for kinds, _ in results] == [{True}] * pp, results
    assert [pairs for _, pairs in results] == [[]] * pp, results


def _zero3(rank, world):
    """ZeRO-3 training (prefetched all-gathers on their own stream, reduce-scatters from backward
    hooks, two in flight) on the rules group: the same weights as over plain gloo."""
    from dp_zero3_checks import _build, _steps
    patch_batch_isend_irecv()
    group = nccl_rules_group(timeout=20)
    out = []
    for g in (group, None):
        model, opt = _build(3, torch.float32, dict(dp_group=g), prefetch=2)
        _steps(model, opt, world, rank, torch.float32, 2, 2)
        with opt.gathered():
            out.append([p.detach().clone() for p in model.parameters()])
    return all(torch.equal(a, b) for a, b in zip(*out))


@pytest.mark.parametrize("world", [2, 4])
def test_zero3_runs_under_nccl_rules(world):
    assert run_ranks(_zero3, world, timeout=90) == [True] * world


def _moe_dispatch(rank, world_size):
    from test_moe_ep import _equal
    group = nccl_rules_group(timeout=20)
    return _equal(rank, world_size, 2, {}, False, group=group)


@pytest.mark.parametrize("world", [2, 4])
def test_moe_dispatch_runs_under_nccl_rules(world):
    """Expert parallelism's all-to-alls (the counts, then each chunk's dispatch and return,
    several in flight at once, both directions) on the NCCL-rules group: the layer equals the
    single-rank one."""
    assert run_ranks(_moe_dispatch, world, timeout=120) == [r * 8 // world for r in range(world)]
