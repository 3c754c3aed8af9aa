"""What every model implements, so the engine, the graph runners and the compiled steps need no
knowledge of a family's module tree (they used to reach into `model.model.layers`)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch
from torch import nn

from engine.layers.attention import AttentionBackend, AttentionMetadata

if TYPE_CHECKING:
    from engine.loader.param_loading import CheckpointTensor
    from engine.model_config import ModelConfig
    from engine.platform import CaptureSettings
    from engine.speculative.aux_hidden import AuxHiddenTap

KVCache = tuple[torch.Tensor, torch.Tensor]


@runtime_checkable
class CausalLM(Protocol):
    config: Any
    attention_backend: AttentionBackend | None
    # Every loop over the layers records the stream entering each into it (an EAGLE-3 head's inputs); None: off.
    aux_tap: AuxHiddenTap | None

    def __init__(self, config: ModelConfig) -> None:
        """Built from the config alone (ModelConfig.model_class(config), on the meta device)."""

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[KVCache], meta: AttentionMetadata
    ) -> torch.Tensor:
        """Hidden states [tokens, hidden] of every token of a (ragged) step."""

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The residual stream entering the first decoder layer."""

    def decoder_layers(self) -> nn.ModuleList:
        """The layers, each called as layer(positions, hidden, kv_cache, meta) -> hidden; compiled steps
        compile one graph per distinct layer kind (dynamo guards on a layer's own attributes)."""

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Float32 logits [rows, vocab] of the rows that sample; written into `out` when given (the CUDA
        decode graphs' one logits buffer: no float32 copy of them is left in the graphs' pool)."""

    def load_weights(self, weights: Iterable[tuple[str, CheckpointTensor]]) -> None:
        """Fill every parameter from (checkpoint name, tensor) pairs, or raise ModelLoadError naming both."""

    def checkpoint_route(self, name: str) -> tuple[str, Any] | None:
        """HF checkpoint name -> (our parameter, its part or None), or None for a tensor the model
        computes itself; what the loaders (and the CPU's GGUF blocks) use to find a tensor's home."""

    def set_attention_backend(self, backend: AttentionBackend) -> None: ...

    def set_layer_windows(self, windows: Sequence[int | None]) -> None:
        """Each decoder layer's sliding window (None: full attention)."""

    def after_materialize(self) -> None:
        """After `to_empty` off the meta device: re-tie shared weights, rebuild computed tables (rotary)."""

    def supports_device_graphs(self, capture: CaptureSettings) -> bool:
        """Whether a step of this model may be captured by this platform's capture mechanism."""

    # What the engine uses of the nn.Module every family is: the call runs forward().
    def __call__(
        self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[KVCache], meta: AttentionMetadata
    ) -> torch.Tensor: ...

    def modules(self) -> Iterator[nn.Module]: ...

    def named_modules(self) -> Iterator[tuple[str, nn.Module]]: ...


def as_module(model: CausalLM) -> nn.Module:
    """The model as the nn.Module every family is, for what takes any module (the platforms' hooks)."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"{type(model).__name__} is not a torch.nn.Module, as every model family must be")
    return model
