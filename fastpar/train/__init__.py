"""The trainer, its data, checkpoints and metrics."""
from .checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from .config import TrainConfig
from .data import BatchSampler, ByteTokenizer, load_tokens, write_token_file
from .trainer import train

__all__ = ["BatchSampler", "ByteTokenizer", "TrainConfig", "latest_checkpoint",
           "load_checkpoint", "load_tokens", "save_checkpoint", "train", "write_token_file"]
