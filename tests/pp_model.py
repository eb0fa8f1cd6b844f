"""A small model cut the way the pipeline expects, shared by the pipeline tests.

embedding -> blocks (an nn.ModuleDict: LayerNorm -> Linear -> GELU -> Linear, residual) ->
final LayerNorm -> head; the loss is cross-entropy over (batch, seq, vocab) logits.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

from fastpar.tensor_parallel import ColumnParallelLinear, RowParallelLinear


class Block(nn.Module):
    def __init__(self, hidden: int):
        super().__init__()
        self.ln = nn.LayerNorm(hidden)
        self.fc1 = nn.Linear(hidden, 2 * hidden)
        self.fc2 = nn.Linear(2 * hidden, hidden)

    def forward(self, x):                          # (B, T, H)
        return x + self.fc2(F.gelu(self.fc1(self.ln(x))))


class ToyModel(nn.Module):
    def __init__(self, vocab: int = 32, hidden: int = 16, layers: int = 8):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.blocks = nn.ModuleDict({str(i): Block(hidden) for i in range(layers)})
        self.norm = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, vocab)

    def forward(self, tokens):                     # (B, T) -> (B, T, vocab)
        x = self.embed(tokens)
        for block in self.blocks.values():
            x = block(x)
        return self.head(self.norm(x))


def loss_fn(logits, targets):
    return F.cross_entropy(logits.flatten(0, -2), targets.flatten())


def shard_tp(model: ToyModel, tp_group) -> ToyModel:
    """Replace each block's fc1 / fc2 by Column / Row parallel layers holding this rank's slice."""
    for block in model.blocks.values():
        block.fc1 = ColumnParallelLinear.from_linear(block.fc1, tp_group=tp_group)
        block.fc2 = RowParallelLinear.from_linear(block.fc2, tp_group=tp_group)
    return model


def batch(seed: int, size: int = 8, seq: int = 5, vocab: int = 32):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (size, seq), generator=g)
    targets = torch.randint(0, vocab, (size, seq), generator=g)
    return tokens, targets
