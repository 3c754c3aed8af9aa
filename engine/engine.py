"""The Python API: Engine.generate / Engine.stream / add_request + step."""

from __future__ import annotations

import itertools
import logging
import os
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypedDict, Unpack

import torch

from backends import get_platform
from engine.capture_sizes import parse_sizes
from engine.config import EngineConfig
from engine.detokenizer import IncrementalDetokenizer
from engine.distributed.collectives import min_over_ranks
from engine.distributed.sharding import kv_head_shard
from engine.distributed.state import SINGLE, TensorParallelState, building_for, tp_state
from engine.errors import (
    EngineError,
    EngineStoppedError,
    InvalidRequestError,
    RequestFailedError,
    UnsupportedArchitectureError,
)
from engine.gc_freeze import freeze_start_up_objects, unfreeze_gc
from engine.kv_cache import KVPool
from engine.kv_event_publisher import make_publisher
from engine.kv_events import KVEventRecorder, KVEventsConfig
from engine.kv_host_tier import HostKVPool, HostTierStats
from engine.kv_manager import KVCacheManager, PrefixCacheStats
from engine.layers.attention import Attention, AttentionBackend
from engine.loader import ModelSource, load_model, resolve_model_source
from engine.logit_rows import LogitRowLadder
from engine.lora.manager import LoRAManager, SlotChange
from engine.lora.matmul import DENSE_LORA
from engine.models.interface import as_module
from engine.penalties import PenaltyState
from engine.platform import CaptureKind
from engine.request import Request, RequestOutput, TokenLogprob
from engine.sampler import SampledTokens
from engine.sampling_params import SamplingParams
from engine.scheduler import INIT_NEW_TOKEN_RATIO, ScheduledStep, Scheduler, max_step_tokens_for
from engine.speculative.acceptance import SpecDecodeStats
from engine.speculative.config import SpeculativeConfig
from engine.speculative.draft_model import DraftModelProposer
from engine.speculative.eagle3 import Eagle3Proposer
from engine.speculative.speculator import Speculator
from engine.stats import EngineStats, StatsLogger
from engine.step_message import StepBuilder, StepMessage
from engine.structured.waitlist import GrammarWaitlist
from engine.tokenizer import encode_prompt, load_tokenizer
from engine.transfer import to_device
from graphs.model_runner import DecodeBatchState, ModelRunner

if TYPE_CHECKING:
    from typing_extensions import TypeIs

    from engine.distributed.launcher import RankGroup
    from graphs.compiled_extend import CompiledExtendStep
    from graphs.extend_graph_runner import ExtendGraphRunner
    from graphs.step_runner import DecodeStepRunner, StepRunner

# The start-up warm-up request's prompt: a prefill of a typical chunk size, the extend-step time model's first point.
WARM_UP_PROMPT_TOKENS = 256
DRAFT_KV_MEMORY_FRACTION = 0.1  # of the free device memory, for a draft model's KV pool (the target takes the rest)

logger = logging.getLogger(__name__)

Prompt = str | list[int]


class Engine:
    # Rank 0's worker ranks under tensor parallelism (set by _join_tensor_parallel); None otherwise. A class
    # default rather than set in __init__, where mypy would take it for None for the rest of __init__.
    tp_ranks: RankGroup | None = None
    draft_engine: Engine | None = None  # speculative decoding's draft model, an engine of its own

    def __init__(self, config: EngineConfig | None = None, **overrides: object) -> None:
        config = config or EngineConfig()
        if overrides:
            unknown = [k for k in overrides if k not in EngineConfig.__dataclass_fields__]
            if unknown:
                raise EngineError(f"unknown engine options: {unknown}")
            config = EngineConfig(**{**config.__dict__, **overrides})
        self.platform = get_platform(config.device)
        self.config = config.resolve(self.platform)
        self.platform.configure(self.config)
        if self._compiles():
            # First of all: inductor's worker pool took ~8 s to come up on the H200's host (a process that imports
            # torch and initialises CUDA), longer than the rest of a dummy-weight build before the first compile;
            # a kernel inductor generates before the pool is up compiles on the main thread, one by one.
            self.platform.start_compile_workers()
        self.device = self.platform.device
        self.platform.set_seed(self.config.seed)

        source = resolve_model_source(self.config.model, self.config.load_format)
        # Tensor parallelism (engine/distributed/): rank 0 spawns the other ranks here and they build this
        # same engine on their shard; a worker rank finds its group joined already. World size 1: nothing.
        self.tp = self._join_tensor_parallel(source)
        try:
            self._build(config, source)
        except Exception as exc:
            if self.tp_ranks is not None and not isinstance(exc, EngineError):
                # A collective of the build (KV pool size, graph capture, warm-up) failed: name the rank
                # (every rank is stopped then).
                raise self.tp_ranks.failure(exc) from exc
            self.shutdown()
            raise
        except BaseException:
            self.shutdown()
            raise

    def _build(self, config: EngineConfig, source: ModelSource) -> None:
        """Everything after the config and the ranks: model, KV pool, scheduler, runner, graphs, warm-up."""
        if config.dtype == "auto" and (
            preferred := self.platform.dtype_for_checkpoint(source.kind, self.config.quantization)
        ):
            self.config.dtype = preferred
        with building_for(self.tp):
            self.model, self.model_config = load_model(
                source,
                self.config.torch_dtype,
                self.device,
                self.config.load_format,
                self.config.quantization,
                self.config.kv_torch_dtype,
            )
        # Rank 0 owns the tokenizer (and the scheduler's requests); the other ranks only run steps.
        self.tokenizer = load_tokenizer(source.tokenizer_dir) if self.tp.is_driver else None
        self.max_model_len = min(self.config.positive_int("max_model_len"), self.model_config.max_position_embeddings)
        self.context_limit_reason = ""
        limit = self.model_config.context_limit
        if limit is not None and limit[0] < self.max_model_len:
            logger.warning("%s: context length lowered from %d to %d", limit[1], self.max_model_len, limit[0])
            self.max_model_len = limit[0]
            self.context_limit_reason = f" ({limit[1]} past {limit[0]} tokens)"
        self.eos_token_ids = set(self.model_config.eos_token_ids)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            self.eos_token_ids.add(int(self.tokenizer.eos_token_id))

        backend = self.platform.attention_backend()
        if self.config.kv_torch_dtype == torch.float8_e4m3fn and not backend.capabilities.fp8_kv:
            raise EngineError(
                f"--kv-cache-dtype {self.config.kv_cache_dtype}: the {self.platform.name} attention backend reads "
                "float caches only (an FP8 KV cache runs on cuda's Triton attention)"
            )
        backend.kv_dtype = self.config.kv_torch_dtype
        self.model.set_attention_backend(backend)
        self._check_softcap(backend)
        self._apply_sliding_window(backend)
        self._choose_fp8_method()
        self.platform.prepare_model(
            as_module(self.model),
            {
                **self.config.device_config,
                **self.config.__dict__,
                "gguf_path": source.path if source.kind == "gguf" else None,
            },
        )
        # Before the KV pool: a draft model's engine takes its memory first, the target's pool the rest.
        self.speculator = self._speculator()
        # LoRA's slots before the KV pool (the pool takes a fraction of what is free; the slots of 8 rank-16
        # adapters on Llama-3-8B are 1 GB) and before anything is captured (the graphs run their matmuls too).
        self.lora = self._lora()
        self.kv_pool = self._allocate_kv_pool()
        if self.speculator is not None and self.speculator.eagle is not None:
            # The EAGLE-3 head keeps its K/V at the target pool's slots (engine/speculative/eagle3_kv.py).
            self.speculator.eagle.allocate_store(self.kv_pool.num_pages * self.kv_pool.page_size)
        # KV cache events for routers (engine/kv_events.py): recorded by the prefix cache, published per step.
        events = KVEventsConfig.parse(self.config.kv_events_config)
        self.kv_events = (
            KVEventRecorder("CPU" if self.device.type == "cpu" else "GPU") if events.enable_kv_cache_events else None
        )
        self.kv_event_publisher = make_publisher(events)
        self.kv_manager = KVCacheManager(
            self.kv_pool.allocator,
            self.kv_pool.page_size,
            self.config.enable_prefix_caching,
            self.kv_events,
            host_tier=self._host_tier(),
            write_through=self.config.hicache_write_policy == "write_through",
        )
        max_num_seqs = self.config.positive_int("max_num_seqs")
        step_ms = self.config.max_extend_step_ms
        self.scheduler = Scheduler(
            self.kv_manager,
            max_num_seqs,
            self.config.positive_int("max_prefill_tokens"),
            self.config.chunked_prefill_size,
            self.max_model_len,
            float(step_ms) / 1000.0 if step_ms is not None and step_ms > 0 else None,
            mixed_steps=bool(self.config.mixed_steps) and self.speculator is None,
            drafter=self.speculator.draft if self.speculator is not None else None,
        )
        max_pages = -(-self.max_model_len // self.kv_pool.page_size)
        self.decode_state = DecodeBatchState(
            max_num_seqs,
            max_pages,
            self.kv_pool.page_size,
            self.device,
            self.platform.slot_index_dtype,
        )
        self.decode_state.penalties = PenaltyState(max_num_seqs, int(self.model_config.vocab_size), self.device)
        if self.speculator is not None and self.speculator.eagle is not None and self.speculator.drafts_on_device:
            self.decode_state.device_drafts = self.speculator.eagle.loop.drafts.view(-1)
        # The host side of the decode rows, and the builder of every step's message (engine/step_message.py).
        self.step_builder = StepBuilder(
            max_num_seqs,
            max_pages,
            self.kv_pool.page_size,
            self.device,
            lambda request: (request.shared_pages, self.kv_pool.allocator.pages_of(request.request_id)),
            on_row_released=self.decode_state.release_row,
        )
        self.kv_manager.on_release = self._on_release
        if self._compiles():
            self.platform.wait_for_compile_workers()  # its compiler imports done before the main thread compiles
        extend_step = self._extend_step()  # first: the CUDA decode graphs compile its layer graph for both
        graph_runner = self._graph_runner(extend_step)
        # The step runners, most specialised first (graphs/step_runner.py); the ModelRunner adds the eager one.
        step_runners: list[StepRunner] = [
            runner
            for runner in (
                graph_runner,
                self._prefill_runner(),
                self._extend_graphs(extend_step, graph_runner, max_pages),
                self._compiled_runner(extend_step),
            )
            if runner is not None
        ]
        runner_args = (self.model, self.kv_pool, self.device, self.platform.slot_index_dtype, self.decode_state)
        if self.tp_ranks is not None:
            from graphs.tensor_parallel_runner import TensorParallelRunner

            self.runner: ModelRunner = TensorParallelRunner(*runner_args, step_runners, ranks=self.tp_ranks)
        else:
            self.runner = ModelRunner(*runner_args, step_runners)
        self.runner.lora_rows = self.lora.rows if self.lora is not None else None
        logger.info("step runners, in the order they are offered a step: %s", self.runner.describe())
        self._pad_logit_rows()
        # Debug mode: the pool invariant after every step (ENGINE_DEBUG_KV=1 or debug_kv_invariant).
        self.debug_kv = bool(self.config.debug_kv_invariant) or os.environ.get("ENGINE_DEBUG_KV", "") not in ("", "0")
        self.stats_logger = StatsLogger(self)
        self._ids = itertools.count()
        self._requests: dict[str, Request] = {}
        self._lora_waiting: list[Request] = []  # their adapter has no device slot yet (_admit_lora_waiting)
        self.last_step_was_decode = False  # of the step whose outputs the last step() call returned
        # A verify step's accepted tokens decide the next step's drafts: no step is launched before them.
        self.overlap = bool(self.config.overlap_schedule) and self.speculator is None
        self._in_flight: _LaunchedStep | None = None  # launched, outputs not yet read back (overlap)
        self._settled_early: list[RequestOutput] = []  # outputs of a step read back before sampling the next
        # Structured output: requests whose grammar is compiling wait here, not in the scheduler.
        self.grammar_waitlist = GrammarWaitlist(self.tokenizer, int(self.model_config.vocab_size), self.eos_token_ids)
        logger.info(
            "overlap scheduling %s; %s%s",
            "on" if self.overlap else "off",
            "mixed prefill+decode steps" if self.scheduler.mixed_steps else "separate prefill and decode steps",
            f"; speculative decoding: {self.speculator.describe()} (verify steps without overlap or mixed steps)"
            if self.speculator is not None
            else "",
        )
        if self.tp_ranks is not None:
            self.tp_ranks.wait_ready()
            if self.lora is not None:  # the workers loaded --lora-modules themselves; later changes follow
                self.lora.on_change = self._send_lora_change
        if self.config.warmup:
            self._warm_up()
        self.froze_gc = bool(self.config.freeze_gc) and freeze_start_up_objects() > 0

    def _lora(self) -> LoRAManager | None:
        """The LoRA slots of --enable-lora in the model's projections, with --lora-modules loaded; None when off."""
        if not self.config.enable_lora:
            return None
        manager = LoRAManager(
            as_module(self.model),
            self.config.max_loras,
            self.config.max_lora_rank,
            self.config.torch_dtype,
            max_step_tokens_for(self.config),
            self.device,
            self.config.max_cpu_loras,
            self.platform.lora_kernels() or DENSE_LORA,
        )
        for entry in (self.config.lora_modules or "").split(","):
            if entry.strip():
                name, _, path = entry.partition("=")
                if not name.strip() or not path.strip():
                    raise EngineError(f"--lora-modules takes name=path entries, got {entry!r}")
                adapter = manager.load(name.strip(), path.strip())
                logger.info("LoRA adapter %s loaded from %s (rank %d)", adapter.name, adapter.path, adapter.rank)
        logger.info(
            "LoRA: %d device slots of rank up to %d in %d projections, %d adapters in host memory; %s matmul",
            manager.max_loras,
            manager.max_rank,
            len(manager.projections),
            manager.max_cpu_loras,
            manager.kernels.name,
        )
        return manager

    def load_lora_adapter(self, name: str, path: str) -> None:
        """Load a PEFT adapter folder into a free slot (vLLM's /v1/load_lora_adapter); requests may then name it."""
        if self.lora is None:
            raise InvalidRequestError("LoRA is off: start the engine with --enable-lora")
        adapter = self.lora.load(name, path)
        logger.info("LoRA adapter %s loaded from %s (rank %d)", adapter.name, adapter.path, adapter.rank)

    def unload_lora_adapter(self, name: str) -> None:
        """Free the adapter's slot; refused while a request uses it (requests finish first)."""
        if self.lora is None:
            raise InvalidRequestError("LoRA is off: start the engine with --enable-lora")
        users = [r.request_id for r in self._requests.values() if r.params.lora_name == name]
        if users:
            raise InvalidRequestError(f"LoRA adapter {name!r} is in use by {len(users)} request(s); unload it after")
        self.lora.unload(name)
        logger.info("LoRA adapter %s unloaded", name)

    def _lora_busy(self) -> set[str]:
        """Adapters that live requests hold a slot of (their slots must not be reused)."""
        return {r.params.lora_name for r in self._requests.values() if r.lora_slot >= 0 and r.params.lora_name}

    def _admit_lora_waiting(self) -> None:
        """Requests whose adapter found no free slot when added: in order, those whose adapter now gets one."""
        assert self.lora is not None
        still = []
        busy = self._lora_busy()
        for request in self._lora_waiting:
            assert request.params.lora_name is not None
            slot = self.lora.make_resident(request.params.lora_name, busy)
            if slot is None:
                still.append(request)
            else:
                request.lora_slot = slot
                busy.add(request.params.lora_name)
                self._schedule_new(request)
        self._lora_waiting = still

    def _send_lora_change(self, change: SlotChange) -> None:
        """Rank 0's adapter slot change to the other ranks, ahead of the step that may use it."""
        from engine.distributed.channel import Command

        ranks = self.tp_ranks
        assert ranks is not None and ranks.channel is not None
        ranks.raise_if_failed()
        try:
            ranks.channel.publish(Command.LORA, change)
        except Exception as exc:
            raise ranks.failure(exc) from exc

    def lora_adapters(self) -> dict[str, str]:
        """Loaded adapters: name -> the folder it came from."""
        return {name: adapter.path for name, adapter in self.lora.adapters.items()} if self.lora is not None else {}

    def _speculator(self) -> Speculator | None:
        """The speculative decoding of --speculative-config, or None."""
        spec = SpeculativeConfig.parse(self.config.speculative_config)
        if spec is None:
            return None  # (tensor parallelism refused it: preflight.py)
        if spec.model is None:
            return Speculator(spec)
        if spec.method == "eagle3":
            # Where steps read their input tokens on the device (overlap scheduling's platforms), the head's
            # drafts stay there: the host builds the verify step while the device drafts.
            return Speculator(spec, eagle=self._eagle3(spec), drafts_on_device=bool(self.config.overlap_schedule))
        # The draft model: an engine of its own on this device (its KV pool, its graphs), greedy, with the
        # prefix cache its rollback. On an accelerator it takes a tenth of the free memory for its KV pool.
        draft = Engine(
            EngineConfig(
                model=spec.model,
                device=self.config.device,
                max_num_seqs=self.config.positive_int("max_num_seqs"),
                max_model_len=self.max_model_len,
                page_size=self.config.positive_int("page_size"),
                seed=self.config.seed,
                enable_prefix_caching=True,
                disable_graphs=self.config.disable_graphs,
                kv_cache_memory_fraction=DRAFT_KV_MEMORY_FRACTION if self.device.type != "cpu" else None,
            )
        )
        if int(draft.model_config.vocab_size) != int(self.model_config.vocab_size):
            draft.shutdown()
            raise EngineError(
                f"--speculative-config: the draft model's vocabulary ({draft.model_config.vocab_size} tokens) is "
                f"not the target's ({self.model_config.vocab_size}); a draft model must share the tokenizer"
            )
        self.draft_engine = draft
        proposer = DraftModelProposer(draft, spec.num_speculative_tokens, draft.max_model_len)
        return Speculator(spec, proposer)

    def _eagle3(self, spec: SpeculativeConfig) -> Eagle3Proposer:
        """The EAGLE-3 head of --speculative-config on this device, and the tap that hands it the target's
        inner-layer states (set before any graph is captured: the captures copy them too)."""
        from engine.speculative.aux_hidden import AuxHiddenTap
        from engine.speculative.eagle3_checkpoint import TargetShape, load_eagle3_head

        assert spec.model is not None
        mc = self.model_config
        target = TargetShape(
            int(mc.hidden_size),
            int(mc.vocab_size),
            int(mc.num_hidden_layers),
            int(mc.num_attention_heads),
            int(mc.num_key_value_heads),
            int(mc.intermediate_size),
            self.max_model_len,
        )
        dummy = self.config.load_format == "dummy"
        head = load_eagle3_head(spec.model, target, self.config.torch_dtype, self.device, dummy, self.config.seed)
        self.platform.prepare_draft_module(head)
        # Rows for the largest step: a prefill's token budget, or every verify row.
        verify_rows = self.config.positive_int("max_num_seqs") * (1 + spec.num_speculative_tokens)
        rows = max(max_step_tokens_for(self.config), verify_rows)
        layers = head.config.target_layers(target.num_layers)
        tap = AuxHiddenTap(layers, target.hidden_size, rows, self.config.torch_dtype, self.device)
        self.model.aux_tap = tap
        logger.info(
            "EAGLE-3 head %s: draft vocabulary %d of %d, hidden states of target layers %s",
            spec.model,
            head.config.draft_vocab_size,
            head.config.vocab_size,
            tap.layers,
        )
        # The draft loop (a Llama layer whatever the target) runs in the platform's device graphs unless graphs
        # are off, captured per shape on first use (engine/speculative/eagle3_loop.py).
        graphs = None if self.config.disable_graphs else self.platform.device_graphs()
        return Eagle3Proposer(
            head,
            self.model.embed,
            tap,
            spec.num_speculative_tokens,
            self.device,
            max_batch=self.config.positive_int("max_num_seqs"),
            graphs=graphs,
            max_context=self.max_model_len,
        )

    def _compiles(self) -> bool:
        """Whether this engine torch.compiles a step (decode or extend)."""
        return not self.config.disable_graphs and bool(self.config.compile_decode or self.config.compile_extend)

    def _pad_logit_rows(self) -> None:
        """Where the platform asks (engine/logit_rows.py): the eager LM head's rows padded to the decode capture
        sizes up to max_num_seqs, each size run once now. A tensor-parallel head needs every rank in its
        collectives, so there the sizes are paid at their first step instead."""
        if not self.platform.pads_logit_rows:
            return
        ladder = LogitRowLadder(self.config.resolved_capture_sizes(), self.config.positive_int("max_num_seqs"))
        self.runner.logit_rows = ladder
        if self.tp_ranks is None and not self.tp.enabled:
            ladder.warm(
                self.model.compute_logits,
                int(self.model_config.hidden_size),
                self.config.torch_dtype,
                self.device,
                self.platform.synchronize,
            )

    def _join_tensor_parallel(self, source: ModelSource) -> TensorParallelState:
        """This engine's rank: rank 0 of 1 (no tensor parallelism), a worker's (its group joined by
        engine/tp_worker.py), or rank 0 of N after spawning the workers and joining them."""
        world = int(self.config.tensor_parallel_size)
        current = tp_state()
        if world == 1:
            return SINGLE
        if current.enabled:
            if current.is_driver or current.world_size != world:
                raise EngineError(
                    "a tensor-parallel engine is running in this process already (one at a time: "
                    "Engine.shutdown() it first)"
                )
            return current  # a worker rank
        from engine.distributed.launcher import RankGroup
        from engine.distributed.preflight import check_launch
        from engine.model_config import ModelConfig
        from engine.tp_worker import worker_main

        check_launch(self.config, self.platform, source, ModelConfig.from_hf(source.hf_config))
        self.tp_ranks = RankGroup(
            world, self.platform.dist_backend, float(self.config.dist_timeout_s), self.device, worker_main
        )
        try:
            return self.tp_ranks.start(self.config)
        except BaseException:
            self.tp_ranks.shutdown()
            raise

    def shutdown(self) -> None:
        """Stop a tensor-parallel engine's worker ranks and leave its process group (also done at exit and
        on SIGTERM), and unfreeze the garbage collector if this engine froze it (freeze_gc), so that a
        `del` of the engine frees its memory; idempotent. The engine cannot step afterwards."""
        if self.tp_ranks is not None:
            self.tp_ranks.shutdown()
        if self.draft_engine is not None:
            self.draft_engine.shutdown()
        kv_manager = getattr(self, "kv_manager", None)
        if kv_manager is not None and kv_manager.host_tier is not None:
            kv_manager.host_tier.close()
        publisher = getattr(self, "kv_event_publisher", None)
        if publisher is not None:
            publisher.shutdown()
            self.kv_event_publisher = None
        if getattr(self, "froze_gc", False):
            unfreeze_gc()
            self.froze_gc = False

    def _warm_up(self) -> None:
        """One short request through the real step path (prefill, decode, sampling, detokenizing).

        Whatever is lazy on a first call (oneDNN's JIT for a new shape, lazily
        imported modules, first touch of the KV pool, a graph's first replay) is
        paid here, at start-up, and not by the first user; the log says how long
        it took. Its prompt (WARM_UP_PROMPT_TOKENS) gives the scheduler a first
        measure of the prefill speed, so the extend-step time budget holds from
        the first request on. Otherwise it leaves no trace: the
        prefix cache, its counters, the step counters and the scheduler's
        admission ratio are reset afterwards.
        """
        # Room for two new tokens: prefill, then one decode. With speculative decoding, room for two verify steps
        # as well: their kernels (k + 1 rows per request, the draft's own) compile here, not in a user's request.
        new_tokens = 2
        if self.speculator is not None:
            new_tokens += 2 * (self.speculator.config.num_speculative_tokens + 1)
        prompt_len = min(WARM_UP_PROMPT_TOKENS, self.max_model_len - new_tokens)
        if prompt_len < 1:
            return
        start = time.perf_counter()
        request_id = "engine-warm-up"
        self.add_request(
            [0] * prompt_len,
            SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True),
            request_id=request_id,
        )
        while self.has_unfinished():
            self.step()
        self._requests.pop(request_id, None)
        self.kv_manager.reset_prefix_cache()
        if self.kv_events is not None:
            self.kv_events.take()  # subscribers start from an empty cache; the warm-up's pages are gone
        self.kv_manager.stats = PrefixCacheStats()
        if self.kv_manager.host_tier is not None:
            self.kv_manager.host_tier.stats = HostTierStats()
        self.scheduler.new_token_ratio = INIT_NEW_TOKEN_RATIO
        if self.speculator is not None:
            self.speculator.stats = SpecDecodeStats()
        self.runner.reset_counts()
        self.stats_logger.step_sizes.reset()
        logger.info(
            "warm-up request (%d-token prefill, %d new tokens) took %.2f s",
            prompt_len,
            new_tokens,
            time.perf_counter() - start,
        )

    # ---- construction -------------------------------------------------------------
    def _choose_fp8_method(self) -> None:
        """FP8 linears (an FP8 checkpoint, or --quantization fp8) run the platform's FP8 kernel, or are
        dequantized once to the model dtype where it has none."""
        from engine.quantization.fp8 import dequantize_fp8_linears, fp8_linears

        layers = [layer for _, layer in fp8_linears(as_module(self.model))]
        if not layers:
            return
        method = self.platform.fp8_linear_method()
        if method is None:
            dequantize_fp8_linears(as_module(self.model), self.config.torch_dtype)
            logger.warning(
                "FP8: %s has no FP8 matmul kernel; %d FP8 layers dequantized to %s once (no memory or speed gain here)",
                self.platform.name,
                len(layers),
                self.config.torch_dtype,
            )
            return
        for layer in layers:
            layer.method = method
        logger.info("FP8: %d linear layers run %s", len(layers), method.name)

    def _check_softcap(self, backend: AttentionBackend) -> None:
        """Soft-capped attention scores (Gemma 2) have no exact substitute: refused where the backend lacks them."""
        if backend.capabilities.softcap:
            return
        if any(m.softcap for m in self.model.modules() if isinstance(m, Attention)):
            raise UnsupportedArchitectureError(
                f"{self.model_config.model_type}: attention logit soft-capping is not implemented by the "
                f"{self.platform.name} attention backend (it runs on cpu, cuda and rocm)"
            )

    def _apply_sliding_window(self, backend: AttentionBackend) -> None:
        """A model whose attention has a sliding window: each layer gets its own (every layer for Mistral,
        alternate layers for Gemma 2, Qwen2's upper layers) where the backend implements windows; compiled
        steps then compile one layer graph per kind. Otherwise (HPU, NPU) the context stops at the window,
        where full causal attention is exactly the windowed computation, rather than giving wrong tokens."""
        window = self.model_config.sliding_window
        if window is None or window >= self.max_model_len:
            return  # no position ever reaches past the window
        windows = self.model_config.layer_windows
        if backend.capabilities.sliding_window:
            self.model.set_layer_windows(windows)
            logger.info(
                "sliding-window attention: %d tokens in %d of %d layers",
                window,
                sum(w is not None for w in windows),
                len(windows),
            )
            return
        why = f"not implemented by the {self.platform.name} attention backend"
        logger.warning(
            "the model's %d-token sliding window is %s: context length lowered from %d to %d",
            window,
            why,
            self.max_model_len,
            window,
        )
        self.max_model_len = window
        self.context_limit_reason = f" (the model's {window}-token sliding window, {why})"

    def _allocate_kv_pool(self) -> KVPool:
        cfg, mc = self.config, self.model_config
        page_size = cfg.positive_int("page_size")
        kv_heads = kv_head_shard(mc.num_key_value_heads, self.tp.rank, self.tp.world_size).size  # this rank's heads
        per_token = KVPool.bytes_per_token(mc.num_hidden_layers, kv_heads, mc.head_dim, cfg.kv_torch_dtype)
        if self.speculator is not None and self.speculator.eagle is not None:
            per_token += self.speculator.eagle.kv_bytes_per_token()  # the head's store, allocated after the pool
        useful_tokens = cfg.positive_int("max_num_seqs") * self.max_model_len
        if cfg.kv_cache_tokens is not None:
            tokens = int(cfg.kv_cache_tokens)
        else:
            free = self.platform.memory_info().free_bytes
            if self.tp.enabled:
                free = min_over_ranks(free)  # every rank holds the same pages: the tightest rank decides
            tokens = min(int(free * float(cfg.kv_cache_memory_fraction or 0.1)) // per_token, useful_tokens)
        num_pages = -(-tokens // page_size) + 1  # whole pages, rounded up, + the reserved page 0
        if num_pages < 2:
            raise EngineError(f"KV pool too small: {tokens} tokens; raise kv_cache_tokens or the memory fraction")
        capacity = (num_pages - 1) * page_size
        if capacity < self.max_model_len:
            # A request of the full context must fit alone, or it could wait (or preempt itself) forever.
            logger.warning("KV pool holds %d tokens: context length lowered from %d", capacity, self.max_model_len)
            self.max_model_len = capacity
            self.context_limit_reason = f" (lowered to the KV pool's {capacity} tokens)"
        pool = KVPool(
            mc.num_hidden_layers, num_pages, page_size, kv_heads, mc.head_dim, cfg.kv_torch_dtype, self.device
        )
        logger.info("KV pool: %d pages x %d tokens (%.1f MiB)", num_pages - 1, page_size, pool.nbytes() / 2**20)
        return pool

    def _host_tier(self) -> HostKVPool | None:
        """The host-memory tier under the prefix cache (--enable-hierarchical-cache), sized from the device pool."""
        cfg = self.config
        if not (cfg.enable_hierarchical_cache and cfg.enable_prefix_caching):
            return None
        num_pages = HostKVPool.num_pages_for(self.kv_pool, float(cfg.hicache_size), float(cfg.hicache_ratio))
        if num_pages < 1:
            raise EngineError(f"host KV tier too small: {num_pages} pages; raise --hicache-size or --hicache-ratio")
        return HostKVPool(self.kv_pool, num_pages, self.device, self.platform.kv_page_mover())

    def _graphs_unsupported(self) -> bool:
        """The model says its steps cannot be captured on this platform (MoE's data-dependent experts op
        outside the CPU: MoEForCausalLM.supports_device_graphs)."""
        if not self.model.supports_device_graphs(self.platform.capture_settings()):
            logger.warning(
                "%s: %s graphs off for this model (its steps run eagerly)",
                self.model_config.model_type,
                self.platform.name,
            )
            return True
        return False

    def graph_runner_options(self, extend_step: CompiledExtendStep | None = None) -> dict[str, object]:
        """The platform-specific keyword arguments of this engine's decode graph runner (the tuner builds
        runners with them too): the platform's answer for this config. extend_step: the compiled extend step
        whose layer graph a CUDA runner's compiled decode step shares (one compile for both)."""
        return self.platform.decode_runner_options(
            self.config,
            as_module(self.model),
            self.kv_pool.caches,
            extend_step.layer_fn if extend_step is not None else None,
        )

    def _graph_runner(self, extend_step: CompiledExtendStep | None) -> DecodeStepRunner | None:
        if self.config.disable_graphs or self._graphs_unsupported():
            return None
        runner_cls = self.platform.graph_runner_class()
        max_pages = (self.max_model_len + self.kv_pool.page_size - 1) // self.kv_pool.page_size
        kwargs = self.graph_runner_options(extend_step)
        runner: DecodeStepRunner = runner_cls(
            self.model,
            self.kv_pool.caches,
            self.config.resolved_capture_sizes(),
            max_pages,
            self.kv_pool.page_size,
            self.device,
            self.platform.slot_index_dtype,
            **kwargs,
        )
        runner.capture()
        return runner

    def _extend_step(self) -> CompiledExtendStep | None:
        """Prefill, chunk and mixed steps through compiled layers (compile_extend), or None: eager."""
        if self.config.disable_graphs or not self.config.compile_extend:
            return None
        from graphs.compiled_extend import CompiledExtendStep

        logger.info(
            "extend steps: torch.compile'd layers, token count dynamic (compiled by the CUDA decode capture "
            "where it shares them, else on the first prefill)"
        )
        return CompiledExtendStep(self.model, self.kv_pool.caches, strict=bool(self.config.strict_graphs))

    def _compiled_runner(self, extend_step: CompiledExtendStep | None) -> StepRunner | None:
        """Every step the runners before it did not take, through the compiled layers; None: eager."""
        if extend_step is None:
            return None
        from graphs.compiled_extend import CompiledStepRunner

        return CompiledStepRunner(extend_step)

    def _prefill_runner(self) -> StepRunner | None:
        """The platform's own prefill runner (HPU: extend steps padded to prompt buckets), warmed up; None where
        the platform has none, or with graphs off (then every extend step takes the paths above)."""
        factory = self.platform.prefill_runner_class()
        if factory is None or self.config.disable_graphs or self._graphs_unsupported():
            return None
        runner: StepRunner = factory(
            self.model,
            self.kv_pool.caches,
            self.kv_pool.page_size,
            self.max_model_len,
            self.device,
            self.platform.slot_index_dtype,
        )
        runner.capture()
        return runner

    def _extend_graphs(
        self, extend_step: CompiledExtendStep | None, decode_graphs: DecodeStepRunner | None, max_pages: int
    ) -> ExtendGraphRunner | None:
        """CUDA graphs of extend and mixed steps per token bucket (extend_capture_tokens), or None."""
        buckets = parse_sizes(self.config.extend_capture_tokens) if self.config.extend_capture_tokens else []
        if (
            self.config.disable_graphs
            or not buckets
            or self.platform.capture_settings().kind is not CaptureKind.CUDA_GRAPH
            or self._graphs_unsupported()
        ):
            return None
        # No bucket above what one step can hold (the prompt-token budget, plus the decodes of a mixed step).
        step_tokens = self.scheduler.max_step_tokens()
        buckets = sorted({min(b, step_tokens) for b in buckets})
        from graphs.cuda_graph_runner import CudaGraphRunner
        from graphs.extend_graph_runner import ExtendGraphRunner, eager_extend_step

        step = extend_step if extend_step is not None else eager_extend_step(self.model, self.kv_pool.caches)
        # Into the decode graphs' pool, on their capture stream (ExtendGraphRunner.capture says why).
        shared = decode_graphs if isinstance(decode_graphs, CudaGraphRunner) else None
        runner = ExtendGraphRunner(
            step,
            buckets,
            self.config.positive_int("max_num_seqs"),
            max_pages,
            self.kv_pool.page_size,
            self.device,
            self.platform.slot_index_dtype,
            pool=shared.pool if shared is not None else None,
            stream=shared.capture_stream if shared is not None else None,
        )
        runner.capture()
        return runner

    # ---- requests ---------------------------------------------------------------------
    def add_request(
        self, prompt: Prompt, params: SamplingParams | None = None, request_id: str | None = None, chat: bool = False
    ) -> str:
        params = params or SamplingParams()
        params.validate()
        token_ids = encode_prompt(self.tokenizer, prompt, chat=chat)
        if max(token_ids) >= self.model_config.vocab_size:
            raise InvalidRequestError(
                f"token id {max(token_ids)} is outside the vocabulary ({self.model_config.vocab_size})"
            )
        if len(token_ids) >= self.max_model_len:
            raise InvalidRequestError(
                f"prompt has {len(token_ids)} tokens; the context length is {self.max_model_len}"
                f"{self.context_limit_reason}, leaving no room for a new token"
            )
        request_id = request_id or f"req-{next(self._ids)}"
        if request_id in self._requests:
            raise InvalidRequestError(f"duplicate request id {request_id!r}")
        generator = None
        if params.seed is not None:
            generator = torch.Generator(device=self.device).manual_seed(params.seed)
        if params.allowed_token_ids and max(params.allowed_token_ids) >= self.model_config.vocab_size:
            raise InvalidRequestError(
                f"allowed_token_ids: token id {max(params.allowed_token_ids)} is outside the "
                f"vocabulary ({self.model_config.vocab_size})"
            )
        if params.logit_bias and max(params.logit_bias) >= self.model_config.vocab_size:
            raise InvalidRequestError(
                f"logit_bias token id {max(params.logit_bias)} is outside the vocabulary "
                f"({self.model_config.vocab_size})"
            )
        if params.lora_name is not None:
            if self.lora is None:
                raise InvalidRequestError(
                    f"LoRA adapter {params.lora_name!r} asked for, but LoRA is off (--enable-lora)"
                )
            self.lora.check_loaded(params.lora_name)
        request = Request(
            request_id, token_ids, params, prompt if isinstance(prompt, str) else None, generator=generator
        )
        if params.min_tokens:
            request.early_stop_ids = sorted(
                set(params.stop_token_ids) | (set() if params.ignore_eos else self.eos_token_ids)
            )
        self.scheduler.check_fits(request)
        if params.lora_name is not None:
            assert self.lora is not None
            slot = self.lora.make_resident(params.lora_name, self._lora_busy())
            if slot is None:
                self._lora_waiting.append(request)  # every slot is in use: placed by step() once one frees
            else:
                request.lora_slot = slot
                self._schedule_new(request)
        else:
            self._schedule_new(request)
        self._requests[request_id] = request
        self.stats_logger.step_sizes.record_prompt(len(token_ids))  # /metrics' prompt-length histogram
        return request_id

    def _on_release(self, request: Request) -> None:
        """The request holds no KV any more (finished, aborted, retracted): its decode row and its draft
        head's cache go too."""
        self.step_builder.release(request)
        if self.speculator is not None:
            self.speculator.forget(request)

    def _schedule_new(self, request: Request) -> None:
        if request.params.grammar is not None:
            self.grammar_waitlist.add(request)  # scheduled once its grammar has compiled (step())
        else:
            self.scheduler.add(request)

    def abort(self, request_id: str) -> None:
        request = self._requests.pop(request_id, None)
        if self.grammar_waitlist.remove(request_id) is not None:
            return  # never scheduled: nothing to free
        if request is not None and request in self._lora_waiting:
            self._lora_waiting.remove(request)
            return  # waiting for an adapter slot: nothing to free
        if request is not None and not request.finished:
            self.scheduler.finish(request, "abort")
        self._settle_if_idle()

    def _settle_if_idle(self) -> None:
        """No live request left: settle the step still on the device (each of its requests finished
        after it was launched, so every token in it is dropped). An idle engine has nothing in flight."""
        if self._in_flight is not None and not self.scheduler.has_work():
            launched, self._in_flight = self._in_flight, None
            dropped = self._complete(launched)
            assert not dropped, "a live request in a step the scheduler no longer knows"

    def has_unfinished(self) -> bool:
        return (
            self.scheduler.has_work()
            or self._in_flight is not None
            or len(self.grammar_waitlist) > 0
            or bool(self._lora_waiting)
        )

    def step(self) -> list[RequestOutput]:
        """Run one scheduled step; outputs of every request that produced a token (or failed).

        With overlap scheduling the step is launched first and the outputs returned are those of the
        step before it, read back while the device runs this one: the host's work (scheduling,
        building inputs, detokenizing, stop checks) hides behind the device's. Without it (CPU, and
        `overlap_schedule: false`) each step's own outputs come back.
        """
        if self._lora_waiting:
            self._admit_lora_waiting()
        outputs = self._admit_compiled_grammars()
        launched = self._launch(self.scheduler.schedule())
        outputs += self._settled_early
        self._settled_early = []
        previous, self._in_flight = self._in_flight, launched
        outputs += self._complete(previous) if previous is not None else []
        if launched is not None and not self.overlap:
            self._in_flight = None
            outputs += self._complete(launched)
        self._settle_if_idle()
        if self.debug_kv:
            self.check_kv_invariant()
        self.stats_logger.maybe_log()
        if self.kv_event_publisher is not None and self.kv_events is not None and self.kv_events.events:
            self.kv_event_publisher.publish(self.kv_events.take())
        return outputs

    def _settle_constrained(self) -> None:
        """Between a step's forward and its sampling (overlap scheduling): if the step in flight sampled
        for a grammar, read it back now, so that each grammar has taken its last token before its next
        mask is made. The device runs the new forward meanwhile; only the sampling waits."""
        if self._in_flight is not None and self._in_flight.constrained:
            previous, self._in_flight = self._in_flight, None
            self._settled_early += self._complete(previous)

    def _admit_compiled_grammars(self) -> list[RequestOutput]:
        """Schedule the requests whose grammar has compiled; fail those whose grammar did not."""
        idle = not self.scheduler.has_work() and self._in_flight is None
        ready, failed = self.grammar_waitlist.take_ready(idle)
        for request in ready:
            self.scheduler.add(request)
        outputs = []
        for request, error in failed:
            self._requests.pop(request.request_id, None)
            request.finish_reason = "error"
            outputs.append(_output(request, "error", error=str(error)))
        return outputs

    def _launch(self, step: ScheduledStep | None) -> _LaunchedStep | None:
        """Put the step on the device; the scheduler advances its requests as if it had run."""
        if step is None:
            return None
        self.stats_logger.step_sizes.record(step)  # the step-size histograms of /metrics (tune-capture reads them)
        rewind = _generator_states(step.sampled_requests)
        start = time.perf_counter()
        self.kv_manager.fence()  # after the host tier's loads into (and write-backs out of) the pages it uses
        ran_whole: StepMessage | None = None  # the step's message, where it ran in one piece
        try:
            message = self.step_builder.build(step)
            parts = [(step, self.runner.launch(step, message, self._settle_constrained))]
            failed: list[tuple[Request, Exception]] = []
            ran_whole = message
        except EngineStoppedError:
            raise  # a tensor-parallel rank is gone (or the ranks were shut down): no re-run can help
        except Exception as exc:
            parts, failed = self._isolate_failure(step, exc, rewind)
        if self.speculator is not None and ran_whole is not None:
            # An EAGLE-3 head keeps the step's hidden states (a step re-run in parts gives it none: its requests
            # draft again once a later step has computed their last position).
            self.speculator.observe(step, ran_whole)
        for part, sampled in parts:
            self.scheduler.on_step_launched(part)
            if sampled is not None:
                sampled.start_copy()
        for request, _ in failed:
            # Out of the scheduler now, so no later step includes it; its error output comes with the step's.
            self._requests.pop(request.request_id, None)
            self.scheduler.finish(request, "abort")
        constrained = any(r.grammar is not None for r in step.sampled_requests)
        return _LaunchedStep(step.is_decode, parts, failed, start, constrained)

    def _complete(self, launched: _LaunchedStep) -> list[RequestOutput]:
        """Read a launched step's tokens back (waiting for the device if need be) and hand them out.

        A request that finished or was aborted after the step was launched drops its token: a stop
        found one step late never lets a token past it out.
        """
        outputs: list[RequestOutput] = []
        for part, sampled in launched.parts:
            if sampled is None:
                continue
            tokens, logprobs = sampled.resolve()
            if part.is_verify:
                outputs += self._complete_verify(part, tokens, logprobs)
                continue
            for request, token, entry in zip(part.sampled_requests, tokens, logprobs):
                request.num_pending_tokens -= 1
                if request.finished:
                    continue
                if entry is not None:
                    request.output_logprobs.append(entry)
                outputs.append(self._append_token(request, token))
        if not launched.is_decode:
            lens = [(r, n) for part, _ in launched.parts for r, n in zip(part.extend_requests, part.extend_lens)]
            logprob_tokens = sum(n for r, n in lens if r.params.prompt_logprobs is not None)
            self.scheduler.record_extend_time(
                sum(n for _, n in lens), time.perf_counter() - launched.started, logprob_tokens
            )
        for request, error in launched.failed:
            outputs.append(_output(request, "error", error=f"generation failed: {type(error).__name__}: {error}"))
        self.last_step_was_decode = launched.is_decode  # benchmarks split time into prefill and decode steps
        return outputs

    def _complete_verify(
        self, step: ScheduledStep, tokens: list[int], logprobs: list[TokenLogprob | None]
    ) -> list[RequestOutput]:
        """A verify step's rows, 1 + drafts per request: each request keeps the drafts the target agreed with
        and the target's token after them, appended one by one (a stop among them ends it there), as one
        output; pages that only rejected drafts used go back to the pool."""
        assert step.drafts is not None and self.speculator is not None
        self.speculator.resolve(step.drafts)
        outputs = []
        start = 0
        penalized: tuple[list[int], list[int]] = ([], [])  # (decode row, kept token) of penalized requests
        for request, drafts in zip(step.requests, step.drafts):
            rows = slice(start, start + 1 + len(drafts))
            start = rows.stop
            request.num_pending_tokens -= 1
            if request.finished:
                continue
            kept = self.speculator.accept(drafts, tokens[rows])
            self.scheduler.on_verified(request, len(kept) - 1)
            if request.params.has_penalties and request.batch_row is not None:
                penalized[0].extend([request.batch_row] * len(kept))
                penalized[1].extend(kept)
            parts = []
            for token, entry in zip(kept, logprobs[rows]):
                if entry is not None:
                    request.output_logprobs.append(entry)
                parts.append(self._append_token(request, token))
                if parts[-1].finished:
                    break
            if not parts[-1].finished:
                self.scheduler.trim_drafts(request)
            outputs.append(_merged(parts))
        if penalized[0] and self.decode_state.penalties is not None:
            # The verify step sampled every row; only the kept tokens count as generated (engine/sampler.py).
            kept_rows, kept_tokens = to_device(list(penalized), torch.int64, self.device)
            self.decode_state.penalties.record(kept_rows, kept_tokens)
        return outputs

    def _isolate_failure(
        self, step: ScheduledStep, error: Exception, rewind: dict[int, torch.Tensor]
    ) -> tuple[list[tuple[ScheduledStep, SampledTokens | None]], list[tuple[Request, Exception]]]:
        """A step raised: re-run it in halves until the request(s) that make it fail are alone.

        Re-running is safe: a step writes each token's k/v to the same slot
        every time, and seeded generators are rewound to where the step began,
        so every other request gets exactly the token it would have had.
        """
        if step.is_mixed:
            parts = step.parts()  # its decode part and its extend part apart first, halved from there
        elif len(step.requests) == 1:
            logger.error(
                "request %s failed its step: %s: %s",
                step.requests[0].request_id,
                type(error).__name__,
                error,
                exc_info=error,
            )
            return [], [(step.requests[0], error)]
        else:
            logger.warning(
                "a step of %d requests failed (%s: %s): re-running it in parts to find the culprit",
                len(step.requests),
                type(error).__name__,
                error,
            )
            half = len(step.requests) // 2
            parts = [
                ScheduledStep(
                    step.is_decode,
                    step.requests[part],
                    step.extend_lens[part],
                    step.sample_mask[part],
                    drafts=step.drafts[part] if step.drafts is not None else None,
                )
                for part in (slice(0, half), slice(half, None))
            ]
        done: list[tuple[ScheduledStep, SampledTokens | None]] = []
        failed: list[tuple[Request, Exception]] = []
        for sub in parts:
            _rewind_generators(sub.sampled_requests, rewind)
            try:
                done.append((sub, self.runner.launch(sub, self.step_builder.build(sub), self._settle_constrained)))
            except EngineStoppedError:
                raise
            except Exception as exc:
                sub_done, sub_failed = self._isolate_failure(sub, exc, rewind)
                done += sub_done
                failed += sub_failed
        return done, failed

    def _append_token(self, request: Request, token: int) -> RequestOutput:
        params = request.params
        request.output_token_ids.append(token)
        if self.tokenizer is not None:
            if request.detokenizer is None:
                request.detokenizer = IncrementalDetokenizer(self.tokenizer, params.skip_special_tokens)
            request.output_text += request.detokenizer.step(request.output_token_ids)
        reason = None
        cut = None
        if request.grammar is not None and not request.grammar.accept_token(token):
            # Only a broken row (non-finite logits: the sampler's argmax fallback) can get here.
            assert params.grammar is not None  # the request's matcher was compiled from it (GrammarWaitlist)
            self.scheduler.finish(request, "abort")
            self._requests.pop(request.request_id, None)
            return _output(
                request, "error", error=f"token {token} does not match the request's {params.grammar.describe()}"
            )
        early = len(request.output_token_ids) < params.min_tokens  # no stop of any kind before min_tokens
        if request.grammar is not None and request.grammar.is_terminated():
            reason = "stop"  # the grammar is complete (it took its stop token): nothing may follow
        elif not early and (token in params.stop_token_ids or (not params.ignore_eos and token in self.eos_token_ids)):
            reason = "stop"
        elif (
            not early
            and params.stop
            and (cut := _first_stop(request.output_text, params.stop, request.num_text_sent)) is not None
        ):
            request.output_text = request.output_text[:cut]
            reason = "stop"
        elif len(request.output_token_ids) >= params.max_tokens or request.num_tokens >= self.max_model_len:
            reason = "length"
        if reason is not None:
            if request.detokenizer is not None and cut is None:
                # Whatever was held back (a character cut off by the last token) belongs to the final text.
                request.output_text = request.detokenizer.flush(request.output_token_ids)
            self.scheduler.finish(request, reason)
            self._requests.pop(request.request_id, None)
        new_text = self._releasable_text(request, finished=reason is not None)
        wants_logprobs = params.logprobs is not None
        return _output(
            request,
            reason,
            new_token_ids=[token],
            new_text=new_text,
            logprobs=list(request.output_logprobs) if wants_logprobs else None,
            new_logprobs=request.output_logprobs[-1:] if wants_logprobs else None,
            prompt_logprobs=request.prompt_logprobs if params.prompt_logprobs is not None else None,
        )

    @staticmethod
    def _releasable_text(request: Request, finished: bool) -> str:
        """The streaming delta: text that can no longer change.

        Held back until final: a trailing U+FFFD (a character whose bytes span
        tokens still to come) and the last len(longest stop) - 1 characters,
        which could be the start of a stop string. So the deltas always add up
        to the final text.
        """
        text = request.output_text
        end = len(text)
        if not finished:
            while end > request.num_text_sent and text[end - 1] == "\ufffd":
                end -= 1
            if request.params.stop:
                end = min(end, len(text) - (max(len(s) for s in request.params.stop) - 1))
        if end <= request.num_text_sent:
            return ""
        delta = text[request.num_text_sent : end]
        request.num_text_sent = end
        return delta

    # ---- batch APIs -------------------------------------------------------------------
    def stream(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        chat: bool = False,
    ) -> Iterator[RequestOutput]:
        """Yield each new token's output (with its delta) as it is produced."""
        return self._drive(self._add_all(prompts, params, chat))

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        chat: bool = False,
    ) -> list[RequestOutput]:
        """Complete outputs, in prompt order."""
        ids = self._add_all(prompts, params, chat)
        final = {output.request_id: output for output in self._drive(ids) if output.finished}
        return [final[request_id] for request_id in ids]

    def _drive(self, ids: list[str]) -> Iterator[RequestOutput]:
        pending = set(ids)
        try:
            while pending:
                for output in self.step():
                    if output.request_id in pending:
                        if output.finished:
                            pending.discard(output.request_id)
                        if output.error is not None:
                            raise RequestFailedError(f"request {output.request_id}: {output.error}")
                        yield output
        finally:
            for request_id in pending:
                self.abort(request_id)

    def _add_all(
        self, prompts: Prompt | Sequence[Prompt], params: SamplingParams | Sequence[SamplingParams] | None, chat: bool
    ) -> list[str]:
        if _is_one_prompt(prompts):
            prompts = [prompts]
        if isinstance(params, (list, tuple)):
            if len(params) != len(prompts):
                raise InvalidRequestError(f"{len(prompts)} prompts but {len(params)} sampling params")
            per_prompt = list(params)
        else:
            per_prompt = [params or SamplingParams()] * len(prompts)
        # Validate every prompt before queueing any, so a bad one leaves nothing behind.
        for prompt in prompts:
            encode_prompt(self.tokenizer, prompt, chat=chat)
        ids = []
        try:
            for prompt, p in zip(prompts, per_prompt):
                ids.append(self.add_request(prompt, p, chat=chat))
        except EngineError:
            for request_id in ids:
                self.abort(request_id)
            raise
        return ids

    # ---- introspection ------------------------------------------------------------------
    def check_kv_invariant(self) -> None:
        """free + evictable + protected + in use == total pages; raises with the numbers if not. Under tensor
        parallelism also every other rank's pool and decode rows against rank 0's (engine/distributed/
        consistency.py)."""
        self.kv_manager.check_invariant()
        if self.tp_ranks is not None:
            from graphs.tensor_parallel_runner import TensorParallelRunner

            assert isinstance(self.runner, TensorParallelRunner)  # built with the ranks (_build)
            self.runner.check_ranks(self)

    def kv_pages_in_use(self) -> int:
        """Pages held by live requests (cached pages nobody uses are free to evict, so not counted)."""
        return self.kv_manager.pages_in_use

    def stats(self) -> EngineStats:
        return EngineStats.collect(self)


@dataclass
class _LaunchedStep:
    """A step on the device whose tokens the host has not read back yet."""

    is_decode: bool
    parts: list[tuple[ScheduledStep, SampledTokens | None]]  # one, or the parts a failure was split into
    failed: list[tuple[Request, Exception]]  # requests that made it fail (finished already)
    started: float  # perf_counter at launch
    constrained: bool = False  # a request it samples has a grammar (its next mask needs this token)


def _is_one_prompt(prompts: Prompt | Sequence[Prompt]) -> TypeIs[Prompt]:
    """A single prompt (text, or one list of token ids) rather than a batch of them."""
    return isinstance(prompts, str) or (bool(prompts) and isinstance(prompts[0], int))


def _first_stop(text: str, stops: list[str], previous_len: int) -> int | None:
    """Index where the earliest stop string starts, searching only text that could be new."""
    best = None
    for stop in stops:
        index = text.find(stop, max(0, previous_len - len(stop) + 1))
        if index != -1 and (best is None or index < best):
            best = index
    return best


class _OutputFields(TypedDict, total=False):
    """RequestOutput's optional fields, as _output passes them on."""

    new_token_ids: list[int]
    new_text: str
    logprobs: list[TokenLogprob] | None
    new_logprobs: list[TokenLogprob] | None
    prompt_logprobs: list[TokenLogprob | None] | None
    error: str | None


def _output(request: Request, finish_reason: str | None, **fields: Unpack[_OutputFields]) -> RequestOutput:
    """The request's output so far; finished when there is a finish reason."""
    return RequestOutput(
        request_id=request.request_id,
        prompt=request.prompt,
        prompt_token_ids=request.prompt_token_ids,
        token_ids=list(request.output_token_ids),
        text=request.output_text,
        finished=finish_reason is not None,
        finish_reason=finish_reason,
        **fields,
    )


def _merged(outputs: list[RequestOutput]) -> RequestOutput:
    """One request's outputs of one step (a verify step keeps several tokens) as one: the last, with every
    delta joined."""
    last = outputs[-1]
    if len(outputs) == 1:
        return last
    last.new_token_ids = [t for o in outputs for t in o.new_token_ids]
    last.new_text = "".join(o.new_text for o in outputs)
    if last.new_logprobs is not None:
        last.new_logprobs = [entry for o in outputs for entry in o.new_logprobs or []]
    return last


def _generator_states(requests: list[Request]) -> dict[int, torch.Tensor]:
    """The RNG state of each seeded request's generator (cheap: seeded requests only)."""
    return {id(r): r.generator.get_state() for r in requests if r.generator is not None}


def _rewind_generators(requests: list[Request], states: dict[int, torch.Tensor]) -> None:
    for request in requests:
        if request.generator is not None and id(request) in states:
            request.generator.set_state(states[id(request)])
