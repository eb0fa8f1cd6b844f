"""Tensor parallelism (Megatron-style layers, sequence parallelism, overlapped GEMMs)."""
from .cross_entropy import vocab_parallel_cross_entropy
from .embedding import VocabParallelEmbedding
from .linear import ColumnParallelLinear, RowParallelLinear
from .mappings import (copy_to_tp, gather_from_sp, gather_from_tp, reduce_from_tp,
                       reduce_scatter_to_sp, scatter_to_sp, scatter_to_tp)

__all__ = ["ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding", "copy_to_tp",
           "gather_from_sp", "gather_from_tp", "reduce_from_tp", "reduce_scatter_to_sp",
           "scatter_to_sp", "scatter_to_tp", "vocab_parallel_cross_entropy"]
