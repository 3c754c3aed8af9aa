"""What a model family declares about itself, in one object (`FAMILY` in its file under
engine/models/families/): the checkpoints it serves, how it reads their HF config and GGUF metadata,
and the traits the loader and the platforms act on. Nothing outside the family file compares
`model_type` strings: they ask the registry (engine/models/registry.py) for the family and read this.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from engine.models.interface import CausalLM


class SlidingWindow(Enum):
    """Where a family's attention window comes from (which layers it covers: the config's `layer_types`
    where it has them, else every layer; engine/model_config.py)."""

    NONE = "none"  # full attention always; a `sliding_window` in the config is not this family's
    CONFIG = "config"  # the config's `sliding_window` whenever it is set (Mistral, Phi-3, Gemma)
    # Only with `use_sliding_window` true: Qwen's configs carry a window that they do not use by default.
    OPT_IN = "opt_in"


@dataclass(frozen=True)
class FamilyTraits:
    """What the loader and the platforms need to know of a family beyond its weights."""

    # Gaudi's decode softmax keeps its statistics in fp32 (backends/hpu/attention.py); otherwise bf16.
    fp32_softmax_on_hpu: bool = False
    # The CPU's one-call GGUF decode step (backends/cpu/gguf_decode.py, kernels/gguf_decode.c) implements
    # this family's block: pre-norm RMSNorm, SiLU-gated MLP, optional per-head q/k RMSNorm and q/k/v bias.
    native_cpu_step: bool = False
    sliding_window: SlidingWindow = SlidingWindow.NONE
    # Soft-capped attention scores and logits (cap * tanh(x / cap)); llama.cpp stores the caps as
    # `{arch}.attn_logit_softcapping` / `{arch}.final_logit_softcapping`, which transformers' reader drops.
    softcap: bool = False


@dataclass(frozen=True)
class DecoderSettings:
    """What a family reads off its HF config for the decoder, beyond the shapes every config has."""

    qkv_bias: bool = False
    o_proj_bias: bool = False
    qk_norm: bool = False  # RMSNorm per head on q and k before rotary (Qwen3, Gemma 3)
    family_config: Any = None  # the family's own hyper-parameters (ModelConfig.family_config)


def no_settings(hf_config: Any) -> DecoderSettings:
    """A family whose HF config switches nothing beyond the common shapes."""
    return DecoderSettings()


def all_projection_bias(hf_config: Any) -> DecoderSettings:
    """`attention_bias` puts a bias on q, k, v and o alike (transformers' Llama, Qwen3, Gemma, OLMo-2)."""
    bias = bool(getattr(hf_config, "attention_bias", False))
    return DecoderSettings(qkv_bias=bias, o_proj_bias=bias)


@dataclass(frozen=True)
class GGUFSpec:
    """How llama.cpp writes this family: which `general.architecture` names, its tensor names, and what
    its converter changed on the way (all read by engine/loader/ and the CPU's GGUF blocks)."""

    archs: tuple[str, ...]
    # llama.cpp tensor base name -> HF name ({i}: the layer index); suffixes (.weight, .bias) carry over.
    tensor_names: Mapping[str, str]
    # The converter interleaved each head's two rotary halves in the Q/K rows (llama.cpp's llama family).
    rope_permuted: bool = False
    # Norm weights are stored as offset + weight (Gemma's (1 + w) norms: 1.0).
    norm_offset: float = 0.0
    # Sets on the transformers config what its GGUF reader leaves at class defaults although llama.cpp
    # stores it or fixes it in code; called with the file's scalar metadata.
    complete_config: Callable[[Any, Mapping[str, Any]], None] | None = None


@dataclass(frozen=True)
class Family:
    """A model family: checkpoints of these HF `model_type`s (or, failing that, `architectures`) run
    on `model_class`, configured by `read_hf`."""

    name: str  # its file's name in engine/models/families/
    model_types: tuple[str, ...]
    architectures: tuple[str, ...]
    model_class: type[CausalLM]
    read_hf: Callable[[Any], DecoderSettings] = no_settings
    traits: FamilyTraits = field(default_factory=FamilyTraits)
    gguf: GGUFSpec | None = None  # None: GGUF files of this family are refused
