"""Expert parallelism (``MoE(ep_group=...)``): each rank holds n_experts / ep experts, tokens go
to them by all-to-all and come back. Over gloo at ep 2 and 4: outputs, the input's and the
router's gradients equal the single-process layer's on each rank's tokens; each local expert's
gradient is the sum over the ranks of the reference's; at any number of chunks, with capacity,
with shared experts, under bf16 autocast. The dispatch travels while experts compute (progress
probe); one chunk: nothing in flight while the experts compute."""
import contextlib
import time

import pytest
import torch
import torch.distributed as dist

from fastpar.mesh import collectives
from fastpar.models import moe as moe_mod
from fastpar.models.moe import MoE
from fastpar.testing import run_ranks


def _pair(rank, ep, chunks, group=None, **kw):
    torch.manual_seed(0)
    ref = MoE(32, 8, 2, 48, **kw)
    torch.manual_seed(0)
    got = MoE(32, 8, 2, 48, ep_group=group or dist.group.WORLD, ep_chunks=chunks, **kw)
    with torch.no_grad():           # the same weights: the slice of the whole
        for name, p in got.named_parameters():
            q = ref.get_parameter(name)
            p.copy_(q[rank * p.shape[0]:(rank + 1) * p.shape[0]] if name.startswith("experts.")
                    else q)
    return ref, got


def _equal(rank, world_size, chunks, kw, autocast, group=None):
    """``group``: the ep group (default: the world's gloo group). ``kw["steer"]``: every
    token routed to rank 0's experts (rank 0 sends nothing, the others keep nothing)."""
    kw = dict(kw)
    steer = kw.pop("steer", False)
    ref, got = _pair(rank, world_size, chunks, group, **kw)
    if steer:
        for m in (ref, got):
            m.router.bias[:8 // world_size] = 10.0
    torch.manual_seed(10 + rank)                # each rank its own tokens, a different count
    x = torch.randn(5 + 3 * rank, 2, 32)
    xr, xg = x.clone().requires_grad_(), x.clone().requires_grad_()
    w = torch.randn(5 + 3 * rank, 2, 32)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        yr, yg = ref(xr)[0], got(xg)[0]
    tol = dict(atol=2e-2, rtol=2e-2) if autocast else dict(atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(yg, yr, **tol)
    for t in ("tokens", "dropped", "aux"):
        torch.testing.assert_close(got.stats[t], ref.stats[t])
    (yr.float() * w).sum().backward()
    (yg.float() * w).sum().backward()
    torch.testing.assert_close(xg.grad, xr.grad, **tol)
    for name, p in got.named_parameters():
        q = ref.get_parameter(name).grad
        if name.startswith("experts."):
            q = q.clone()
            dist.all_reduce(q)                  # every rank's tokens reach these experts
            n = p.shape[0]
            q = q[rank * n:(rank + 1) * n]
        torch.testing.assert_close(p.grad, q, msg=name, **tol)
        assert getattr(p, "expert_parallel", False) == name.startswith("experts.")
    return got.experts.first


@pytest.mark.parametrize("ep,chunks,kw,autocast", [
    (2, 2, {}, False), (2, 1, {}, False), (4, 3, {}, False),
    (2, 2, dict(n_shared=1, shared_gate=True, norm_topk=False), False),
    (2, 2, dict(capacity_factor=1.0), False),
    (2, 2, dict(steer=True), False), (4, 2, dict(steer=True), False),
    (2, 2, {}, True)])
def test_expert_parallel_equals_one_rank(ep, chunks, kw, autocast):
    firsts = run_ranks(_equal, ep, chunks, kw, autocast, timeout=90)
    assert firsts == [r * 8 // ep for r in range(ep)]


@contextlib.contextmanager
def recording(events, phases=()):
    """Within: each all-to-all the MoE layer issues and waits for, and each call of the expert
    ``phases`` (functions of fastpar.models.moe), appended to ``events`` in order."""
    real_a2a, real = moe_mod._a2a, {k: getattr(moe_mod, k) for k in phases}

    def a2a(*args, **kwargs):
        work, n = real_a2a(*args, **kwargs), len(events)
        events.append(("issue", n))

        class Work:
            def wait(self):
                events.append(("wait", n))
                return work.wait()
        return Work()

    def probed(name):
        def compute(*args, **kwargs):
            events.append((name, None))
            return real[name](*args, **kwargs)
        return compute
    moe_mod._a2a = a2a
    for k in real:
        setattr(moe_mod, k, probed(k))
    try:
        yield events
    finally:
        moe_mod._a2a = real_a2a
        for k, f in real.items():
            setattr(moe_mod, k, f)


def _events(layer, phases=(), events=None):
    """Forward and backward of ``layer``, recording in ``events`` (returned) each all-to-all
    issued and waited for and each call of the expert ``phases``, in order."""
    events = [] if events is None else events
    with recording(events, phases):
        x = torch.randn(16, 2, layer.router.weight.shape[1], requires_grad=True)
        y = layer(x)[0]
        events.append(("backward", None))
        y.square().sum().backward()
    return events


def _own_order(rank, world_size):
    """The order of the layer's transfers (issued, waited) and expert computations."""
    torch.manual_seed(0)
    layer = MoE(64, 4, 2, 96, ep_group=dist.group.WORLD, ep_chunks=2)
    return _events(layer, ("_expert_forward", "_expert_dx", "_expert_dw"))


def test_own_rows_compute_while_the_transfers_travel():
    """The rows a rank routes to its own experts are computed straight from its input, under
    the transfers. Forward: half of them after both chunks' dispatches are issued, before any
    is waited for; the other half after the last chunk's return is issued, before it is
    waited for. Backward: all of them after the gradients' dispatches are issued, before any
    is waited for; every weight gradient after the last input gradient's return is issued,
    before any return is waited for."""
    for events in run_ranks(_own_order, 2, timeout=90):
        split = events.index(("backward", None))
        fwd, bwd = events[:split], events[split + 1:]
        kinds = [e for e, _ in fwd]
        computes = [i for i, e in enumerate(kinds) if e == "_expert_forward"]
        assert len(computes) == 4, fwd          # own rows in two halves, two chunks
        first, last = computes[0], computes[-1]
        assert kinds[:first] == ["issue", "issue"], fwd     # the 2 dispatches
        issued = [n for e, n in fwd[:last] if e == "issue"]
        assert len(issued) == 4 and ("wait", issued[-1]) in fwd[last:], fwd  # last return
        assert ("wait", issued[-1]) not in fwd[:last], fwd
        kinds = [e for e, _ in bwd]
        dx = [i for i, e in enumerate(kinds) if e == "_expert_dx"]
        assert len(dx) == 4 and kinds[:dx[0]] == ["issue", "issue"], bwd
        assert kinds[dx[1] + 1] == "wait", bwd   # both own halves before the first wait
        dw = [i for i, e in enumerate(kinds) if e == "_expert_dw"]
        returns = [n for e, n in bwd[:dw[0]] if e == "issue"][2:]
        assert len(dw) == 4 and len(returns) == 2, bwd
        assert not [n for e, n in bwd[:dw[-1]] if e == "wait" and n in returns], bwd


def _sequence_parallel(rank, world_size, ep, fold):
    """Each TP rank routes its shard of the sequence (``sp_group``), with expert parallelism
    over ``ep`` ranks of another dimension when ep > 1 (world = tp2 x ep)."""
    from fastpar.tensor_parallel import partial_grad_params, reduce_replicated_grads
    tp = 2
    tp_groups = [dist.new_group(list(range(i, i + tp))) for i in range(0, world_size, tp)]
    ep_groups = [dist.new_group(list(range(i, world_size, tp))) for i in range(tp)]
    me_tp, me_seq = rank % tp, rank // tp
    # Folded, the ep group is every rank (whole TP groups): rank r holds experts slice r.
    ep_group = dist.group.WORLD if fold else ep_groups[me_tp] if ep > 1 else None
    me_ep = rank if fold else me_seq
    kw = dict(n_shared=1, shared_gate=True, aux_loss_coef=0.1)
    torch.manual_seed(0)
    ref = MoE(32, 8, 2, 48, **kw)
    torch.manual_seed(0)
    got = MoE(32, 8, 2, 48, sp_group=tp_groups[rank // tp], ep_chunks=2, ep_group=ep_group, **kw)
    assert got.folded == fold
    # Folded, the experts are not replicated over TP: no partial gradients to sum there.
    partial = {id(p) for p in partial_grad_params([got])}
    assert all((id(p) in partial) != fold for p in got.experts.parameters())
    assert id(got.router.weight) in partial
    with torch.no_grad():
        for name, p in got.named_parameters():
            q = ref.get_parameter(name)
            n = p.shape[0]
            p.copy_(q[me_ep * n:(me_ep + 1) * n] if name.startswith("experts.") else q)
    torch.manual_seed(10 + me_seq)              # each TP group its own sequence, cut over tp
    x = torch.randn(12, 2, 32)
    w = torch.randn(12, 2, 32)
    xr = x.clone().requires_grad_()
    shard = slice(me_tp * 6, (me_tp + 1) * 6)
    xg = x[shard].clone().requires_grad_()
    yr, yg = ref(xr)[0], got(xg)[0]
    torch.testing.assert_close(yg, yr[shard], atol=1e-5, rtol=1e-5)
    (yr * w).sum().backward()
    (yg * w[shard]).sum().backward()
    torch.testing.assert_close(xg.grad, xr.grad[shard], atol=1e-5, rtol=1e-5)
    assert reduce_replicated_grads(got, tp_groups[rank // tp]) > 0
    for name, p in got.named_parameters():
        q = ref.get_parameter(name).grad
        if name.startswith("experts."):
            q = q.clone()       # every sequence's gradient, summed
            dist.all_reduce(q, group=ep_groups[me_tp]) if world_size > tp else None
            n = p.shape[0]
            q = q[me_ep * n:(me_ep + 1) * n]
        torch.testing.assert_close(p.grad, q, atol=1e-5, rtol=1e-5, msg=name)
    return True


@pytest.mark.parametrize("ep, fold", [(1, False), (2, False), (2, True), (4, True)],
                         ids=["tp2", "tp2 ep2", "tp2 ep2 folded", "tp2 x 2 ep4 folded"])
def test_sequence_parallel_equals_one_rank(ep, fold):
    """Under SP each TP rank runs the layer on its shard of the tokens: its outputs and input
    gradients are the single-process layer's rows; the auxiliary loss counts over the whole
    sequence, so once the replicated parameters' partial gradients are summed over TP
    (``reduce_replicated_grads``) every gradient is the reference's (each expert's summed over
    the ep ranks, which route other sequences). Folded (the ep group holds the TP group: each
    TP rank other experts), the experts' gradients need no sum over TP: the all-to-alls'
    backward brings every TP rank's rows' share."""
    world = ep if fold else 2 * ep
    assert all(run_ranks(_sequence_parallel, world, ep, fold, timeout=90))


def test_bad_sizes_are_refused():
    with pytest.raises(ValueError, match="n_experts=8 must be .* ep_chunks=0"):
        MoE(32, 8, 2, 48, ep_chunks=0)


def _probe(rank, world_size, chunks, runs):
    """Runs forward + backward ``runs`` times with every all-to-all of the layer recorded; at
    each expert computation, the transfers then in flight (issued, not finished, not waited)
    and how many of them finished while it computed (nothing waited in between)."""
    torch.manual_seed(0)
    layer = MoE(256, 4, 2, 512, ep_group=dist.group.WORLD, ep_chunks=chunks)
    works, seen = [], {"in_flight": 0, "progressed": 0, "computes": 0}
    phases = ("_expert_forward", "_expert_dx", "_expert_dw")
    real_a2a, real = moe_mod._a2a, {name: getattr(moe_mod, name) for name in phases}

    def a2a(*args, **kwargs):
        rec = {"work": real_a2a(*args, **kwargs), "waited": False}
        works.append(rec)

        class Work:
            def wait(self):
                rec["waited"] = True
                return rec["work"].wait()
        return Work()

    def probed(real):
        def compute(*args, **kwargs):
            flying = [r for r in works if not r["waited"] and not r["work"].is_completed()]
            out = real(*args, **kwargs)
            seen["computes"] += 1
            seen["in_flight"] += len(flying)
            seen["progressed"] += sum(r["work"].is_completed() for r in flying)
            return out
        return compute

    moe_mod._a2a = a2a
    for name in phases:
        setattr(moe_mod, name, probed(real[name]))
    try:
        for run in range(runs):
            x = torch.randn(2048, 2, 256, requires_grad=True)
            layer(x)[0].square().sum().backward()
            stats = [None] * world_size
            dist.all_gather_object(stats, seen["progressed"])
            if sum(stats) and chunks > 1:
                break
    finally:
        moe_mod._a2a = real_a2a
        for name in phases:
            setattr(moe_mod, name, real[name])
    return seen


def test_dispatch_travels_while_experts_compute():
    """Two chunks: some all-to-all in flight when an expert computation (forward or backward)
    starts finishes before it ends, nothing having waited for it (the transfer progressed
    during compute). One chunk: no transfer is ever in flight while the experts compute
    (blocking dispatch)."""
    seen = run_ranks(_probe, 2, 2, 8, timeout=120)
    assert sum(s["progressed"] for s in seen) > 0, seen
    assert all(s["in_flight"] > 0 for s in seen), seen
    seen = run_ranks(_probe, 2, 1, 2, timeout=120)
    assert all(s["in_flight"] == 0 and s["computes"] == 6 for s in seen), seen


MOE_CFG = dict(vocab_size=64, n_layers=2, d_model=32, n_heads=4, max_seq_len=8, pad_vocab_to=64,
               n_experts=4, moe_top_k=2, moe_ffn=24)


def _ep_model(ep, seed=0):
    import fastpar
    from fastpar.data_parallel import DataParallel
    from fastpar.mesh import ep_groups
    from fastpar.models import GPT, GPTConfig
    mesh = fastpar.init(dp=dist.get_world_size() if dist.is_initialized() else None)
    if ep > 1:
        mesh.ep_group, mesh.expert_dp_group = ep_groups(mesh, ep)
    model = GPT(GPTConfig(**MOE_CFG, init_seed=seed), ep_group=mesh.ep_group)
    ddp = DataParallel(model, dp_group=mesh.dp_group, expert_group=mesh.expert_dp_group)
    return mesh, model, ddp


def _optimizer(ddp, model, zero):
    from fastpar.data_parallel import DistributedOptimizer
    if not zero:
        return torch.optim.AdamW(model.parameters(), lr=1e-2)
    return DistributedOptimizer(ddp, torch.optim.AdamW, [{"params": list(model.parameters())}],
                                shard=True, stage=zero, lr=1e-2)


def _ep_save(rank, world_size, out, ep, zero=0):
    from fastpar.train.checkpoint import latest_checkpoint
    from fastpar.train.checkpoint_writer import save_checkpoint
    mesh, model, ddp = _ep_model(ep)
    opt = _optimizer(ddp, model, zero)
    tokens = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(rank))
    ddp(tokens[:, :-1], tokens[:, 1:]).backward()
    if zero:
        ddp.finish_gradient_sync()
        opt.step()
        opt.finish_param_sync()
        path = save_checkpoint(out, 1, [model], opt, mesh, {"config": MOE_CFG, "data_step": 1})
        return {n: p.detach().clone() for n, p in model.named_parameters()}, \
            model.layers["0"].mlp.experts.first, sorted(f.name for f in path.glob("model_*"))
    opt.step()
    for i, layer in model.layers.items():    # the loss-free bias: a buffer, saved too
        layer.mlp.router.bias.copy_(torch.arange(4.0) + int(i))
    save_checkpoint(out, 1, [model], opt, mesh, {"config": MOE_CFG, "data_step": 1})
    return {n: (p.detach().clone(), opt.state[p]["exp_avg"].clone())
            for n, p in model.named_parameters()}, model.layers["0"].mlp.experts.first, \
        sorted(f.name for f in latest_checkpoint(out).glob("model_*"))


def _ep_load(rank, world_size, out, ep, zero=0):
    from fastpar.train.checkpoint import latest_checkpoint, load_checkpoint
    mesh, model, ddp = _ep_model(ep, seed=5)
    opt = _optimizer(ddp, model, zero)
    load_checkpoint(latest_checkpoint(out), [model], opt, mesh)
    if zero:
        return {n: p.detach().clone() for n, p in model.named_parameters()}, \
            model.layers["0"].mlp.experts.first
    for i, layer in model.layers.items():
        assert torch.equal(layer.mlp.router.bias, torch.arange(4.0) + int(i))
    return {n: (p.detach().clone(), opt.state[p]["exp_avg"].clone())
            for n, p in model.named_parameters()}, model.layers["0"].mlp.experts.first


def test_checkpoint_saved_at_one_ep_loads_at_another(tmp_path):
    """Saved at dp4 ep2 (each expert slice written once: the first replica's file and the
    other ep rank's experts file), loaded into one process and at dp4 ep4: every rank's
    experts and their optimizer state are the slices of the whole, the rest equal, the
    routers' loss-free biases restored."""
    from fastpar.models import GPT, GPTConfig
    from fastpar.train.checkpoint import latest_checkpoint, load_checkpoint
    saved = run_ranks(_ep_save, 4, str(tmp_path), 2, init_pg=False, timeout=120)
    assert saved[0][2] == ["model_tp0_pp0.safetensors", "model_tp0_pp0_ep1.safetensors"]
    one = GPT(GPTConfig(**MOE_CFG, init_seed=3))
    opt = torch.optim.AdamW(one.parameters(), lr=1e-2)
    load_checkpoint(latest_checkpoint(tmp_path), [one], opt, None)
    assert torch.equal(one.layers["1"].mlp.router.bias, torch.arange(4.0) + 1)

    def check(ranks):
        for got, first in ranks:
            for n, p in one.named_parameters():
                want, moment = p.detach(), opt.state[p]["exp_avg"]
                if ".experts." in n:
                    k = got[n][0].shape[0]
                    want, moment = want[first:first + k], moment[first:first + k]
                assert torch.equal(got[n][0], want) and torch.equal(got[n][1], moment), n
    check([(s[0], s[1]) for s in saved])
    loaded = run_ranks(_ep_load, 4, str(tmp_path), 4, init_pg=False, timeout=120)
    assert [first for _, first in loaded] == [0, 1, 2, 3]
    check(loaded)


@pytest.mark.parametrize("bad, world, words", [
    (dict(dp=4, ep=4, zero=1, dp_shard=2), 4, "ep=4 does not divide an HSDP shard group"),
    (dict(ep=3), 3, "n_experts=4 is not a multiple of ep=3"),
    (dict(ep=2, pp=2), 2, r"does not divide dp x cp = 1 x 1"),
])
def test_layouts_expert_parallelism_cannot_run_are_refused(bad, world, words):
    from fastpar.models import GPTConfig
    from fastpar.models.parallel_config import ParallelConfig
    moe = GPTConfig(**MOE_CFG)
    ParallelConfig(dp=2, ep=2, micro_batch_size=1).check(moe, 2, 4, 8)
    with pytest.raises(ValueError, match=words):
        ParallelConfig(micro_batch_size=1, **bad).check(moe, world, 4, 8)
    with pytest.raises(ValueError, match="no experts"):
        ParallelConfig(dp=2, ep=2, micro_batch_size=1).check(
            GPTConfig(**dict(MOE_CFG, n_experts=0)), 2, 4, 8)


def test_zero_checkpoint_with_expert_parallelism(tmp_path):
    """ZeRO-1 at dp4 ep2: the experts' shards cut over their two replicas, every dp rank's
    shard file; loaded into one process and at dp4 ep4 under ZeRO-2, every rank's weights
    are the slices of the whole."""
    from fastpar.models import GPT, GPTConfig
    from fastpar.train.checkpoint import latest_checkpoint, load_checkpoint
    saved = run_ranks(_ep_save, 4, str(tmp_path), 2, 1, init_pg=False, timeout=120)
    assert saved[0][2] == [f"model_tp0_pp0_dp{d}.safetensors" for d in range(4)]
    one = GPT(GPTConfig(**MOE_CFG, init_seed=3))
    load_checkpoint(latest_checkpoint(tmp_path), [one], None, None)
    loaded = run_ranks(_ep_load, 4, str(tmp_path), 4, 2, init_pg=False, timeout=120)
    for got, first in [s[:2] for s in saved] + loaded:
        for n, p in one.named_parameters():
            want = p.detach()
            if ".experts." in n:
                want = want[first:first + got[n].shape[0]]
            assert torch.equal(got[n], want), n


def _shared_order(rank, world_size):
    torch.manual_seed(0)
    layer = MoE(64, 4, 2, 96, n_shared=1, shared_gate=True, ep_group=dist.group.WORLD)
    events = []
    layer.shared.register_forward_pre_hook(lambda *a: events.append(("shared", "forward")))
    layer.shared.register_full_backward_hook(lambda *a: events.append(("shared", "backward")))
    return _events(layer, events=events)


def test_the_shared_experts_compute_while_the_dispatch_travels():
    """Forward: the shared experts run after every chunk's dispatch is issued, before any is
    waited for. Backward: they run after the input gradients' returns are issued, before any
    of those is waited for (the returns travel under them)."""
    for events in run_ranks(_shared_order, 2, timeout=90):
        split = events.index(("backward", None))
        fwd, bwd = events[:split], events[split + 1:]
        at = fwd.index(("shared", "forward"))
        assert [e for e, _ in fwd[:at]] == ["issue", "issue"], fwd      # the 2 dispatches
        assert fwd[at + 1][0] == "wait", fwd
        at = bwd.index(("shared", "backward"))
        issued = [n for e, n in bwd[:at] if e == "issue"]
        assert len(issued) == 4, bwd            # 2 gradients in, 2 input gradients back
        returns = issued[2:]
        assert not [n for e, n in bwd[:at] if e == "wait" and n in returns], bwd
        assert {n for e, n in bwd[at:] if e == "wait"} >= set(returns), bwd
