"""The training loop: GPT over any (tp, pp, dp) layout, as setup -> a :class:`Run`, one
:func:`train_step` per optimizer step, and the evaluation and checkpoint hooks after it.

    from fastpar.train import TrainConfig, train
    train(TrainConfig(model="tiny", tp=2, steps=100))     # under torchrun, or one process

Every layout runs the same math: the global batch of step s is fixed by (seed, s); each DP rank
takes its share, cut into micro-batches; gradients are averaged over the DP group, the loss is the
mean over the whole global batch; gradients are clipped by the true global norm.

Reliability: a rank that makes no progress for ``cfg.timeout`` seconds (no collective issued, no
step region begun) is noticed by its watchdog thread, on gloo and NCCL alike: every rank dumps
its record of collectives and the launcher names the first rank and collective that differ
(:mod:`fastpar.mesh.watchdog`, :mod:`fastpar.mesh.flight`); a
non-finite step is skipped on every rank (:mod:`.guard`); checkpoints are atomic, checksummed and
optionally written in the background (:mod:`.checkpoint_writer`).

A step that does not log never makes the host wait for the device: the loss, the gradient norm
and the non-finite flag stay there (clipping and skipping happen there too) until the next log
step reads all the steps since the last one at once (:class:`.metrics.PendingSteps`).
"""
from __future__ import annotations

import functools
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils._foreach_utils import _get_fused_kernels_supported_devices as _fused_devices

import fastpar
from ..data_parallel import DataParallel, DistributedOptimizer
from ..mesh import Layout, Mesh, ep_groups, hsdp_expert_group, hsdp_groups
from ..pipeline.schedules import PLACEMENT
from ..pipeline.tied import embedding_group
from ..mesh.profiling import span
from ..mesh import collectives
from ..mesh.watchdog import CollectiveTimeoutError, Watchdog, group_timeout
from ..models import GPT
from ..models.compile import compile_blocks
from ..models.hf import HFShardReader, is_hf_dir, load_hf
from ..pipeline import PipelineExecutor, build_schedule, build_stages
from . import faults
from ..tensor_parallel.sharding import tp_params
from .checkpoint import Verifier, checkpoint_shard_reader, latest_checkpoint, load_checkpoint, \
    pointer_note, read_manifest
from .checkpoint_writer import CheckpointWriter
from .config import TrainConfig
from ..data.packing import DocumentSampler
from ..data.sources import load_tokens
from .batches import make_sampler, step_inputs
from .guard import NonFiniteError, NonFiniteGuard
from .metrics import Metrics, PendingSteps
from .outdir import check_out, nothing_to_resume, prepare_out, resolve_out
from .run_record import check_changes, legacy_record, run_record, write_run_files
from .lr_schedule import lr_at
from .step import evaluate, forward_backward, loss_fn
from ..models.moe import router_stats, update_biases
from .sample import print_sample
from .profiler import StepProfiler


def build_model(cfg: TrainConfig, mesh, device=None) -> list[GPT]:
    """This rank's model chunks (one per virtual stage), each built with only its layers and
    numbered as its pipeline stage; stages balanced by ``GPTConfig.piece_flops``. ``device``
    "meta": parameters without values (ZeRO-3 fills each rank's shards), buffers on the
    mesh's device."""
    mc = cfg.model_config
    make = functools.partial(GPT, mc, tp_group=mesh.tp_group, recompute=cfg.recompute,
                             sequence_parallel=cfg.sequence_parallel,
                             device=device or mesh.device, cp_group=mesh.cp_group,
                             ep_group=mesh.ep_group, ep_chunks=cfg.ep_chunks)
    chunks = build_stages(make, mesh.pp_rank, mesh.pp_size, cfg.virtual_stages,
                          num_blocks=mc.n_layers, layer_costs=mc.piece_flops(cfg.seq_len),
                          placement=PLACEMENT.get(cfg.schedule, "loop") if mesh.pp_size > 1
                          else "loop")
    if device is not None:
        for m in chunks:
            m.reset_buffers(mesh.device)
    return chunks


def fully_sharded(cfg: TrainConfig, mesh) -> bool:
    """ZeRO-3 over more than one rank: the model is built on the meta device and each rank
    fills only its shards (no rank ever holds it whole)."""
    return cfg.zero == 3 and mesh.dp_size * mesh.cp_size > 1


def _fill(cfg: TrainConfig, chunks, mesh, opt, resume_from, say, reader) -> None:
    """ZeRO-3: this rank's shards of the model built on the meta device: read from
    ``--init-from`` (a Hugging Face directory or a fastpar checkpoint: only what this rank's
    shard covers), else initialised a unit at a time as the constructor does (a resumed run:
    nothing here, its checkpoint's masters and moments are loaded as this rank's shard)."""
    if resume_from is not None:
        return
    src = cfg.init_from
    if reader is not None or src:
        opt.load_shards(reader or checkpoint_shard_reader(src, chunks, mesh))
    else:
        opt.materialize(lambda params: [m.init_weights_(params) for m in chunks])
    if src and say:
        say(f"fastpar train: starting from the weights in {src} (each rank reads only its "
            f"shards)")


def _wrap(cfg: TrainConfig, chunks, mesh):
    """The DataParallel wrapper and its DistributedOptimizer (AdamW), at every layout.

    ``--precision bf16`` (Megatron's mixed precision): the parameters become bf16 (buffers such
    as rotary tables stay fp32), DataParallel keeps fp32 main gradients and the optimizer steps
    fp32 master weights. ``--zero 1`` (dp > 1) shards the optimizer state over the DP group,
    ``--zero 2`` the gradients as well (ZeRO-2: whole gradients freed once reduced), ``--zero 3``
    the parameters too (each Transformer block a unit, gathered around its use). At
    dp = 1 nothing is reduced: the wrapper only gives every layout the same optimizer, which
    clips over the layout's groups and saves its own state."""
    mixed = cfg.bf16_params(mesh.device.type)
    if mixed:
        for m in chunks:
            for p in m.parameters():
                p.data = p.data.to(torch.bfloat16)
    reduce_dtype = torch.bfloat16 if cfg.grad_reduce_dtype == "bf16" else \
        (torch.float32 if mixed else None)
    # Context-parallel ranks see other tokens of the same sequences: their gradients are
    # averaged together with the data-parallel ones (each rank's loss is its tokens' mean).
    sharded = cfg.zero >= 1 and mesh.dp_size * mesh.cp_size > 1     # over dp x cp
    units = [layer for m in chunks for layer in m.layers.values()] \
        if sharded and cfg.zero == 3 else None
    groups = dict(dp_group=mesh.dp_cp_group, expert_group=mesh.expert_dp_group)
    if sharded and 0 < cfg.dp_shard < mesh.dp_size:    # HSDP: shard in a group, replicate over
        shard, replicate = hsdp_groups(mesh, cfg.dp_shard, group_timeout(cfg.timeout))
        groups = dict(dp_group=shard, replicate_group=replicate)
        if mesh.expert_dp_group is not None:    # the experts' replicas inside the shard group
            groups["expert_group"] = hsdp_expert_group(mesh, cfg.dp_shard, cfg.ep_dp,
                                                       group_timeout(cfg.timeout))
    ddp = DataParallel(nn.ModuleList(chunks), main_grads=mixed, reduce_dtype=reduce_dtype,
                       units=units, device=mesh.device, **groups)
    # Fused AdamW: one kernel per parameter group, and it skips a non-finite step on the device.
    kernel = dict(fused=True) if mesh.device.type in _fused_devices() else dict(foreach=True)
    return ddp, DistributedOptimizer(ddp, torch.optim.AdamW, _param_groups(chunks, cfg.weight_decay),
                                     shard=sharded, stage=cfg.zero if sharded else 1, lr=cfg.lr,
                                     betas=(0.9, 0.95), eps=1e-8, **kernel)


def _activation(cfg: TrainConfig, mesh, chunks, sched) -> tuple[tuple[int, ...], torch.dtype]:
    """What passes between pipeline stages: the hidden states (S[/tp], micro-batch, D) of this
    rank's sequence share, in the residual stream's dtype (bf16 under autocast: a block's
    output is its bf16 branch added to the residual; else the parameters'): the executor sizes
    its receive buffers from it instead of a shape handshake."""
    seq = cfg.seq_len // mesh.cp_size // (mesh.tp_size if cfg.sequence_parallel else 1)
    micro = cfg.global_batch_size // mesh.dp_size // sched.num_microbatches
    dtype = torch.bfloat16 if cfg.autocast(mesh.device.type) else \
        next(chunks[0].parameters()).dtype
    return (seq, micro, cfg.model_config.d_model), dtype


def _param_groups(chunks, weight_decay):
    decay = [p for m in chunks for p in m.parameters() if p.requires_grad and p.dim() >= 2]
    rest = [p for m in chunks for p in m.parameters() if p.requires_grad and p.dim() < 2]
    return [{"params": decay, "weight_decay": weight_decay},
            {"params": rest, "weight_decay": 0.0}]


def _clip(chunks, mesh, max_norm: float, opt: DistributedOptimizer) -> torch.Tensor:
    """Clip by the global norm of the whole model's gradient (TP shards summed, parameters
    replicated over TP counted once, pipeline stages summed, a tied embedding's last-stage
    copy not counted); returns it, on the device."""
    sharded = {id(p) for p, split in tp_params(chunks) if split}
    # TP folded into ep: every TP rank holds other experts, their norm summed over the ep group
    # (which holds the TP group) and added once, on TP rank 0.
    fold = any(getattr(m, "folded", False) for c in chunks for m in c.modules())
    return opt.clip_grad_norm_(max_norm if max_norm > 0 else float("inf"),
                               groups=[mesh.tp_group, mesh.pp_group],
                               counted=lambda p: not getattr(p, "tied_copy", False) and (
                                   id(p) in sharded or mesh.tp_rank == 0 or
                                   fold and getattr(p, "expert_parallel", False)),
                               ep_group=mesh.ep_group, ep_counted=not fold or mesh.tp_rank == 0)


def _init_from(path, chunks, mesh, say) -> None:
    if is_hf_dir(path):
        load_hf(path, chunks, mesh.tp_size, mesh.tp_rank)
    else:
        load_checkpoint(path, chunks, None, mesh)
    if say:
        say(f"fastpar train: starting from the weights in {path}")


def check_resume(cfg: TrainConfig, full: bool = False, say=None) -> Path | None:
    """The checkpoint to resume from (None: start fresh); a checkpoint of another model shape,
    or one whose files do not match its manifest (sizes; with ``full`` also the sha256), is
    refused here. ``say`` (e.g. print) is told which checkpoint and step, and what is wrong with
    the ``latest`` pointer if it names another."""
    if not cfg.resume:
        return None
    root = Path(cfg.out) / "checkpoints"
    path = latest_checkpoint(root)
    note = pointer_note(root, path)
    if say and note:
        say(f"fastpar train: {note}")
    if path is None:
        if cfg.resume is True:
            raise nothing_to_resume(cfg.out)
        if say:
            say(f"fastpar train: --resume auto: no checkpoint in {cfg.out}, starting fresh")
        return None
    manifest = read_manifest(path)
    Verifier(path, manifest).all(full)
    saved = manifest.get("model_config", {})
    now = cfg.model_config.to_dict()
    diff = {k: (saved.get(k), now[k]) for k in ("vocab_size", "n_layers", "d_model", "n_heads",
                                                 "n_kv_heads", "d_ff", "norm", "activation")
            if saved.get(k) != now[k]}
    if diff:
        raise ValueError(f"checkpoint {path} is of another model shape: "
                         + ", ".join(f"{k} {a} (saved) != {b}" for k, (a, b) in diff.items()))
    check_changes(manifest.get("run") or legacy_record(cfg.out), cfg, path, say)
    if say:
        say(f"fastpar train: resuming from {path} (step {manifest['data_step']} of "
            f"{cfg.steps})")
    return path


@dataclass
class Run:
    """What :func:`setup` builds on one rank: the model chunks, their DataParallel wrapper and
    optimizer, the pipeline (pp > 1), the data, and the hooks around each step."""

    cfg: TrainConfig
    mesh: Mesh                    # its layout is the run's, sized and checked once
    chunks: list[GPT]
    ddp: DataParallel
    opt: DistributedOptimizer
    pipe: PipelineExecutor | None
    sampler: DocumentSampler
    val: DocumentSampler | None   # the held-out split's
    held_out: list | None         # the same held-out batches at every evaluation
    start: int                    # the step a resumed run continues after (0: fresh)
    resume_from: Path | None
    watchdog: Watchdog
    guard: NonFiniteGuard
    writer: CheckpointWriter
    metrics: Metrics
    profiler: StepProfiler
    fault: faults.Faults | None   # FASTPAR_FAULT's injected faults (tests)
    say: Callable | None          # print on the first rank, else None
    moe_stats: dict = field(default_factory=dict)   # the last step's router_stats
    trained: int = 0                                # the last step's trained targets

    @property
    def micro_batches(self) -> int:
        return self.cfg.num_microbatches(self.cfg.global_batch_size, self.mesh.dp_size)


def setup(cfg: TrainConfig, layout: Layout | None = None) -> Run:
    """Everything before the first step, on this rank: the output folder and the checkpoint to
    resume from (checked before any collective), the data, the mesh, the model (its initial,
    fine-tuning or resumed weights), the optimizer and the hooks. ``layout`` is the run's, when
    the launcher has checked it already (``cfg.check_layout``); else it is checked here."""
    world, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    lay = layout or cfg.check_layout(world)     # every check before any collective
    say = print if rank == 0 else None
    cfg = resolve_out(cfg, world)
    check_out(cfg)
    resume_from = check_resume(cfg, say=say)
    cfg = prepare_out(cfg, rank, say or (lambda _: None))
    if say:
        say(f"fastpar train: writing to {cfg.out}")
    dp_rank = lay.coords(rank).dp         # the data is read (and checked) before any group
    sampler = make_sampler(cfg, "train", dp_rank, lay.dp)
    val = make_sampler(cfg, "val", dp_rank, lay.dp) if cfg.eval_every else None
    if say and cfg.warmup < cfg.warmup_steps:
        say(f"fastpar train: --warmup-steps {cfg.warmup_steps} is more than half of "
            f"--steps {cfg.steps}: warming up for {cfg.warmup} steps, then decaying")
    fault = faults.from_env()
    _set_deterministic(cfg.deterministic)
    trace = Path(cfg.out).resolve() / "nccl_trace"      # NCCL's flight-recorder dumps
    if torch.cuda.is_available():
        trace.mkdir(parents=True, exist_ok=True)
    mesh = fastpar.init(layout=lay, timeout=group_timeout(cfg.timeout), nccl_trace=str(trace / "rank_"))
    if cfg.ep > 1:      # the experts split over ep data-parallel ranks (or TP groups' ranks)
        mesh.ep_group, mesh.expert_dp_group = ep_groups(mesh, cfg.ep, group_timeout(cfg.timeout),
                                                        fold_tp=cfg.ep_fold_tp)
    if cfg.model_config.tie_embeddings and PLACEMENT.get(cfg.schedule) != "v":
        # the first and last stage's embedding copies (in a V both are on pp rank 0)
        mesh.embed_group = embedding_group(mesh, group_timeout(cfg.timeout))
    torch.manual_seed(cfg.seed)
    sharded3 = fully_sharded(cfg, mesh)
    chunks = build_model(cfg, mesh, "meta" if sharded3 else None)
    if cfg.compile:                             # --compile: each block compiled at first call
        chunks = [compile_blocks(m) for m in chunks]
    if cfg.init_from and resume_from is None and not sharded3:   # fine-tuning: the weights
        _init_from(cfg.init_from, chunks, mesh, say)
    reader = HFShardReader(cfg.init_from, chunks, mesh.tp_size, mesh.tp_rank) \
        if sharded3 and cfg.init_from and resume_from is None and is_hf_dir(cfg.init_from) \
        else None                               # notes the tensors by name, before DataParallel
    ddp, opt = _wrap(cfg, chunks, mesh)
    if sharded3:
        _fill(cfg, chunks, mesh, opt, resume_from, say, reader)
    held_out = None
    if val is not None:
        M = cfg.num_microbatches(cfg.global_batch_size, lay.dp)
        held_out = [step_inputs(val.batch(k), mesh, M, lambda t: t, cfg.cp_balance)
                    for k in range(cfg.eval_batches)]
    pipe = None
    if lay.pp > 1:
        sched = build_schedule(cfg.schedule, lay.pp, cfg.num_microbatches(
            cfg.global_batch_size, lay.dp), cfg.virtual_stages)
        pipe = PipelineExecutor(chunks, sched, mesh.pp_group, loss_fn=loss_fn(mesh.tp_group),
                                activation=_activation(cfg, mesh, chunks, sched),
                                stage_loss=True)
    start = 0 if resume_from is None else \
        load_checkpoint(resume_from, chunks, opt, mesh)["data_step"]
    if mesh.rank == 0:
        write_run_files(cfg, lay, fresh=start == 0)
    return Run(
        cfg, mesh, chunks, ddp, opt, pipe,
        sampler, val, held_out, start, resume_from, Watchdog(mesh, cfg.timeout, out=cfg.out),
        NonFiniteGuard(cfg.max_skipped_steps, mesh.device, verbose=mesh.rank == 0),
        CheckpointWriter(Path(cfg.out) / "checkpoints", mesh, cfg.keep_last, cfg.async_save,
                         cfg.timeout, lambda s: faults.during_save(fault, s, mesh.rank)),
        Metrics(cfg.out, mesh.rank == 0, cfg.steps, start, cfg.log_every,
                cfg.peak_tflops * 1e12 if cfg.peak_tflops else None, resume=start > 0,
                tensorboard=cfg.tensorboard),
        StepProfiler(cfg.profile_window, cfg.out, mesh.rank), fault, say)


def train_step(run: Run, step: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, float]:
    """One optimizer step: the learning rate, forward and backward over the micro-batches
    (through the pipeline when pp > 1), the loss averaged over the data-parallel ranks,
    clipping by the global norm, and the optimizer step, skipped on the device when the step is
    not finite. The host never waits for the device here: returns (loss, gradient norm,
    non-finite flag) as 0-dim device tensors (the loss in float64) and the learning rate; the
    loop reads them back at log steps (:class:`.metrics.PendingSteps`)."""
    cfg, mesh, wd, opt = run.cfg, run.mesh, run.watchdog, run.opt
    lr = lr_at(step, cfg.lr, cfg.min_lr, cfg.warmup, cfg.steps)
    for g in opt.param_groups:
        g["lr"] = lr
    batch = run.sampler.batch(step)
    run.trained = batch.trained
    x, y, docs, per_loss = step_inputs(batch, mesh, run.micro_batches,
                                       lambda t: _to_device(t, mesh.device), cfg.cp_balance)
    with wd.region(step, "forward and backward", ("tp", "cp", "pp", "dp")), \
            cfg.train_context(mesh.device.type), span("step", step):
        loss = forward_backward(run.chunks, run.ddp, run.pipe, x, y, run.micro_batches, mesh,
                                interleave=run.cfg.interleave,
                                fb_overlap=run.cfg.fb_overlapped(run.micro_batches),
                                docs=docs, per_loss=per_loss)
    faults.poison(run.fault, step, mesh.rank, loss, run.chunks)
    with wd.region(step, "the loss all-reduce", ("dp", "cp")):
        collectives.all_reduce(loss, group=mesh.dp_cp_group)
    # float64, as the host divided loss.item(): the logged losses are the same numbers.
    loss = loss.to(torch.float64) / (mesh.dp_size * mesh.cp_size)
    with wd.region(step, "the gradient-norm all-reduce", ("tp", "pp", "dp")), \
            span("gradient clipping"):
        norm = _clip(run.chunks, mesh, cfg.grad_clip, opt)
    with wd.region(step, "the non-finite check", ("world",)):
        bad = run.guard.flag(loss, norm)
    with wd.region(step, "the optimizer step", ("dp",)), span("optimizer step"):
        opt.step(found_inf=bad)     # ZeRO-1 all-gathers the updated shards here
    opt.zero_grad(set_to_none=True)
    update_biases(run.chunks, mesh.dp_cp_group)     # MoE's loss-free balancing, if on
    run.moe_stats = router_stats(run.chunks)        # read back with the loss
    return loss, norm, bad, lr


def _to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A batch tensor onto the device without a host sync (pinned, non-blocking on CUDA)."""
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def _read_due(run: Run, step: int) -> bool:
    """Whether the host reads the steps run so far after ``step`` (one sync): at log steps,
    the first and the last step, and before an evaluation or a checkpoint (they wait for the
    device anyway, and none may follow a step past the non-finite limit unread)."""
    cfg = run.cfg
    return (step % cfg.log_every == 0 or step in (run.start + 1, cfg.steps)
            or _eval_due(run, step) or _save_due(cfg, step))


def read_back(run: Run, pending: PendingSteps, tokens: int, flops: float) -> list[dict]:
    """The rows of the steps in ``pending``, read with one host sync: each step is settled
    with the non-finite guard in step order (raising :class:`NonFiniteError` at the step that
    reached the limit, after writing the rows before it), the last one evaluated when due, and
    each written to the metrics exactly as if read right after it ran."""
    rows, done = [], pending.read()
    for i, (step, (loss, norm, bad, *moe), host) in enumerate(done):
        ok = run.guard.settle(step, bool(bad), loss, norm)
        if run.guard.exhausted:
            raise run.guard.error(run.writer.wait() or run.resume_from)
        val = evaluate_hook(run, step) if i == len(done) - 1 else None
        rows.append(run.metrics.log(step, loss, host["lr"], tokens, host["step_time"], flops,
                                    run.mesh.world_size, skipped=not ok, val_loss=val,
                                    extra={"grad_norm": float(norm),
                                           "trained_tokens": host["trained"],
                                           **dict(zip(host["moe"], moe))}))
    return rows


def evaluate_hook(run: Run, step: int) -> float | None:
    """The validation loss after ``step`` when it is an evaluation step, else None."""
    cfg = run.cfg
    if not _eval_due(run, step):
        return None
    with run.watchdog.region(step, "the evaluation", ("tp", "cp", "pp", "dp")), \
            cfg.train_context(run.mesh.device.type), span("evaluation"):
        return evaluate(run.chunks, run.pipe, run.held_out, run.micro_batches, run.mesh)


def _eval_due(run: Run, step: int) -> bool:
    cfg = run.cfg
    return bool(run.held_out) and (step % cfg.eval_every == 0 or step == cfg.steps)


def _save_due(cfg: TrainConfig, step: int) -> bool:
    return not cfg.no_save and ((cfg.save_every and step % cfg.save_every == 0)
                                or step == cfg.steps)


def checkpoint_hook(run: Run, step: int, record: dict) -> None:
    """Save after every ``save_every``-th step and the last (unless ``no_save``)."""
    cfg = run.cfg
    if not _save_due(cfg, step):
        return
    with run.watchdog.region(step, "saving the checkpoint"):
        run.writer.save(step, run.chunks, run.opt, {
            "data_step": step, "model_config": cfg.model_config.to_dict(),
            "layout": run.mesh.layout.sizes(),
            "run": record})


def train(cfg: TrainConfig, layout: Layout | None = None) -> list[dict]:
    """Run ``cfg`` on this process's rank (on ``layout``, if checked already); returns the
    per-step metrics (all ranks)."""
    run = setup(cfg, layout)
    cfg, mesh = run.cfg, run.mesh
    step_tokens = cfg.global_batch_size * cfg.seq_len
    # model FLOPs, as MFU counts (attention inside packed documents: their span of keys)
    flops = cfg.model_config.train_flops(cfg.seq_len, step_tokens,
                                         span=run.sampler.attention_span())
    record = run_record(cfg)            # what every checkpoint says the run depends on
    rows, pending = [], PendingSteps()
    for step in range(run.start + 1, cfg.steps + 1):
        faults.before_step(run.fault, step, mesh.rank)
        run.profiler.before(step, first=step == run.start + 1)
        t0 = time.perf_counter()
        loss, norm, bad, lr = train_step(run, step)
        # The host's time (on a GPU: the device's only summed up to a read; metrics.py).
        step_time = time.perf_counter() - t0    # the evaluation is not part of the step
        moe = run.moe_stats
        pending.add(step, (loss, norm, bad, *moe.values()), lr=lr, step_time=step_time,
                    moe=list(moe), trained=run.trained)
        if _read_due(run, step):
            rows += read_back(run, pending, step_tokens, flops)
        checkpoint_hook(run, step, record)
        traced = run.profiler.after(step)
        if traced is not None and run.say:
            run.say(f"fastpar train: profiled steps {cfg.profile_steps}: {traced.parent}/"
                    "rank*.json (open in https://ui.perfetto.dev)")
        faults.after_step(run.fault, step, mesh.rank)
    with run.watchdog.region(cfg.steps, "writing the last checkpoint"):
        run.writer.wait()
    run.metrics.close()
    if cfg.sample_tokens and run.start < cfg.steps:
        with run.watchdog.region(cfg.steps, "the sample after training", ("tp",)), \
                run.opt.gathered():                 # ZeRO-3: whole on every dp rank
            print_sample(cfg, run.chunks, mesh, load_tokens(cfg.data, split="val")
                         if run.val is None else run.val.tokens, run.say)
    return rows


def _set_deterministic(on: bool) -> None:
    """Deterministic kernels on GPU (see docs/training.md, Determinism); CPU always is."""
    if not on or not torch.cuda.is_available():
        return
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")     # before cuBLAS starts
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.benchmark = False
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False


# Errors a worker reports as one line (no traceback): the job failed for a reason it names.
CLEAR_ERRORS = (ValueError, CollectiveTimeoutError, NonFiniteError)
