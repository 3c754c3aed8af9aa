"""The model hyper-parameters our model code needs, read from a transformers config: the shapes every
decoder has here, what is particular to a family through that family's declaration (its `read_hf` and
traits, engine/models/family.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from engine.errors import UnsupportedArchitectureError
from engine.models.family import Family, SlidingWindow
from engine.models.registry import family_for, supported_model_types

if TYPE_CHECKING:
    from engine.models.interface import CausalLM


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
    qkv_bias: bool
    o_proj_bias: bool
    qk_norm: bool  # per-head q/k norms (a family that norms them otherwise says so in its own classes)
    hidden_act: str
    rope_parameters: dict[str, Any]
    family: Family  # who serves this checkpoint: its class, its traits, its GGUF layout
    eos_token_ids: list[int] = field(default_factory=list)
    # Attention reaches back at most this many tokens (Mistral-7B-v0.1: 4096; Qwen2/3 with
    # use_sliding_window: the family's SlidingWindow trait says which). None: full causal attention.
    sliding_window: int | None = None
    layer_windows: list[int | None] = field(default_factory=list)  # each layer's window (None: full attention)
    # (tokens, why): the context up to which this engine computes exactly what the checkpoint's
    # reference does, where a feature past it is not implemented (Phi-3's LongRoPE long factors).
    context_limit: tuple[int, str] | None = None
    # What only one family has (MoEConfig for Mixtral and Qwen3-MoE), read by that family's class.
    family_config: Any = None
    hf_config: Any = None  # the transformers config this was read from

    @property
    def model_class(self) -> type[CausalLM]:
        """The class in engine/models/ that runs this config (its family's)."""
        return self.family.model_class

    @property
    def rope_theta(self) -> float:
        return float(self.rope_parameters.get("rope_theta", 10000.0))

    @classmethod
    def from_hf(cls, hf_config: Any) -> ModelConfig:
        model_type = getattr(hf_config, "model_type", None)
        archs = getattr(hf_config, "architectures", None)
        family = family_for(model_type, archs)
        if family is None:
            raise UnsupportedArchitectureError(
                f"unsupported architecture: model_type={model_type!r} architectures={archs}; "
                f"supported model types: {supported_model_types()}"
            )
        heads = hf_config.num_attention_heads
        head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads
        eos = getattr(hf_config, "eos_token_id", None)
        eos_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        settings = family.read_hf(hf_config)
        window = _sliding_window(hf_config, family.traits.sliding_window)
        return cls(
            model_type=model_type or "",  # found by its architecture; transformers' configs always have one
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
            qkv_bias=settings.qkv_bias,
            o_proj_bias=settings.o_proj_bias,
            qk_norm=settings.qk_norm,
            hidden_act=getattr(hf_config, "hidden_act", "silu"),
            rope_parameters=_rope_parameters(hf_config),
            family=family,
            eos_token_ids=eos_ids,
            sliding_window=window,
            layer_windows=_layer_windows(hf_config, window),
            context_limit=_context_limit(hf_config),
            family_config=settings.family_config,
            hf_config=hf_config,
        )


def _sliding_window(hf_config: Any, rule: SlidingWindow) -> int | None:
    """The window the config puts in effect, by the family's rule: the config's `sliding_window` when
    set (CONFIG), only with `use_sliding_window` (OPT_IN), never (NONE)."""
    window = getattr(hf_config, "sliding_window", None)
    if not window or rule is SlidingWindow.NONE:
        return None
    if rule is SlidingWindow.OPT_IN and not getattr(hf_config, "use_sliding_window", False):
        return None
    return int(window)


def _context_limit(hf_config: Any) -> tuple[int, str] | None:
    """LongRoPE (Phi-3 128k) rotates with its short factors up to original_max_position_embeddings and
    switches to the long ones past it; only the short table is built here, so the context stops there."""
    rope = _rope_parameters(hf_config)
    if rope.get("rope_type") != "longrope":
        return None
    original = rope.get("original_max_position_embeddings") or getattr(
        hf_config, "original_max_position_embeddings", None
    )
    if not original:
        return None
    return int(original), "LongRoPE's long-context factors are not implemented"


def _layer_windows(hf_config: Any, window: int | None) -> list[int | None]:
    """Which layers the window applies to: the config's `layer_types` where it has them
    ("sliding_attention"), else every layer (Mistral)."""
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
