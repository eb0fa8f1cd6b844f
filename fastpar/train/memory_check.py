"""Refuse, before any rank starts, a run whose sizes cannot fit in the device's memory.

The estimate is the planner's memory model (:func:`fastpar.plan.planner.memory_per_gpu`), not a
second one: weights, gradients and optimizer state by the bytes per parameter the trainer keeps
under its precision (:func:`fastpar.plan.cost.trainer_features`), the activations of the
schedule's peak in-flight micro-batches, the logits and their gradient, and the runtime's
reserve; against the device's memory: the GPU's on CUDA, on a CPU the host's memory (or its
cgroup's limit) shared by the ranks started on it.

    check_memory(cfg, world_size=2, local_ranks=2)      # raises ValueError, one line
    memory_estimate(cfg, 2, "cpu")                      # {"weights": GB, ..., "total": GB}

What the device really runs decides what is counted: ``precision="auto"`` is bf16 on CUDA and
fp32 on a CPU (``TrainConfig.bf16_params`` / ``autocast``); off CUDA fastpar runs torch's
reference ops, which keep fp32 intermediates (``Hardware.kind == "cpu"``); and whether the
attention keeps an (s x s) score matrix is torch's own choice of SDPA kernel for the shapes and
dtype the model uses (:func:`fused_attention`: torch 2.x runs a flash kernel on CPU too).
"""
from __future__ import annotations

import os
from dataclasses import fields
from pathlib import Path

from ..mesh.layout import Layout
from ..models.parallel_config import ParallelConfig
from ..plan.cost import trainer_features
from ..plan.hardware import device_profile
from ..plan.planner import Cluster, Workload, memory_per_gpu

_GB = 1e9       # the planner's unit


def default_device_type() -> str:
    """The device the ranks will train on: ``"cuda"`` if torch sees a GPU, else ``"cpu"``."""
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def precision_mode(cfg, device_type: str) -> str:
    """What ``cfg.precision`` resolves to on ``device_type``: "bf16" (bf16 parameters, fp32
    main gradients and masters), "amp" (bf16 autocast over fp32 parameters) or "fp32"."""
    if cfg.bf16_params(device_type):
        return "bf16"
    return "amp" if cfg.autocast(device_type) else "fp32"


def fused_attention(device_type: str, bf16: bool, model, tp: int = 1, cp: int = 1) -> bool:
    """Whether the attention keeps no (s x s) scores for the backward on ``device_type``.

    Under context parallelism (``cp > 1``) fastpar's ring attention works block by block and
    saves only q, k, v, the output and the log-sum-exp. Otherwise the model calls
    ``F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=...)``
    (fastpar/models/layers.py, ``ParallelAttention.core``): torch picks a fused kernel (flash,
    memory-efficient, cuDNN; on CPU ``_scaled_dot_product_flash_attention_for_cpu``) or the math
    backend, which materializes the scores. This asks torch which it picks for tensors like the
    model's (a few tokens, this rank's heads, the activation dtype, requiring grad)."""
    if cp > 1:
        return True
    try:
        import torch
        from torch.nn.attention import SDPBackend

        if device_type == "cuda" and not torch.cuda.is_available():
            raise RuntimeError("no GPU here to ask")
        dtype = torch.bfloat16 if bf16 else torch.float32
        heads, kv = model.n_heads // tp, model.kv_heads // tp

        def t(h):
            return torch.zeros(1, h, 16, model.head_dim, dtype=dtype, device=device_type,
                               requires_grad=True)
        choice = torch._fused_sdp_choice(t(heads), t(kv), t(kv), None, 0.0, True,
                                         enable_gqa=kv != heads)
        return choice not in (int(SDPBackend.MATH), int(SDPBackend.ERROR))
    except Exception:       # an older or newer torch without this private helper
        import torch

        if device_type == "cuda":
            return True     # flash / memory-efficient kernels serve training shapes on CUDA
        return hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu")


def _cgroup_limit() -> int | None:
    """This process's cgroup memory limit in bytes (v2 ``memory.max``, v1
    ``memory.limit_in_bytes``), or None if there is none."""
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            text = Path(path).read_text().strip()
        except OSError:
            continue
        if text.isdigit():
            return int(text)
    return None


def host_memory() -> tuple[float, str]:
    """(GB, what it is) of this host's memory: physical memory, or the cgroup's limit if it
    is lower."""
    try:
        phys = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        phys = None
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                phys = int(line.split()[1]) * 1024
    limit = _cgroup_limit()
    if limit is not None and (phys is None or limit < phys):
        return limit / _GB, "cgroup memory limit"
    return phys / _GB, "host memory"


def device_memory(device_type: str, local_ranks: int,
                  limit_gb: float | None = None) -> tuple[float, str]:
    """(GB each rank has, where that comes from) on ``device_type``: on CUDA the GPU's memory
    (a GPU per rank); on a CPU the host's memory (or cgroup limit) divided by ``local_ranks``.
    ``limit_gb`` stands for the detected GPU or host memory."""
    if device_type == "cuda":
        if limit_gb is not None:
            return limit_gb, f"{limit_gb:.1f} GB per GPU, as given"
        import torch

        props = torch.cuda.get_device_properties(0)
        return props.total_memory / _GB, props.name
    host, what = (limit_gb, "host memory as given") if limit_gb is not None else host_memory()
    shared = f", shared by {local_ranks} ranks" if local_ranks > 1 else ""
    return host / local_ranks, f"{host:.1f} GB {what}{shared}"


def layout_config(cfg, lay: Layout) -> ParallelConfig:
    """The planner's ParallelConfig of ``cfg`` (a ``TrainConfig``) on the run's layout."""
    return ParallelConfig(**{f.name: getattr(cfg, f.name) for f in fields(ParallelConfig)
                             if f.name != "dp"}, dp=lay.dp)


def _planner_inputs(cfg, lay: Layout, device_type: str, memory_gb: float):
    """The planner's (Workload, Cluster, ParallelConfig, Features) for ``cfg`` on ``lay``'s
    ranks of this device."""
    world_size = lay.world_size
    layout = layout_config(cfg, lay)
    mc, mode = cfg.model_config, precision_mode(cfg, device_type)
    low = mode != "fp32"                        # activations in bf16 under autocast
    hw = device_profile(device_type, 2 if low else 4, memory_gb)
    feat = trainer_features(
        mode, cfg.grad_reduce_dtype,
        flash_attention=fused_attention(device_type, low, mc, cfg.tp, cfg.cp),
        # The reference bias_dropout_add keeps its mask; the GPU kernel regenerates it.
        dropout=mc.dropout > 0 and hw.kind == "cpu")
    work = Workload(mc, cfg.seq_len, cfg.global_batch_size)
    return work, Cluster(world_size, world_size, hw), layout, feat


def memory_estimate(cfg, world_size, device_type: str,
                    memory_gb: float | None = None) -> dict:
    """GB (1e9 bytes) per rank, on the fullest pipeline rank, by kind: weights, gradients,
    optimizer, activations, reserve and total; :func:`fastpar.plan.planner.memory_per_gpu` of
    ``cfg`` (a ``TrainConfig``) on ``world_size`` ranks (or the run's Layout) of ``device_type``. ``memory_gb``, the
    memory each rank has, only sizes the reserve (1 GB, at most a quarter of it); None: this
    host's, as if all ``world_size`` ranks ran here."""
    lay = world_size if isinstance(world_size, Layout) else cfg.check_layout(world_size)
    if memory_gb is None:
        memory_gb = device_memory(device_type, lay.world_size)[0]
    mem = memory_per_gpu(*_planner_inputs(cfg, lay, device_type, memory_gb))
    return {k: v for k, v in mem.items() if k != "params_per_gpu"}


def check_memory(cfg, world_size, local_ranks: int, device_type: str | None = None,
                 limit_gb: float | None = None) -> None:
    """Raise ValueError (one line: the estimate by kind, the memory each rank has, what to
    change) if ``cfg`` on ``world_size`` ranks, ``local_ranks`` of them on this host, needs more
    memory per rank than the device has. ``device_type`` defaults to the one the ranks will
    use; ``limit_gb`` replaces the detected memory: the GPU's on CUDA, the host's (shared by
    ``local_ranks``) on a CPU."""
    device_type = device_type or default_device_type()
    local_ranks = max(1, local_ranks)
    per_rank, where = device_memory(device_type, local_ranks, limit_gb)
    est = memory_estimate(cfg, world_size, device_type, per_rank)
    if est["total"] <= per_rank:
        return
    parts = ", ".join(f"{k} {v:.1f}" for k, v in est.items() if k != "total")
    if device_type == "cuda":
        has = f"each rank's GPU has {per_rank:.1f} GB ({where})"
    elif local_ranks > 1:
        has = f"each of the {local_ranks} ranks on this host has {per_rank:.1f} GB ({where})"
    else:
        has = f"the one rank on this host has {per_rank:.1f} GB ({where})"
    fixes = "lower --seq-len or --micro-batch-size, use " + \
        ("--recompute full or " if cfg.recompute != "full" else "") + \
        "more ranks (--tp, --pp, --cp)"
    raise ValueError(f"the layout needs about {est['total']:.1f} GB per rank ({parts}) but "
                     f"{has}: {fixes}, or pass --no-memory-check to start anyway")
