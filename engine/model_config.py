"""The model hyper-parameters our model code needs, read from a transformers config."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from engine.errors import UnsupportedArchitectureError

# model_type -> model family implemented in engine/models/.
SUPPORTED_MODEL_TYPES: dict[str, str] = {
    "llama": "llama",
    "mistral": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "phi3": "phi3",
    "mixtral": "moe",
    "qwen3_moe": "moe",
}


@dataclass
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    qk_norm: bool
    hidden_act: str
    rope_parameters: dict[str, Any]
    eos_token_ids: list[int] = field(default_factory=list)
    # Attention reaches back at most this many tokens (Mistral-7B-v0.1: 4096; Qwen2/3 with
    # use_sliding_window). None: full causal attention.
    sliding_window: int | None = None
    layer_windows: list[int | None] = field(default_factory=list)  # each layer's window (None: full attention)
    # (tokens, why): the context up to which this engine computes exactly what the checkpoint's
    # reference does, where a feature past it is not implemented (Phi-3's LongRoPE long factors).
    context_limit: tuple[int, str] | None = None
    # Mixture of experts (Mixtral, Qwen3-MoE): experts per MoE layer (0: a dense model), experts each
    # token takes, each expert's intermediate size, whether the top-k weights are renormalised, and
    # which layers are MoE (Qwen3-MoE's decoder_sparse_step / mlp_only_layers; the rest dense).
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    moe_layers: list[bool] = field(default_factory=list)
    hf_config: Any = None  # the transformers config this was read from

    @property
    def family(self) -> str:
        return SUPPORTED_MODEL_TYPES[self.model_type]

    @property
    def rope_theta(self) -> float:
        return float(self.rope_parameters.get("rope_theta", 10000.0))

    @classmethod
    def from_hf(cls, hf_config: Any) -> "ModelConfig":
        model_type = getattr(hf_config, "model_type", None)
        if model_type not in SUPPORTED_MODEL_TYPES:
            archs = getattr(hf_config, "architectures", None)
            raise UnsupportedArchitectureError(
                f"unsupported architecture: model_type={model_type!r} architectures={archs}; "
                f"supported model types: {sorted(SUPPORTED_MODEL_TYPES)}"
            )
        heads = hf_config.num_attention_heads
        head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads
        eos = getattr(hf_config, "eos_token_id", None)
        eos_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        return cls(
            model_type=model_type,
            vocab_size=hf_config.vocab_size,
            hidden_size=hf_config.hidden_size,
            intermediate_size=hf_config.intermediate_size,
            num_hidden_layers=hf_config.num_hidden_layers,
            num_attention_heads=heads,
            num_key_value_heads=getattr(hf_config, "num_key_value_heads", None) or heads,
            head_dim=head_dim,
            rms_norm_eps=hf_config.rms_norm_eps,
            max_position_embeddings=hf_config.max_position_embeddings,
            tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
            # Qwen2 always has q/k/v bias; Llama-family configs say so with attention_bias.
            attention_bias=model_type == "qwen2" or bool(getattr(hf_config, "attention_bias", False)),
            qk_norm=model_type in ("qwen3", "qwen3_moe"),
            hidden_act=getattr(hf_config, "hidden_act", "silu"),
            rope_parameters=_rope_parameters(hf_config),
            eos_token_ids=eos_ids,
            sliding_window=_sliding_window(hf_config),
            layer_windows=_layer_windows(hf_config),
            context_limit=_context_limit(hf_config),
            **_moe_fields(model_type, hf_config),
            hf_config=hf_config,
        )


def _sliding_window(hf_config: Any) -> int | None:
    """The window the config puts in effect: Mistral's `sliding_window` unless None; Qwen2/Qwen3's
    only with `use_sliding_window` (their configs carry a window they do not use by default)."""
    window = getattr(hf_config, "sliding_window", None)
    if not window or not getattr(hf_config, "use_sliding_window", True):
        return None
    return int(window)


def _moe_fields(model_type: str, hf_config: Any) -> dict[str, Any]:
    """The MoE fields of ModelConfig for Mixtral and Qwen3-MoE (nothing for dense models)."""
    layers = hf_config.num_hidden_layers
    if model_type == "mixtral":
        return dict(num_experts=hf_config.num_local_experts, num_experts_per_tok=hf_config.num_experts_per_tok,
                    moe_intermediate_size=hf_config.intermediate_size, norm_topk_prob=True, moe_layers=[True] * layers)
    if model_type == "qwen3_moe":
        if getattr(hf_config, "shared_expert_intermediate_size", None):
            raise UnsupportedArchitectureError("MoE with shared experts is not supported yet")
        step = int(getattr(hf_config, "decoder_sparse_step", 1) or 1)
        dense = set(getattr(hf_config, "mlp_only_layers", None) or [])
        experts = int(hf_config.num_experts)
        moe = [experts > 0 and i not in dense and (i + 1) % step == 0 for i in range(layers)]
        return dict(num_experts=experts, num_experts_per_tok=hf_config.num_experts_per_tok,
                    moe_intermediate_size=hf_config.moe_intermediate_size,
                    norm_topk_prob=bool(getattr(hf_config, "norm_topk_prob", False)), moe_layers=moe)
    return {}


def _context_limit(hf_config: Any) -> tuple[int, str] | None:
    """LongRoPE (Phi-3 128k) rotates with its short factors up to original_max_position_embeddings and
    switches to the long ones past it; only the short table is built here, so the context stops there."""
    rope = _rope_parameters(hf_config)
    if rope.get("rope_type") != "longrope":
        return None
    original = rope.get("original_max_position_embeddings") or getattr(hf_config, "original_max_position_embeddings", None)
    if not original:
        return None
    return int(original), "LongRoPE's long-context factors are not implemented"


def _layer_windows(hf_config: Any) -> list[int | None]:
    """Which layers the window applies to: the config's `layer_types` where it has them
    ("sliding_attention"), else every layer (Mistral)."""
    window = _sliding_window(hf_config)
    types = getattr(hf_config, "layer_types", None)
    if window is None:
        return [None] * hf_config.num_hidden_layers
    if types:
        return [window if kind == "sliding_attention" else None for kind in types]
    return [window] * hf_config.num_hidden_layers


def _rope_parameters(hf_config: Any) -> dict[str, Any]:
    """transformers >= 5 keeps rope settings in `rope_parameters`; 4.x in rope_theta + rope_scaling."""
    params = getattr(hf_config, "rope_parameters", None)
    if isinstance(params, dict) and params:
        merged = dict(params)
    else:
        merged = dict(getattr(hf_config, "rope_scaling", None) or {})
        merged["rope_theta"] = getattr(hf_config, "rope_theta", 10000.0)
    rope_type = merged.get("rope_type", merged.get("type", "default"))
    merged["rope_type"] = rope_type
    return merged
