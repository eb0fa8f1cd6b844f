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
    assert (mesh.dp_rank, mesh.pp_rank, mesh.tp_rank, mesh.cp_rank) == tuple(lay.coords(rank))
    assert (mesh.tp_size, mesh.pp_size, mesh.dp_size, mesh.cp_size) == \
        (lay.tp, lay.pp, lay.dp, lay.cp)
    assert mesh.device == torch.device("cpu")
    for dim in ("tp", "pp", "dp") + (("cp", "dp-cp") if lay.cp > 1 else ()):
        group = getattr(mesh, f"{dim.replace('-', '_')}_group")
        members = mesh.group_ranks(dim)
        assert dist.get_world_size(group) == len(members)
        if dim != "dp-cp":
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
    (8, dict(tp=2, cp=2, dp=2), False),                      # context parallelism
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


def _init_with_layout(rank, world_size):
    from fastpar.mesh import Layout

    lay = Layout(world_size, tp=2)
    errors = []
    for kwargs in (dict(layout=lay, tp=2), dict(layout=Layout(4, tp=2))):
        try:
            fastpar.init(**kwargs)
        except ValueError as e:
            errors.append(str(e))
        assert not dist.is_initialized(), f"{kwargs}: torch.distributed started before the error"
    mesh = fastpar.init(layout=lay)
    return errors, mesh.layout is lay, mesh.tp_rank


def test_init_takes_a_layout_made_once():
    """fastpar.init(layout=...) uses the object it is given (the trainer's, checked against the
    run) without sizing it again; sizes beside it, or a layout of another world, are refused
    before torch.distributed starts."""
    out = run_ranks(_init_with_layout, 2, init_pg=False, timeout=60)
    for rank, (errors, same, tp_rank) in enumerate(out):
        assert errors == ["init: pass layout= or the sizes, not both ({'tp': 2})",
                          "init: the layout is of 4 ranks, this world of 2"]
        assert same and tp_rank == rank


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


def _fake_gpus(monkeypatch, count):
    """This host "has" ``count`` CUDA devices and a torch built with NCCL."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    monkeypatch.setattr(dist, "is_nccl_available", lambda: True)


@pytest.mark.parametrize("gpus,local_ranks,backend,expect", [
    (8, 8, None, "nccl"),
    (2, 1, None, "nccl"),
    (0, 2, None, "gloo"),                      # a CPU machine: gloo, nothing to warn about
    (1, 2, None, "gloo!"),                     # too few GPUs: gloo, and say why
    (1, 2, "gloo", "gloo"),                    # asked for: no warning
    (2, 2, "nccl", "nccl"),
])
def test_backend_needs_one_gpu_per_local_rank(monkeypatch, gpus, local_ranks, backend, expect):
    _fake_gpus(monkeypatch, gpus)
    chosen, why = fastpar.mesh.mesh.pick_backend(backend, local_ranks)
    assert chosen == expect.rstrip("!")
    if expect.endswith("!"):
        assert why and "\n" not in why
        assert f"{local_ranks} ranks on this host but {gpus} CUDA device(s)" in why
        assert f"--nproc-per-node {gpus}" in why
    else:
        assert why is None


def test_nccl_with_too_few_gpus_is_one_clear_error(monkeypatch):
    _fake_gpus(monkeypatch, 1)
    with pytest.raises(ValueError, match=r"backend='nccl' needs one GPU per rank, but this host "
                       r"runs 4 ranks and sees 1 CUDA device\(s\)"):
        fastpar.mesh.mesh.pick_backend("nccl", 4)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")
    assert fastpar.mesh.mesh.local_world_size(8) == 3
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    assert fastpar.mesh.mesh.local_world_size(8) == 8


def _init_on_one_gpu(rank, world_size):
    mp = pytest.MonkeyPatch()
    _fake_gpus(mp, 1)
    try:
        with pytest.raises(ValueError, match="this host runs 2 ranks and sees 1 CUDA device"):
            fastpar.init(backend="nccl")
        assert not dist.is_initialized()
        import warnings
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            mesh = fastpar.init()
        t = torch.ones(1)
        dist.all_reduce(t, group=mesh.dp_group)
        return (dist.get_backend(), str(mesh.device), t.item(),
                [str(w.message) for w in caught if "CUDA device" in str(w.message)])
    finally:
        mp.undo()


def test_init_with_fewer_gpus_than_local_ranks_runs_gloo_and_warns_once():
    out = run_ranks(_init_on_one_gpu, 2, init_pg=False, timeout=60)
    assert [o[:3] for o in out] == [("gloo", "cpu", 2.0)] * 2
    assert len(out[0][3]) == 1 and out[1][3] == []       # one warning per host (local rank 0)
    assert "2 ranks on this host but 1 CUDA device(s)" in out[0][3][0]


class _FakeNCCL:
    """Stands in for dist.ProcessGroupNCCL where this torch has no NCCL (the CPU wheel)."""

    class Options:
        def __init__(self):
            self.is_high_priority_stream = False


def _nccl_options_class(monkeypatch):
    if not hasattr(dist, "ProcessGroupNCCL"):
        monkeypatch.setattr(dist, "ProcessGroupNCCL", _FakeNCCL, raising=False)
    return dist.ProcessGroupNCCL.Options


def test_nccl_groups_get_high_priority_streams(monkeypatch):
    options_class = _nccl_options_class(monkeypatch)
    monkeypatch.delenv("TORCH_NCCL_HIGH_PRIORITY", raising=False)
    a, b = fastpar.mesh.mesh.group_options("nccl"), fastpar.mesh.mesh.group_options("nccl")
    assert isinstance(a, options_class) and a.is_high_priority_stream and a is not b
    assert fastpar.mesh.mesh.group_options("gloo") is None
    monkeypatch.setenv("TORCH_NCCL_HIGH_PRIORITY", "0")       # the user's opt-out wins
    assert fastpar.mesh.mesh.group_options("nccl") is None


def test_init_passes_high_priority_options_to_every_nccl_group(monkeypatch):
    """A single-process init on a faked one-GPU NCCL host, torch.distributed recorded."""
    _fake_gpus(monkeypatch, 1)
    _nccl_options_class(monkeypatch)
    monkeypatch.setattr(os, "environ", {k: v for k, v in os.environ.items() if k not in (
        "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "TORCH_NCCL_HIGH_PRIORITY")})
    calls = []
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    monkeypatch.setattr(dist, "init_process_group",
                        lambda backend, **kw: calls.append((backend, kw["pg_options"])))
    monkeypatch.setattr(dist, "new_group",
                        lambda ranks, **kw: calls.append(("group", kw["pg_options"])) or object())
    mesh = fastpar.init()
    assert mesh.device == torch.device("cuda", 0)
    assert [c[0] for c in calls] == ["nccl", "group", "group", "group"]
    assert all(c[1].is_high_priority_stream for c in calls)


def test_nccl_communicators_are_created_at_init_on_this_ranks_gpu(monkeypatch):
    """Under NCCL the default group is bound to this rank's device: torch then creates its
    communicator inside init_process_group and splits every new_group from it on the spot,
    instead of lazily at the first collective of step 1."""
    _fake_gpus(monkeypatch, 4)
    for key in fastpar.mesh.watchdog.nccl_debug_env("x").keys():
        monkeypatch.setenv(key, "")                  # init sets them; restored after the test
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.setenv(key, {"RANK": "2", "WORLD_SIZE": "4", "LOCAL_RANK": "2"}.get(key, "1"))
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    seen = {}

    class _Stop(Exception):
        pass

    def init_process_group(backend, **kwargs):
        seen.update(kwargs, backend=backend)
        raise _Stop

    monkeypatch.setattr(dist, "init_process_group", init_process_group)
    monkeypatch.setattr(fastpar.mesh.mesh, "group_options", lambda backend: None)
    with pytest.raises(_Stop):
        fastpar.init(backend="nccl")
    assert seen["backend"] == "nccl" and seen["device_id"] == torch.device("cuda", 2)
    assert fastpar.mesh.mesh.bound_device("gloo", 2) is None     # gloo: nothing to bind
