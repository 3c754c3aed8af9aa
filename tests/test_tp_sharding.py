"""Tensor parallelism, model side, in one process: what each rank's layers hold, read from the checkpoint.

The ranks are simulated by building the model under another rank's state (no process group is needed to
load: collectives only run in a forward). Each rank's parameters are held against slices of the whole model
cut here independently of the loaders (Megatron's split: q/k/v and gate/up by rows of each part, o_proj and
down_proj by columns, the vocabulary by rows, every expert's intermediate dimension); the sharded tensors must
never be read whole from the file; and at world size 1 the model is built exactly as before (plain layers).
The multi-process runs (greedy ids, graphs, failures) are in tests/test_tensor_parallel.py.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from engine.distributed.sharding import check_tensor_parallel, kv_head_shard, vocab_shard
from engine.distributed.state import TensorParallelState, building_for, tp_state
from engine.errors import EngineError
from engine.layers.linear import ColumnParallelLinear, Linear, RowParallelLinear
from engine.layers.moe import SparseMoE, TensorParallelSparseMoE
from engine.layers.vocab_parallel import ParallelLMHead, VocabParallelEmbedding
from engine.loader import load_model, resolve_model_source
from engine.loader.weights import SafetensorsSlice

# Every family shape that shards differently: GQA (llama), q/k norms (qwen3), experts (mixtral), a shared
# expert and q/k/v bias (qwen2_moe), a checkpoint with q/k/v and gate/up fused already (phi3), a tied head
# with q/k/v bias (qwen2).
MODELS = ["llama", "qwen3", "mixtral", "qwen2_moe", "phi3", "qwen2"]
# Parameter names whose tensors are split (so must be read only in part); everything else is whole on every rank.
SHARDED = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj", "embed_tokens", "lm_head")


def _load(folder: str, rank: int = 0, world: int = 1) -> tuple[Any, Any]:
    with building_for(TensorParallelState(rank, world)):
        return load_model(resolve_model_source(folder), torch.float32, torch.device("cpu"))


def _rows(tensor: torch.Tensor, piece: int, pieces: int, dim: int = 0) -> torch.Tensor:
    return tensor.chunk(pieces, dim=dim)[piece]


def expected_shard(name: str, full: torch.Tensor, config: Any, rank: int, world: int) -> torch.Tensor:
    """The slice of the whole model's parameter `name` that rank `rank` of `world` must hold."""
    head = config.head_dim
    if "qkv_proj" in name:
        q_rows, kv_rows = config.num_attention_heads * head, config.num_key_value_heads * head
        q, k, v = full[:q_rows], full[q_rows : q_rows + kv_rows], full[q_rows + kv_rows :]
        kv = kv_head_shard(config.num_key_value_heads, rank, world)
        return torch.cat([_rows(q, rank, world), _rows(k, kv.index, kv.count), _rows(v, kv.index, kv.count)])
    if "experts.gate_up_proj" in name:  # [E, 2I, H]: gate rows, then up rows, of every expert
        gate, up = full.chunk(2, dim=1)
        return torch.cat([_rows(gate, rank, world, 1), _rows(up, rank, world, 1)], dim=1)
    if "experts.down_proj" in name:  # [E, H, I]
        return _rows(full, rank, world, 2)
    if "gate_up_proj" in name:
        gate, up = full.chunk(2)
        return torch.cat([_rows(gate, rank, world), _rows(up, rank, world)])
    if "o_proj" in name or "down_proj" in name:
        return _rows(full, rank, world, 1)
    if "embed_tokens" in name or "lm_head" in name:
        piece = vocab_shard(full.shape[0], rank, world)
        padding = torch.zeros(piece.padded_size - piece.size, full.shape[1])
        return torch.cat([full[piece.start : piece.end], padding])
    return full


@pytest.mark.parametrize("model", MODELS)
def test_each_rank_holds_exactly_its_slice_and_reads_only_it(
    tiny_checkpoints: dict[str, str], model: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    full_model, config = _load(tiny_checkpoints[model])
    full = dict(full_model.named_parameters())
    read_whole: list[str] = []
    real_read = SafetensorsSlice.read

    def spying_read(self: SafetensorsSlice) -> torch.Tensor:  # observes, then reads as before
        read_whole.append(self._name)
        return real_read(self)

    monkeypatch.setattr(SafetensorsSlice, "read", spying_read)
    world = 2
    for rank in range(world):
        read_whole.clear()
        part, _ = _load(tiny_checkpoints[model], rank, world)
        params = dict(part.named_parameters())
        assert params.keys() == full.keys()
        for name, param in params.items():
            want = expected_shard(name, full[name].detach(), config, rank, world)
            assert param.shape == want.shape, f"rank {rank} {name}: {tuple(param.shape)} vs {tuple(want.shape)}"
            assert torch.equal(param, want), f"rank {rank} {name}: wrong values"
        # Half of every split weight, the rest whole: the shard, not a full copy, is what each rank holds.
        split = sum(p.numel() for n, p in params.items() if any(s in n for s in SHARDED))
        whole_split = sum(p.numel() for n, p in full.items() if any(s in n for s in SHARDED))
        assert split * world == whole_split
        assert read_whole, "replicated tensors (norms) are read whole"
        assert not [
            n
            for n in read_whole
            if any(
                s in n
                for s in (
                    "q_proj",
                    "k_proj",
                    "v_proj",
                    "qkv_proj",
                    "o_proj",
                    "gate_proj",
                    "up_proj",
                    "down_proj",
                    "w1",
                    "w2",
                    "w3",
                    "embed_tokens",
                    "lm_head",
                )
            )
        ], read_whole
    assert tp_state().world_size == 1  # the simulated ranks left the process's state as it was


def test_kv_heads_are_replicated_when_fewer_than_ranks(tiny_checkpoints: dict[str, str]) -> None:
    """4 query heads over 2 KV heads at world size 4: each rank one query head and the KV head its query
    head attends over (ranks 0 and 1 share KV head 0, ranks 2 and 3 KV head 1)."""
    full_model, config = _load(tiny_checkpoints["llama"])
    full = full_model.model.layers[0].self_attn.qkv_proj.weight.detach()
    for rank in range(4):
        part, _ = _load(tiny_checkpoints["llama"], rank, 4)
        attention = part.model.layers[0].self_attn
        assert (attention.num_heads, attention.num_kv_heads) == (1, 1)
        assert kv_head_shard(2, rank, 4).index == rank // 2
        assert torch.equal(attention.qkv_proj.weight, expected_shard("qkv_proj", full, config, rank, 4))


def test_a_vocabulary_that_does_not_split_evenly_is_padded(tmp_path: Any) -> None:
    """383 tokens over 2 ranks: 192 rows each, the last rank's final row zero (its logit is cut after the gather)."""
    from conftest import build_tiny_checkpoint

    folder = build_tiny_checkpoint("llama_plain", str(tmp_path / "odd_vocab"), vocab_size=383)
    full_model, _ = _load(folder)
    full = full_model.lm_head.weight.detach()
    for rank in range(2):
        part, _ = _load(folder, rank, 2)
        head, embedding = part.lm_head, part.model.embed_tokens
        assert isinstance(head, ParallelLMHead) and isinstance(embedding, VocabParallelEmbedding)
        assert head.weight.shape[0] == 192 and (head.shard.start, head.shard.end) == (
            192 * rank,
            min(192 * (rank + 1), 383),
        )
        assert torch.equal(head.weight[: head.shard.size], full[head.shard.start : head.shard.end])
        assert not head.weight[head.shard.size :].any()


def test_world_size_one_builds_the_plain_layers(tiny_checkpoints: dict[str, str]) -> None:
    """Without tensor parallelism nothing of it is built: the layers a forward runs are the ones it always ran."""
    for name in ("llama", "qwen2_moe"):
        model, _ = _load(tiny_checkpoints[name])
        kinds = {type(m) for m in model.modules()}
        assert not kinds & {
            ColumnParallelLinear,
            RowParallelLinear,
            ParallelLMHead,
            VocabParallelEmbedding,
            TensorParallelSparseMoE,
        }
        assert Linear in kinds and nn.Embedding in kinds
        assert type(model.lm_head) is Linear and type(model.model.embed_tokens) is nn.Embedding
        assert all(type(m) is SparseMoE for m in model.modules() if isinstance(m, SparseMoE))


def test_models_that_do_not_split_are_refused_naming_why(tiny_checkpoints: dict[str, str]) -> None:
    _, llama = _load(tiny_checkpoints["llama"])
    with pytest.raises(EngineError, match="does not divide the 4 attention heads"):
        check_tensor_parallel(llama, 3)
    _, moe = _load(tiny_checkpoints["qwen3_moe"])  # 4 heads, 2 KV heads, MLP 128, experts 48
    with pytest.raises(
        EngineError,
        match=r"5 does not divide the 4 attention heads; the 128 MLP intermediate size; the 2 "
        r"KV heads .*; the 48 moe intermediate size of this qwen3_moe model",
    ):
        check_tensor_parallel(moe, 5)  # every reason at once
    check_tensor_parallel(llama, 4)  # 4 heads, 2 KV heads replicated twice: fine
