"""fastpar.extension.CPUMemory: allocator-level live and peak bytes of CPU tensors, counted on
every thread, as torch.cuda.memory_allocated / max_memory_allocated are on a GPU."""
import threading

import torch

from fastpar.extension import CPUMemory


def test_live_and_peak_bytes_follow_allocations_and_frees_on_any_thread():
    CPUMemory.install()
    assert CPUMemory.installed()
    base = CPUMemory.allocated()
    CPUMemory.reset_peak()
    a = torch.empty(1000, 1000)                     # 4 MB
    b = torch.empty(500, 1000, dtype=torch.float64)  # 4 MB
    assert CPUMemory.allocated() - base == 8_000_000
    del a
    assert CPUMemory.allocated() - base == 4_000_000
    assert CPUMemory.peak() - base == 8_000_000      # the peak stays
    CPUMemory.reset_peak()
    assert CPUMemory.peak() == CPUMemory.allocated()

    held = []
    t = threading.Thread(target=lambda: held.append(torch.ones(250_000)))  # 1 MB on a thread
    t.start(); t.join()
    assert CPUMemory.allocated() - base == 5_000_000
    t = threading.Thread(target=held.clear)         # freed on another thread
    t.start(); t.join()
    del b
    assert CPUMemory.allocated() == base


def test_views_and_autograd_count_storage_once():
    CPUMemory.install()
    base = CPUMemory.allocated()
    x = torch.randn(256, 256, requires_grad=True)   # 256 KiB
    v = x.detach().view(-1)[:10]                    # a view: no bytes
    assert CPUMemory.allocated() - base == 256 * 256 * 4
    (x @ x).sum().backward()                        # x.grad stays, the rest is freed
    assert CPUMemory.allocated() - base == 2 * 256 * 256 * 4
    del x, v
    assert CPUMemory.allocated() == base
