"""Autograd Functions for the linear layers' overlapped paths, built on the extension's ops.

Inputs are 2-D ``(rows, features)``: rows are the flattened sequence-first tokens, so a
sequence-parallel shard is a contiguous block of rows. ``w`` is an nn.Linear weight shard.
"""
from __future__ import annotations

import torch

from .. import ops


class ColumnLinearOverlap(torch.autograd.Function):
    """Forward: x @ w.T (under SP: ring all-gather fused with the GEMM). Backward: the input-grad
    all-reduce (in row chunks) / reduce-scatter overlaps the weight-grad GEMM."""

    @staticmethod
    def forward(ctx, x, w, group, sequence_parallel, chunks):
        ctx.group, ctx.sp, ctx.chunks = group, sequence_parallel, chunks
        ctx.save_for_backward(x, w)
        if sequence_parallel:
            # The gathered input is not kept: backward gathers it again while it computes.
            return ops.allgather_matmul(x, w, group)[0]
        return x @ w.t()

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        gx, gw = ops.column_linear_backward(g.contiguous(), x, w, ctx.group, ctx.sp,
                                            ctx.needs_input_grad[0], ctx.needs_input_grad[1],
                                            ctx.chunks)
        return gx, gw, None, None, None


class RowLinearOverlap(torch.autograd.Function):
    """Forward: chunked GEMM + all-reduce (under SP: GEMM + ring reduce-scatter). Backward: no
    communication (under SP: ring all-gather of the output grad fused with the input-grad GEMM)."""

    @staticmethod
    def forward(ctx, x, w, group, sequence_parallel, chunks):
        ctx.group, ctx.sp = group, sequence_parallel
        ctx.save_for_backward(x, w)
        if sequence_parallel:
            return ops.matmul_reducescatter(x, w, group)
        return ops.matmul_allreduce(x, w, group, chunks)

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        g = g.contiguous()
        if ctx.sp:
            gx, g = ops.allgather_matmul(g, w.t(), group=ctx.group)   # g: (rows, N) gathered
        else:
            gx = g @ w if ctx.needs_input_grad[0] else None
        gw = g.t() @ x if ctx.needs_input_grad[1] else None
        return gx, gw, None, None, None
