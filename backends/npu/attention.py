"""Ascend attention: npu_scatter_nd_update_ KV writes, torch_npu._npu_paged_attention decode.

UNTESTED ON ASCEND HARDWARE. The decode op and its argument layout follow how
vllm-ascend (attention_v1.py, DecodeOnly) and SGLang's Ascend backend (MHA decode)
call it:

    torch_npu._npu_paged_attention(
        query=[tokens, heads, head_dim], key_cache=value_cache=[num_blocks, block_size, kv_heads, head_dim],
        num_kv_heads=int, num_heads=int, scale_value=float,
        block_table=[batch, max_blocks] int32 (device), context_lens=[batch] int32 (HOST),
        out=[tokens, heads, head_dim])

The page table is read on the device, but ``context_lens`` is a *host* tensor: the
kernel's tiling is computed from it when the op is launched. Inside an NPUGraph
that launch happens once, at capture, so every replay must refresh it. SGLang
captures with ``torch.npu.graph(..., auto_dispatch_capture=True)`` and calls
``graph.update(cpu_update_input=[{"context_lens": <int32 CPU tensor>}])`` before
``replay()``; NpuDecodeGraphRunner does the same (seq_lens_update_key="context_lens"),
and hands the step a host buffer (``seq_lens_host``) that reaches this backend as
``NpuDecodeMetadata``, so nothing here syncs the device inside a graph. The update
only reaches ops torch_npu *recorded* at capture, which older releases do not do for
this op; the runner checks the records after every capture (graph_runner.check_update_records).
(vllm-ascend instead re-issues the op between graph_task_update_begin/end with the task
group handle it took at capture: vllm_ascend/compilation/acl_graph.py, _update_attn_pa_params.)

The op's workspace is computed at launch from ``context_lens``; a captured launch sized
for the capture-time lengths (one token) would be too small for later, longer replays.
As vllm-ascend does (it captures with SEQ_LEN_WITH_MAX_PA_WORKSPACE = 6144 tokens,
vllm_ascend/worker/model_runner_v1.py, and passes ``workspace=`` to the op), the captured
launch gets an explicit workspace sized for the longest context the graphs serve
(``NpuDecodeMetadata.workspace_context_len``); the update then re-issues the op with it.

Limits the op enforces (CANN ATB PagedAttentionOperation: hicann/ascend-transformer-boost
src/ops_infer/paged_attention/paged_attention_operation.cpp, and the CANN 8.0 ATB reference's
constraints): block_size % 16 == 0, 0 < head_size <= 256, heads % kv_heads == 0 and, on CANN 8.0,
block_size * head_size <= 128 * 128. check_paged_attention_limits refuses the rest with the limit named.

Our per-layer caches are [slots, kv_heads, head_dim] with slot = page * page_size +
offset, so the op's [num_blocks, block_size, kv_heads, head_dim] is a free view.
Off the NPU (CPU tensors) the op is replaced by paged_attention_reference, which
takes exactly the same arguments, so the layout fed to the op is tested on CPU.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from backends.npu.kv_store import paged_view
from engine.errors import EngineError
from engine.layers.attention import AttentionBackend, AttentionCapabilities, AttentionMetadata
from engine.layers.torch_attention import extend_attention, gather_context
from engine.transfer import to_device
from graphs.capture_hooks import CaptureHooks
from graphs.static_buffers import StaticDecodeBuffers

if TYPE_CHECKING:
    from engine.step_message import DecodeMessage
    from graphs.model_runner import DecodeBatchState

logger = logging.getLogger(__name__)
StoreFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]
SEQ_LENS_UPDATE_KEY = "context_lens"  # the host argument graph.update refreshes (SGLang's MHA key)
# _npu_paged_attention limits (ATB PagedAttentionOperation; see the module docstring).
BLOCK_SIZE_MULTIPLE = 16
MAX_HEAD_SIZE = 256
MAX_BLOCK_TIMES_HEAD = 128 * 128
# vllm-ascend captures at this length because _npu_paged_attention_get_workspace returns its largest
# workspace there (vllm_ascend/worker/model_runner_v1.py); it is one more candidate below the longest context.
SEQ_LEN_WITH_MAX_PA_WORKSPACE = 6144


class NpuAttentionLimitError(EngineError, ValueError):
    """The model or page size is outside what torch_npu._npu_paged_attention accepts."""


def check_paged_attention_limits(num_heads: int, num_kv_heads: int, head_size: int, block_size: int) -> None:
    """Raise NpuAttentionLimitError naming the first _npu_paged_attention limit the shapes break.

    The CANN 9.0 reference lifts the block_size * head_size cap for plain (unquantized, non-parallel)
    decode, but CANN 8.0 (ascendtb_01_0070, "embedding * blockSize <= 128 * 128") applies it to every
    call; the engine cannot tell the toolkit's version, so it keeps the stricter rule.
    """
    if num_kv_heads < 1 or num_heads < 1 or num_heads % num_kv_heads:
        raise NpuAttentionLimitError(
            f"_npu_paged_attention needs heads divisible by KV heads; this model has {num_heads} heads and "
            f"{num_kv_heads} KV heads"
        )
    if not 0 < head_size <= MAX_HEAD_SIZE:
        raise NpuAttentionLimitError(
            f"_npu_paged_attention takes head sizes in (0, {MAX_HEAD_SIZE}]; this model's is {head_size}"
        )
    if block_size < 1 or block_size % BLOCK_SIZE_MULTIPLE:
        raise NpuAttentionLimitError(
            f"_npu_paged_attention needs block_size % {BLOCK_SIZE_MULTIPLE} == 0 (128 recommended); page_size is "
            f"{block_size}: set --page-size to a multiple of {BLOCK_SIZE_MULTIPLE}"
        )
    if block_size * head_size > MAX_BLOCK_TIMES_HEAD:
        fits = MAX_BLOCK_TIMES_HEAD // head_size // BLOCK_SIZE_MULTIPLE * BLOCK_SIZE_MULTIPLE
        raise NpuAttentionLimitError(
            f"_npu_paged_attention (CANN 8.0) needs block_size * head_size <= 128 * 128; page_size {block_size} x "
            f"head size {head_size} = {block_size * head_size}: set --page-size {fits} or less"
        )


def capture_workspace(
    get_workspace: Callable[..., torch.Tensor],
    args: dict[str, Any],
    longest: int,
    cache: dict[tuple[Any, ...], torch.Tensor],
) -> torch.Tensor:
    """The workspace one captured _npu_paged_attention launch gets: the largest the op asks for at any
    candidate length up to `longest` (the longest context a replay serves), for every row.

    One per call shape (batch, cache, dtype, heads), shared by the layers of a graph: they run one after
    another on one stream. The cache holds the tensors, so they live as long as the graphs that use them.
    """
    query, key_cache = args["query"], args["key_cache"]
    key = (tuple(query.shape), tuple(key_cache.shape), query.dtype, args["num_heads"], args["num_kv_heads"])
    if key not in cache:
        best: torch.Tensor | None = None
        for length in sorted({longest, min(longest, SEQ_LEN_WITH_MAX_PA_WORKSPACE)}):
            lens = torch.full_like(args["context_lens"], length)  # a host int32 tensor, like the real lengths
            workspace = get_workspace(**{**args, "context_lens": lens})
            if best is None or workspace.numel() * workspace.element_size() > best.numel() * best.element_size():
                best = workspace
        assert best is not None
        cache[key] = best
    return cache[key]


@dataclass
class NpuDecodeMetadata:
    """AttentionMetadata.platform_metadata on NPU decode steps run by the graph runner."""

    context_lens: torch.Tensor  # [bs] int32 on the host, padded rows 0; refreshed per replay via graph.update
    # Set (to the longest context served) only for the launch being captured: it gets an explicit workspace.
    workspace_context_len: int = 0
    workspaces: dict[tuple[Any, ...], torch.Tensor] | None = None  # capture_workspace's cache, one per runner


def paged_attention_args(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    context_lens: torch.Tensor,
    page_size: int,
    scale: float,
) -> dict[str, Any]:
    """The keyword arguments of torch_npu._npu_paged_attention for one layer (checked, nothing copied but q)."""
    args: dict[str, Any] = dict(
        query=q.contiguous(),
        key_cache=paged_view(k_cache, page_size),
        value_cache=paged_view(v_cache, page_size),
        num_kv_heads=int(k_cache.shape[1]),
        num_heads=int(q.shape[1]),
        scale_value=float(scale),
        block_table=page_table if page_table.dtype == torch.int32 else page_table.to(torch.int32),
        context_lens=context_lens,
    )
    args["out"] = torch.empty_like(args["query"])
    check_paged_attention_args(**args)
    return args


def check_paged_attention_args(
    *,
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    num_kv_heads: int,
    num_heads: int,
    scale_value: float,
    block_table: torch.Tensor,
    context_lens: torch.Tensor,
    out: torch.Tensor,
) -> None:
    """Raise ValueError unless the arguments have the layout vllm-ascend and SGLang pass to the op."""
    tokens, heads, head_dim = query.shape
    if key_cache.dim() != 4 or key_cache.shape != value_cache.shape:
        raise ValueError(f"caches must be [num_blocks, block_size, kv_heads, head_dim], got {tuple(key_cache.shape)}")
    if key_cache.shape[2:] != (num_kv_heads, head_dim) or heads != num_heads or num_heads % num_kv_heads:
        raise ValueError(f"heads {num_heads}/{num_kv_heads} do not match query {tuple(query.shape)} / cache")
    if not (query.is_contiguous() and key_cache.is_contiguous() and value_cache.is_contiguous()):
        raise ValueError("query and caches must be contiguous")
    if key_cache.dtype != query.dtype or value_cache.dtype != query.dtype:
        raise ValueError(f"cache dtype {key_cache.dtype} differs from query dtype {query.dtype}")
    if block_table.dim() != 2 or block_table.shape[0] != tokens or block_table.dtype != torch.int32:
        got = f"{tuple(block_table.shape)} {block_table.dtype}"
        raise ValueError(f"block_table must be [{tokens}, max_blocks] int32, got {got}")
    if context_lens.shape != (tokens,) or context_lens.dtype != torch.int32 or context_lens.device.type != "cpu":
        raise ValueError(
            f"context_lens must be a [{tokens}] int32 CPU tensor, got {tuple(context_lens.shape)} "
            f"{context_lens.dtype} on {context_lens.device}"
        )
    if out.shape != query.shape or out.dtype != query.dtype:
        raise ValueError(f"out must be {tuple(query.shape)} {query.dtype}")


def paged_attention_reference(
    *,
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    num_kv_heads: int,
    num_heads: int,
    scale_value: float,
    block_table: torch.Tensor,
    context_lens: torch.Tensor,
    out: torch.Tensor,
) -> torch.Tensor:
    """Plain-torch _npu_paged_attention with the same arguments; rows with context_len 0 give zeros."""
    check_paged_attention_args(
        query=query,
        key_cache=key_cache,
        value_cache=value_cache,
        num_kv_heads=num_kv_heads,
        num_heads=num_heads,
        scale_value=scale_value,
        block_table=block_table,
        context_lens=context_lens,
        out=out,
    )
    block_size = key_cache.shape[1]
    lengths = context_lens.to(device=query.device, dtype=torch.int64)
    longest = int(context_lens.max()) if context_lens.numel() else 0  # a host tensor: no device sync
    pages = block_table[:, : max(1, -(-longest // block_size))]
    flat_k = key_cache.view(-1, num_kv_heads, key_cache.shape[-1])
    flat_v = value_cache.view(-1, num_kv_heads, value_cache.shape[-1])
    keys = gather_context(flat_k, pages, block_size).transpose(1, 2)  # [B, KVH, L, D]
    values = gather_context(flat_v, pages, block_size).transpose(1, 2)
    group = num_heads // num_kv_heads
    keys, values = keys.repeat_interleave(group, dim=1), values.repeat_interleave(group, dim=1)
    scores = (query.unsqueeze(2) * scale_value) @ keys.transpose(-1, -2)  # [B, H, 1, L]
    valid = torch.arange(keys.shape[2], device=query.device) < lengths.unsqueeze(1)  # [B, L]
    scores = scores.float().masked_fill(~valid[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # an all-masked (padded) row -> zeros
    out.copy_((probs.to(values.dtype) @ values).squeeze(2))
    return out


# ---- capture/replay hooks (NpuDecodeGraphRunner calls them; the NPUGraph mechanism stays there) ----

PAD_SLOT = 0
PAD_PAGE = 0
PAD_SEQ_LEN = 0  # SGLang's NPU runner: padded rows have no context at all
CAPTURE_SEQ_LEN = 1  # during capture every row attends one dummy token, so warm-up math is finite
# graph.update keys whose kernels take a host *tensor* (torch_npu._npu_paged_attention's context_lens,
# as SGLang passes it); other keys (fused attention's actual_seq_lengths_kv) take a list of ints.
HOST_TENSOR_UPDATE_KEYS = frozenset({"context_lens"})


def fill_static_inputs(
    buffers: StaticDecodeBuffers,  # allocated with host_lengths=True
    bs: int,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    slot_indices: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
) -> int:
    """Copy n real rows into the buffers in place and pad rows n..bs-1; returns n.

    Padded rows: id 0, position 0, slot 0, page table all page 0, seq_len 0.
    Columns past the input's width are zeroed, so no stale page id survives from
    an earlier, longer batch.
    """
    n = int(seq_lens.numel())
    width = buffers.page_table.shape[1]
    if n > bs:
        raise ValueError(f"batch of {n} does not fit graph size {bs}")
    if page_table.dim() != 2 or page_table.shape[0] < n:
        raise ValueError(f"page_table must be [>= {n}, pages], got {tuple(page_table.shape)}")
    cols = page_table.shape[1]
    if cols > width and n and bool((page_table[:n, width:] != PAD_PAGE).any()):
        raise ValueError(f"page_table uses more than the {width} pages per sequence the graphs were captured for")
    cols = min(cols, width)
    assert buffers.seq_lens_host is not None, "NPU buffers keep a host copy of the lengths (host_lengths=True)"
    buffers.input_ids[:n].copy_(input_ids.reshape(-1)[:n], non_blocking=True)
    buffers.positions[:n].copy_(positions.reshape(-1)[:n], non_blocking=True)
    buffers.slot_indices[:n].copy_(slot_indices.reshape(-1)[:n], non_blocking=True)
    buffers.seq_lens[:n].copy_(seq_lens.reshape(-1)[:n], non_blocking=True)
    buffers.seq_lens_host[:n].copy_(seq_lens.reshape(-1)[:n])  # blocking: graph.update reads it right away
    buffers.page_table[:n, :cols].copy_(page_table[:n, :cols], non_blocking=True)
    buffers.page_table[:n, cols:].fill_(PAD_PAGE)
    buffers.input_ids[n:bs].zero_()
    buffers.positions[n:bs].zero_()
    buffers.slot_indices[n:bs].fill_(PAD_SLOT)
    buffers.page_table[n:bs].fill_(PAD_PAGE)
    buffers.seq_lens[n:bs].fill_(PAD_SEQ_LEN)
    buffers.seq_lens_host[n:bs].fill_(PAD_SEQ_LEN)
    return n


class NpuGraphHooks(CaptureHooks):
    """The NPU's capture/replay hooks (graphs/capture_hooks.py names, over the step callable's raw inputs):
    static buffers with a host copy of the lengths, capture-time lengths, the update-record check after
    each capture, and graph.update of the host lengths before each replay.

    seq_lens_update_key: the op argument graph.update refreshes ("context_lens" for _npu_paged_attention,
    "actual_seq_lengths_kv" for npu_fused_infer_attention_score; None: no update).
    update_records: the graph API's record reader (NpuGraphApi.update_records); records_per_graph: how
    many each graph must hold (one per attention layer; None: at least one).
    pass_host_seq_lens / max_context_len: hand the step the host lengths, and the captured launch the
    longest context its workspace must serve.
    """

    def __init__(
        self,
        seq_lens_update_key: str | None = None,
        update_records: Callable[[Any], list[str] | None] | None = None,
        records_per_graph: int | None = None,
        pass_host_seq_lens: bool = False,
        max_context_len: int | None = None,
    ) -> None:
        self.seq_lens_update_key = seq_lens_update_key
        self.update_records = update_records
        self.records_per_graph = records_per_graph
        self.pass_host_seq_lens = pass_host_seq_lens
        self.max_context_len = max_context_len

    def init_capture_state(
        self,
        max_bs: int,
        max_pages: int,
        page_size: int | None,
        device: torch.device | str,
        slot_dtype: torch.dtype = torch.int32,
    ) -> StaticDecodeBuffers:
        """The shared static buffers (graphs/static_buffers.py) with a host copy of the lengths."""
        return StaticDecodeBuffers.allocate(max_bs, max_pages, page_size or 0, device, slot_dtype, host_lengths=True)

    def capture_metadata(self, state: StaticDecodeBuffers, bs: int) -> AttentionMetadata:
        return state.metadata(bs)

    def prepare_for_capture(self, state: StaticDecodeBuffers, bs: int) -> None:
        assert state.seq_lens_host is not None
        state.seq_lens[:bs].fill_(CAPTURE_SEQ_LEN)
        state.seq_lens_host[:bs].fill_(CAPTURE_SEQ_LEN)

    def capture_inputs(
        self, state: StaticDecodeBuffers, bs: int, captured: bool = False
    ) -> tuple[tuple[torch.Tensor, ...], dict[str, Any]]:
        """The step's (args, kwargs) for size bs: views of `state`; `captured`: the launch being captured,
        which gets the workspace length."""
        kwargs: dict[str, Any] = {"seq_lens_host": state.seq_lens_host[:bs]} if self.pass_host_seq_lens else {}
        if captured and self.pass_host_seq_lens and self.max_context_len:
            kwargs["workspace_context_len"] = self.max_context_len  # the captured launch only
        return state.views(bs), kwargs

    def after_capture(self, state: StaticDecodeBuffers, bs: int, graph: Any) -> None:
        """Refuse a graph whose graph.update would not reach every attention layer; reset the lengths."""
        if self.seq_lens_update_key is not None:
            from backends.npu import graph_runner
            from backends.npu.platform import torch_npu_version

            recorded = self.update_records(graph) if self.update_records is not None else None
            graph_runner.check_update_records(
                recorded, self.seq_lens_update_key, self.records_per_graph, bs, torch_npu_version()
            )
        assert state.seq_lens_host is not None
        state.seq_lens[:bs].fill_(PAD_SEQ_LEN)
        state.seq_lens_host[:bs].fill_(PAD_SEQ_LEN)

    def prepare_for_replay(
        self, state: StaticDecodeBuffers, message: DecodeMessage, batch_state: DecodeBatchState, padded_bs: int
    ) -> torch.Tensor:
        """The engine's decode step (graphs/capture_hooks.py's contract): the rows filled from the step
        message's host tensors and the host copy of the rows' pages (the captured kernel takes host
        lengths, so nothing is copied back from the device), padded to padded_bs; returns the decode rows
        on the device."""
        ids, positions, slots, page_table, seq_lens = message.host_batch()
        self.fill_inputs(state, padded_bs, ids, positions, slots, page_table, seq_lens)
        return to_device(message.inputs[3], torch.int64, batch_state.device)

    def fill_inputs(
        self,
        state: StaticDecodeBuffers,
        bs: int,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        slot_indices: torch.Tensor,
        page_table: torch.Tensor,
        seq_lens: torch.Tensor,
    ) -> int:
        """Fill n real rows given as tensors (host or device) and pad to bs (fill_static_inputs); returns n."""
        return fill_static_inputs(state, bs, input_ids, positions, slot_indices, page_table, seq_lens)

    def host_lengths(self, state: StaticDecodeBuffers, bs: int) -> torch.Tensor | list[int]:
        """This replay's lengths (padded rows 0) in the form the captured kernel's host argument takes.

        A captured kernel keeps the host arguments it was launched with; writing the
        host buffer alone does not reach it, graph.update(cpu_update_input=...) does.
        """
        assert state.seq_lens_host is not None
        lengths = state.seq_lens_host[:bs]
        if self.seq_lens_update_key in HOST_TENSOR_UPDATE_KEYS:
            return lengths.clone()  # a fresh tensor: the update may outlive this call's buffer contents
        return lengths.tolist()

    def before_replay(self, state: StaticDecodeBuffers, bs: int, graph: Any) -> None:
        if self.seq_lens_update_key is not None:
            graph.update(cpu_update_input=[{self.seq_lens_update_key: self.host_lengths(state, bs)}])


def _npu_store_kv() -> StoreFn:
    from backends.npu.platform import NpuPlatform

    return NpuPlatform().store_kv


class NpuAttentionBackend(AttentionBackend):
    """KV writes through NpuPlatform.store_kv; decode through _npu_paged_attention; extend in torch ops."""

    name = "npu_paged"
    # _npu_paged_attention takes no window or soft-cap and reads float caches: the engine keeps the context
    # within a model's window and refuses soft-capped models here.
    capabilities = AttentionCapabilities()
    seq_lens_update_key = SEQ_LENS_UPDATE_KEY
    # Its capture/replay hooks (host lengths, graph.update, the update-record check): NpuDecodeGraphRunner's.
    graph_hooks = NpuGraphHooks

    def __init__(self, store_kv: StoreFn | None = None) -> None:
        # npu_scatter_nd_update_ with int32 [tokens, 1] slot indices on NPU, its reference elsewhere.
        self.store_kv = store_kv if store_kv is not None else _npu_store_kv()
        self._checked: set[tuple[int, int, int, int]] = set()  # shapes already checked against the op's limits
        self._warned: set[str] = set()

    @contextmanager
    def step_context(self, meta: AttentionMetadata) -> Iterator[None]:
        """Around one eager forward pass: copy the lengths to the host once per decode step, not per layer."""
        if not meta.is_decode or meta.platform_metadata is not None:
            yield
            return
        meta.platform_metadata = NpuDecodeMetadata(context_lens=meta.seq_lens.to(device="cpu", dtype=torch.int32))
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
            # extend_attention reads the page table and host lengths only; no int64 slots needed.
            return extend_attention(q, k_cache, v_cache, meta, scale)
        extra = meta.platform_metadata
        if isinstance(extra, NpuDecodeMetadata):
            context_lens = extra.context_lens
        else:  # an eager step (no graph runner): one device-to-host copy is fine here
            context_lens = meta.seq_lens.to(device="cpu", dtype=torch.int32)
        args = paged_attention_args(q, k_cache, v_cache, meta.page_table, context_lens, meta.page_size, scale)
        if q.device.type == "npu":
            import torch_npu

            shape = (args["num_heads"], args["num_kv_heads"], int(q.shape[-1]), meta.page_size)
            if shape not in self._checked:  # once per shape, not per layer and step
                check_paged_attention_limits(*shape)
                self._checked.add(shape)
            get_workspace = getattr(torch_npu, "_npu_paged_attention_get_workspace", None)
            if isinstance(extra, NpuDecodeMetadata) and extra.workspace_context_len and get_workspace is not None:
                cache = extra.workspaces if extra.workspaces is not None else {}
                workspace = capture_workspace(get_workspace, args, extra.workspace_context_len, cache)
                torch_npu._npu_paged_attention(**args, workspace=workspace)
            else:
                if isinstance(extra, NpuDecodeMetadata) and extra.workspace_context_len and "ws" not in self._warned:
                    self._warned.add("ws")  # a capture without an explicit workspace: sized for the capture lengths
                    logger.warning(
                        "torch_npu has no _npu_paged_attention_get_workspace: the captured attention "
                        "launch sizes its own workspace for the capture-time lengths"
                    )
                torch_npu._npu_paged_attention(**args)
            return args["out"]
        return paged_attention_reference(**args)
