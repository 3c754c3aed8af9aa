"""Flat paged attention for Gaudi decode (vllm-gaudi's flat_pa layout), in plain static-shape torch ops.

Gaudi compiles one recipe per tensor shape, so decode attention must not depend on
the context length. A 2-D page table cut to the longest row would; vllm-gaudi's
*flat* layout does not: the blocks (KV pages) of all rows are listed one after
another in ``block_list`` and padded to a bucketed length, and every per-row
quantity is moved between rows and blocks with a ``[blocks, bs]`` one-hot matmul
(``block_mapping``). Every op below has shapes fixed by (bs, blocks), so one
compiled recipe (or HPU graph) per bucket serves every batch in it, and the same
code runs on CPU for tests.

Per block b of row r = block_groups[b]:
  scores_b = q_r . K_b / sqrt(d)   masked to the first block_usage[b] tokens,
  m_b = max(scores_b), s_b = sum(exp(scores_b - m_b)), o_b = exp(scores_b - m_b) . V_b
then per row, with M_r the max of its blocks' m_b (an index_reduce over groups):
  out_r = sum_b exp(m_b - M_r) o_b / sum_b exp(m_b - M_r) s_b.
Subtracting the row max M_r (not a global one) keeps every row's sum away from
underflow however different the rows' scores are. Rows always own >= 1 block with
usage >= 1 (padded rows read one slot of page 0), so the denominator is never 0.

The host sends only three [blocks] vectors (block_list, block_groups, block_usage); the
[blocks, bs] mapping and the [blocks, page_size] bias are built on the device inside the
step. The math runs in the model dtype (bf16 on Gaudi), with the softmax statistics in fp32
only for the families that need it (FamilyTraits.fp32_softmax_on_hpu), as vllm-hpu-extension does.

UNTESTED ON GAUDI HARDWARE: checked on CPU against engine.layers.torch_attention.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from backends.hpu.bucketing import (
    PaddedDecodeBatch,
    build_block_metadata,
    choose_decode_bucket,
    pad_decode_batch,
    page_table_width,
)
from backends.hpu.fused_sdpa import fused_prompt_attention
from backends.hpu.prompt_attention import HpuPromptMetadata, padded_prompt_attention
from engine.layers.attention import AttentionBackend, AttentionCapabilities, AttentionMetadata
from engine.layers.torch_attention import extend_attention
from engine.models.registry import family_for
from engine.transfer import to_device

if TYPE_CHECKING:
    from engine.step_message import DecodeMessage
    from graphs.model_runner import DecodeBatchState

StoreFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]


def fp32_softmax_for(model_type: str | None, setting: str | bool | None = "auto") -> bool:
    """Whether decode attention keeps its softmax in fp32: `setting` true/false forces it; "auto" (or None)
    follows the model type's family (FamilyTraits.fp32_softmax_on_hpu: Qwen2, Qwen2-MoE)."""
    if isinstance(setting, bool):
        return setting
    text = str(setting or "auto").strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    if text != "auto":
        raise ValueError(f"hpu.fp32_softmax must be auto, true or false, got {setting!r}")
    family = family_for((model_type or "").lower())
    return family is not None and family.traits.fp32_softmax_on_hpu


def block_mapping(block_groups: torch.Tensor, batch_size: int, dtype: torch.dtype) -> torch.Tensor:
    """[blocks, bs] one-hot of each block's row, built where block_groups lives (the device): filler
    blocks (group == bs) match no column and get a zero row. A comparison rather than one_hot, whose
    out-of-range classes vllm-gaudi has to work around on CPU and in torch.compile (hpu_model_runner.py
    _set_block_mapping); the host sends only the [blocks] groups, not the [blocks, bs] matrix."""
    rows = torch.arange(batch_size, device=block_groups.device, dtype=block_groups.dtype)
    return (block_groups.unsqueeze(1) == rows.unsqueeze(0)).to(dtype)


@dataclass
class HpuFlatMetadata:
    """What flat_paged_attention reads; AttentionMetadata.platform_metadata on HPU decode steps."""

    block_list: torch.Tensor  # [blocks] int64 page ids, row after row, filler page 0
    block_groups: torch.Tensor  # [blocks] int64 row of each block; bs for filler blocks
    block_mapping: torch.Tensor  # [blocks, bs] one-hot of block_groups (zero rows for filler)
    block_bias: torch.Tensor  # [blocks, page_size] 0 for used tokens, -inf past block_usage

    @classmethod
    def from_block_metadata(
        cls,
        block_list: torch.Tensor,
        block_groups: torch.Tensor,
        block_usage: torch.Tensor,
        page_size: int,
        batch_size: int,
        dtype: torch.dtype = torch.float32,
    ) -> HpuFlatMetadata:
        """Device-side, static-shape: runs inside the step once per step (not per layer), from the three
        [blocks] vectors the host sends; the one-hot mapping and the bias are built here."""
        offsets = torch.arange(page_size, device=block_usage.device, dtype=torch.int32)
        masked = offsets.unsqueeze(0) >= block_usage.to(torch.int32).unsqueeze(1)
        bias = torch.zeros(masked.shape, dtype=dtype, device=block_usage.device).masked_fill(masked, float("-inf"))
        groups = block_groups.long()
        return cls(block_list.long(), groups, block_mapping(groups, batch_size, dtype), bias)

    @classmethod
    def from_page_table(
        cls,
        page_table: torch.Tensor,
        seq_lens: torch.Tensor,
        page_size: int,
        dtype: torch.dtype,
        device: torch.device | str | None = None,
    ) -> HpuFlatMetadata:
        """For eager steps that no runner padded: exactly the blocks the batch needs (data-dependent shape).
        Built on the host from host tensors (device ones are copied back once), then sent to `device`
        (default: the page table's)."""
        host_table, host_lens = page_table.cpu(), seq_lens.cpu()
        blocks = _count_blocks(host_lens, page_size)
        host = build_block_metadata(host_table, host_lens, page_size, blocks)
        target = page_table.device if device is None else torch.device(device)
        return cls.from_block_metadata(
            host.block_list.to(target),
            host.block_groups.to(target),
            host.block_usage.to(target),
            page_size,
            int(host_lens.numel()),
            dtype,
        )


def _count_blocks(seq_lens: torch.Tensor, page_size: int) -> int:
    return int(((seq_lens.to(torch.int64) + page_size - 1) // page_size).sum())


def flat_paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: HpuFlatMetadata,
    page_size: int,
    scale: float,
    fp32_softmax: bool = False,
) -> torch.Tensor:
    """q [bs, heads, dim], caches [slots, kv_heads, dim] -> [bs, heads, dim]; see the module docstring.

    The math runs in the query's dtype (bf16 on Gaudi), as vllm-hpu-extension's flat_pa does, so the
    matmuls stay on bf16 MME paths and nothing is upcast per block; fp32_softmax keeps the softmax
    statistics (scores, maxima, exponentials, sums) in fp32 for the models that need it
    (FamilyTraits.fp32_softmax_on_hpu).
    """
    bs, heads, dim = q.shape
    kv_heads = k_cache.shape[1]
    group = heads // kv_heads
    blocks = meta.block_list.shape[0]
    stat = torch.float32 if fp32_softmax else q.dtype
    mapping = meta.block_mapping.to(q.dtype)
    # batch2block: every block gets the (scaled) query of its row; filler blocks get zeros.
    q_blocks = (mapping @ (q * scale).reshape(bs, heads * dim)).view(blocks, kv_heads, group, dim)
    # Gather whole pages: the cache viewed as [pages, page_size, kv_heads, dim] (a view, no copy).
    keys = k_cache.view(-1, page_size, kv_heads, dim).index_select(0, meta.block_list)
    values = v_cache.view(-1, page_size, kv_heads, dim).index_select(0, meta.block_list)
    # GQA without repeating K/V: the query heads of one kv head form a [group, dim] matrix.
    scores = torch.matmul(q_blocks, keys.permute(0, 2, 3, 1))  # [blocks, kv_heads, group, page_size]
    scores = scores.to(stat) + meta.block_bias.to(stat).view(blocks, 1, 1, page_size)
    block_max = scores.amax(dim=-1)  # [blocks, kv_heads, group]
    probs = torch.exp(scores - block_max.unsqueeze(-1))
    block_sum = probs.sum(dim=-1)
    partial = torch.matmul(probs.to(values.dtype), values.permute(0, 2, 1, 3))  # [blocks, kv_heads, group, dim]
    # Row max over the row's blocks; filler blocks reduce into an extra row `bs` that is dropped.
    # index_reduce is what vllm-gaudi runs on Gaudi for this (CPU torch calls it beta, once).
    row_max = torch.full((bs + 1, kv_heads, group), float("-inf"), dtype=stat, device=q.device)
    row_max = row_max.index_reduce(0, meta.block_groups, block_max, "amax")
    rescale = torch.exp(block_max - row_max.index_select(0, meta.block_groups))  # [blocks, kv_heads, group]
    # block2batch: mapping^T sums the rescaled blocks of each row (filler rows of mapping are zero).
    mapping_t = mapping.t().to(stat)
    row_sum = mapping_t @ (block_sum * rescale).view(blocks, -1)  # [bs, kv_heads * group]
    out = mapping_t @ (partial.to(stat) * rescale.unsqueeze(-1)).view(blocks, -1)  # [bs, kv_heads * group * dim]
    out = out.view(bs, kv_heads, group, dim) / row_sum.view(bs, kv_heads, group, 1)
    return out.reshape(bs, heads, dim).to(q.dtype)


# ---- capture/replay hooks (HpuDecodeRunner calls them; its compile-per-bucket mechanism stays there) ----

STEP_INPUTS = ("input_ids", "positions", "slot_indices", "page_table", "seq_lens")  # the step's positional args


def warmup_batch(
    bucket: tuple[int, int],
    page_size: int,
    max_blocks_per_seq: int,
    slot_dtype: torch.dtype = torch.int64,
    device: torch.device | str = "cpu",
) -> PaddedDecodeBatch:
    """A full batch that lands exactly on `bucket` and only touches the dummy page 0.

    The bucket's blocks are spread over its rows (each >= 1), every page id is 0
    and every slot is 0, so warm-up never writes into a real request's KV.
    """
    bs, blocks = bucket
    base, extra = divmod(blocks, bs)
    pages = torch.full((bs,), base, dtype=torch.int64)
    pages[:extra] += 1
    if int(pages.min()) < 1 or int(pages.max()) > max_blocks_per_seq:
        raise ValueError(f"bucket {bucket} is not valid for max_blocks_per_seq={max_blocks_per_seq}")
    seq_lens = (pages * page_size).to(torch.int32)
    width = page_table_width(blocks, max_blocks_per_seq)
    batch = pad_decode_batch(
        input_ids=torch.zeros(bs, dtype=torch.int64),
        positions=(seq_lens - 1).to(torch.int64),
        slot_indices=torch.zeros(bs, dtype=slot_dtype),
        page_table=torch.zeros(bs, width, dtype=torch.int32),
        seq_lens=seq_lens,
        bucket=bucket,
        page_size=page_size,
        max_blocks_per_seq=max_blocks_per_seq,
    )
    return move_batch(batch, device)


def move_batch(batch: PaddedDecodeBatch, device: torch.device | str) -> PaddedDecodeBatch:
    """One host-to-device copy per tensor; padding happened on the host."""
    moved = {name: getattr(batch, name).to(device, non_blocking=True) for name in STEP_INPUTS}
    return PaddedDecodeBatch(**moved, num_real=batch.num_real, bucket=batch.bucket)


class HpuGraphHooks:
    """The HPU's capture/replay hooks (graphs/capture_hooks.py names, over bucketed host batches): the
    warm-up batch of a bucket, host-side bucket choice and padding before a run, and the flat block
    metadata (block_list, block_groups, block_usage) built on the host and sent with the inputs.

    with_block_metadata: the step takes the three [blocks] vectors as keyword arguments, so its shapes
    depend on (bs, blocks) rather than on (bs, page-table width).
    """

    def __init__(
        self,
        buckets: Sequence[tuple[int, int]],
        page_size: int,
        max_blocks_per_seq: int,
        slot_dtype: torch.dtype = torch.int64,
        with_block_metadata: bool = False,
    ) -> None:
        self.buckets = sorted(set(buckets))
        self.page_size = page_size
        self.max_blocks_per_seq = max_blocks_per_seq
        self.slot_dtype = slot_dtype
        self.with_block_metadata = with_block_metadata

    def shape_key(self, bucket: tuple[int, int]) -> tuple[int, int]:
        """What the step's shapes depend on: (bs, page-table width), or (bs, blocks) with block metadata."""
        if self.with_block_metadata:
            return bucket
        return bucket[0], page_table_width(bucket[1], self.max_blocks_per_seq)

    def capture_inputs(self, bucket: tuple[int, int]) -> PaddedDecodeBatch:
        """The host batch a bucket is warmed up (compiled) with: dummy page 0 only."""
        return warmup_batch(bucket, self.page_size, self.max_blocks_per_seq, self.slot_dtype)

    def init_capture_state(
        self,
        max_bs: int,
        max_pages: int,
        page_size: int,
        device: torch.device | str,
        slot_dtype: torch.dtype,
    ) -> HpuReplayState:
        """HPU graphs are compiled per bucket shape and take fresh inputs each call: no static buffers, only
        the padded batch prepare_for_replay hands the runner."""
        return HpuReplayState()

    def prepare_for_replay(
        self, state: HpuReplayState, message: DecodeMessage, batch_state: DecodeBatchState, padded_bs: int
    ) -> torch.Tensor:
        """The engine's decode step (graphs/capture_hooks.py's contract): the bucket chosen and the batch
        padded on the host from the step message's host tensors and the host copy of the rows' pages, so
        no step copies its inputs back from the device; the padded batch goes to `state.batch`. padded_bs
        is not used: the bucket (rows and blocks) is this hook's choice. Returns the decode rows on the device."""
        ids, positions, slots, page_table, seq_lens = message.host_batch()
        state.batch = self.pad_inputs(ids, positions, slots, page_table, seq_lens)
        return to_device(message.inputs[3], torch.int64, batch_state.device)

    def pad_inputs(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        slot_indices: torch.Tensor,
        page_table: torch.Tensor,
        seq_lens: torch.Tensor,
    ) -> PaddedDecodeBatch:
        """Choose the bucket and pad host tensors to it (padding with device ops would compile per pair)."""
        bucket = choose_decode_bucket(seq_lens, self.page_size, self.buckets)
        return pad_decode_batch(
            input_ids,
            positions,
            slot_indices.to(self.slot_dtype),
            page_table,
            seq_lens,
            bucket,
            self.page_size,
            self.max_blocks_per_seq,
        )

    def replay_inputs(
        self, host_batch: PaddedDecodeBatch, device: torch.device
    ) -> tuple[PaddedDecodeBatch, dict[str, torch.Tensor]]:
        """The padded batch on the device, and the step's block metadata keywords (built on the host)."""
        kwargs: dict[str, torch.Tensor] = {}
        if self.with_block_metadata:
            meta = build_block_metadata(
                host_batch.page_table, host_batch.seq_lens, self.page_size, host_batch.bucket[1]
            )
            kwargs = {k: v.to(device, non_blocking=True) for k, v in vars(meta).items()}
        return move_batch(host_batch, device), kwargs


@dataclass
class HpuReplayState:
    """What HpuGraphHooks.prepare_for_replay hands the runner: the step's batch, padded to its bucket."""

    batch: PaddedDecodeBatch | None = None


def _hpu_store_kv() -> StoreFn:
    from backends.hpu.platform import HpuPlatform

    return HpuPlatform().store_kv


class HpuAttentionBackend(AttentionBackend):
    """Decode: index_copy_ store + flat paged attention; extend: the same store, then attention over a padded
    prompt batch (a bucketed prefill) or the ragged torch extend attention (an unpadded one)."""

    name = "hpu_flat"
    # The flat layout and FusedSDPA have no window or soft-cap argument, and the caches are float: the engine
    # keeps the context within a model's window and refuses soft-capped models here.
    capabilities = AttentionCapabilities()
    # Its capture/replay hooks (warm-up batches, host padding, flat block metadata): HpuDecodeRunner's.
    graph_hooks = HpuGraphHooks

    def __init__(
        self,
        store_kv: StoreFn | None = None,
        fp32_softmax: bool = False,
        mark_steps: bool = False,
        fused_sdpa: Any | None = None,
    ) -> None:
        """fp32_softmax: decode and padded-prompt softmax in fp32 (HpuPlatform.prepare_model sets it per model type).
        mark_steps: lazy mode; a prefill's lazily accumulated graph is flushed (htorch.core.mark_step) at the
        end of its forward pass, so it compiles and runs there, not at the next decode step's mark_step.
        fused_sdpa: Habana's FusedSDPA kernel class for padded prompts (backends/hpu/fused_sdpa.py
        load_fused_sdpa; HpuPlatform.attention_backend passes it), None for the masked-matmul op."""
        # HpuPlatform.store_kv: index_copy_ along slots, int64 indices, static per bucket.
        self.store_kv = store_kv if store_kv is not None else _hpu_store_kv()
        self.fp32_softmax = fp32_softmax
        self.mark_steps = mark_steps
        self.fused_sdpa = fused_sdpa

    @contextmanager
    def step_context(self, meta: AttentionMetadata) -> Iterator[None]:
        """Around one eager forward pass: an unpadded decode step gets its flat layout once, not per layer;
        in lazy mode a prefill (extend) pass ends with a mark_step."""
        if not meta.is_decode:
            yield
            if self.mark_steps:
                import habana_frameworks.torch as htorch

                htorch.core.mark_step()
            return
        if meta.platform_metadata is not None:
            yield
            return
        # fp32 mapping: flat_paged_attention casts it to the query dtype anyway.
        flat = HpuFlatMetadata.from_page_table(meta.page_table, meta.seq_lens, meta.page_size, torch.float32)
        meta.platform_metadata = flat
        try:
            yield
        finally:
            meta.platform_metadata = None

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        self.store_kv(k_cache, v_cache, meta.slot_indices, k, v)
        if not meta.is_decode:
            prompt = meta.platform_metadata
            if isinstance(prompt, HpuPromptMetadata):
                # A prefill padded to a prompt bucket (backends/hpu/prefill_runner.py): one static-shape op over
                # each row's prefix pages (read back from the caches just written) and its new tokens.
                if self.fused_sdpa is not None:
                    return fused_prompt_attention(
                        self.fused_sdpa, q, k, v, prompt, scale, self.fp32_softmax, k_cache, v_cache
                    )
                return padded_prompt_attention(q, k, v, prompt, scale, self.fp32_softmax, k_cache, v_cache)
            return extend_attention(q, k_cache, v_cache, meta, scale)
        flat = meta.platform_metadata
        if not isinstance(flat, HpuFlatMetadata):
            # An eager decode step (graphs off, or a batch beyond every bucket): build the
            # layout here, per layer. Correct, but a new shape for the graph compiler.
            flat = HpuFlatMetadata.from_page_table(meta.page_table, meta.seq_lens, meta.page_size, q.dtype)
        return flat_paged_attention(q, k_cache, v_cache, flat, meta.page_size, scale, self.fp32_softmax)
