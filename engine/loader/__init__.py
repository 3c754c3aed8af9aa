"""Model sources: a Hugging Face folder, a GGUF file, or random (dummy) weights."""

from engine.loader.resolve import ModelSource, resolve_model_source
from engine.loader.build import load_model

__all__ = ["ModelSource", "resolve_model_source", "load_model"]
