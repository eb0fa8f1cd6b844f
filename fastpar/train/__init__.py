"""Floor 5: training data, checkpoints (and, next, the trainer)."""
from .checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from .data import BatchSampler, ByteTokenizer, load_tokens, write_token_file

__all__ = ["BatchSampler", "ByteTokenizer", "latest_checkpoint", "load_checkpoint",
           "load_tokens", "save_checkpoint", "write_token_file"]
