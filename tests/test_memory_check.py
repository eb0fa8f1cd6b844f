"""The check before launch: the planner's memory model, against the device's memory."""
import json
import os
import subprocess
import sys

import pytest

from fastpar.models.parallel_config import ParallelConfig
from fastpar.plan import cost
from fastpar.plan.hardware import device_profile
from fastpar.plan.planner import Cluster, Workload, memory_per_gpu
from fastpar.train import TrainConfig
from fastpar.train import memory_check
from fastpar.train.memory_check import check_memory, memory_estimate


def test_the_estimate_is_the_planners_memory_model():
    """One model: the estimate is memory_per_gpu of the same layout, with the bytes of the
    trainer's precision on the device."""
    cfg = TrainConfig(model="tiny", seq_len=512)
    est = memory_estimate(cfg, 2, "cpu", memory_gb=12.0)
    work = Workload(cfg.model_config, 512, 16)
    mem = memory_per_gpu(work, Cluster(2, 2, device_profile("cpu", 4, 12.0)),
                         ParallelConfig(dp=2, micro_batch_size=4),
                         cost.trainer_features("fp32", flash_attention=True))
    assert est == {k: v for k, v in mem.items() if k != "params_per_gpu"}
    # bf16 on CUDA (precision auto): 2-byte weights and activations, fp32 main gradients,
    # masters and moments; a pipeline of 2 with the trainer's split and the schedule's peak.
    cfg = TrainConfig(model="tiny", seq_len=512, pp=2, global_batch_size=16)
    est = memory_estimate(cfg, 2, "cuda", memory_gb=80.0)
    mem = memory_per_gpu(work, Cluster(2, 2, device_profile("cuda", 2, 80.0)),
                         ParallelConfig(pp=2, dp=1, micro_batch_size=4),
                         cost.trainer_features("bf16", flash_attention=True))
    assert est == {k: v for k, v in mem.items() if k != "params_per_gpu"}
    assert est["weights"] * 2 == pytest.approx(est["gradients"])


@pytest.mark.parametrize("precision, bytes_", [("fp32", (4, 4, 8)), ("bf16", (2, 4, 12)),
                                               ("amp", (6, 4, 8))])
def test_precision_decides_the_bytes_per_parameter(precision, bytes_):
    cfg = TrainConfig(model="tiny", precision=precision)
    est = memory_estimate(cfg, 1, "cpu", memory_gb=12.0)
    params = est["weights"] / bytes_[0]
    assert (est["gradients"], est["optimizer"]) == pytest.approx((params * bytes_[1],
                                                                   params * bytes_[2]))
    fp32 = memory_estimate(TrainConfig(model="tiny"), 1, "cpu", memory_gb=12.0)
    if precision != "fp32":             # bf16 activations: less than fp32's
        assert est["activations"] < fp32["activations"]


def test_the_probe_says_what_sdpa_runs_on_cpu():
    """fused_attention is torch's own choice: the kernel the profiler sees for the model's
    attention call."""
    import torch
    import torch.nn.functional as F
    from torch.profiler import ProfilerActivity, profile

    from fastpar.models import get_config

    tiny = get_config("tiny")
    q = torch.randn(1, tiny.n_heads, 64, tiny.head_dim, requires_grad=True)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        F.scaled_dot_product_attention(q, q, q, is_causal=True).sum().backward()
    names = {e.key for e in prof.key_averages()}
    fused = "aten::_scaled_dot_product_flash_attention_for_cpu" in names
    assert fused == memory_check.fused_attention("cpu", False, tiny)
    assert fused or "aten::_scaled_dot_product_attention_math" in names


@pytest.mark.parametrize("fused", [True, False])
def test_activations_grow_with_seq_len_as_the_model_says(monkeypatch, fused):
    """Linear in the sequence with a fused attention; with the scores materialized (the math
    backend) the (s x s) scores of every layer add a quadratic term."""
    monkeypatch.setattr(memory_check, "fused_attention", lambda *a, **k: fused)

    def acts(seq):
        cfg = TrainConfig(model="tiny", seq_len=seq)
        return memory_estimate(cfg, 2, "cpu", memory_gb=12.0)["activations"] * 1e9
    a1, a2 = acts(1024), acts(2048)
    m, b = TrainConfig(model="tiny").model_config, 4
    scores = m.n_layers * 4 * b * m.n_heads * (2 * 1024 ** 2)     # E b a (2s)^2 - 2 E b a s^2
    assert a2 - 2 * a1 == pytest.approx(0.0 if fused else scores, abs=1.0)
    assert a2 > 2 * a1 - 1.0


def test_the_users_case_is_refused_in_one_line():
    """tiny at --seq-len 100000 on 2 CPU ranks of a 24 GB host: refused, naming both."""
    cfg = TrainConfig(model="tiny", seq_len=100000)
    est = memory_estimate(cfg, 2, "cpu", memory_gb=12.0)
    assert est["total"] > 12.0 and est["activations"] > 12.0
    with pytest.raises(ValueError) as info:
        check_memory(cfg, world_size=2, local_ranks=2, device_type="cpu", limit_gb=24.0)
    msg = str(info.value)
    assert "\n" not in msg
    assert msg.startswith(f"the layout needs about {est['total']:.1f} GB per rank (weights ")
    assert "each of the 2 ranks on this host has 12.0 GB (24.0 GB host memory" in msg
    assert "shared by 2 ranks" in msg and "--seq-len" in msg and "--no-memory-check" in msg


def test_the_default_run_passes_on_a_24_gb_host():
    check_memory(TrainConfig(model="tiny"), world_size=2, local_ranks=2, device_type="cpu",
                 limit_gb=24.0)
    # On CUDA each rank has its GPU: the limit is the GPU's, not shared.
    check_memory(TrainConfig(model="tiny", seq_len=8192, global_batch_size=32), world_size=8,
                 local_ranks=8,
                 device_type="cuda", limit_gb=80.0)
    with pytest.raises(ValueError, match="each rank's GPU has 8.0 GB"):
        check_memory(TrainConfig(model="tiny", seq_len=100000), world_size=2, local_ranks=2,
                     device_type="cuda", limit_gb=8.0)


def test_host_memory_honours_a_cgroup_limit(monkeypatch):
    phys, what = memory_check.host_memory()
    assert phys > 0
    monkeypatch.setattr(memory_check, "_cgroup_limit", lambda: int(phys * 1e9 / 4))
    assert memory_check.host_memory() == (pytest.approx(phys / 4), "cgroup memory limit")
    per, where = memory_check.device_memory("cpu", 2)
    assert per == pytest.approx(phys / 8) and "cgroup memory limit, shared by 2 ranks" in where
    monkeypatch.setattr(memory_check, "_cgroup_limit", lambda: None)
    physical = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") / 1e9
    assert memory_check.host_memory() == (pytest.approx(physical), "host memory")


_MEASURE = """
import json, os, resource, sys, tempfile
from fastpar.train import TrainConfig
from fastpar.train.trainer import train
with tempfile.TemporaryDirectory() as d:
    train(TrainConfig(model="tiny", seq_len=1024, micro_batch_size=4, global_batch_size=4,
                      steps=1, no_save=True, sample_tokens=0, out=os.path.join(d, "run")))
print(json.dumps(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9))
"""


def test_the_estimate_is_near_a_real_step():
    """One real training step of tiny (seq 1024, micro-batch 4, fp32, one process): its peak
    resident memory is within 3x of the estimate, either way (measured 0.69 GB against 1.24 GB
    estimated, most of it the 1 GB reserve)."""
    out = subprocess.run([sys.executable, "-c", _MEASURE], capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    measured = json.loads(out.stdout.strip().splitlines()[-1])
    cfg = TrainConfig(model="tiny", seq_len=1024, micro_batch_size=4, global_batch_size=4)
    est = memory_estimate(cfg, 1, "cpu", memory_gb=12.0)["total"]
    assert measured / 3 < est < 3 * measured, (est, measured)
