"""The collectives fastpar issues, recorded: torch.distributed's signatures, each entry written
to the flight recorder (:mod:`fastpar.mesh.flight`) before torch is called.

    from fastpar.mesh import collectives
    collectives.all_reduce(loss, group=mesh.dp_group)      # as dist.all_reduce

Recording costs a few Python operations and reads no tensor value (see the recorder). A skipped
collective (the ``skip@`` fault of the reliability tests) is neither issued nor recorded; it
returns None, or a completed work when ``async_op``. Code outside training steps (the planner's
link calibration, wrap-time checks) may call torch.distributed directly.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .flight import _Done, recorder

ReduceOp = dist.ReduceOp

# torch 2.13 renamed the tensor-in, tensor-out collectives; keep working on either name.
_all_gather_tensor = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_tensor = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _skipped(async_op: bool):
    return _Done() if async_op else None


def all_reduce(tensor: torch.Tensor, op=ReduceOp.SUM, group=None, async_op: bool = False):
    if recorder.collective("all_reduce", group, tensor):
        return _skipped(async_op)
    return dist.all_reduce(tensor, op=op, group=group, async_op=async_op)


def all_gather_into_tensor(output_tensor: torch.Tensor, input_tensor: torch.Tensor, group=None,
                           async_op: bool = False):
    if recorder.collective("all_gather_into_tensor", group, input_tensor):
        return _skipped(async_op)
    return _all_gather_tensor(output_tensor, input_tensor, group=group, async_op=async_op)


def reduce_scatter_tensor(output: torch.Tensor, input: torch.Tensor, op=ReduceOp.SUM,
                          group=None, async_op: bool = False):
    if recorder.collective("reduce_scatter_tensor", group, input):
        return _skipped(async_op)
    return _reduce_scatter_tensor(output, input, op=op, group=group, async_op=async_op)


def broadcast(tensor: torch.Tensor, src: int | None = None, group=None, async_op: bool = False,
              group_src: int | None = None):
    if recorder.collective("broadcast", group, tensor):
        return _skipped(async_op)
    return dist.broadcast(tensor, src=src, group=group, async_op=async_op, group_src=group_src)


def all_to_all_single(output: torch.Tensor, input: torch.Tensor, output_split_sizes=None,
                      input_split_sizes=None, group=None, async_op: bool = False):
    if recorder.collective("all_to_all_single", group, input):
        return _skipped(async_op)
    return dist.all_to_all_single(output, input, output_split_sizes, input_split_sizes,
                                  group=group, async_op=async_op)


def barrier(group=None, async_op: bool = False, device_ids=None, timeout=None):
    if recorder.collective("barrier", group, _NOTHING):
        return _skipped(async_op)
    return dist.barrier(group=group, async_op=async_op, device_ids=device_ids, timeout=timeout)


def batch_isend_irecv(p2p_op_list: list[dist.P2POp]) -> list:
    if recorder.p2p("batch_isend_irecv", p2p_op_list):
        return [_Done() for _ in p2p_op_list]
    return dist.batch_isend_irecv(p2p_op_list)


def isend(tensor: torch.Tensor, dst: int | None = None, group=None, tag: int = 0,
          group_dst: int | None = None):
    op = dist.P2POp(dist.isend, tensor, dst, group, tag, group_dst)
    if recorder.p2p("isend", [op]):
        return _Done()
    return dist.isend(tensor, dst, group=group, tag=tag, group_dst=group_dst)


def irecv(tensor: torch.Tensor, src: int | None = None, group=None, tag: int = 0,
          group_src: int | None = None):
    op = dist.P2POp(dist.irecv, tensor, src, group, tag, group_src)
    if recorder.p2p("irecv", [op]):
        return _Done()
    return dist.irecv(tensor, src, group=group, tag=tag, group_src=group_src)


_NOTHING = torch.empty(0)       # what a barrier sends
