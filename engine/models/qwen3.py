"""Qwen3: the Llama block with per-head RMSNorm on q and k before RoPE (ModelConfig.qk_norm)."""

from engine.models.llama import LlamaForCausalLM
from engine.models.registry import register_model


@register_model("qwen3", architectures=("Qwen3ForCausalLM",))
class Qwen3ForCausalLM(LlamaForCausalLM):
    """Same layers; ModelConfig.from_hf sets qk_norm=True for model_type qwen3."""
