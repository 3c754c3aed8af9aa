"""The XLA step programs: one jitted function for decode steps, one for prefill chunks, each compiled once
per bucket shape (decode: batch size; prefill: token count) and never again.

Only arrays cross the jit boundary: the weights (a dict of jax arrays, an argument so they are not baked
into the program as constants), the KV cache (a flat list, donated, so XLA scatters the step's k/v into
the same buffers), and the step's padded index tensors. The model's eager PyTorch forward runs inside,
on torchax tensors, with backends/xla/attention.py as its attention backend. The KV cache lives here, as
jax arrays: the engine's host pool only gave its shape (its pages, allocator and prefix cache are the
engine's as on every platform; the bytes are these).
"""

from __future__ import annotations

import functools
import logging
import time
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch import nn

from backends.xla.attention import XlaChunkMetadata
from backends.xla.compile_log import compile_counter
from backends.xla.vendor import load
from engine.layers.attention import AttentionMetadata

logger = logging.getLogger(__name__)


class _Step(nn.Module):
    """The model's forward (and, for decode, its LM head) as one module, so that functional_call swaps every
    weight of both for the traced ones."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
        logits: bool,
    ) -> torch.Tensor:
        hidden: torch.Tensor = self.model(input_ids, positions, kv_caches, meta)
        if not logits:
            return hidden
        head: torch.Tensor = self.model.compute_logits(hidden)  # type: ignore[operator]
        return head


def _pairs(flat: list[torch.Tensor]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(flat[i], flat[i + 1]) for i in range(0, len(flat), 2)]


class XlaPrograms:
    """The weights and KV cache as jax arrays, and the two jitted step programs over them."""

    def __init__(
        self, model: nn.Module, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], page_size: int, max_pages: int
    ) -> None:
        vendor = load()
        # The model's index math asks for int64 (CPU torch's index_copy_ wants it); JAX without x64 traces it as
        # int32, which holds every slot and position, and warns once per op: quiet those warnings only.
        warnings.filterwarnings("ignore", message="Explicitly requested dtype int64", category=UserWarning)
        self._jax, self._jnp, self._interop = vendor.jax, vendor.jnp, vendor.interop
        self.counter = compile_counter()
        self.page_size = page_size
        self.max_pages = max_pages
        self._step = _Step(model)
        t2j = vendor.mappings.t2j
        start = time.perf_counter()
        state = {**dict(self._step.named_parameters()), **dict(self._step.named_buffers())}
        # Weights copied (no dlpack alias): jax owns them, whatever the host model does later.
        self.params = {name: t2j(tensor.detach(), use_dlpack=False) for name, tensor in state.items()}
        # The KV cache: zeros of the pool's shapes and dtype (the host pool's bytes are never read here).
        self.kv: list[Any] = [
            self._jnp.zeros(tuple(t.shape), dtype=vendor.mappings.t2j_dtype(t.dtype))
            for pair in kv_caches
            for t in pair
        ]
        logger.info(
            "XLA: %d weight arrays (%.1f MiB) and a %d-layer KV cache (%.1f MiB) on %s in %.1f s",
            len(self.params),
            sum(a.nbytes for a in self.params.values()) / 2**20,
            len(kv_caches),
            sum(a.nbytes for a in self.kv) / 2**20,
            self._jax.devices()[0].platform,
            time.perf_counter() - start,
        )
        call_torch = vendor.interop.call_torch
        # donate_argnums=1: the KV cache list; its buffers are reused for the returned cache.
        self._decode = self._jax.jit(functools.partial(call_torch, self._decode_fn), donate_argnums=(1,))
        self._prefill = self._jax.jit(functools.partial(call_torch, self._prefill_fn), donate_argnums=(1,))

    # ---- the traced functions (torch code, run on torchax tensors) ---------------------------------
    def _decode_fn(
        self,
        params: dict[str, torch.Tensor],
        kv: list[torch.Tensor],
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        slots: torch.Tensor,
        page_table: torch.Tensor,
        seq_lens: torch.Tensor,
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        meta = AttentionMetadata(True, slots, page_table, seq_lens, self.page_size)
        caches = _pairs(kv)
        logits = torch.func.functional_call(self._step, params, (input_ids, positions, caches, meta, True))
        return logits, [t for pair in caches for t in pair]

    def _prefill_fn(
        self,
        params: dict[str, torch.Tensor],
        kv: list[torch.Tensor],
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        slots: torch.Tensor,
        page_row: torch.Tensor,
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        seq_lens = positions.max().reshape(1).to(torch.int32) + 1
        meta = AttentionMetadata(
            False, slots, page_row, seq_lens, self.page_size, platform_metadata=XlaChunkMetadata(positions)
        )
        caches = _pairs(kv)
        hidden = torch.func.functional_call(self._step, params, (input_ids, positions, caches, meta, False))
        return hidden, [t for pair in caches for t in pair]

    # ---- running them -------------------------------------------------------------------------------
    def decode(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        slots: torch.Tensor,
        page_table: torch.Tensor,
        seq_lens: torch.Tensor,
    ) -> torch.Tensor:
        """Logits [B, vocab] float32 (host) of a padded decode batch; the KV cache updated in place."""
        args = (
            self._array(input_ids),
            self._array(positions),
            self._array(slots),
            self._array(page_table),
            self._array(seq_lens),
        )
        logits, self.kv = self._decode(self.params, self.kv, *args)
        return _to_host(logits)

    def prefill(
        self, input_ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, page_row: torch.Tensor
    ) -> torch.Tensor:
        """Hidden states [T, hidden] (host) of one request's padded chunk; the KV cache updated in place."""
        args = (
            self._array(input_ids),
            self._array(positions),
            self._array(slots),
            self._array(page_row.reshape(1, -1)),
        )
        hidden, self.kv = self._prefill(self.params, self.kv, *args)
        return _to_host(hidden)

    def cache_sizes(self) -> dict[str, int]:
        """Programs each jitted function holds compiled (one per bucket shape): JAX's own cache."""
        return {"decode": int(self._decode._cache_size()), "prefill": int(self._prefill._cache_size())}

    def _array(self, tensor: torch.Tensor) -> Any:
        """An index tensor as an int32 jax array: JAX without x64 holds indices in int32 (every slot, position and
        token id fits), and a host-side cast keeps a conversion program out of every step."""
        return self._jnp.asarray(tensor.detach().cpu().numpy().astype(np.int32))

    def timed(self, run: Callable[[], torch.Tensor]) -> tuple[float, int]:
        """(seconds, compiles) of one call (its result waited for): what a warm-up logs per bucket."""
        before = self.counter.count
        start = time.perf_counter()
        run()
        return time.perf_counter() - start, self.counter.count - before


def _to_host(array: Any) -> torch.Tensor:
    """A jax array as a host torch tensor (a copy: the next step's donation may reuse the buffer)."""
    return torch.from_numpy(np.array(array))
