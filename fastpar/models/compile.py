"""torch.compile per Transformer block, as torchtitan does: each block compiled on its own, not
the whole model.

A block is the unit that repeats, so one compiled graph serves every block of the model (dynamo
inlines nn.Modules: the parameters are graph inputs, not constants, and the blocks share one
cache entry); compile time does not grow with depth, and the embedding, the head, the loss and
pipeline stages stay eager and free to change shape. ``fullgraph=True`` makes any graph break an
error: the tensor-parallel mappings (torch.distributed collectives, which dynamo traces as
functional collectives), the extension's GEMM <-> collective ops (their fake implementations are
in :mod:`fastpar.extension`), the ring attention ops of context parallelism and the kernels'
torch references (CPU) or their Triton autograd Functions (CUDA) all trace into the one graph.

What stays eager: a block called with a KV cache (generation: the cache is Python state that
changes length at every token; decoding one token at a time gains little from compiling), and
anything outside the blocks. Dropout draws each mask's seed on the host (``Tensor.item``), a
graph break: ``fullgraph=True`` refuses a model with dropout. A split backward (the zero-bubble
schedules' input-gradient and weight-gradient halves, :mod:`fastpar.split_backward`) cannot
reach inside a compiled block, whose backward is one piece; the trainer refuses the pair.
"""
from __future__ import annotations

import types

import torch
import torch.nn as nn

from .layers import ParallelTransformerLayer


def _block_forward(compiled):
    """A block's forward that runs ``compiled`` (the class's forward, compiled), or the eager
    forward when a KV cache or packed documents are given (their boundaries are host integers
    that differ every batch: compiled, each batch would be a new graph)."""

    def forward(self, x, rope=None, recompute_core=False, kv=None, docs=None):
        if kv is not None or docs is not None:
            return type(self).forward(self, x, rope, recompute_core, kv, docs)
        return compiled(self, x, rope, recompute_core)

    return forward


def compile_blocks(model: nn.Module, *, fullgraph: bool = True, backend: str = "inductor",
                   mode: str | None = None) -> nn.Module:
    """Compile every Transformer block (:class:`~fastpar.models.layers.ParallelTransformerLayer`)
    of ``model`` in place with ``torch.compile(fullgraph, backend, mode)``; returns ``model``.

    The blocks stay the same modules (same parameters, same ``state_dict`` keys, so checkpoints
    are unchanged); only their ``forward`` is replaced. Compilation happens at the first call.
    Raises ValueError if the model has no block, a block is compiled already, or
    ``fullgraph=True`` meets dropout (see the module docstring)."""
    blocks = [(n, m) for n, m in model.named_modules() if isinstance(m, ParallelTransformerLayer)]
    if not blocks:
        raise ValueError(f"compile_blocks: {type(model).__name__} has no ParallelTransformerLayer "
                         "to compile")
    for name, block in blocks:
        if "forward" in vars(block):
            raise ValueError(f"compile_blocks: block {name!r} is compiled already")
        if fullgraph and block.dropout:
            raise ValueError(f"compile_blocks: dropout={block.dropout} draws its mask seed on the "
                             "host, a graph break; fullgraph=True needs dropout=0 (or pass "
                             "fullgraph=False)")
    forwards = {}                       # one compiled forward per block class
    for _, block in blocks:
        cls = type(block)
        if cls not in forwards:
            forwards[cls] = _block_forward(torch.compile(cls.forward, fullgraph=fullgraph,
                                                         backend=backend, mode=mode))
        # A bound method in the instance: copy.deepcopy rebinds it to the copy.
        block.forward = types.MethodType(forwards[cls], block)
    return model
