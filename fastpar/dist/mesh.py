"""``fastpar.init``: start (or join) torch.distributed and build every process group once.

The returned :class:`Mesh` is the only carrier of parallel state: it is passed explicitly to the
layers, wrappers and schedules that need a group. Nothing is stored in module globals.
"""
from __future__ import annotations

import os
import socket
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from .layout import Coords, Layout, layout
from .watchdog import nccl_debug_env

_BACKENDS = ("gloo", "nccl")


@dataclass
class Mesh:
    """This rank's view of the layout: its coordinates, its three groups and its device."""

    layout: Layout
    rank: int
    device: torch.device
    tp_group: dist.ProcessGroup = field(repr=False)
    pp_group: dist.ProcessGroup = field(repr=False)
    dp_group: dist.ProcessGroup = field(repr=False)

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

    def group_ranks(self, dim: str) -> list[int]:
        """Global ranks of this rank's ``dim`` group ("tp", "pp" or "dp"), in group-rank order."""
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


def _pick_backend(backend: str | None) -> str:
    if backend is None:
        return "nccl" if torch.cuda.is_available() and dist.is_nccl_available() else "gloo"
    if backend not in _BACKENDS:
        raise ValueError(f"backend={backend!r} is not one of {_BACKENDS}")
    if backend == "nccl" and not (torch.cuda.is_available() and dist.is_nccl_available()):
        raise ValueError("backend='nccl' needs CUDA devices and a torch built with NCCL; "
                         f"torch.cuda.is_available()={torch.cuda.is_available()}, "
                         f"nccl available={dist.is_nccl_available()}; use backend='gloo'")
    return backend


def init(tp: int = 1, pp: int = 1, dp: int | None = None, order: str = "tp-dp-pp",
         backend: str | None = None, timeout: float | timedelta = 600.0,
         nccl_trace: str | None = None) -> Mesh:
    """Initialise torch.distributed from torchrun's environment and build the tp/pp/dp groups.

    Reads RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT. Without RANK and WORLD_SIZE
    it runs as a single process (world size 1 on a free local port). If torch.distributed is
    already initialised its world is used as it is. ``backend=None`` picks NCCL when CUDA is
    available, else gloo. Every check (layout against the world size, the backend) runs before
    any collective, so a bad configuration raises the same ``ValueError`` on every rank.

    ``timeout`` (seconds) bounds every collective of every group: a rank that stops taking part
    makes the others fail instead of hanging. On NCCL the watchdog's error handling and the
    flight recorder are turned on (unless set already); ``nccl_trace`` is the path prefix of its
    per-rank dumps (see :func:`fastpar.dist.watchdog.nccl_debug_env`).
    """
    timeout = timeout if isinstance(timeout, timedelta) else timedelta(seconds=float(timeout))
    if timeout.total_seconds() <= 0:
        raise ValueError(f"timeout={timeout.total_seconds():g}s must be > 0")
    if dist.is_initialized():
        rank, world_size = dist.get_rank(), dist.get_world_size()
        backend = dist.get_backend()
        local_rank = _env_int("LOCAL_RANK", rank % max(torch.cuda.device_count(), 1))
        lay = layout(world_size, tp=tp, pp=pp, dp=dp, order=order)
    else:
        single = "RANK" not in os.environ and "WORLD_SIZE" not in os.environ
        rank = 0 if single else _env_int("RANK")
        world_size = 1 if single else _env_int("WORLD_SIZE")
        local_rank = _env_int("LOCAL_RANK", 0 if single else rank)
        lay = layout(world_size, tp=tp, pp=pp, dp=dp, order=order)
        backend = _pick_backend(backend)
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
        dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=timeout)
    if "nccl" in str(backend):
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    # new_group is collective: every rank creates every group, in the same order.
    mine = {}
    for dim in ("tp", "pp", "dp"):
        for ranks in lay.groups(dim):
            group = dist.new_group(ranks, timeout=timeout)
            if rank in ranks:
                mine[dim] = group
    return Mesh(layout=lay, rank=rank, device=device, tp_group=mine["tp"],
                pp_group=mine["pp"], dp_group=mine["dp"])
