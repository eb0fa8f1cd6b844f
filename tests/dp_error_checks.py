"""Rank checks for bad input and unused parameters: one clear error, never a hang.

Run inside the ranks of tests/test_dp_data_parallel.py, which also compares the messages across
ranks.
"""
import pytest
import torch
import torch.nn as nn

from fastpar.data_parallel import DataParallel, DistributedOptimizer


class _Two(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(3, 3), nn.Linear(3, 3)

    def forward(self, x, use_b=True):
        x = self.a(x)
        return self.b(x) if use_b else x


def error_checks(rank, world):
    """Every expected error, by case: {case: message}."""
    seen = {}

    def expect(case, exc, fn, match):
        with pytest.raises(exc, match=match) as e:
            fn()
        seen[case] = str(e.value)

    lin = lambda: nn.Linear(2, 2)  # noqa: E731
    # Local checks: raised before any collective, identically on every rank.
    expect("not a module", ValueError, lambda: DataParallel(lambda x: x), "wraps an nn.Module")
    expect("no parameters", ValueError, lambda: DataParallel(nn.ReLU()), "has no parameters")
    expect("all frozen", ValueError, lambda: DataParallel(lin().requires_grad_(False)),
           "is frozen")
    for cap in (0, -1.5, float("nan"), True, "25"):
        expect(f"bucket_cap_mb={cap!r}", ValueError,
               lambda: DataParallel(lin(), bucket_cap_mb=cap), "must be None or a finite number > 0")
    expect("reduce_dtype", ValueError, lambda: DataParallel(lin(), reduce_dtype=torch.int32),
           "reduce_dtype=torch.int32 must be None or one of")
    expect("dp_group", ValueError, lambda: DataParallel(lin(), dp_group="world"),
           "must be a torch.distributed ProcessGroup")
    # Shapes that differ across ranks: found by the one wrap-time collective, on every rank.
    expect("shapes differ", ValueError,
           lambda: DataParallel(nn.Linear(4, 4 + (rank == world - 1))),
           f"parameters differ across data-parallel ranks .*on dp rank")
    # A parameter no rank uses: every rank raises once the step's reduction is done ...
    model = DataParallel(_Two())
    x = torch.randn(2, 3)
    expect("unused everywhere", RuntimeError, lambda: model(x, use_b=False).sum().backward(),
           "no gradient in this step on this data-parallel rank: 'b.weight'")
    # ... and one used on rank 0 only raises on the other ranks: as in torch DDP, telling rank 0
    # would cost a host sync every step. Every rank's reduction still completes (no hang).
    if rank == 0:
        model(x).sum().backward()
        seen["unused on some ranks"] = None
    else:
        expect("unused on some ranks", RuntimeError,
               lambda: model(x, use_b=False).sum().backward(),
               "'b.weight'.*find_unused_parameters=True")
    model.zero_grad()
    model(x).sum().backward()                      # the wrapper is still usable afterwards
    assert all(p.grad is not None for p in model.parameters())
    # ZeRO-1's own checks.
    expect("zero: plain module", ValueError, lambda: DistributedOptimizer(lin()),
           "needs a fastpar DataParallel")
    expect("zero: optimizer class", ValueError, lambda: DistributedOptimizer(model, object),
           "must be a torch.optim.Optimizer subclass")
    expect("zero: foreign tensor", ValueError,
           lambda: DistributedOptimizer(model, param_groups=[{"params": [torch.zeros(1)]}]),
           "not a trainable parameter")
    DistributedOptimizer(model)
    expect("zero: twice", ValueError, lambda: DistributedOptimizer(model),
           "already has a DistributedOptimizer")
    return seen
