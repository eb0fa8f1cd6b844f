"""The trainer, its data, checkpoints and metrics."""
from .checkpoint import latest_checkpoint, load_checkpoint
from .checkpoint_writer import save_checkpoint
from .config import TrainConfig
from ..data import BatchSampler, check_data, data_vocab, load_tokens, write_token_file
from ..data import ByteTokenizer, load_tokenizer, tokenizer_for_data
from .trainer import train

__all__ = ["BatchSampler", "ByteTokenizer", "TrainConfig", "check_data", "data_vocab",
           "latest_checkpoint", "load_checkpoint", "load_tokenizer", "load_tokens",
           "save_checkpoint", "tokenizer_for_data", "train", "write_token_file"]
