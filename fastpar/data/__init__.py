"""Training data: the token-file format, sources and the batch of every step (packed documents,
loss masks), tokenizers, and ``fastpar prepare-data`` (text files or JSONL examples -> token
files)."""
from .packing import Batch, DocumentSampler
from .sources import BatchSampler, check_data, data_vocab, describe_data, load_tokens
from .token_file import write_token_file
from .tokenizer import ByteTokenizer, load_tokenizer, tokenizer_for_data

__all__ = ["Batch", "BatchSampler", "ByteTokenizer", "DocumentSampler", "check_data",
           "data_vocab", "describe_data", "load_tokenizer", "load_tokens", "tokenizer_for_data",
           "write_token_file"]
