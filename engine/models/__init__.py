"""Model families, looked up by ModelConfig.family."""

from __future__ import annotations

from engine.model_config import ModelConfig
from engine.models.llama import LlamaForCausalLM
from engine.models.moe import MoEForCausalLM
from engine.models.phi3 import Phi3ForCausalLM
from engine.models.qwen2 import Qwen2ForCausalLM
from engine.models.qwen3 import Qwen3ForCausalLM

MODEL_CLASSES: dict[str, type[LlamaForCausalLM]] = {
    "llama": LlamaForCausalLM,
    "qwen2": Qwen2ForCausalLM,
    "qwen3": Qwen3ForCausalLM,
    "phi3": Phi3ForCausalLM,
    "moe": MoEForCausalLM,
}


def model_class_for(config: ModelConfig) -> type[LlamaForCausalLM]:
    return MODEL_CLASSES[config.family]
