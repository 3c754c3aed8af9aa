"""Errors the engine raises for bad input: one clear message naming the problem."""


class EngineError(Exception):
    """Base class of the engine's user-facing errors."""


class ModelLoadError(EngineError):
    """The model path, its config or its weights cannot be used."""


class UnsupportedArchitectureError(ModelLoadError):
    """The checkpoint's architecture has no model implementation here."""


class InvalidRequestError(EngineError, ValueError):
    """A request (prompt or sampling parameters) is invalid."""


class RequestFailedError(EngineError):
    """A step failed because of this request; it was dropped (pages freed) and the others went on."""


class EngineStoppedError(EngineError):
    """The engine cannot step any more: its tensor-parallel ranks were shut down, or one of them failed."""


class RankFailedError(EngineStoppedError):
    """A tensor-parallel rank died, hung or failed: the message names it."""
