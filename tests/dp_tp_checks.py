"""Rank check for data parallelism over a tensor-parallel model: tp=2 x dp=2 equals one process.

The dp group (ranks sharing a TP coordinate) is separate from the tp group; plain DP and ZeRO-1
are both trained for several AdamW steps and compared with the single-process model, shard by
shard. Run inside the 4 ranks of tests/test_dp_data_parallel.py.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

import fastpar
from fastpar.data_parallel import DataParallel, DistributedOptimizer
from fastpar.tensor_parallel import ColumnParallelLinear, RowParallelLinear


def _reference():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8), nn.Linear(8, 4))


def _tensor_parallel(ref, tp_group):
    head = nn.Linear(8, 4)                         # replicated over TP
    head.load_state_dict(ref[3].state_dict())
    return nn.Sequential(ColumnParallelLinear.from_linear(ref[0], tp_group), nn.GELU(),
                         RowParallelLinear.from_linear(ref[2], tp_group), head)


def tp_by_dp_checks(rank, world):
    mesh = fastpar.init(tp=2)              # torch.distributed runs already: only new groups
    assert (mesh.tp_size, mesh.dp_size) == (2, 2)
    ref = _reference()
    plain = DataParallel(_tensor_parallel(ref, mesh.tp_group), dp_group=mesh.dp_group,
                         bucket_cap_mb=200 / 2**20)
    sharded = DataParallel(_tensor_parallel(ref, mesh.tp_group), dp_group=mesh.dp_group,
                           bucket_cap_mb=200 / 2**20)
    opts = [torch.optim.AdamW(plain.parameters(), lr=1e-2),
            DistributedOptimizer(sharded, torch.optim.AdamW, lr=1e-2),
            torch.optim.AdamW(ref.parameters(), lr=1e-2)]
    for step in range(3):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(8, 8, generator=g), torch.randn(8, 4, generator=g)
        xs, ys = x.chunk(mesh.dp_size)[mesh.dp_rank], y.chunk(mesh.dp_size)[mesh.dp_rank]
        for model, opt, (a, b) in zip((plain, sharded, ref), opts, ((xs, ys), (xs, ys), (x, y))):
            F.mse_loss(model(a), b).backward()
            opt.step()
            opt.zero_grad()
    tp, r = mesh.tp_size, mesh.tp_rank
    want = [ref[0].weight.chunk(tp, 0)[r], ref[0].bias.chunk(tp, 0)[r],
            ref[2].weight.chunk(tp, 1)[r], ref[2].bias, ref[3].weight, ref[3].bias]
    for model in (plain, sharded):
        for (name, p), w in zip(model.module.named_parameters(), want):
            assert torch.allclose(p, w, atol=1e-5), f"{name}: {(p - w).abs().max()}"
    # ZeRO's gradient norm over dp and tp, replicated parameters counted on tp rank 0 only.
    for model, (a, b) in ((sharded, (xs, ys)), (ref, (x, y))):
        F.mse_loss(model(a), b).backward()
    replicated = {id(sharded.module[2].bias), id(sharded.module[3].weight),
                  id(sharded.module[3].bias)}
    got = opts[1].clip_grad_norm_(1e9, groups=[mesh.tp_group],
                                  counted=lambda p: r == 0 or id(p) not in replicated)
    want_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 1e9)
    assert torch.allclose(got, want_norm, rtol=1e-5), (got, want_norm)
