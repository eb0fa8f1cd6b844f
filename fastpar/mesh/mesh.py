"""``fastpar.init``: start (or join) torch.distributed and build every process group once.

The returned :class:`Mesh` is the only carrier of parallel state: it is passed explicitly to the
layers, wrappers and schedules that need a group. Nothing is stored in module globals.
"""
from __future__ import annotations

import os
import socket
import warnings
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from .layout import Coords, Layout
from .watchdog import nccl_debug_env

_BACKENDS = ("gloo", "nccl")


@dataclass
class Mesh:
    """This rank's view of the layout: its coordinates, its groups and its device.

    ``cp_group`` is None without context parallelism; ``dp_cp_group`` (the ranks that share this
    rank's tp and pp coordinates, over which gradients are averaged) is then ``dp_group``."""

    layout: Layout
    rank: int
    device: torch.device
    tp_group: dist.ProcessGroup = field(repr=False)
    pp_group: dist.ProcessGroup = field(repr=False)
    dp_group: dist.ProcessGroup = field(repr=False)
    cp_group: dist.ProcessGroup | None = field(default=None, repr=False)
    dp_cp_group: dist.ProcessGroup | None = field(default=None, repr=False)
    # Expert parallelism (:func:`ep_groups`): the ranks splitting the experts, and those
    # holding the same experts; None without it.
    ep_group: dist.ProcessGroup | None = field(default=None, repr=False)
    expert_dp_group: dist.ProcessGroup | None = field(default=None, repr=False)
    # Tied embeddings under pipeline parallelism (fastpar.pipeline.tied.embedding_group): the
    # first and the last stage's ranks; None without them.
    embed_group: dist.ProcessGroup | None = field(default=None, repr=False)

    def __post_init__(self):
        if self.dp_cp_group is None:
            self.dp_cp_group = self.dp_group

    @property
    def world_size(self) -> int:
        return self.layout.world_size

    @property
    def coords(self) -> Coords:
        return self.layout.coords(self.rank)

    tp_size = property(lambda self: self.layout.tp)
    pp_size = property(lambda self: self.layout.pp)
    dp_size = property(lambda self: self.layout.dp)
    tp_rank = property(lambda self: self.coords.tp)
    pp_rank = property(lambda self: self.coords.pp)
    dp_rank = property(lambda self: self.coords.dp)
    cp_size = property(lambda self: self.layout.cp)
    cp_rank = property(lambda self: self.coords.cp)

    @property
    def replica_rank(self) -> int:
        """Which copy of this rank's (tp, pp) shard of the model it holds: its rank in the
        dp x cp group (CP ranks hold the same weights too). Copy 0 saves the shard."""
        return self.dp_rank * self.cp_size + self.cp_rank

    def group_ranks(self, dim: str) -> list[int]:
        """Global ranks of this rank's ``dim`` group ("tp", "cp", "pp", "dp" or "dp-cp"), in
        group-rank order."""
        return self.layout.group_of(dim, self.rank)


def _env_int(name: str, default: int | None = None) -> int:
    value = os.environ.get(name)
    if value is None:
        if default is None:
            raise ValueError(f"environment variable {name} is not set; launch with torchrun "
                             f"or set RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT")
        return default
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"environment variable {name}={value!r} is not an integer") from None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def local_world_size(world_size: int) -> int:
    """Ranks on this host: torchrun's LOCAL_WORLD_SIZE, else every rank (a one-host launch)."""
    return _env_int("LOCAL_WORLD_SIZE", world_size)


def pick_backend(backend: str | None, local_ranks: int) -> tuple[str, str | None]:
    """The backend for ``local_ranks`` ranks on this host, and why gloo if NCCL was passed over.

    NCCL needs one GPU per rank: ``backend=None`` picks it only when CUDA, NCCL and at least
    ``local_ranks`` devices are there, else gloo on CPU (with the reason when GPUs exist but
    are too few). ``backend="nccl"`` without them is a ``ValueError`` naming the counts. The
    answer depends only on this host, so every rank of it decides the same, before any
    collective.
    """
    if backend is not None and backend not in _BACKENDS:
        raise ValueError(f"backend={backend!r} is not one of {_BACKENDS}")
    if backend == "gloo":
        return "gloo", None
    cuda, nccl = torch.cuda.is_available(), dist.is_nccl_available()
    gpus = torch.cuda.device_count() if cuda else 0
    if backend == "nccl" and not (cuda and nccl):
        raise ValueError("backend='nccl' needs CUDA devices and a torch built with NCCL; "
                         f"torch.cuda.is_available()={cuda}, nccl available={nccl}; "
                         "use backend='gloo'")
    if backend == "nccl" and gpus < local_ranks:
        raise ValueError(f"backend='nccl' needs one GPU per rank, but this host runs "
                         f"{local_ranks} ranks and sees {gpus} CUDA device(s); launch at most "
                         f"{gpus} ranks per host (torchrun --nproc-per-node {gpus}) or use "
                         f"backend='gloo'")
    if backend == "nccl" or (cuda and nccl and gpus >= local_ranks):
        return "nccl", None
    if not (cuda and nccl):
        return "gloo", None
    return "gloo", (f"fastpar: {local_ranks} ranks on this host but {gpus} CUDA device(s), and "
                    f"NCCL needs one GPU per rank: running on CPU with gloo; launch at most "
                    f"{gpus} ranks per host (torchrun --nproc-per-node {gpus}) to use the GPUs, "
                    f"or pass backend='gloo' to silence this")


def group_options(backend: str):
    """``pg_options`` for a new group: on NCCL, high-priority streams, else None.

    fastpar overlaps chunked collectives with GEMMs that fill every SM; on a normal-priority
    stream NCCL's kernels wait behind the GEMM's blocks and the overlap is lost. A fresh object
    per group (torch writes the group's ranks and name into it). TORCH_NCCL_HIGH_PRIORITY=0 in
    the environment keeps torch's normal priority.
    """
    if backend != "nccl" or not hasattr(dist, "ProcessGroupNCCL"):
        return None
    opt_out = os.environ.get("TORCH_NCCL_HIGH_PRIORITY", "1").strip().lower()
    if opt_out in ("0", "false", "no", "off"):
        return None
    options = dist.ProcessGroupNCCL.Options()
    options.is_high_priority_stream = True
    return options


def bound_device(backend: str, local_rank: int) -> torch.device | None:
    """The device the default group is bound to: this rank's GPU under NCCL, else None.

    Bound, torch creates the NCCL communicator inside ``init_process_group`` (a rendezvous of
    every rank, at startup, where a failure is easy to read) and every ``new_group`` after it
    is split from that communicator on the spot, instead of each being created lazily by its
    first collective in the middle of step 1 (seconds of setup at scale, timed as training,
    and a hang there looks like a training hang)."""
    return torch.device("cuda", local_rank) if backend == "nccl" else None


def _layout_of(world_size: int, given: Layout | None, *sizes) -> Layout:
    if given is None:
        return Layout(world_size, *sizes)
    if given.world_size != world_size:
        raise ValueError(f"init: the layout is of {given.world_size} ranks, this world of "
                         f"{world_size}")
    return given


def init(tp: int = 1, pp: int = 1, dp: int | None = None, order: str = "tp-cp-dp-pp",
         backend: str | None = None, timeout: float | timedelta = 600.0,
         nccl_trace: str | None = None, cp: int = 1, layout: Layout | None = None) -> Mesh:
    """Initialise torch.distributed from torchrun's environment and build the tp/pp/dp groups
    (and with ``cp`` > 1 the cp and dp x cp groups) of the :class:`Layout` of ``tp``, ``pp``,
    ``dp``, ``cp`` and ``order`` over the world, or of ``layout``, one already made (the
    trainer's, checked against the run): then it must be of this world's size and no size is
    passed beside it.

    Reads RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT. Without RANK and WORLD_SIZE
    it runs as a single process (world size 1 on a free local port). If torch.distributed is
    already initialised its world is used as it is. ``backend=None`` picks NCCL when this host
    has a GPU for each of its ranks (LOCAL_WORLD_SIZE, else the world size), else gloo on CPU,
    with a warning when GPUs exist but are too few (see :func:`pick_backend`). Every check
    (layout against the world size, the backend) runs before any collective, so a bad
    configuration raises the same ``ValueError`` on every rank.

    ``timeout`` (seconds) bounds every collective of every group: a rank that stops taking part
    makes the others fail instead of hanging. On NCCL the watchdog's error handling and the
    flight recorder are turned on (unless set already); ``nccl_trace`` is the path prefix of its
    per-rank dumps (see :func:`fastpar.mesh.watchdog.nccl_debug_env`). NCCL groups get
    high-priority streams (:func:`group_options`).
    """
    given = {k: v for k, v in dict(tp=tp, pp=pp, dp=dp, cp=cp, order=order).items()
             if v != {"dp": None, "order": "tp-cp-dp-pp"}.get(k, 1)}
    if layout is not None and given:
        raise ValueError(f"init: pass layout= or the sizes, not both ({given})")
    timeout = timeout if isinstance(timeout, timedelta) else timedelta(seconds=float(timeout))
    if timeout.total_seconds() <= 0:
        raise ValueError(f"timeout={timeout.total_seconds():g}s must be > 0")
    if dist.is_initialized():
        rank, world_size = dist.get_rank(), dist.get_world_size()
        backend = dist.get_backend()
        local_rank = _env_int("LOCAL_RANK", rank % max(torch.cuda.device_count(), 1))
        lay = _layout_of(world_size, layout, tp, pp, dp, order, cp)
    else:
        single = "RANK" not in os.environ and "WORLD_SIZE" not in os.environ
        rank = 0 if single else _env_int("RANK")
        world_size = 1 if single else _env_int("WORLD_SIZE")
        local_rank = _env_int("LOCAL_RANK", 0 if single else rank)
        lay = _layout_of(world_size, layout, tp, pp, dp, order, cp)
        backend, why_gloo = pick_backend(backend, local_world_size(world_size))
        if why_gloo and local_rank == 0:            # once per host
            warnings.warn(why_gloo, RuntimeWarning, stacklevel=2)
        if single:
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            os.environ.setdefault("MASTER_PORT", str(_free_port()))
        else:
            for name in ("MASTER_ADDR", "MASTER_PORT"):
                if name not in os.environ:
                    raise ValueError(f"environment variable {name} is not set (RANK={rank}, "
                                     f"WORLD_SIZE={world_size}); launch with torchrun")
        if backend == "nccl":
            for key, value in nccl_debug_env(nccl_trace).items():
                os.environ.setdefault(key, value)
            torch.cuda.set_device(local_rank)
        dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=timeout,
                                pg_options=group_options(backend),
                                device_id=bound_device(backend, local_rank))
    if "nccl" in str(backend):
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    # new_group is collective: every rank creates every group, in the same order.
    mine = {}
    for dim in ("tp", "pp", "dp") + (("cp", "dp-cp") if lay.cp > 1 else ()):
        for ranks in lay.groups(dim):
            group = dist.new_group(ranks, timeout=timeout, pg_options=group_options(backend))
            if rank in ranks:
                mine[dim] = group
    return Mesh(layout=lay, rank=rank, device=device, tp_group=mine["tp"],
                pp_group=mine["pp"], dp_group=mine["dp"], cp_group=mine.get("cp"),
                dp_cp_group=mine.get("dp-cp"))


def hsdp_groups(mesh: Mesh, shard: int, timeout: float | timedelta = 600.0):
    """HSDP's two groups inside this rank's dp group: ``(shard_group, replicate_group)``.

    The dp group's ranks, in dp order, are cut into blocks of ``shard`` consecutive ones (the
    shard groups: with the tp-cp-dp-pp order the nearest ranks, a node when tp x cp x shard is
    the node's size), and the ranks at the same place of every block form a replicate group.
    Under context parallelism (whose ranks hold the same weights and average their gradients)
    a block is ``shard`` dp ranks with all their cp ranks. ``shard`` must divide dp (checked
    before any collective). Collective: every rank creates every group, in the same order."""
    dp = mesh.dp_size
    if isinstance(shard, bool) or not isinstance(shard, int) or shard < 1 or dp % shard:
        raise ValueError(f"--dp-shard={shard!r} must be a divisor of dp={dp}")
    return _blocks(mesh, shard * mesh.cp_size, timeout)


def _blocks(mesh: Mesh, size: int, timeout) -> tuple:
    """This rank's block of ``size`` consecutive ranks of its dp x cp group, and the ranks at
    its place in every block: two new groups (every rank creates every group, in order)."""
    timeout = timeout if isinstance(timeout, timedelta) else timedelta(seconds=float(timeout))
    options = group_options(dist.get_backend())
    mine = {}
    for ranks in mesh.layout.groups("dp-cp" if mesh.cp_size > 1 else "dp"):
        blocks = [ranks[i:i + size] for i in range(0, len(ranks), size)]
        for kind, groups in (("block", blocks), ("across",
                                                [ranks[j::size] for j in range(size)])):
            for g in groups:
                group = dist.new_group(g, timeout=timeout, pg_options=options)
                if mesh.rank in g:
                    mine[kind] = group
    return mine["block"], mine["across"]


def hsdp_expert_group(mesh: Mesh, shard: int, ep: int, timeout: float | timedelta = 600.0):
    """HSDP with expert parallelism: the ranks of this rank's shard group (:func:`hsdp_groups`)
    that hold its experts (the same place in their ep groups, :func:`ep_groups`): the experts'
    ZeRO shards are cut over them, then all-reduced over HSDP's replicate group, whose ranks
    hold the same experts. ``ep`` must divide the shard group's ``shard`` x cp ranks (checked
    before any collective). Collective: every rank creates every group, in order."""
    size = shard * mesh.cp_size
    if size % ep:
        raise ValueError(f"--ep={ep} must divide the HSDP shard group's --dp-shard x cp = "
                         f"{shard} x {mesh.cp_size} ranks")
    timeout = timeout if isinstance(timeout, timedelta) else timedelta(seconds=float(timeout))
    options = group_options(dist.get_backend())
    mine = None
    for ranks in mesh.layout.groups("dp-cp" if mesh.cp_size > 1 else "dp"):
        for block in (ranks[i:i + size] for i in range(0, len(ranks), size)):
            for j in range(ep):
                group = dist.new_group(block[j::ep], timeout=timeout, pg_options=options)
                if mesh.rank in block[j::ep]:
                    mine = group
    return mine


def ep_ranks(layout, ep: int, fold_tp: bool = False) -> tuple[list[list[int]], list[list[int]]]:
    """Every ep group and every expert-data-parallel group of ``layout``, as rank lists (pure
    arithmetic; :func:`ep_groups` creates them). Unfolded, an ep group is ``ep`` consecutive
    ranks of a dp x cp group (the same TP rank). With ``fold_tp`` (Megatron's MoE parallel
    folding) it is the union over the TP ranks of ``ep / tp`` such ranks: whole TP groups, so
    each TP rank holds other experts; the ranks holding the same experts are then still those
    at the same place of a dp x cp group's blocks of ``ep / tp``."""
    k = ep // layout.tp if fold_tp else ep
    blocks, across, by_stage = [], [], {}
    for ranks in layout.groups("dp-cp" if layout.cp > 1 else "dp"):
        cut = [ranks[i:i + k] for i in range(0, len(ranks), k)]
        across += [ranks[j::k] for j in range(k)]
        if not fold_tp:
            blocks += cut
            continue
        # The dp x cp groups of one stage (one per TP rank) list their ranks in the same
        # (dp, cp) order: block i of each is the same dp x cp ranks.
        stage = by_stage.setdefault(layout.coords(ranks[0]).pp, [[] for _ in cut])
        for i, block in enumerate(cut):
            stage[i] += block
    for stage in by_stage.values():
        blocks += [sorted(b) for b in stage]
    return blocks, across


def ep_groups(mesh: Mesh, ep: int, timeout: float | timedelta = 600.0, fold_tp: bool = False):
    """Expert parallelism's two groups: ``(ep_group, expert_dp_group)``. The ep group is ``ep``
    consecutive ranks of this rank's dp x cp group (with the tp-cp-dp-pp order the nearest
    ones: the all-to-alls stay inside a node where they can), each holding ``n_experts / ep``
    of every MoE layer's experts; the ranks at the same place of every ep group hold the same
    experts and sum their gradients (Megatron's expert-data-parallel group). ``ep`` must divide
    dp x cp. ``fold_tp``: the ep group is whole TP groups of ``ep / tp`` such ranks
    (:func:`ep_ranks`), ``ep`` a multiple of tp. Checked before any collective."""
    lay = mesh.layout
    k = ep // lay.tp if fold_tp and isinstance(ep, int) else ep
    if isinstance(ep, bool) or not isinstance(ep, int) or ep < 1 or \
            (fold_tp and ep % lay.tp) or (mesh.dp_size * mesh.cp_size) % k:
        raise ValueError(f"--ep={ep!r} must be a divisor of dp x cp = {mesh.dp_size} x "
                         f"{mesh.cp_size}" + (f" times tp={lay.tp} (folded)" if fold_tp else ""))
    timeout = timeout if isinstance(timeout, timedelta) else timedelta(seconds=float(timeout))
    options = group_options(dist.get_backend())
    mine = {}
    for kind, groups in zip(("block", "across"), ep_ranks(lay, ep, fold_tp)):
        for g in groups:
            group = dist.new_group(g, timeout=timeout, pg_options=options)
            if mesh.rank in g:
                mine[kind] = group
    return mine["block"], mine["across"]
