"""fastpar.init on gloo ranks: groups match the layout, collectives run over each group."""
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

import fastpar
from fastpar.testing import run_ranks


def _init_and_reduce(rank, world_size, kwargs):
    mesh = fastpar.init(**kwargs)
    lay = mesh.layout
    assert mesh.rank == rank and mesh.world_size == world_size
    assert (mesh.dp_rank, mesh.pp_rank, mesh.tp_rank) == tuple(lay.coords(rank))
    assert (mesh.tp_size, mesh.pp_size, mesh.dp_size) == (lay.tp, lay.pp, lay.dp)
    assert mesh.device == torch.device("cpu")
    for dim in ("tp", "pp", "dp"):
        group = getattr(mesh, f"{dim}_group")
        members = mesh.group_ranks(dim)
        assert dist.get_world_size(group) == len(members)
        assert dist.get_rank(group) == getattr(mesh, f"{dim}_rank")
        # all_reduce: the sum of member ranks; all_gather: members in group-rank order.
        t = torch.tensor([float(rank)])
        dist.all_reduce(t, group=group)
        assert t.item() == sum(members), (dim, t.item(), members)
        out = torch.empty(len(members))
        dist.all_gather_into_tensor(out, torch.tensor([float(rank)]), group=group)
        assert out.tolist() == [float(m) for m in members], (dim, out.tolist(), members)
    return tuple(mesh.coords)


@pytest.mark.parametrize("world_size,kwargs,init_pg", [
    (2, dict(tp=2), True),                                   # joins an existing process group
    (4, dict(tp=2, pp=2, order="tp-pp-dp"), False),
    (8, dict(tp=2, pp=2, dp=2, order="dp-tp-pp"), False),
])
def test_init_builds_groups_and_collectives_work(world_size, kwargs, init_pg):
    coords = run_ranks(_init_and_reduce, world_size, kwargs, init_pg=init_pg, timeout=90)
    lay = fastpar.layout(world_size, **kwargs)
    assert coords == [tuple(lay.coords(r)) for r in range(world_size)]


def _bad_init(rank, world_size):
    errors = []
    for kwargs in (dict(tp=3), dict(tp=2, pp=2), dict(backend="nccl"), dict(backend="mpi")):
        try:
            fastpar.init(**kwargs)
        except ValueError as e:
            errors.append(str(e))
        assert not dist.is_initialized(), f"{kwargs}: torch.distributed started before the error"
    return errors


def test_bad_configuration_raises_on_every_rank_before_any_collective():
    out = run_ranks(_bad_init, 2, init_pg=False, timeout=60)
    for errors in out:
        assert len(errors) == 4
        assert "world_size=2 is not divisible by tp*pp = 3*1 = 3" in errors[0]
        assert "tp*pp" in errors[1] and "world_size=2" in errors[1]
        assert "backend='nccl' needs CUDA" in errors[2]
        assert "backend='mpi'" in errors[3]
    assert out[0] == out[1]


def test_single_process_without_launcher():
    code = ("import fastpar, torch, torch.distributed as dist; m = fastpar.init(); "
            "t = torch.ones(1); dist.all_reduce(t, group=m.dp_group); "
            "print(m.world_size, m.tp_size, m.dp_rank, t.item())")
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK")}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["1", "1", "0", "1.0"]


def test_missing_master_addr_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    with pytest.raises(ValueError, match="MASTER_ADDR is not set"):
        fastpar.init()
    monkeypatch.setenv("WORLD_SIZE", "two")
    with pytest.raises(ValueError, match="WORLD_SIZE='two' is not an integer"):
        fastpar.init()
