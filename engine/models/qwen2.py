"""Qwen2: the Llama block with bias on the q/k/v projections (ModelConfig.attention_bias)."""

from engine.models.llama import LlamaForCausalLM
from engine.models.registry import register_model


@register_model("qwen2", architectures=("Qwen2ForCausalLM",))
class Qwen2ForCausalLM(LlamaForCausalLM):
    """Same layers; ModelConfig.from_hf sets attention_bias=True for model_type qwen2."""
