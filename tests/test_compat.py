"""The compatibility floor (torch 2.11, triton 3.6): no module calls an API newer than that.

The GPU machines run torch 2.11 while development uses a newer CPU wheel, so a call that only the
newer torch has passes every CPU test and fails on the GPU. APIs that torch renamed go through
the fallbacks in fastpar/mesh/groups.py; everything else must use names 2.11 has.
"""
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
SOURCES = ("fastpar", "kernels", "bench", "tests")

# Newer than the floor -> what to use instead. torch.distributed gained the `_single` names in
# 2.13 (fastpar.mesh.groups falls back to the old ones); DDP's `forward_sync_buffers` is 2.13's
# name for 2.11's `broadcast_buffers`.
_NEWER_THAN_FLOOR = {
    r"\b(dist|distributed|ProcessGroup|pg|group)\.all_gather_single\b":
        "fastpar.mesh.groups.all_gather_tensor",
    r"\b(dist|distributed|ProcessGroup|pg|group)\.reduce_scatter_single\b":
        "fastpar.mesh.groups.reduce_scatter_tensor",
    r"\ball_gather_single_coalesced\b|\breduce_scatter_single_coalesced\b":
        "a loop over fastpar.mesh.groups' collectives",
    r"\bforward_sync_buffers\s*=": "DDP(broadcast_buffers=...)",
    r"\bnn\.LinearCrossEntropyLoss\b|\bF\.linear_cross_entropy\b":
        "fastpar's vocab-parallel cross entropy",
}
# The one place allowed to name the new APIs (to prefer them when present), and this file.
_ALLOWED = {ROOT / "fastpar" / "dist" / "groups.py", pathlib.Path(__file__).resolve()}


def _python_files():
    for top in SOURCES:
        yield from sorted((ROOT / top).rglob("*.py"))


def _violations(pattern: str) -> list[str]:
    rx = re.compile(pattern)
    found = []
    for path in _python_files():
        if path.resolve() in _ALLOWED:
            continue
        for n, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#", 1)[0]
            if rx.search(code):
                found.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
    return found


@pytest.mark.parametrize("pattern", list(_NEWER_THAN_FLOOR))
def test_no_api_newer_than_the_floor_outside_the_fallbacks(pattern):
    found = _violations(pattern)
    assert not found, (f"API newer than torch 2.11 used directly (use "
                       f"{_NEWER_THAN_FLOOR[pattern]}):\n" + "\n".join(found))


def test_the_scan_sees_the_source_tree():
    files = list(_python_files())
    assert ROOT / "fastpar" / "tensor_parallel" / "embedding.py" in files and len(files) > 50


def test_fallbacks_resolve_on_this_torch():
    import torch.distributed as dist

    from fastpar.mesh import collectives, groups

    # The recorded collectives (groups re-exports them) call whichever name this torch has.
    assert groups.all_gather_tensor is collectives.all_gather_into_tensor
    assert groups.reduce_scatter_tensor is collectives.reduce_scatter_tensor
    assert collectives._all_gather_tensor in (getattr(dist, "all_gather_single", None),
                                              dist.all_gather_into_tensor)
    assert collectives._reduce_scatter_tensor in (getattr(dist, "reduce_scatter_single", None),
                                                  dist.reduce_scatter_tensor)
