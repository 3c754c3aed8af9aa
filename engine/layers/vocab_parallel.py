"""The embedding and the LM head, split by vocabulary over tensor-parallel ranks.

Each rank holds a contiguous block of vocabulary rows (engine/distributed/
sharding.py `vocab_shard`; the last block zero-padded so every rank holds the
same number). The embedding looks up the ids that fall in its block, zeroes
the others and sums over the ranks (one all-reduce); the LM head computes the
logits of its block and gathers every rank's side by side, so each rank ends
with the full row (rank 0 samples from it; see docs/tensor_parallel.md on why
an all-gather rather than a gather to rank 0). At world size 1 the factories
give the plain nn.Embedding and Linear.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.distributed.collectives import all_gather_last_dim, all_reduce
from engine.distributed.sharding import vocab_shard
from engine.distributed.state import tp_state
from engine.layers.linear import Linear
from engine.loader.param_loading import set_weight_loader, vocab_parallel_loader


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        state = tp_state()
        self.shard = vocab_shard(vocab_size, state.rank, state.world_size)
        self.weight = nn.Parameter(torch.empty(self.shard.padded_size, hidden_size))
        self.attach_weight_loaders()

    def attach_weight_loaders(self) -> None:
        set_weight_loader(self.weight, vocab_parallel_loader(self.shard), reads_lazily=True)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - self.shard.start
        elsewhere = (local < 0) | (local >= self.shard.size)  # another rank's rows
        rows = F.embedding(local.masked_fill(elsewhere, 0), self.weight)
        return all_reduce(rows.masked_fill(elsewhere.unsqueeze(-1), 0.0))


class ParallelLMHead(Linear):
    """Logits of this rank's vocabulary block, gathered over the ranks into the full [rows, vocab]."""

    def __init__(self, hidden_size: int, vocab_size: int) -> None:
        state = tp_state()
        self.shard = vocab_shard(vocab_size, state.rank, state.world_size)  # set first: the loaders need it
        self.vocab_size = vocab_size
        super().__init__(hidden_size, self.shard.padded_size, bias=False)

    def attach_weight_loaders(self) -> None:
        set_weight_loader(self.weight, vocab_parallel_loader(self.shard), reads_lazily=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = all_gather_last_dim(self.method.apply(self, x))
        if logits.shape[-1] != self.vocab_size:
            logits = logits[..., : self.vocab_size]  # the padding rows of the last block
        return logits


# The token embedding vocab_embedding gives.
TokenEmbedding = nn.Embedding | VocabParallelEmbedding


def vocab_embedding(vocab_size: int, hidden_size: int) -> TokenEmbedding:
    """The token embedding: nn.Embedding at world size 1, split by vocabulary otherwise."""
    if tp_state().world_size == 1:
        return nn.Embedding(vocab_size, hidden_size)
    return VocabParallelEmbedding(vocab_size, hidden_size)


def lm_head(hidden_size: int, vocab_size: int) -> Linear:
    """The LM head: a Linear at world size 1, split by vocabulary (logits gathered) otherwise."""
    if tp_state().world_size == 1:
        return Linear(hidden_size, vocab_size, bias=False)
    return ParallelLMHead(hidden_size, vocab_size)
