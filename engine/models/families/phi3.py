"""Phi-3: the neutral decoder, with q/k/v and gate/up already fused in the checkpoint.

Its `qkv_proj` ([q; k; v] rows) and `gate_up_proj` ([gate; up] rows) are the
layouts our fused projections use, so each checkpoint tensor fills the whole
parameter. Phi-3's sliding window (mini-4k: 2047 tokens) goes through the
engine's sliding-window attention; LongRoPE (the 128k variants) through
transformers' own rope init, short factors, with the context stopped at
`original_max_position_embeddings` (ModelConfig.context_limit). A partial
rotary factor (Phi-4-mini) is refused. No bias anywhere.

GGUF: llama.cpp's phi3 files name the fused tensors attn_qkv / ffn_up (gate and up together), which
no loader here maps: refused.
"""

from __future__ import annotations

from typing import ClassVar

from engine.errors import ModelLoadError
from engine.model_config import ModelConfig
from engine.models.decoder import DecoderForCausalLM
from engine.models.family import Family, FamilyTraits, SlidingWindow


class Phi3ForCausalLM(DecoderForCausalLM):
    stacked_params: ClassVar[dict[str, tuple[str, str]]] = {}  # nothing to fuse: the checkpoint is fused already

    def __init__(self, config: ModelConfig) -> None:
        rotary_fraction = float(config.rope_parameters.get("partial_rotary_factor", 1.0) or 1.0)
        if rotary_fraction != 1.0:
            raise ModelLoadError(
                f"partial rotary embeddings (partial_rotary_factor={rotary_fraction}) are not supported"
            )
        super().__init__(config)


FAMILY = Family(
    name="phi3",
    model_types=("phi3",),
    architectures=("Phi3ForCausalLM",),
    model_class=Phi3ForCausalLM,
    traits=FamilyTraits(sliding_window=SlidingWindow.CONFIG),
)
