"""Every model family: importing this module registers each class with engine/models/registry.py."""

from engine.models import gemma2, gemma3, llama, moe, phi3, qwen2, qwen3  # noqa: F401
