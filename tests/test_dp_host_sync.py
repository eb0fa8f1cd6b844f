"""The data-parallel hot path never stalls the host on the device.

On CUDA, ``.item()``, ``.tolist()``, ``torch.tensor(list)`` onto the device and
``Work.wait(timeout)`` each block the host until the GPU catches up, which serialises the step.
On CPU they cost nothing, so this test counts them instead: every call made from
fastpar/data_parallel while dp=2 ranks run forward, backward and the reduction's finish over a few
steps, in each mode of the reducer. Only find_unused_parameters=True may sync (as torch DDP); it
is the control that shows the counter sees a sync.
"""
import contextlib
import os
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from fastpar.data_parallel import DataParallel, DistributedOptimizer
from fastpar.testing import run_ranks

_DP_DIR = os.sep + os.path.join("fastpar", "data_parallel") + os.sep


def _from_data_parallel() -> bool:
    """Whether a frame of fastpar/data_parallel is on the Python stack."""
    frame = sys._getframe(2)
    while frame is not None:
        if _DP_DIR in frame.f_code.co_filename:
            return True
        frame = frame.f_back
    return False


class _ScalarReads(TorchDispatchMode):
    """Counts aten._local_scalar_dense (item(), bool(t), int(t), float(t)) from fastpar/data_parallel."""

    def __init__(self, seen):
        super().__init__()
        self.seen = seen

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default and _from_data_parallel():
            self.seen.append("aten._local_scalar_dense")
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def _count_host_syncs(seen):
    """Patch the calls that sync on CUDA; record those made from fastpar/data_parallel."""
    work = torch._C._distributed_c10d.Work
    originals = {"tolist": torch.Tensor.tolist, "item": torch.Tensor.item,
                 "tensor": torch.tensor, "wait": work.wait}

    def tolist(self):
        if _from_data_parallel():
            seen.append("Tensor.tolist")
        return originals["tolist"](self)

    def item(self):
        if _from_data_parallel():
            seen.append("Tensor.item")
        return originals["item"](self)

    def tensor(data, *args, **kwargs):
        if isinstance(data, (list, tuple)) and _from_data_parallel():
            seen.append("torch.tensor(list)")
        return originals["tensor"](data, *args, **kwargs)

    def wait(self, *args, **kwargs):
        if (args or kwargs) and _from_data_parallel():
            seen.append("Work.wait(timeout)")
        return originals["wait"](self, *args, **kwargs)

    torch.Tensor.tolist, torch.Tensor.item, torch.tensor, work.wait = tolist, item, tensor, wait
    try:
        with _ScalarReads(seen):
            yield
    finally:
        torch.Tensor.tolist, torch.Tensor.item = originals["tolist"], originals["item"]
        torch.tensor, work.wait = originals["tensor"], originals["wait"]


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 16), nn.GELU(),
                         nn.Linear(16, 4))


def _steps(model, opt, rank, n=3):
    for step in range(n):
        g = torch.Generator().manual_seed(100 * step + rank)
        x, y = torch.randn(4, 8, generator=g), torch.randn(4, 4, generator=g)
        with model.no_sync():                      # gradient accumulation: one local micro-batch
            F.mse_loss(model(x[:2]), y[:2]).backward()
        F.mse_loss(model(x[2:]), y[2:]).backward()
        model.finish_gradient_sync()
        opt.step()
        opt.zero_grad()


def _modes(rank, world):
    """Host syncs counted from fastpar/data_parallel in each mode: {mode: [what, ...]}."""
    torch.set_num_threads(1)
    cap = 300 / 2**20                               # ~300-byte buckets: several per model
    modes = {
        "overlap": dict(bucket_cap_mb=cap),
        "no overlap": dict(bucket_cap_mb=cap, overlap=False),
        "bf16 reduce (packed)": dict(bucket_cap_mb=cap, reduce_dtype=torch.bfloat16),
        "zero-1": dict(bucket_cap_mb=cap),
        "deferred wait": dict(bucket_cap_mb=cap),
        "find_unused (control)": dict(bucket_cap_mb=cap, find_unused_parameters=True),
    }
    out = {}
    for name, kwargs in modes.items():
        model = DataParallel(_model(), **kwargs)
        opt = (DistributedOptimizer(model, torch.optim.SGD, lr=0.1) if name == "zero-1"
               else torch.optim.SGD(model.parameters(), lr=0.1))
        if name == "deferred wait":                 # as a pipeline schedule drives it
            model.set_requires_gradient_sync(True, wait_in_backward=False)
        _steps(model, opt, rank, n=1)               # warm-up outside the count
        seen = []
        with _count_host_syncs(seen):
            _steps(model, opt, rank)
        out[name] = seen
    dist.barrier()
    return out


def test_dp_hot_path_has_no_host_syncs():
    out = run_ranks(_modes, 2, timeout=120)
    for rank, modes in enumerate(out):
        control = modes.pop("find_unused (control)")
        assert "Tensor.tolist" in control, f"rank {rank}: the counter missed the used-map sync"
        assert modes == {m: [] for m in modes}, f"rank {rank}: host syncs in the DP hot path"
