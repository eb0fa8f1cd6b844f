"""Rank checks for ZeRO-1 (DistributedOptimizer) against plain data parallelism with torch's AdamW.

Run inside the ranks of tests/test_dp_data_parallel.py (one spawn per world size serves every
data-parallel check).
"""
import time

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from fastpar.data_parallel import DataParallel, DistributedOptimizer

CAP_MB = 2000 / 2**20


def _mlp(seed=0, dtype=torch.float32):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(10, 30, dtype=dtype), nn.GELU(), nn.Linear(30, 17, dtype=dtype),
                         nn.GELU(), nn.Linear(17, 5, dtype=dtype))


def _batch(step, world, rank, dtype=torch.float32):
    g = torch.Generator().manual_seed(500 + step)
    x, y = torch.randn(4 * world, 10, generator=g), torch.randn(4 * world, 5, generator=g)
    return x.chunk(world)[rank].to(dtype), y.chunk(world)[rank].to(dtype)


def _state_bytes(opt):
    return sum(t.numel() * t.element_size() for s in opt.state.values() for t in s.values())


def _zero_equals_plain_dp(rank, world):
    for overlap_gather in (False, True):
        plain, sharded = DataParallel(_mlp(), bucket_cap_mb=CAP_MB), \
            DataParallel(_mlp(), bucket_cap_mb=CAP_MB)
        no_decay = [sharded.module[i].bias for i in (0, 2, 4)]
        opt = torch.optim.AdamW([{"params": [p for n, p in plain.named_parameters()
                                             if n.endswith("weight")]},
                                 {"params": [p for n, p in plain.named_parameters()
                                             if n.endswith("bias")], "weight_decay": 0.0}],
                                lr=1e-2, weight_decay=0.1)
        zero = DistributedOptimizer(sharded, torch.optim.AdamW,
                                    [{"params": no_decay, "weight_decay": 0.0}],
                                    overlap_param_gather=overlap_gather, lr=1e-2,
                                    weight_decay=0.1)
        for step in range(4):
            x, y = _batch(step, world, rank)
            for model, o in ((plain, opt), (sharded, zero)):
                F.mse_loss(model(x), y).backward()
                o.step()
                o.zero_grad()
        zero.finish_param_sync()
        for (n, p), q in zip(plain.named_parameters(), sharded.parameters()):
            assert torch.allclose(p, q, atol=1e-6, rtol=0), f"{n}: {(p - q).abs().max()}"
        ratio = zero.state_bytes() / _state_bytes(opt)
        assert ratio < 1 / world + 0.05, f"ZeRO state is {ratio:.3f} of plain AdamW's"
        # fp32: the parameters are views of the gather buffers, which the gathers land in.
        stores = {zero._full[b].untyped_storage().data_ptr() for b in range(len(zero._full))}
        assert all(p.untyped_storage().data_ptr() in stores for p in sharded.parameters())
    # A parameter re-pointed by hand is no longer a view: the gathered values are copied in.
    w = sharded.module[0].weight
    w.data = w.data.clone()
    x, y = _batch(8, world, rank)
    for model, o in ((plain, opt), (sharded, zero)):
        F.mse_loss(model(x), y).backward()
        o.step()
        o.zero_grad()
    zero.finish_param_sync()
    for p, q in zip(plain.parameters(), sharded.parameters()):
        assert torch.allclose(p, q, atol=1e-6, rtol=0)
    # Clipping the sharded gradients equals torch's clip_grad_norm_ on the full mean gradient.
    x, y = _batch(9, world, rank)
    for model in (plain, sharded):
        F.mse_loss(model(x), y).backward()
    want = torch.nn.utils.clip_grad_norm_(plain.parameters(), 0.05)
    got = zero.clip_grad_norm_(0.05)
    assert torch.allclose(got, want, rtol=1e-5), (got, want)
    opt.step()
    zero.step()
    zero.finish_param_sync()            # overlap_param_gather: else the next forward waits
    for p, q in zip(plain.parameters(), sharded.parameters()):
        assert torch.allclose(p, q, atol=1e-6, rtol=0)
    with pytest.raises(RuntimeError, match="no gradient reduction since the last step"):
        zero.step()


def _zero_low_precision_and_unused(rank, world):
    # bf16 parameters: fp32 master shards, gradients reduced in fp32; replicas stay identical.
    model = DataParallel(_mlp(seed=1, dtype=torch.bfloat16), bucket_cap_mb=CAP_MB,
                         reduce_dtype=torch.float32)
    zero = DistributedOptimizer(model, torch.optim.AdamW, lr=1e-2)
    before = [p.detach().clone() for p in model.parameters()]
    for step in range(2):
        x, y = _batch(step, world, rank, torch.bfloat16)
        F.mse_loss(model(x), y).backward()
        zero.step()
        zero.zero_grad()
    for p, b in zip(model.parameters(), before):
        assert p.dtype == torch.bfloat16 and not torch.equal(p, b)
        every = [torch.empty_like(p) for _ in range(world)]
        torch.distributed.all_gather(every, p.detach())
        assert all(torch.equal(e, p) for e in every), "replicas diverged"
    # The bf16 parameters are views of the buffers their gathers land in: held once.
    stores = {t.untyped_storage().data_ptr() for t in zero._full}
    assert all(p.untyped_storage().data_ptr() in stores for p in model.parameters())
    mine = sum(pc.hi - pc.lo for pc in zero._pieces)   # elements of this rank's shard
    assert zero.state_bytes() >= 3 * 4 * mine           # fp32 master + two fp32 moments
    # A parameter no rank uses is not updated (torch skips a None gradient too).
    net = nn.ModuleDict({"used": nn.Linear(4, 4), "dead": nn.Linear(4, 4)})
    model = DataParallel(net, find_unused_parameters=True)
    zero = DistributedOptimizer(model, torch.optim.AdamW, lr=1e-1, weight_decay=0.5)
    dead = net["dead"].weight.detach().clone()
    net["used"](torch.randn(3, 4)).sum().backward()
    zero.step()
    assert torch.equal(net["dead"].weight, dead)


def _zero_overlap_step(rank, world):
    """overlap_step: each bucket steps as its reduction lands, inside backward, in bucket order
    while the later buckets are still outstanding; the result equals plain DP + AdamW."""
    for shard, gather in ((True, False), (True, True), (False, False)):
        plain, model = DataParallel(_mlp(), bucket_cap_mb=CAP_MB), \
            DataParallel(_mlp(), bucket_cap_mb=CAP_MB)
        assert len(model.bucket_specs) >= 2
        opt = torch.optim.AdamW([{"params": [p for n, p in plain.named_parameters()
                                             if n.endswith("weight")]},
                                 {"params": [p for n, p in plain.named_parameters()
                                             if n.endswith("bias")], "weight_decay": 0.0}],
                                lr=1e-2, weight_decay=0.1)
        zero = DistributedOptimizer(model, torch.optim.AdamW,
                                    [{"params": [model.module[i].bias for i in (0, 2, 4)],
                                      "weight_decay": 0.0}], shard=shard,
                                    overlap_param_gather=gather, overlap_step=True, lr=1e-2,
                                    weight_decay=0.1)
        log = model._reducer.events
        stepped = []
        inner = zero.optimizer.step
        zero.optimizer.step = lambda: (stepped.append(time.perf_counter_ns()), inner())[1]
        for step in range(4):
            x, y = _batch(step, world, rank)
            F.mse_loss(plain(x), y).backward()
            opt.step()
            opt.zero_grad()
            log.enable()
            stepped.clear()
            before = model.module[4].weight.detach().clone()
            F.mse_loss(model(x), y).backward()
            events = log.take()
            log.enable(False)
            # Stepped inside backward: the last layer's bucket (bucket 0) changed already.
            zero.finish_param_sync()
            assert not torch.equal(model.module[4].weight, before)
            # One optimizer step per bucket, each after its own bucket's wait and before the
            # next bucket's wait returns (that bucket was launched before, so it was in flight).
            done = [t for e, b, t in events if e == "done"]
            launch = [t for e, b, t in events if e == "launch"]
            assert len(stepped) == len(done) == len(model.bucket_specs)
            for b in range(len(done) - 1):
                assert done[b] < stepped[b] < done[b + 1] and launch[b + 1] < stepped[b]
            zero.step()                          # nothing left but the bookkeeping
            assert len(stepped) == len(done)
            zero.zero_grad()
        zero.finish_param_sync()
        for (n, p), q in zip(plain.named_parameters(), model.parameters()):
            assert torch.allclose(p, q, atol=1e-6, rtol=0), f"{n}: {(p - q).abs().max()}"
        assert all(zero._intact(b) for b in range(len(model.bucket_specs)))   # stepped in place
        with pytest.raises(RuntimeError, match="no gradient reduction since the last step"):
            zero.step()
        F.mse_loss(model(x), y).backward()
        with pytest.raises(RuntimeError, match="clip_grad_norm_ cannot run with overlap_step"):
            zero.clip_grad_norm_(1.0)
        zero.step()
    with pytest.raises(ValueError, match="overlap_step=True needs find_unused_parameters=False"):
        DistributedOptimizer(DataParallel(_mlp(), find_unused_parameters=True),
                             torch.optim.AdamW, overlap_step=True)


def _zero2_frees_whole_gradients(rank, world):
    """ZeRO-2 (stage=2) steps exactly as ZeRO-1, and between a step's reduction and the next
    backward holds no whole gradient: the buckets' flat buffers have no storage, ``.grad`` is
    None, and the allocator gets those bytes back (counted by fastpar's CPU allocator)."""
    from fastpar.extension import CPUMemory
    if not CPUMemory.installed():
        CPUMemory.install()
    bf16 = torch.bfloat16
    # (parameter dtype, DataParallel options): views, packed, fp32 main grads, + a bf16 wire
    cases = [(torch.float32, {}), (torch.float32, dict(reduce_dtype=bf16)),
             (bf16, dict(main_grads=True)), (bf16, dict(main_grads=True, reduce_dtype=bf16))]
    for dtype, opts in cases:
        for micro in (1, 2):
            pair = []
            for stage in (1, 2):
                torch.manual_seed(3)
                wide = nn.Sequential(nn.Linear(10, 256, dtype=dtype), nn.GELU(),
                                     nn.Linear(256, 256, dtype=dtype), nn.GELU(),
                                     nn.Linear(256, 5, dtype=dtype))
                model = DataParallel(wide, bucket_cap_mb=0.1, **opts)
                pair.append((model, DistributedOptimizer(model, torch.optim.AdamW, lr=1e-2,
                                                         stage=stage,
                                                         overlap_param_gather=micro == 2)))
            what = f"{dtype} {opts} micro={micro}"
            for step in range(3):
                for model, opt in pair:
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
                (one, o1), (two, o2) = pair
                o1.finish_param_sync()
                o2.finish_param_sync()
                for p, q in zip(one.parameters(), two.parameters()):
                    assert torch.equal(p, q), f"{what} step {step}: {(p - q).abs().max()}"
                buckets = two._reducer.buckets
                assert all(b.released for b in buckets) and \
                    all(p.grad is None for p in two.parameters()), what
                flats = [t for b in buckets for t in b._flats()]
                assert sum(t.untyped_storage().nbytes() for t in flats) == 0, what
                assert not any(b.released for b in one._reducer.buckets), what
            # What release frees, the allocator counts: each bucket's whole gradients (gloo's
            # scratch comes back at the bucket's launch, not here).
            for b in buckets:
                whole = sum(t.numel() * t.element_size() for t in b._flats()
                            if t is not b.scratch)
                before = CPUMemory.allocated()
                b.acquire()
                grown = CPUMemory.allocated() - before
                b.release()
                freed = before + grown - CPUMemory.allocated()
                assert grown == whole == freed > 0, (what, grown, whole, freed)
    with pytest.raises(ValueError, match="stage=4 must be 1"):
        DistributedOptimizer(DataParallel(_mlp()), torch.optim.AdamW, stage=4)
    with pytest.raises(ValueError, match="stage=2 shards gradients, which needs shard=True"):
        DistributedOptimizer(DataParallel(_mlp()), torch.optim.AdamW, stage=2, shard=False)


def zero_checks(rank, world):
    _zero2_frees_whole_gradients(rank, world)
    _zero_equals_plain_dp(rank, world)
    _zero_low_precision_and_unused(rank, world)
    _zero_overlap_step(rank, world)
