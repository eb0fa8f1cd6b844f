"""A GPT-style model built from the parallel layers."""
from .config import PRESETS, GPTConfig, get_config
from .generate import KVCache, generate
from .gpt import GPT, RECOMPUTE
from .layers import Norm, ParallelAttention, ParallelMLP, ParallelTransformerLayer
from .parallel_config import ParallelConfig

__all__ = ["GPT", "GPTConfig", "KVCache", "Norm", "PRESETS", "RECOMPUTE", "ParallelAttention",
           "ParallelConfig", "ParallelMLP", "ParallelTransformerLayer", "generate", "get_config"]
