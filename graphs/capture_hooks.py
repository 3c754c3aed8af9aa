"""Capture/replay hooks an attention backend implements, so a new platform is one attention folder.

The graph runners own the capture *mechanism* (CUDA/HIP graphs, torch.compile per size, NPUGraph,
HPU buckets); the attention backend owns what those graphs read: the static per-size state, the
attention metadata a captured size sees, and how a step's inputs reach that state before a replay.
The shape follows mini-sglang's attention backends (init_capture_graph / prepare_for_capture /
prepare_for_replay over one metadata builder) and SGLang's init_cuda_graph_state /
init_forward_metadata_capture_cuda_graph / init_forward_metadata_replay_cuda_graph.

Hooks are stateless: the state they allocate is returned to the runner (its `buffers`), so two
runners over one backend never share buffers. A backend that is no CaptureHooks gets
StaticBufferCaptureHooks, the default, built on graphs.static_buffers.StaticDecodeBuffers (the
Triton and CPU backends inherit it unchanged). CaptureHooks is a base class, not a protocol: a
backend is its own hooks by declaring so, never because it happens to have methods of those names.
"""

from __future__ import annotations

import abc
from typing import TYPE_CHECKING, Any

import torch

from engine.layers.attention import AttentionBackend, AttentionMetadata
from graphs.static_buffers import StaticDecodeBuffers

if TYPE_CHECKING:
    from engine.step_message import DecodeMessage
    from graphs.model_runner import DecodeBatchState


class CaptureHooks(abc.ABC):
    """What DecodeGraphRunner asks of the attention backend around capture and replay."""

    @abc.abstractmethod
    def init_capture_state(
        self, max_bs: int, max_pages: int, page_size: int, device: torch.device, slot_dtype: torch.dtype
    ) -> Any:
        """Allocate the static state every captured size reads (sized for the largest batch and pages)."""

    @abc.abstractmethod
    def capture_metadata(self, state: Any, bs: int) -> AttentionMetadata:
        """The attention metadata the graph of size bs is captured (and replayed) with: views of `state`."""

    @abc.abstractmethod
    def prepare_for_capture(self, state: Any, bs: int) -> None:
        """Put `state` in a safe condition for warming up and capturing size bs (dummy rows only)."""

    @abc.abstractmethod
    def after_capture(self, state: Any, bs: int, graph: Any) -> None:
        """After size bs is captured (graph: the platform's graph object, None without one)."""

    @abc.abstractmethod
    def prepare_for_replay(
        self, state: Any, message: DecodeMessage, batch_state: DecodeBatchState, padded_bs: int
    ) -> torch.Tensor:
        """Fill `state` from the step's message and the persistent decode state, rows n..padded_bs as
        padding; returns the decode rows [n] on the device."""

    @abc.abstractmethod
    def before_replay(self, state: Any, bs: int, graph: Any) -> None:
        """Just before the graph of size bs replays (e.g. refresh host arguments a graph froze)."""


class StaticBufferCaptureHooks(CaptureHooks):
    """The default hooks: StaticDecodeBuffers, filled by one copy (int64 slots) or from the device batch."""

    def init_capture_state(
        self, max_bs: int, max_pages: int, page_size: int, device: torch.device, slot_dtype: torch.dtype
    ) -> StaticDecodeBuffers:
        return StaticDecodeBuffers.allocate(max_bs, max_pages, page_size, device, slot_dtype)

    def capture_metadata(self, state: StaticDecodeBuffers, bs: int) -> AttentionMetadata:
        return state.metadata(bs)

    def prepare_for_capture(self, state: StaticDecodeBuffers, bs: int) -> None:
        # Every row attends one token of the dummy page 0 and writes its k/v to slot 0.
        state.seq_lens[:bs].fill_(1)
        state.slot_indices[:bs].zero_()
        state.page_table[:bs].zero_()

    def after_capture(self, state: StaticDecodeBuffers, bs: int, graph: Any) -> None:
        return None

    def prepare_for_replay(
        self, state: StaticDecodeBuffers, message: DecodeMessage, batch_state: DecodeBatchState, padded_bs: int
    ) -> torch.Tensor:
        if state.staging is not None:
            return state.fill_from_rows(message.inputs, batch_state, padded_bs)
        batch = batch_state.decode_batch(message, [])
        assert batch.decode_rows is not None
        state.fill(batch.input_ids, batch.positions, batch.meta, padded_bs)
        return batch.decode_rows

    def before_replay(self, state: StaticDecodeBuffers, bs: int, graph: Any) -> None:
        return None


DEFAULT_HOOKS = StaticBufferCaptureHooks()


def capture_hooks_for(backend: AttentionBackend | None) -> CaptureHooks:
    """The backend itself where it is CaptureHooks (the CPU and Triton backends), else the default."""
    return backend if isinstance(backend, CaptureHooks) else DEFAULT_HOOKS
