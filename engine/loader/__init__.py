"""Model sources: a Hugging Face folder, a GGUF file, or random (dummy) weights."""

from engine.loader.build import load_model
from engine.loader.resolve import ModelSource, resolve_model_source

__all__ = ["ModelSource", "load_model", "resolve_model_source"]
