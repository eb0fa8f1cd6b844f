"""``fastpar train ... --dry-run``: a launch of any number of ranks, checked and sized in this one
process, without data, GPUs or FLOPs.

    fastpar train --model 70b --tp 8 --pp 8 --dp 16 --seq-len 4096 --micro-batch-size 1 \\
        --global-batch-size 256 --zero 1 --sequence-parallel --dry-run --hardware h100-80gb

    report = dry_run(cfg, world_size=1024, hardware="h100-80gb")   # from Python
    print(format_report(report))

Every check a launch runs on its inputs runs first (the layout against the world, the weights of
``--init-from``; not the data, which a dry run does not read). Then, for each distinct rank role
(a pipeline rank: the TP, CP and DP ranks of one stage hold the same shapes), this process joins
torch's fake process group as that role's first rank and builds what the rank builds: the mesh
and every group (:func:`fastpar.init`, the launch's own), the model chunks on the meta device
(the trainer's ``build_model``: its stage split, TP shards, sequence parallelism, tied
embeddings) and the DataParallel buckets with their ZeRO-1 shards
(:func:`fastpar.data_parallel.data_parallel.bucket_specs`). It counts the parameters, gradient
buffers and optimizer state the rank holds, takes the activations of the pipeline schedule's
peak in-flight micro-batches from the memory model, and sets the total against the device's
memory, with the planner's step-time estimate. The memory model
(:func:`fastpar.plan.planner.memory_rows`) gives the same numbers: the report carries both.
"""
from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn

from ..data_parallel.data_parallel import bucket_specs, param_kinds, unit_index
from ..plan import planner
from ..plan.cost import trainer_features
from ..plan.hardware import get_hardware
from .memory_check import layout_config, precision_mode


@dataclass
class Role:
    """One pipeline rank's share, in GB (1e9 bytes) but for the counts."""

    pp_rank: int
    first_rank: int             # the role's lowest global rank, the one built
    ranks: int                  # how many ranks hold these shapes
    layers: list[int]
    params: int                 # counted on the built model chunks
    model_params: float         # the memory model's count
    weights: float
    gradients: float            # the DataParallel buffers (padded to dp shards)
    optimizer: float            # the ZeRO-1 shard's (or every parameter's) state
    activations: float          # the memory model's, at the schedule's peak
    reserve: float
    total: float
    model_total: float          # the memory model's total for this rank


@dataclass
class DryRunReport:
    world_size: int
    layout: str
    hardware: str
    memory_gb: float
    roles: list[Role]
    step_time_s: float | None   # the planner's estimate (None if it cannot run there)
    fits: bool


@contextlib.contextmanager
def _fake_world(rank: int, world_size: int):
    """This process as ``rank`` of ``world_size`` on torch's fake backend (no peer, no traffic)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers "fake"

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


def dry_run(cfg, world_size: int, hardware: str = "h100-80gb") -> DryRunReport:
    """The report of ``cfg`` (a ``TrainConfig``) on ``world_size`` ranks of ``hardware`` (a
    built-in profile name or a .json file; one GPU per rank). Raises ValueError (one line) on
    what a launch would refuse before sizing anything."""
    from .. import init
    from ..mesh import ep_groups
    from .init_from import check_source
    from .trainer import build_model

    if dist.is_initialized():
        raise ValueError("a dry run builds its own fake world: run it outside a distributed job")
    lay = cfg.check_layout(world_size)
    if cfg.init_from:
        check_source(cfg.init_from, cfg.tp, cfg.pp)
    hw = get_hardware(hardware)
    mode = precision_mode(cfg, "cuda")
    hw = dataclasses.replace(hw, bytes_per_element=2 if mode != "fp32" else 4)
    feat = trainer_features(mode, cfg.grad_reduce_dtype, dropout=False)
    layout = layout_config(cfg, lay)
    work = planner.Workload(cfg.model_config, cfg.seq_len, cfg.global_batch_size)
    per_node = min(8, world_size)
    cluster = planner.Cluster(world_size, per_node if world_size % per_node == 0 else 1, hw)
    rows = planner.memory_rows(work, cluster, layout, feat)
    dtype = torch.bfloat16 if mode == "bf16" else torch.float32
    reduce = torch.bfloat16 if cfg.grad_reduce_dtype == "bf16" else \
        (torch.float32 if mode == "bf16" else None)
    dp = lay.dp * lay.cp                        # the gradients are averaged over DP x CP
    roles = []
    for p in range(lay.pp):
        first = lay.rank(pp=p)
        with _fake_world(first, world_size):
            mesh = init(layout=lay)
            if cfg.ep > 1:
                mesh.ep_group, mesh.expert_dp_group = ep_groups(mesh, cfg.ep,
                                                                fold_tp=cfg.ep_fold_tp)
            with torch.device("meta"):
                chunks = build_model(cfg, dataclasses.replace(mesh, device=torch.device("meta")))
        params = [q for c in chunks for q in c.parameters()]
        n = sum(q.numel() for q in params)
        zero3 = cfg.zero == 3 and planner.shard_size(layout) > 1
        blocks = [layer for c in chunks for layer in c.layers.values()]
        unit_of = unit_index(nn.ModuleList(chunks), blocks, params) if zero3 else None
        shard = planner.shard_size(layout) if cfg.zero else dp    # HSDP: the shard groups
        experts = [getattr(q, "expert_parallel", False) for q in params]
        specs = bucket_specs([(q.numel(), dtype) for q in params], shard, None, reduce,
                             mode == "bf16", unit_of, param_kinds(params))
        buffered = sum(s.padded_numel for s in specs)
        stepped = buffered // shard if cfg.zero and shard > 1 else n
        # Expert parallelism: the experts' buckets are sharded over their replicas only.
        held = [s.padded_numel for s in specs if experts[s.indices[0]]]
        if held and cfg.zero and shard > 1:
            stepped += sum(held) // (shard // cfg.ep_dp) - sum(held) // shard
        row = rows[p]
        weight, grad, opt = planner.bytes_per_param(layout, feat, hw)
        weights = n * weight
        grads = planner.gradient_bytes(layout, work, feat, hw, buffered,
                                       row["activations"] * 1e9)
        if zero3:          # the gathered units and whole gradients in flight at the peak
            owner = [unit_of[s.indices[0]] for s in specs]
            sizes: dict = {}
            for s, u in zip(specs, owner):  # a unit's buckets (dense, and its experts')
                sizes[u] = sizes.get(u, 0) + s.padded_numel
            unit = max(v for u, v in sizes.items() if u is not None)
            weights, whole_g = planner.zero3_bytes(layout, work, feat, hw, buffered, unit,
                                                   sizes.get(None, 0), len(blocks))
            grads = buffered * grad + whole_g
        if held and cfg.zero:
            grads += sum(held) * (planner.bytes_per_param(planner.expert_view(layout), feat,
                                                          hw)[1] - planner.bytes_per_param(
                                                              layout, feat, hw)[1])
        mine = {"weights": weights / 1e9, "gradients": grads / 1e9,
                "optimizer": stepped * (feat.optimizer_bytes + (
                    4 if zero3 and not feat.main_grads else 0)) / 1e9,
                "activations": row["activations"], "reserve": row["reserve"]}
        layers = sorted(int(i) for c in chunks for i in c.layers.keys())
        roles.append(Role(p, first, world_size // lay.pp, layers, n, row["params_per_gpu"],
                          **mine, total=sum(mine.values()), model_total=row["total"]))
    try:
        est = planner.evaluate(work, cluster, layout, feat)
        step = est.step_time_s
    except ValueError:
        step = None
    fits = max(r.total for r in roles) <= hw.hbm_gb
    name = f"tp{lay.tp} x cp{lay.cp} x pp{lay.pp} x dp{lay.dp}" + \
        (f" (ep{cfg.ep})" if cfg.ep > 1 else "")
    return DryRunReport(world_size, name, hw.name, hw.hbm_gb, roles, step, fits)


def format_report(rep: DryRunReport) -> str:
    """The report as a table, one row per rank role, and a verdict line."""
    lines = [f"dry run: {rep.world_size} ranks, {rep.layout}, {rep.hardware} "
             f"({rep.memory_gb:g} GB per rank)",
             "| pp rank | ranks | layers | params | weights | gradients | optimizer | "
             "activations | reserve | total GB | memory model GB |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rep.roles:
        span = f"{len(r.layers)}: {r.layers[0]}..{r.layers[-1]}" if r.layers else "-"
        lines.append(f"| {r.pp_rank} | {r.ranks} | {span} | {r.params:,} | {r.weights:.2f} | "
                     f"{r.gradients:.2f} | {r.optimizer:.2f} | {r.activations:.2f} | "
                     f"{r.reserve:.2f} | {r.total:.2f} | {r.model_total:.2f} |")
    worst = max(rep.roles, key=lambda r: r.total)
    step = f"; planner's step time {rep.step_time_s:.2f} s" if rep.step_time_s else ""
    verdict = "fits" if rep.fits else "does NOT fit"
    lines.append(f"{verdict}: the fullest rank (pp {worst.pp_rank}) needs {worst.total:.1f} GB "
                 f"of {rep.memory_gb:g}{step}")
    return "\n".join(lines)
