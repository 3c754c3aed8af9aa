"""NPU decode-graph runner (aclgraph via torch.npu.NPUGraph). UNTESTED ON ASCEND HARDWARE.

Same contract as the HPU runner: it takes a callable
``step(input_ids, positions, slot_indices, page_table, seq_lens) -> logits``
that reads those tensors in place. Sizes are captured largest first into one
shared pool after `warmup_runs` eager runs each; a batch of n replays the
smallest captured size >= n with padded rows writing slot 0 (page 0, the dummy
page) and seq_len 0, as SGLang's NPUGraphRunner pads; outputs are sliced back.

The logits returned by run() are a view of the graph's static output: consume
them (sample) before the next run().

aclgraph allows about 1800 graphs per process (2048 streams, 248 kept back), and
each captured size costs streams per layer and per communication group, so the
capture sizes are sampled down the way vllm-ascend's update_aclgraph_sizes does.

Host-side lengths reach a replay only through graph.update(cpu_update_input=...), and
torch_npu applies an update once per op it *recorded* during auto-dispatch capture.
Releases that do not record _npu_paged_attention record nothing here, so the update is a
silent no-op and replays attend over the capture-time lengths: after every capture the
runner checks that there is one record per attention layer (check_update_records) and
refuses, naming the torch_npu version, otherwise; a torch_npu without auto_dispatch_capture
is refused at capture too, not at the first update. TASK_QUEUE_ENABLE=2 is refused before
capture (check_task_queue_for_capture, called by NpuEngineRunner).
Pure helpers below carry the device-independent logic and are tested on CPU.
"""

from __future__ import annotations

import functools
import gc
import logging
import math
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from backends.npu.attention import (  # noqa: F401  (the capture/replay metadata lives with the attention backend)
    CAPTURE_SEQ_LEN,
    HOST_TENSOR_UPDATE_KEYS,
    PAD_PAGE,
    PAD_SEQ_LEN,
    PAD_SLOT,
    NpuGraphHooks,
    fill_static_inputs,
)
from backends.npu.platform import MAX_ACLGRAPH_GRAPHS, torch_npu_version
from engine.capture_sizes import cap_sizes, default_capture_sizes, smallest_bucket_at_least
from engine.errors import EngineError
from graphs.capture_loop import CaptureReport, capture_loop
from graphs.static_buffers import StaticDecodeBuffers  # noqa: F401  (the buffers every platform's graphs read)

logger = logging.getLogger(__name__)

StepFn = Callable[..., torch.Tensor]
# The op whose launch each graph.update key refreshes. torch_npu's auto-dispatch capture keeps one
# record per launch of an op it knows (Ascend/pytorch torch_npu/npu/graphs.py, _GraphDispatchMode;
# on master the ops are registered in torch_npu/npu/_npugraph_handlers/: simple_handler.py maps
# "_npu_paged_attention.default" to its context_lens argument, ifa_handler.py the fused attention).
UPDATE_KEY_OPS = {"context_lens": "_npu_paged_attention", "actual_seq_lengths_kv": "npu_fused_infer_attention_score"}
# torch_npu releases whose auto-dispatch capture records _npu_paged_attention, per the issue-16 audit of
# Ascend/pytorch's release branches (older ones record only npu_fused_infer_attention_score).
PAGED_ATTENTION_RECORDING_RELEASES = "v2.6.0-7.2.0, v2.7.1/v2.8.0/v2.9.0-7.3.0 and the 26.x branches"


class NpuGraphUpdateError(EngineError):
    """A captured graph could not have its host arguments refreshed: replays would run on stale lengths."""


# ---- pure, device-independent helpers -------------------------------------------------------


def npu_graph_budget(
    num_layers: int, num_comm_groups: int = 0, hccl_aiv: bool = False, max_graphs: int = MAX_ACLGRAPH_GRAPHS
) -> int:
    """How many capture sizes fit under the aclgraph limit (vllm-ascend's empirical formula).

    Each size is budgeted num_layers + 1 streams. With HCCL_OP_EXPANSION_MODE=AIV a
    communication group costs one more stream per graph; otherwise (FFTS+/AICPU
    expansion) ~40 streams per group are set aside and each group triples the cost.
    Conservative for a single full-decode graph per size; kept so that the same
    model never fails capture on Ascend for lack of streams.
    """
    per_graph = num_layers + 1
    if hccl_aiv:
        budget = max_graphs / per_graph / (1 + num_comm_groups)
    else:
        budget = (max_graphs - 40 * num_comm_groups) / per_graph / (1 + 2 * num_comm_groups)
    return max(1, math.floor(budget))


def sample_sizes(sizes: Sequence[int], limit: int) -> list[int]:
    """At most `limit` sizes, evenly spread over the sorted list, keeping the smallest and largest."""
    ordered = sorted(set(sizes))
    if limit >= len(ordered):
        return ordered
    if limit <= 1:
        return [ordered[-1]]  # the largest still serves every batch
    step = (len(ordered) - 1) / (limit - 1)
    return sorted({ordered[round(i * step)] for i in range(limit)})


def capture_order(sizes: Sequence[int]) -> list[int]:
    """Largest first: later (smaller) graphs reuse the shared pool's blocks."""
    return sorted(set(sizes), reverse=True)


def check_update_records(
    recorded_ops: Sequence[str] | None, update_key: str, expected: int | None, bs: int, version: str
) -> None:
    """Refuse a captured graph whose graph.update would not reach every attention layer's op.

    torch_npu's update_capture_record copies a one-entry cpu_update_input once per record: with
    no record the update is a silent no-op, and every replay keeps the capture-time lengths
    (CAPTURE_SEQ_LEN: each row attends to one token). That is wrong output, not an error, so it
    is caught here, at capture, where the version can still be named. `recorded_ops` are the
    records' op names (None: the graph object exposes no records at all); `expected` is the
    number of attention layers in the step (None: at least one).
    """
    op = UPDATE_KEY_OPS.get(update_key)
    names = list(recorded_ops or [])
    matching = [name for name in names if op is None or name.split(".")[0] == op]
    if recorded_ops is not None and (len(matching) == expected if expected is not None else matching):
        return
    what = (
        "exposes no dispatch records"
        if recorded_ops is None
        else f"recorded {len(matching)} {op or 'updatable'} launches"
    )
    want = f"{expected} (one per attention layer)" if expected is not None else "at least one"
    extra = f"; other records: {sorted(set(names) - set(matching))}" if len(names) != len(matching) else ""
    raise NpuGraphUpdateError(
        f"torch_npu {version}: the decode graph of batch {bs} {what}, {want} expected{extra}. "
        f"graph.update(cpu_update_input=[{{{update_key!r}: ...}}]) would change nothing and every replay "
        f"would attend over the capture-time lengths. Use a torch_npu whose auto-dispatch capture records "
        f"{op or 'the op'} ({PAGED_ATTENTION_RECORDING_RELEASES}), or run with --disable-graphs."
    )


def task_queue_level(env: Mapping[str, str] | None = None, runtime_level: int | None = None) -> int:
    """torch_npu's task-queue level: what the runtime reports (torch.npu.get_task_queue_enable() where
    the release has it), else TASK_QUEUE_ENABLE (default 1, as the Ascend environment-variable
    reference documents; ASCEND_LAUNCH_BLOCKING=1 forces it off)."""
    if runtime_level is not None:
        return int(runtime_level)
    env = os.environ if env is None else env
    if env.get("ASCEND_LAUNCH_BLOCKING", "").strip() == "1":
        return 0
    raw = env.get("TASK_QUEUE_ENABLE", "").strip()
    return int(raw) if raw.lstrip("-").isdigit() else 1


def check_task_queue_for_capture(level: int) -> None:
    """TASK_QUEUE_ENABLE=2 (level-2 task queue) and NPU graph capture do not mix: torch_npu's own test
    (test/test_task_queue_enable.py, test_npu_graph_capture_rejected_at_mode2) expects
    NPUGraph.capture_begin to raise at that level. Refuse before loading anything onto the graphs."""
    if level == 2:
        raise NpuGraphUpdateError(
            "TASK_QUEUE_ENABLE=2 (torch_npu's level-2 task queue) breaks NPU graph capture; "
            "start with TASK_QUEUE_ENABLE=1 (the default) or run with --disable-graphs"
        )


# ---- the torch.npu graph API, behind four methods so tests can substitute an eager stand-in ----


class NpuGraphApi:
    """torch.npu.NPUGraph capture with a shared pool on a side stream.

    auto_dispatch: capture under torch_npu's dispatch mode (auto_dispatch_capture=True), which records
    the ops whose host arguments graph.update(cpu_update_input=...) can refresh.
    """

    def __init__(self, auto_dispatch: bool = True) -> None:
        import torch_npu  # noqa: F401  (registers torch.npu)

        self.auto_dispatch = auto_dispatch

    def pool(self) -> Any:
        return torch.npu.graph_pool_handle()

    def stream(self) -> Any:
        return torch.npu.Stream()

    def run_on(self, stream: Any) -> Any:
        return torch.npu.stream(stream)

    def capture(self, fn: Callable[[], torch.Tensor], pool: Any, stream: Any) -> tuple[Any, torch.Tensor]:
        graph = torch.npu.NPUGraph()
        if not self.auto_dispatch:
            context = torch.npu.graph(graph, pool=pool, stream=stream)
        else:
            try:
                # auto_dispatch_capture lets graph.update(cpu_update_input=...) refresh host-side op args.
                context = torch.npu.graph(graph, pool=pool, stream=stream, auto_dispatch_capture=True)
            except TypeError as exc:
                # A release without the keyword has no graph.update either: capturing anyway would fail at
                # the first update (or, worse, replay stale lengths). Say so now, with the version.
                raise NpuGraphUpdateError(
                    f"torch_npu {torch_npu_version()}: torch.npu.graph has no auto_dispatch_capture ({exc}), so the "
                    "attention op's host-side lengths cannot be refreshed between replays. Use a torch_npu whose "
                    f"auto-dispatch capture records _npu_paged_attention ({PAGED_ATTENTION_RECORDING_RELEASES}), "
                    "or run with --disable-graphs."
                ) from exc
        with context:
            out = fn()
        return graph, out

    def update_records(self, graph: Any) -> list[str] | None:
        """Names of the ops torch_npu recorded for graph.update (e.g. "_npu_paged_attention.default"), or
        None when the graph keeps no records (torch_npu/npu/graphs.py: NPUGraph.graph_dispatch_mode
        .graph_dispatch_records, each with the op it replays as op_cache_entry)."""
        records = getattr(getattr(graph, "graph_dispatch_mode", None), "graph_dispatch_records", None)
        if records is None:
            return None
        return [str(getattr(getattr(r, "op_cache_entry", None), "__name__", "?")) for r in records]

    def synchronize(self) -> None:
        torch.npu.synchronize()


class NpuDecodeGraphRunner:
    """Capture decode graphs for `capture_sizes`, then replay the smallest that fits each batch."""

    def __init__(
        self,
        step: StepFn,
        *,
        capture_sizes: Sequence[int],
        max_pages_per_seq: int,
        device: torch.device | str = "npu",
        page_size: int | None = None,
        num_layers: int | None = None,
        num_comm_groups: int = 0,
        hccl_aiv: bool = False,
        max_graphs: int = MAX_ACLGRAPH_GRAPHS,
        warmup_runs: int = 2,
        seq_lens_update_key: str | None = None,
        pass_host_seq_lens: bool = False,
        update_records_per_graph: int | None = None,
        graph_api: Any | None = None,
        hooks: NpuGraphHooks | None = None,
        hooks_class: type[NpuGraphHooks] = NpuGraphHooks,
    ) -> None:
        """update_records_per_graph: how many graph.update records each captured graph must hold for
        seq_lens_update_key (one per attention layer; None: at least one); checked after every capture.
        hooks: the attention backend's capture/replay hooks (default: hooks_class, the backend's
        `graph_hooks`, over the arguments above, backends/npu/attention.py); this runner keeps only the
        NPUGraph mechanism."""
        if not capture_sizes:
            raise ValueError("no capture sizes")
        sizes = sorted({int(s) for s in capture_sizes})
        limit = npu_graph_budget(num_layers, num_comm_groups, hccl_aiv, max_graphs) if num_layers else max_graphs
        if len(sizes) > limit:
            kept = sample_sizes(sizes, limit)
            logger.warning(
                "aclgraph limit: %d capture sizes reduced to %d for %s layers (%d comm groups): %s",
                len(sizes),
                len(kept),
                num_layers,
                num_comm_groups,
                kept,
            )
            sizes = kept
        self.step = step
        self.sizes = sizes
        self.report: CaptureReport | None = None  # of capture()
        self.device = torch.device(device)
        self.warmup_runs = warmup_runs
        # The op argument refreshed per replay: "context_lens" (_npu_paged_attention, as
        # NpuAttentionBackend uses) or "actual_seq_lengths_kv" (npu_fused_infer_attention_score).
        self.seq_lens_update_key = seq_lens_update_key
        # Also call step(..., seq_lens_host=<[bs] int32 CPU view>) so the kernel gets host lengths
        # at capture without copying them off the device inside the graph.
        self.pass_host_seq_lens = pass_host_seq_lens
        self.update_records_per_graph = update_records_per_graph
        self.api = graph_api if graph_api is not None else NpuGraphApi(auto_dispatch=seq_lens_update_key is not None)
        # The longest context any replay serves: the attention op's workspace is sized for it at capture
        # (StepFn gets it as workspace_context_len during the captured run only; see backends/npu/attention.py).
        self.max_context_len = max_pages_per_seq * int(page_size) if page_size else None
        self.hooks = (
            hooks
            if hooks is not None
            else hooks_class(
                seq_lens_update_key,
                lambda graph: self.api.update_records(graph),
                update_records_per_graph,
                pass_host_seq_lens,
                self.max_context_len,
            )
        )  # the records are read through the API at check time, as before
        self.buffers = self.hooks.init_capture_state(sizes[-1], max_pages_per_seq, page_size, self.device)
        self.graphs: dict[int, Any] = {}
        self.outputs: dict[int, torch.Tensor] = {}

    @classmethod
    def from_config(
        cls, step: StepFn, config: Mapping[str, Any], num_layers: int | None = None, **kwargs: Any
    ) -> NpuDecodeGraphRunner:
        """Sizes and knobs from configs/npu.yaml; HCCL_OP_EXPANSION_MODE=AIV also sets hccl_aiv."""
        npu = dict(config.get("npu") or {})
        max_size = int(config.get("max_capture_size", config.get("max_num_seqs", 128)))
        sizes = cap_sizes(config.get("capture_sizes") or default_capture_sizes(max_size), max_size)
        aiv = os.environ.get("HCCL_OP_EXPANSION_MODE", "").upper() == "AIV" or bool(npu.get("hccl_aiv", False))
        kwargs.setdefault("hccl_aiv", aiv)
        kwargs.setdefault("max_graphs", int(npu.get("max_graphs", MAX_ACLGRAPH_GRAPHS)))
        kwargs.setdefault("warmup_runs", int(npu.get("warmup_runs", 2)))
        kwargs.setdefault("seq_lens_update_key", npu.get("seq_lens_update_key"))
        page_size = int(config.get("page_size", 128))
        max_pages = math.ceil(int(config.get("max_model_len", 4096)) / page_size)
        kwargs.setdefault("page_size", page_size)
        return cls(step, capture_sizes=sizes, max_pages_per_seq=max_pages, num_layers=num_layers, **kwargs)

    @property
    def max_size(self) -> int:
        return self.sizes[-1]

    def fits(self, batch_size: int) -> bool:
        return 1 <= batch_size <= self.max_size

    def capture(self) -> float:
        """Capture every size, largest first (capture_order), into one pool; returns seconds."""
        self.report = CaptureReport("NPU decode graphs (aclgraph)")
        pool, stream = self.api.pool(), self.api.stream()
        # Freezing the GC keeps collection pauses out of capture (SGLang PR #8577: 2-4x faster).
        gc.collect()
        gc.freeze()
        try:
            for bs in capture_loop(self.report, capture_order(self.sizes)):
                self.hooks.prepare_for_capture(self.buffers, bs)
                self.api.synchronize()  # the side stream must see the filled buffers
                args, kwargs = self.hooks.capture_inputs(self.buffers, bs)
                with self.api.run_on(stream):
                    for _ in range(self.warmup_runs):
                        self.step(*args, **kwargs)
                self.api.synchronize()
                args, kwargs = self.hooks.capture_inputs(self.buffers, bs, captured=True)
                run_once = functools.partial(self.step, *args, **kwargs)  # bound now, not looked up at replay
                self.graphs[bs], self.outputs[bs] = self.api.capture(run_once, pool, stream)
                # The update-record check (check_update_records) and the lengths back to padding.
                self.hooks.after_capture(self.buffers, bs, self.graphs[bs])
                self.api.synchronize()
        finally:
            gc.unfreeze()
        return self.report.seconds

    def host_lengths(self, bs: int) -> torch.Tensor | list[int]:
        """This replay's lengths in the form the captured kernel's host argument takes (NpuGraphHooks)."""
        return self.hooks.host_lengths(self.buffers, bs)

    def _graph_size(self, n: int) -> int:
        bs = smallest_bucket_at_least(self.sizes, n)
        if bs is None or n < 1:
            raise ValueError(f"batch of {n} is outside the captured sizes 1..{self.max_size}; run it eagerly")
        if bs not in self.graphs:
            raise RuntimeError("capture() has not run")
        return bs

    def _replay(self, bs: int, n: int) -> torch.Tensor:
        graph = self.graphs[bs]
        self.hooks.before_replay(self.buffers, bs, graph)  # graph.update of the host lengths
        graph.replay()
        return self.outputs[bs][:n]

    def run_decode(self, message: Any, batch_state: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """The engine's decode contract (graphs/step_runner.py DecodeStepRunner): the hooks fill the static buffers
        from the step message and the persistent decode state; returns (logits [n, vocab], decode rows)."""
        n = message.batch_size
        bs = self._graph_size(n)
        rows = self.hooks.prepare_for_replay(self.buffers, message, batch_state, bs)
        return self._replay(bs, n), rows

    def run(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        slot_indices: torch.Tensor,
        page_table: torch.Tensor,
        seq_lens: torch.Tensor,
    ) -> torch.Tensor:
        """One decode step for n requests given as tensors -> logits [n, vocab] (a view of the static output)."""
        n = int(seq_lens.numel())
        bs = self._graph_size(n)
        self.hooks.fill_inputs(self.buffers, bs, input_ids, positions, slot_indices, page_table, seq_lens)
        return self._replay(bs, n)
