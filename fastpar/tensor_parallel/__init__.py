"""Tensor parallelism (Megatron-style layers, sequence parallelism, overlapped GEMMs)."""
from .cross_entropy import vocab_parallel_cross_entropy
from .embedding import VocabParallelEmbedding
from .linear import ColumnParallelLinear, RowParallelLinear
from .mappings import (copy_to_tp, gather_from_sp, gather_from_tp, reduce_from_tp,
                       reduce_scatter_to_sp, scatter_to_sp, scatter_to_tp)
from .replicated_grads import param_grads, reduce_replicated_grads
from .sharding import mark_partial_grads, partial_grad_params

__all__ = ["ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding", "copy_to_tp",
           "gather_from_sp", "gather_from_tp", "mark_partial_grads", "param_grads",
           "partial_grad_params", "reduce_from_tp", "reduce_replicated_grads",
           "reduce_scatter_to_sp", "scatter_to_sp", "scatter_to_tp",
           "vocab_parallel_cross_entropy"]
