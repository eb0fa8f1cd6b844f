"""Rank checks for ZeRO-3 (``DistributedOptimizer(stage=3)`` over ``DataParallel(units=...)``):
the same training as ZeRO-1, the memory it holds, and its prefetch and reduce-scatter seen in
progress while a unit computes.

Run inside the ranks of tests/test_dp_data_parallel.py (one spawn per world size).
"""
import gc
import json
import time

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from fastpar.data_parallel import DataParallel, DistributedOptimizer
from fastpar.extension import CPUMemory
from pollable import Pollable

GRACE_S = 30.0


class Block(nn.Module):
    def __init__(self, d, dtype):
        super().__init__()
        self.norm = nn.LayerNorm(d, dtype=dtype)
        self.a, self.b = nn.Linear(d, 2 * d, dtype=dtype), nn.Linear(2 * d, d, dtype=dtype)

    def forward(self, x):
        return x + self.b(F.gelu(self.a(self.norm(x))))


class Net(nn.Module):
    def __init__(self, d=16, layers=4, dtype=torch.float32, recompute=False):
        super().__init__()
        self.inp = nn.Linear(6, d, dtype=dtype)
        self.blocks = nn.ModuleList(Block(d, dtype) for _ in range(layers))
        self.out = nn.Linear(d, 3, dtype=dtype)
        self.recompute = recompute

    def forward(self, x):
        x = self.inp(x)
        for blk in self.blocks:
            x = checkpoint(blk, x, use_reentrant=False) if self.recompute else blk(x)
        return self.out(x)


def _batch(step, world, rank, dtype, rows=4):
    g = torch.Generator().manual_seed(900 + step)
    x, y = torch.randn(rows * world, 6, generator=g), torch.randn(rows * world, 3, generator=g)
    return x.chunk(world)[rank].to(dtype), y.chunk(world)[rank].to(dtype)


def _build(stage, dtype, opts, seed=4, **kw):
    torch.manual_seed(seed)
    net = Net(dtype=dtype, recompute=kw.pop("recompute", False), layers=kw.pop("layers", 4),
              d=kw.pop("d", 16))
    model = DataParallel(net, units=list(net.blocks), **opts)
    return model, DistributedOptimizer(model, torch.optim.AdamW, lr=1e-2, weight_decay=0.1,
                                       stage=stage, **kw)


def _steps(model, opt, world, rank, dtype, steps, micro, first=0):
    for step in range(first, first + steps):
        for m in range(micro):
            x, y = _batch(10 * step + m, world, rank, dtype)
            if m < micro - 1:
                with model.no_sync():
                    F.mse_loss(model(x), y).backward()
            else:
                F.mse_loss(model(x), y).backward()
        opt.clip_grad_norm_(1.0)
        opt.step()
        opt.zero_grad()


def _zero3_equals_zero1(rank, world):
    """Every ZeRO-3 setting steps exactly as ZeRO-1 on the same buckets (ZeRO-1 equals plain
    data parallelism: dp_zero_checks); between steps no whole parameter or gradient exists, and
    each micro-batch gathers every unit twice (once: reshard_after_forward=False over a step)."""
    bf16 = torch.bfloat16
    cases = [(torch.float32, {}, dict(micro=1)),
             (torch.float32, dict(reduce_dtype=bf16), dict(micro=2)),
             (bf16, dict(main_grads=True), dict(micro=2, reshard_after_forward=False)),
             (torch.float32, {}, dict(micro=2, recompute=True, prefetch=2)),
             (torch.float32, {}, dict(micro=1, prefetch=0))]
    for dtype, opts, kw in cases:
        micro = kw.pop("micro")
        one, o1 = _build(1, dtype, opts, recompute=kw.get("recompute", False))
        three, o3 = _build(3, dtype, opts, **kw)
        what = f"{dtype} {opts} micro={micro} {kw}"
        units = o3._units
        assert units.groups == [[4], [3], [2], [1], [0]], units.groups  # root, then blocks
        live, inner = [], units.unshard        # blocks whole after each gather started

        def counting(g, inner=inner, units=units, live=live):
            inner(g)
            live.append(sum(units._is_live(k) for k in range(1, len(units.groups))))
        units.unshard = counting
        for step in range(3):
            before = units.gathers
            for model, opt in ((one, o1), (three, o3)):
                _steps(model, opt, world, rank, dtype, 1, micro, first=step)
            per_micro = 1 + 2 * 4 if kw.get("reshard_after_forward", True) else None
            want = micro * per_micro if per_micro else 5
            assert units.gathers - before == want, (what, units.gathers - before, want)
            assert all(t.untyped_storage().nbytes() == 0 for t in o3._full), what
            assert all(b.released for b in three._reducer.buckets), (what, [b.released for b in three._reducer.buckets], [b.work for b in three._reducer.buckets])
        # At most the computing block and the prefetched ones are whole at once.
        if kw.get("reshard_after_forward", True):
            assert max(live) == 1 + kw.get("prefetch", 1), (what, max(live))
        o1.finish_param_sync()
        with o3.gathered():
            for (n, p), q in zip(one.named_parameters(), three.parameters()):
                assert torch.equal(p, q), f"{what} {n}: {(p - q).abs().max()}"
        assert all(t.untyped_storage().nbytes() == 0 for t in o3._full), what
    with pytest.raises(ValueError, match="stage=3 gathers each unit"):
        _build(3, torch.float32, {}, overlap_step=True)
    with pytest.raises(ValueError, match="prefetch=-1 must be an int >= 0"):
        _build(3, torch.float32, {}, prefetch=-1)
    net = Net()
    with pytest.raises(ValueError, match=r"units\[0\] \(Linear\) is not a submodule"):
        DataParallel(net, units=[nn.Linear(2, 2)])


def _zero3_memory(rank, world):
    """After zero_grad a rank holds 12 bytes per parameter / dp (the fp32 master and its two
    moments) and nothing whole, nor the gradient shards; during a step at most the units in
    flight are whole: the peak is below ZeRO-2's by about the whole model."""
    if not CPUMemory.installed():
        CPUMemory.install()
    held = {}
    for stage in (2, 3):
        gc.collect()
        base = CPUMemory.allocated()
        model, opt = _build(stage, torch.float32, {}, layers=8, d=128)
        numel = sum(b.spec.padded_numel for b in model._reducer.buckets)
        _steps(model, opt, world, rank, torch.float32, 2, 1)
        steady = CPUMemory.allocated() - base
        CPUMemory.reset_peak()
        _steps(model, opt, world, rank, torch.float32, 1, 1, first=2)
        held[stage] = (steady, CPUMemory.peak() - base, numel)
        del model, opt
    steady, peak, numel = held[3]
    formula = 12 * numel // world
    assert formula <= steady <= formula + 4096, (steady, formula)
    whole = 4 * numel                          # the model's fp32 parameters
    steady2, peak2, _ = held[2]
    # ZeRO-2 keeps the parameters whole (its fp32 master being this rank's block of them) and
    # the gradient shards.
    # (to 2%: gloo's threads free small buffers of the earlier checks at their own pace)
    assert abs(steady2 - steady - whole) <= 0.02 * whole, (steady2, steady, whole)
    # Peaks: ZeRO-2 holds every parameter whole and each bucket's gradient; ZeRO-3 about three
    # units (of 9) of each, plus the same activations.
    assert peak < peak2 - whole, (peak, peak2, whole)


def _busy_until(done):
    a, give_up = torch.randn(256, 256), time.monotonic() + GRACE_S
    while not done() and time.monotonic() < give_up:
        a = torch.tanh(a @ a)


def _zero3_progress(rank, world):
    """The prefetched all-gather of unit 2 completes while unit 1's forward computes; in unit
    1's backward, unit 2's reduce-scatter and unit 0's prefetched all-gather complete while it
    computes. Without prefetch and overlap none of them has even started at those points."""
    seen = {}
    for on in (True, False):
        torch.manual_seed(5)
        net = Net(d=256, layers=4)
        model = DataParallel(net, units=list(net.blocks), overlap=on)
        opt = DistributedOptimizer(model, torch.optim.AdamW, lr=1e-2, stage=3,
                                   prefetch=1 if on else 0)
        units, reducer = opt._units, model._reducer
        bucket = {k: units.groups[1 + k][0] for k in range(4)}      # block k's bucket
        log = []

        def gather_done(k):
            item = opt._gathers.get(bucket[k])
            if item is None:
                return None                      # not started (or landed and waited)
            if not isinstance(item[0], Pollable):
                opt._gathers[bucket[k]] = item = (Pollable(item[0]), item[1])
            return item[0]

        def forward_probe(_m, _a, _out):
            work = gather_done(2)
            if work is not None:
                _busy_until(work.is_completed)
            log.append(("forward", work is not None and work.is_completed()))

        def backward_probe(_grad):
            b = reducer.buckets[bucket[2]]
            if b.work is not None and not isinstance(b.work, Pollable):
                b.work = Pollable(b.work)
            gather = gather_done(0)
            works = [w for w in (b.work, gather) if w is not None]
            _busy_until(lambda: all(w.is_completed() for w in works))
            log.append(("backward", b.work is not None and b.work.is_completed(),
                        gather is not None and gather.is_completed(),
                        units.arrived[2]))               # block 1's gradients so far
        net.blocks[1].a.register_forward_hook(forward_probe)
        def hook_output(_m, _a, out):
            if out.requires_grad:
                out.register_hook(backward_probe)
        net.blocks[1].b.register_forward_hook(hook_output)
        for step in range(2):
            log.clear()
            x, y = _batch(step, world, rank, torch.float32, rows=64)
            F.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
        seen[on] = list(log)
    assert seen[True] == [("forward", True), ("backward", True, True, 0)], seen[True]
    assert seen[False] == [("forward", False), ("backward", False, False, 0)], seen[False]


def _hsdp_equals_zero(rank, world):
    """HSDP at dp 4 (ZeRO shards over pairs, all-reduced across the two pairs): ZeRO-1's and
    ZeRO-3's weights equal plain ZeRO's over all four ranks (to rounding: the sums are ordered
    otherwise); each rank's optimizer state is half of the pair's, not a quarter."""
    import torch.distributed as dist
    from fastpar.mesh.groups import group_rank
    ranks = list(range(world))
    pairs = [dist.new_group(ranks[i:i + 2]) for i in range(0, world, 2)]
    across = [dist.new_group(ranks[j::2]) for j in range(2)]
    shard, replicate = pairs[rank // 2], across[rank % 2]
    for stage in (1, 3):
        ref, o_ref = _build(stage, torch.float32, {})
        hsdp, o_hsdp = _build(stage, torch.float32, dict(dp_group=shard,
                                                         replicate_group=replicate))
        assert (hsdp.dp_size, hsdp.dp_rank) == (2, group_rank(shard))
        for model, opt in ((ref, o_ref), (hsdp, o_hsdp)):
            _steps(model, opt, world, rank, torch.float32, 3, 2)
        with o_ref.gathered(), o_hsdp.gathered():
            for p, q in zip(ref.parameters(), hsdp.parameters()):
                torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-6)
        assert o_hsdp.state_bytes() == pytest.approx(2 * o_ref.state_bytes(), rel=0.05)
    with pytest.raises(ValueError, match="find_unused_parameters=True is not supported"):
        DataParallel(Net(), dp_group=shard, replicate_group=replicate,
                     find_unused_parameters=True)


def _meta(layers=4, d=16, seed=4):
    with torch.device("meta"):
        torch.manual_seed(seed)
        net = Net(layers=layers, d=d)
    model = DataParallel(net, units=list(net.blocks), device="cpu")
    opt = DistributedOptimizer(model, torch.optim.AdamW, lr=1e-2, weight_decay=0.1, stage=3)
    return model, opt, {id(p): n for n, p in net.named_parameters()}


def _zero3_meta_build(rank, world):
    """A model built on the meta device, filled a unit at a time (``materialize``) or from flat
    ranges of each parameter (``load_shards``), trains exactly as the same model built whole;
    building, wrapping and filling it never hold more than this rank's master shards and one
    unit whole (building it whole holds the whole model); misuse is one clear error."""
    torch.manual_seed(4)
    values = {n: p.detach().clone() for n, p in Net().named_parameters()}
    whole, ow = _build(3, torch.float32, {})                  # the same seed, built whole
    filled, of, names = _meta()
    of.materialize(lambda ps: [p.copy_(values[names[id(p)]]) for p in ps])
    read, orr, rnames = _meta()
    asked = []

    def reader(p, start, n):
        asked.append(n)
        return values[rnames[id(p)]].reshape(-1)[start:start + n].double()
    orr.load_shards(reader)
    assert sum(asked) <= sum(v.numel() for v in values.values()) // world + 8, asked
    for model, opt in ((whole, ow), (filled, of), (read, orr)):
        _steps(model, opt, world, rank, torch.float32, 2, 1)
    with ow.gathered(), of.gathered(), orr.gathered():
        for (n, p), q, r in zip(whole.named_parameters(), filled.parameters(),
                                read.parameters()):
            assert torch.equal(p, q) and torch.equal(p, r), n
    # Memory: this rank's fp32 masters (4 bytes / parameter / dp), and one unit at a time.
    if not CPUMemory.installed():
        CPUMemory.install()
    peaks = {}
    for how in ("meta", "whole"):
        gc.collect()
        base = CPUMemory.allocated()
        CPUMemory.reset_peak()
        if how == "meta":
            model, opt, _ = _meta(layers=8, d=128)
            opt.materialize(lambda ps: [p.normal_() for p in ps])
        else:
            model, opt = _build(3, torch.float32, {}, layers=8, d=128)
        numel = sum(b.spec.padded_numel for b in model._reducer.buckets)
        unit = max(b.spec.padded_numel for b in model._reducer.buckets)
        peaks[how] = CPUMemory.peak() - base
        del model, opt
    assert peaks["meta"] <= 4 * numel // world + 2 * 4 * unit + 65536, (peaks, numel, unit)
    assert peaks["whole"] >= 4 * numel, (peaks, numel)
    with pytest.raises(ValueError, match="built on the meta device: pass device="):
        with torch.device("meta"):
            net = Net()
        DataParallel(net, units=list(net.blocks))
    with pytest.raises(ValueError, match="needs units="):
        DataParallel(net, device="cpu")
    with pytest.raises(ValueError, match="needs stage=3"):
        DistributedOptimizer(DataParallel(net, units=list(net.blocks), device="cpu"),
                             torch.optim.AdamW, stage=2)
    model, opt, _ = _meta()
    with pytest.raises(RuntimeError, match="has no values yet"):
        model(torch.randn(2, 6))


def _zero3_save_gathers_nothing(rank, world):
    """A checkpoint of a ZeRO-3 model is each rank's own shard of the fp32 masters, written by
    that rank: no collective runs for it, no unit is gathered (the model is never whole on any
    rank), and together the ranks' flat pieces are the trained model."""
    from types import SimpleNamespace

    from wire import WireRecorder

    from fastpar.train.checkpoint import snapshot

    model, opt = _build(3, torch.float32, {})
    _steps(model, opt, world, rank, torch.float32, 2, 1)
    units, before = opt._units, opt._units.gathers
    seen = []
    inner = units.unshard
    units.unshard = lambda g: (seen.append(g), inner(g))
    mesh = SimpleNamespace(rank=rank, tp_size=1, tp_rank=0, pp_rank=0, replica_rank=rank)
    with WireRecorder() as wire:
        files = snapshot([model.module], opt, mesh, copy=True)
    units.unshard = inner
    assert not seen and units.gathers == before and not wire.records, (seen, wire.records)
    assert all(t.untyped_storage().nbytes() == 0 for t in opt._full)
    saved = files[f"model_tp0_pp0_dp{rank}.safetensors"]
    index = json.loads(files[f"index_tp0_pp0_dp{rank}.json"])
    held = torch.zeros(1)
    with opt.gathered():
        for n, p in model.module.named_parameters():
            if n in index:
                a, b = index[n]["flat"]
                assert torch.equal(saved[n], p.detach().reshape(-1)[a:b]), n
                assert torch.equal(saved[f"optim.exp_avg.{n}"], opt.optimizer.state[
                    opt._by_param[id(p)]]["exp_avg"]), n
                held += b - a
    dist.all_reduce(held)
    assert held.item() == sum(p.numel() for p in model.module.parameters())


def zero3_checks(rank, world):
    _zero3_equals_zero1(rank, world)
    _zero3_meta_build(rank, world)
    _zero3_save_gathers_nothing(rank, world)
    _zero3_memory(rank, world)
    _zero3_progress(rank, world)
    if world == 4:
        _hsdp_equals_zero(rank, world)
