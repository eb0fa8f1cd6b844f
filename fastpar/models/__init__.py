"""A GPT-style model built from the parallel layers."""
from .config import PRESETS, GPTConfig, get_config
from .gpt import GPT, RECOMPUTE
from .layers import Norm, ParallelAttention, ParallelMLP, ParallelTransformerLayer

__all__ = ["GPT", "GPTConfig", "Norm", "PRESETS", "RECOMPUTE", "ParallelAttention", "ParallelMLP",
           "ParallelTransformerLayer", "get_config"]
