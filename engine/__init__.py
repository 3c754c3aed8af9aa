"""A graph-capture-centric LLM inference engine."""

from typing import Any

from engine.config import EngineConfig
from engine.errors import EngineError, InvalidRequestError, ModelLoadError, UnsupportedArchitectureError
from engine.request import RequestOutput
from engine.sampling_params import SamplingParams

__all__ = [
    "Engine",
    "EngineConfig",
    "EngineError",
    "InvalidRequestError",
    "ModelLoadError",
    "RequestOutput",
    "SamplingParams",
    "UnsupportedArchitectureError",
]


def __getattr__(name: str) -> Any:
    # Engine pulls in torch models and backends; import it lazily so `import engine` stays light.
    if name == "Engine":
        from engine.engine import Engine

        return Engine
    raise AttributeError(name)
