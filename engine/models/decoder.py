"""The neutral decoder every family builds on: token embedding, N layers of attention and MLP,
final norm, LM head; eager PyTorch.

`DecoderForCausalLM` implements engine.models.interface.CausalLM. Its parts
are hooks a family overrides: the module tree (`build_model`), a layer
(`build_layer`: the pre-norm block here; Gemma's sandwich norms and OLMo-2's
post-norms in their own files), a layer's MLP (`build_mlp`: MoE families give
some layers a SparseMoE), and the checkpoint names (`checkpoint_route`).
What the HF config switches (q/k/v and o biases, per-head q/k norms) comes
from the family's `read_hf` (engine/models/family.py) through ModelConfig.
q/k/v and gate/up projections are fused into one matmul each, as vLLM and
SGLang do, so a decode step launches fewer kernels.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

import torch
from torch import nn

from engine.distributed.sharding import Shard, even_shard, kv_head_shard
from engine.distributed.state import tp_state
from engine.layers.attention import Attention, AttentionBackend, AttentionMetadata
from engine.layers.linear import column_parallel_linear, row_parallel_linear
from engine.layers.mlp import GatedMLP
from engine.layers.norm import RMSNorm
from engine.layers.rotary import RotaryEmbedding
from engine.layers.vocab_parallel import TokenEmbedding, lm_head, vocab_embedding
from engine.loader.param_loading import load_checkpoint
from engine.model_config import ModelConfig

if TYPE_CHECKING:
    from engine.loader.param_loading import CheckpointTensor
    from engine.platform import CaptureSettings
    from engine.speculative.aux_hidden import AuxHiddenTap

KVCache = tuple[torch.Tensor, torch.Tensor]
# The CUDA decode graphs write the head's output into their one float32 logits buffer this many rows at a
# time, so that only one chunk of model-dtype logits is left in the graphs' pool: a 1,024-row graph's bf16
# logits over a 128k vocabulary would hold 250 MiB of it, a 256-row chunk holds 63. At 256 rows the head's
# GEMM is compute-bound: 857-row decode steps took 41.83 ms chunked, 41.88 unchunked
# (two H200s, docs/cuda.md 2026-12-04).
HEAD_ROWS_INTO_OUT = 256


def _rows(heads: Shard, head_dim: int) -> Shard:
    """A shard of heads as a shard of projection rows."""
    return Shard(heads.index, heads.count, heads.size * head_dim)


class DecoderAttention(nn.Module):
    """q/k/v (one fused matmul), optional per-head q/k norms, rotary, paged attention, o_proj.
    scale (default head_dim ** -0.5) and softcap: Gemma 2's query_pre_attn_scalar and logit cap;
    norm_class: the q/k norms' class (Gemma's norms scale by 1 + weight); a family that norms q and k
    another way (OLMo-2: over the whole projection) overrides `project`. With tensor parallelism
    num_heads and num_kv_heads are this rank's (engine/distributed/sharding.py)."""

    def __init__(
        self,
        config: ModelConfig,
        rotary: RotaryEmbedding,
        scale: float | None = None,
        softcap: float | None = None,
        norm_class: type[nn.Module] = RMSNorm,
        qk_norm: bool | None = None,
    ) -> None:
        super().__init__()
        state = tp_state()
        heads = even_shard(config.num_attention_heads, state.rank, state.world_size, "attention heads")
        kv_heads = kv_head_shard(config.num_key_value_heads, state.rank, state.world_size)
        self.num_heads = heads.size
        self.num_kv_heads = kv_heads.size
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        q_rows, kv_rows = _rows(heads, self.head_dim), _rows(kv_heads, self.head_dim)
        self.qkv_proj = column_parallel_linear(
            config.hidden_size, [("q", q_rows), ("k", kv_rows), ("v", kv_rows)], bias=config.qkv_bias
        )
        self.o_proj = row_parallel_linear(q_rows, config.hidden_size, bias=config.o_proj_bias)
        self.qk_norm = config.qk_norm if qk_norm is None else qk_norm
        if self.qk_norm:
            self.q_norm = norm_class(self.head_dim, config.rms_norm_eps)
            self.k_norm = norm_class(self.head_dim, config.rms_norm_eps)
        self.rotary = rotary
        self.attn = Attention(self.num_heads, self.num_kv_heads, self.head_dim, scale=scale, softcap=softcap)

    def forward(
        self, positions: torch.Tensor, hidden: torch.Tensor, kv_cache: KVCache, meta: AttentionMetadata
    ) -> torch.Tensor:
        tokens = hidden.shape[0]
        q, k, v = self.project(hidden)
        q, k = self.rotary(positions, q, k)
        out = self.attn(
            q, k, v, kv_cache, meta
        )  # views of the fused projection: Attention makes them contiguous where needed
        return self.o_proj(out.reshape(tokens, self.q_size))

    def project(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v as [tokens, heads, head_dim], normed where the family norms them (before rotary)."""
        q, k, v = self.split_heads(*self.qkv_proj(hidden).split([self.q_size, self.kv_size, self.kv_size], dim=-1))
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        return q, k, v

    def split_heads(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        tokens = q.shape[0]
        return (
            q.view(tokens, self.num_heads, self.head_dim),
            k.view(tokens, self.num_kv_heads, self.head_dim),
            v.view(tokens, self.num_kv_heads, self.head_dim),
        )


class DecoderLayer(nn.Module):
    """Pre-norm block (Llama, Qwen, Phi-3, the MoE families); `hidden` is the residual stream in and out.

    Holds no per-layer Python state (no layer index), so a compiled graph of
    one layer is reused by every layer of the same shape.
    """

    def __init__(self, config: ModelConfig, rotary: RotaryEmbedding, mlp: nn.Module) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = DecoderAttention(config, rotary)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = mlp

    def forward(
        self, positions: torch.Tensor, hidden: torch.Tensor, kv_cache: KVCache, meta: AttentionMetadata
    ) -> torch.Tensor:
        hidden = hidden + self.self_attn(positions, self.input_layernorm(hidden), kv_cache, meta)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class DecoderStack(Protocol):
    """What DecoderForCausalLM uses of its `model`: DecoderModel here, Gemma 3's own elsewhere."""

    @property
    def embed_tokens(self) -> TokenEmbedding: ...

    @property
    def layers(self) -> nn.ModuleList: ...

    @property
    def norm(self) -> nn.Module: ...


# (layer index, the rotary table it shares) -> the layer
LayerBuilder = Callable[[int, RotaryEmbedding], nn.Module]


class DecoderModel(nn.Module):
    """Embedding, layers (one rotary table shared by all) and final norm; build_layer makes each layer."""

    def __init__(
        self, config: ModelConfig, build_layer: LayerBuilder, norm_class: Callable[[int, float], nn.Module] = RMSNorm
    ) -> None:
        super().__init__()
        self.embed_tokens = vocab_embedding(config.vocab_size, config.hidden_size)
        self.rotary = RotaryEmbedding(
            config.head_dim, config.max_position_embeddings, config.rope_parameters, config.hf_config
        )
        self.layers = nn.ModuleList(build_layer(i, self.rotary) for i in range(config.num_hidden_layers))
        self.norm = norm_class(config.hidden_size, config.rms_norm_eps)


class DecoderForCausalLM(nn.Module):
    """forward() -> hidden states of every token; compute_logits() on the rows that need them.
    Implements engine.models.interface.CausalLM; a family's file says which checkpoints it runs."""

    # HF checkpoint names fused into our projections: (our param, part).
    stacked_params: ClassVar[dict[str, tuple[str, str]]] = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", "gate"),
        "up_proj": ("gate_up_proj", "up"),
    }

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.attention_backend: AttentionBackend | None = None
        # An EAGLE-3 head's inner-layer states (engine/speculative/aux_hidden.py); None: nothing recorded.
        self.aux_tap: AuxHiddenTap | None = None
        self.model: DecoderStack = self.build_model()
        self.lm_head = lm_head(config.hidden_size, config.vocab_size)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def build_model(self) -> DecoderStack:
        """The module tree under `model` (its names are the checkpoint's: model.layers.N...)."""
        return DecoderModel(self.config, self.build_layer)

    def build_layer(self, layer_index: int, rotary: RotaryEmbedding) -> nn.Module:
        return DecoderLayer(self.config, rotary, self.build_mlp(layer_index))

    def build_mlp(self, layer_index: int) -> nn.Module:
        return GatedMLP(self.config.hidden_size, self.config.intermediate_size, self.config.hidden_act)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[KVCache],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        hidden = self.embed(input_ids)
        tap = self.aux_tap
        for index, (layer, kv_cache) in enumerate(zip(self.decoder_layers(), kv_caches)):
            if tap is not None:
                tap.record(index, hidden)
            hidden = layer(positions, hidden, kv_cache, meta)
        if tap is not None:
            tap.record(len(kv_caches), hidden)
        return hidden

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)

    def set_prefill_activations(
        self, dtype: torch.dtype, min_rows: int, takes_dtype: Callable[[nn.Module], bool]
    ) -> int:
        """Steps of at least min_rows tokens run each layer's MLP in `dtype`, the residual stream and attention
        staying in the model's: the norm before the MLP writes its output in it. For a float32 GGUF model on the
        CPU, whose many-row matmuls run on a packed bf16 copy (backends/cpu/prefill_weights.py): those GEMMs take
        and give bf16, so three casts around the MLP's matmuls go and its activation reads half the bytes
        (a 1,500-token prompt 20% faster). Attention stays as it was: rotary embeddings in bf16 rounded the keys
        once more and moved greedy text away from HF float32's, for no measurable gain. Only pre-norm layers with
        a gated MLP whose projections both take `dtype` (takes_dtype) switch; returns how many did."""
        count = 0
        for layer in self.decoder_layers():
            if type(layer) is not DecoderLayer or not isinstance(layer.mlp, GatedMLP):
                continue
            norm = layer.post_attention_layernorm
            if isinstance(norm, RMSNorm) and takes_dtype(layer.mlp.gate_up_proj) and takes_dtype(layer.mlp.down_proj):
                norm.many_rows_dtype = (dtype, min_rows)
                count += 1
        return count

    def decoder_layers(self) -> nn.ModuleList:
        return self.model.layers

    def supports_device_graphs(self, capture: CaptureSettings) -> bool:
        return True

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Final norm + LM head, in float32 for sampling (into `out` when given, HEAD_ROWS_INTO_OUT rows at a time)."""
        hidden = self.model.norm(hidden)
        if out is None:
            return self.lm_head(hidden).float()
        for start in range(0, hidden.shape[0], HEAD_ROWS_INTO_OUT):
            rows = slice(start, start + HEAD_ROWS_INTO_OUT)
            out[rows].copy_(self.lm_head(hidden[rows]))
        return out

    def set_layer_windows(self, windows: Sequence[int | None]) -> None:
        """Layer i's attention sees each query's last windows[i] positions (None: all of them): every
        layer for Mistral, alternate layers for Gemma 2, the upper layers for Qwen2's max_window_layers."""
        for layer, window in zip(self.decoder_layers(), windows):
            for module in layer.modules():
                if isinstance(module, Attention):
                    module.sliding_window = window

    def set_attention_backend(self, backend: AttentionBackend) -> None:
        """Every Attention layer runs through this platform's backend."""
        self.attention_backend = backend
        for module in self.modules():
            if isinstance(module, Attention):
                module.backend = backend

    def after_materialize(self) -> None:
        """After construction on the meta device and `to_empty`: tie the head to the embedding again
        (materialising made each its own parameter) and rebuild tables that are computed, not loaded."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        for module in self.modules():
            if isinstance(module, RotaryEmbedding):
                module.rebuild()

    def load_weights(self, weights: Iterable[tuple[str, CheckpointTensor]]) -> None:
        """Every HF-named tensor through its parameter's weight loader; every parameter must be filled."""
        load_checkpoint(dict(self.named_parameters()), weights, self.checkpoint_route)

    def checkpoint_route(self, name: str) -> tuple[str, Any] | None:
        """Checkpoint tensor name -> (our parameter, part of it or None), or None: not ours by design."""
        if "rotary_emb.inv_freq" in name:
            return None
        if name == "lm_head.weight" and self.config.tie_word_embeddings:
            return None  # the head is the embedding
        for hf_name, (ours, part) in self.stacked_params.items():
            if f".{hf_name}." in name:
                return name.replace(hf_name, ours), part
        return name, None
