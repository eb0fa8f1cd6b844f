"""Bucket assignment as a pure function: deterministic, reverse order, split by dtype, capped."""
import pytest
import torch

from fastpar.data_parallel import assign_buckets

F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16


def _check_invariants(params, buckets, cap_bytes, pad_to=1, reduce_dtype=None, first_cap=None):
    seen = [i for b in buckets for i in b.indices]
    assert sorted(seen) == list(range(len(params))), "every parameter exactly once"
    for b in buckets:
        assert {params[i][1] for i in b.indices} == {b.dtype}, "one dtype per bucket"
        assert list(b.indices) == sorted(b.indices, reverse=True), "reverse registration order"
        assert b.numels == tuple(params[i][0] for i in b.indices)
        assert b.offsets == tuple(sum(b.numels[:k]) for k in range(len(b.numels))), "packed"
        assert b.numel == sum(b.numels)
        assert b.padded_numel % pad_to == 0 and b.padded_numel - b.numel < max(pad_to, 1) \
            or b.numel == 0
    item = lambda b: (reduce_dtype or b.dtype).itemsize  # noqa: E731
    for dtype in {d for _, d in params}:
        mine = sorted((b for b in buckets if b.dtype == dtype), key=lambda b: -b.indices[0])
        order = [i for b in mine for i in b.indices]
        assert order == sorted(order, reverse=True), "consecutive runs of the reversed order"
        # Closed at the cap: below it until its last parameter, and (all but the last of a
        # dtype) at or above it; the first of each dtype at first_cap.
        for k, b in enumerate(mine):
            cap = first_cap if first_cap and k == 0 else cap_bytes
            assert (b.numel - b.numels[-1]) * item(b) < cap, f"went on past the cap: {b}"
            assert k == len(mine) - 1 or b.numel * item(b) >= cap, f"closed early: {b}"
    # Launch order: by when a bucket's last gradient is ready (reverse position of its last).
    ready = [len(params) - 1 - b.indices[-1] for b in buckets]
    assert ready == sorted(ready)


def test_reverse_order_and_cap():
    params = [(100, F32), (20, F32), (30, F32), (50, F32), (10, F32)]
    buckets = assign_buckets(params, cap_bytes=60 * 4)
    assert [b.indices for b in buckets] == [(4, 3), (2, 1, 0)]
    assert [b.offsets for b in buckets] == [(0, 10), (0, 30, 50)]
    _check_invariants(params, buckets, 60 * 4)


def test_split_by_dtype_and_ready_order():
    params = [(8, F32), (5, BF16), (20, F32), (3, BF16), (8, F32), (100, F32), (7, F16)]
    buckets = assign_buckets(params, cap_bytes=30 * 4)
    assert [(b.dtype, b.indices) for b in buckets] == [
        (F16, (6,)), (F32, (5,)), (BF16, (3, 1)), (F32, (4, 2, 0))]
    _check_invariants(params, buckets, 30 * 4)


def test_first_bucket_closes_early():
    # Biases (10) and weights (100), as reverse order meets them: the first bucket closes as
    # soon as it reaches 40 bytes, the others only at the 440-byte cap.
    params = [(100, F32), (10, F32)] * 4
    buckets = assign_buckets(params, cap_bytes=440, first_cap_bytes=40)
    assert [b.indices for b in buckets] == [(7,), (6, 5), (4, 3), (2, 1), (0,)]
    _check_invariants(params, buckets, 440, first_cap=40)
    buckets = assign_buckets(params, cap_bytes=440, first_cap_bytes=440)
    assert [b.indices for b in buckets] == [(7, 6), (5, 4), (3, 2), (1, 0)]


def test_a_parameter_larger_than_the_cap_closes_its_bucket():
    buckets = assign_buckets([(10, F32), (1000, F32), (10, F32)], cap_bytes=100)
    assert [b.indices for b in buckets] == [(2, 1), (0,)]


def test_cap_counts_reduce_dtype_bytes_and_padding():
    params = [(7, BF16)] * 6
    # 7 bf16 elements reduced in fp32 are 28 bytes: two reach a 56-byte cap (in bf16, four).
    buckets = assign_buckets(params, cap_bytes=56, pad_to=4, reduce_dtype=F32)
    assert [b.indices for b in buckets] == [(5, 4), (3, 2), (1, 0)]
    assert all(b.numel == 14 and b.padded_numel == 16 for b in buckets)
    assert buckets[0].shard(1, 4) == (4, 8)
    _check_invariants(params, buckets, 56, pad_to=4, reduce_dtype=F32)
    assert [b.indices for b in assign_buckets(params, cap_bytes=56)] == [(5, 4, 3, 2), (1, 0)]


@pytest.mark.parametrize("seed", range(5))
def test_random_models_keep_every_invariant_and_are_deterministic(seed):
    g = torch.Generator().manual_seed(seed)
    dtypes = (F32, BF16, F16)
    params = [(int(torch.randint(0, 500, (), generator=g)),
               dtypes[int(torch.randint(0, 3, (), generator=g))]) for _ in range(40)]
    cap = int(torch.randint(50, 3000, (), generator=g))
    pad = int(torch.randint(1, 9, (), generator=g))
    first = int(torch.randint(1, cap + 1, (), generator=g))
    buckets = assign_buckets(params, cap_bytes=cap, pad_to=pad, first_cap_bytes=first)
    _check_invariants(params, buckets, cap, pad_to=pad, first_cap=first)
    assert assign_buckets(list(params), cap_bytes=cap, pad_to=pad,
                          first_cap_bytes=first) == buckets


def test_bad_arguments():
    with pytest.raises(ValueError, match="cap_bytes=0 must be > 0"):
        assign_buckets([(1, F32)], cap_bytes=0)
    with pytest.raises(ValueError, match="pad_to=0"):
        assign_buckets([(1, F32)], cap_bytes=10, pad_to=0)
    assert assign_buckets([], cap_bytes=10) == []


def _ddp_buckets(rank, world, widths, cap_mb):
    """DataParallel's buckets and torch DDP's (as DDP rebuilds them after the first backward,
    in gradient-ready order, with its 1 MiB first bucket) for the same model and cap."""
    import torch.nn as nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    from fastpar.data_parallel import DataParallel

    torch.manual_seed(0)
    layers = [nn.Linear(a, b) for a, b in zip(widths[:-1], widths[1:])]
    model = nn.Sequential(*layers)
    kw = {} if cap_mb is None else {"bucket_cap_mb": cap_mb}
    ddp = DDP(model, gradient_as_bucket_view=True, **kw)
    for _ in range(3):                  # rebuilt after the first backward, logged later
        ddp(torch.randn(2, widths[0])).sum().backward()
    data = ddp._get_ddp_logging_data()
    theirs = [[int(i) for i in b.split()]
              for b in data["rebuilt_per_bucket_param_indices"].split(", ")]
    ours = [list(s.indices) for s in
            DataParallel(nn.Sequential(*layers), bucket_cap_mb=cap_mb).bucket_specs]
    return ours, theirs


@pytest.mark.parametrize("widths,cap_mb", [((256, 512, 512, 1024, 256, 64), 1.5),
                                           ((64, 700, 700, 700, 32), 0.75),
                                           ((256, 512, 512, 1024, 256, 64), None),
                                           ((128, 128, 128), 25)])
def test_buckets_equal_torch_ddp_for_the_same_cap(widths, cap_mb):
    """None: both at their default (25 MiB, the first bucket at 1 MiB)."""
    from fastpar.testing import run_ranks

    ours, theirs = run_ranks(_ddp_buckets, 2, widths, cap_mb)[0]
    assert len(ours) > 1 or widths[1] == 128
    assert ours == theirs
