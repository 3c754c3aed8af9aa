"""Which slice of each weight a tensor-parallel rank holds, and which models can be split at all.

Megatron's split, as vLLM, SGLang and nano-vllm use it: attention heads and
the MLP's intermediate dimension are divided among the ranks (column-parallel
q/k/v and gate/up, row-parallel o_proj and down_proj, one all-reduce after
each row-parallel product); the vocabulary is divided for the embedding and
the LM head. KV heads are divided too, or, when there are fewer KV heads than
ranks, replicated: each KV head is then held by world / kv_heads ranks, the
ones whose query heads attend over it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from engine.errors import EngineError


@dataclass(frozen=True)
class Shard:
    """This rank's slice of a tensor split into `count` equal pieces along one dimension: piece `index`
    of `size` elements (several ranks may hold the same piece: replicated KV heads)."""

    index: int
    count: int
    size: int

    @property
    def start(self) -> int:
        return self.index * self.size

    @property
    def total(self) -> int:
        return self.count * self.size


def even_shard(total: int, rank: int, world: int, what: str) -> Shard:
    """Piece `rank` of `total` split over `world` ranks; `total` must divide evenly."""
    if total % world:
        raise EngineError(f"tensor parallel size {world} does not divide the {total} {what}")
    return Shard(rank, world, total // world)


def kv_head_shard(num_kv_heads: int, rank: int, world: int) -> Shard:
    """The KV heads this rank holds: its share when there are at least as many heads as ranks, else one
    head shared by world / num_kv_heads neighbouring ranks (head rank // replicas)."""
    if num_kv_heads >= world:
        return even_shard(num_kv_heads, rank, world, "KV heads")
    if world % num_kv_heads:
        raise EngineError(
            f"tensor parallel size {world} is neither a divisor nor a multiple of the {num_kv_heads} KV heads"
        )
    return Shard(rank // (world // num_kv_heads), num_kv_heads, 1)


@dataclass(frozen=True)
class VocabShard:
    """A rank's rows of the vocabulary: [start, end) of the real vocabulary, stored in `padded_size`
    rows (every rank the same, the last one's tail zero) so the LM head's logits gather evenly."""

    start: int
    end: int
    padded_size: int

    @property
    def size(self) -> int:
        return self.end - self.start


def vocab_shard(vocab_size: int, rank: int, world: int) -> VocabShard:
    per_rank = -(-vocab_size // world)
    start = min(rank * per_rank, vocab_size)
    return VocabShard(start, min(start + per_rank, vocab_size), per_rank)


def check_tensor_parallel(config: Any, world: int) -> None:
    """Refuse, with every reason at once, a model (engine.model_config.ModelConfig) whose heads or MLP
    widths this many ranks cannot split evenly."""
    if world == 1:
        return
    problems: list[str] = []
    for total, what in (
        (config.num_attention_heads, "attention heads"),
        (config.intermediate_size, "MLP intermediate size"),
    ):
        if total % world:
            problems.append(f"the {total} {what}")
    kv = config.num_key_value_heads
    if kv % world and world % kv:
        problems.append(f"the {kv} KV heads (neither a multiple nor a divisor of it)")
    family = config.family_config
    for name in ("moe_intermediate_size", "shared_expert_intermediate_size"):
        total = int(getattr(family, name, 0) or 0)
        if total % world:
            problems.append(f"the {total} {name.replace('_', ' ')}")
    if problems:
        raise EngineError(
            f"--tensor-parallel-size {world} does not divide {'; '.join(problems)} of this {config.model_type} model"
        )
