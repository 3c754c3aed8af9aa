"""Engine settings: user overrides on top of configs/<device>.yaml."""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, fields, replace
from typing import Any, Literal

import torch

from engine.capture_sizes import cap_sizes, parse_sizes
from engine.errors import EngineError
from engine.platform import Platform, load_yaml_config
from engine.setting import setting, setting_factory
from engine.speculative.config import SpeculativeConfig, sglang_speculative_config

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# KV caches may also be FP8 (e4m3 with the checkpoint's per-layer k/v scales, else 1.0 as vLLM's default; "fp8" is
# vLLM's alias).
KV_DTYPES = {**DTYPES, "fp8_e4m3": torch.float8_e4m3fn, "fp8": torch.float8_e4m3fn}


def _with_capture_config(defaults: dict[str, Any], path: str, device: str, model: str | None) -> dict[str, Any]:
    """The device YAML with a tuned file's sizes over it (its device sections merged key by key): decode
    capture sizes (`engine tune-capture`) and/or extend-graph token buckets (`engine tune-capture --extend`)."""
    try:
        tuned = load_yaml_config(path)
    except OSError as exc:
        raise EngineError(f"--capture-config {path}: {exc.strerror or exc}") from exc
    has_decode = bool(parse_sizes(tuned.get("capture_sizes")))
    if not has_decode and "extend_capture_tokens" not in tuned:
        raise EngineError(f"--capture-config {path}: no capture_sizes or extend_capture_tokens in it")
    made_for = tuned.get("tuned_for") or {}
    if made_for.get("device") not in (None, device):
        logger.warning("%s was tuned on %s; this engine runs on %s", path, made_for["device"], device)
    if made_for.get("model") and model and os.path.basename(os.path.normpath(model)) not in str(made_for["model"]):
        logger.warning("%s was tuned for %s; this engine loads %s", path, made_for["model"], model)
    merged = dict(defaults)
    if has_decode:
        merged["capture_sizes"] = tuned["capture_sizes"]
        merged["max_capture_size"] = tuned.get("max_capture_size") or max(parse_sizes(tuned["capture_sizes"]) or [1])
        logger.info("capture sizes from %s: %s", path, merged["capture_sizes"])
    if "extend_capture_tokens" in tuned:
        # The buckets were measured over the extend step the file names (compiled or eager): that step too.
        merged["extend_capture_tokens"] = tuned["extend_capture_tokens"] or []
        if "compile_extend" in tuned:
            merged["compile_extend"] = bool(tuned["compile_extend"])
        logger.info("extend-graph token buckets from %s: %s", path, merged["extend_capture_tokens"] or "none")
    for section, values in tuned.items():  # the device's own sections (hpu:, npu:), key by key
        if isinstance(values, dict) and isinstance(defaults.get(section), dict):
            merged[section] = {**defaults[section], **values}
    return merged


def _with_device_options(
    defaults: dict[str, Any], options: dict[str, dict[str, Any]], platform: Platform
) -> dict[str, Any]:
    """The device YAML with --device-options' sections merged over its own, key by key. A section the YAML
    does not have is no setting of this device: refused by name (the platform checks the keys it reads)."""
    merged = dict(defaults)
    for section, values in options.items():
        if not isinstance(defaults.get(section), dict):
            raise EngineError(f"--device-options {section!r}: {platform.name} has no such section in its YAML")
        merged[section] = {**defaults[section], **values}
    return merged


# The settings resolve() requires to be positive integers (EngineConfig.positive_int reads them).
PositiveIntSetting = Literal["page_size", "max_num_seqs", "max_model_len", "max_prefill_tokens"]
POSITIVE_INT_SETTINGS: tuple[PositiveIntSetting, ...] = (
    "page_size",
    "max_num_seqs",
    "max_model_len",
    "max_prefill_tokens",
)

QUANTIZATIONS = ("auto", "fp8", "gguf", "none")
HICACHE_WRITE_POLICIES = ("write_through", "write_back")
GGUF_ACTIVATIONS = ("auto", "float32", "int8x2", "int8")
CPU_PREFILL_WEIGHTS = ("auto", "bf16", "gguf")
CPU_PREFILL_ATTENTION = ("auto", "bf16", "float32")


def _check_hierarchical_cache(config: EngineConfig) -> None:
    """--enable-hierarchical-cache's settings make sense together (it needs the prefix cache it sits under)."""
    if not config.enable_prefix_caching:
        raise EngineError("--enable-hierarchical-cache needs the prefix cache (drop --disable-prefix-caching)")
    if config.tensor_parallel_size != 1:
        raise EngineError("--enable-hierarchical-cache with tensor parallelism is not supported yet")
    if config.hicache_write_policy not in HICACHE_WRITE_POLICIES:
        raise EngineError(
            f"unknown --hicache-write-policy {config.hicache_write_policy!r}; "
            f"choose one of {', '.join(HICACHE_WRITE_POLICIES)}"
        )
    if not (float(config.hicache_size) > 0 or float(config.hicache_ratio) > 0):
        raise EngineError("the host KV tier needs --hicache-size > 0 or --hicache-ratio > 0")


def _parse_device_options(text: str) -> dict[str, Any]:
    """--device-options: a JSON object of device sections, e.g. {"hpu": {"graph_mode": "lazy"}}."""
    value = json.loads(text)
    if not isinstance(value, dict) or not all(isinstance(v, dict) for v in value.values()):
        raise ValueError(f"--device-options takes a JSON object of sections (objects), got {text!r}")
    return value


@dataclass
class EngineConfig:
    """Every engine setting, each declared once: its default, and the help of the command-line flag made from
    it (engine/cli_flags.py). None: the device's YAML (configs/<device>.yaml) decides, in resolve()."""

    model: str | None = setting(None, "HF folder, .gguf file, or preset name (default: embedded SmolLM2-135M-Instruct)")
    device: str = setting("auto", "one of {devices}")
    dtype: str = setting("auto", "the model's dtype (auto: the platform's choice)", choices=("auto", *DTYPES))
    kv_cache_dtype: str = setting(
        "auto",
        "the KV cache's dtype (auto: the model's; fp8 / fp8_e4m3: half the bytes of bf16, cuda's Triton attention "
        "only, scaled by the checkpoint's k/v scales where it has them; docs/quantization.md)",
        choices=("auto", *KV_DTYPES),
    )
    load_format: str = setting("auto", "how to read --model", choices=("auto", "safetensors", "gguf", "dummy"))
    quantization: str = setting(
        "auto",
        "auto: the checkpoint's own (FP8 checkpoints in FP8; GGUF blocks kept on the CPU); fp8: also quantize a "
        "bf16/fp16 checkpoint's linears to FP8 at load (CUDA kernels); gguf: insist on the CPU's GGUF blocks; none: "
        "dequantize at load; docs/quantization.md",
        choices=QUANTIZATIONS,
    )
    gguf_activations: str = setting(
        "auto",
        "kept GGUF blocks, decode rows: auto (int8x2), float32 (exact), int8x2 (each block of 32 activations as "
        "two int8 levels, ~16 bits, integer dot products) or int8 (one level: llama.cpp's numerics, each activation "
        "rounded to 1/254 of its block's largest); docs/quantization.md",
        choices=GGUF_ACTIVATIONS,
    )
    cpu_prefill_weights: str = setting(
        "auto",
        "kept GGUF blocks, prefill rows: auto (a packed bf16 copy for oneDNN's bf16 GEMM where the CPU has "
        "AVX512-BF16 or AMX and the copy fits in a quarter of the free memory; else the block kernels), bf16 "
        "(insist on the copy) or gguf (the block kernels at every row count); docs/quantization.md",
        choices=CPU_PREFILL_WEIGHTS,
    )
    cpu_prefill_attention: str = setting(
        "auto",
        "CPU, prefill steps whose every request has 32 new tokens or more: attention with bf16 dot products "
        "(a native AVX512-BF16 kernel, softmax in float32) or float32 SDPA. auto: bf16 where the CPU has "
        "AVX512-BF16 and the step's matmuls already run in bf16 (--cpu-prefill-weights' copy kept), else float32; "
        "bf16: insist (an error without AVX512-BF16); float32: SDPA always; docs/cpu.md",
        choices=CPU_PREFILL_ATTENTION,
    )
    page_size: int | None = setting(None, "tokens per KV page")
    max_num_seqs: int | None = setting(None, "the most requests a step runs")
    max_model_len: int | None = setting(None, "the longest context (prompt and output)")
    max_prefill_tokens: int | None = setting(None, "the most prompt tokens one step takes")
    kv_cache_tokens: int | None = setting(None, "the KV pool's size in tokens (overrides the memory fraction)")
    kv_cache_memory_fraction: float | None = setting(None, "the fraction of free device memory the KV pool takes")
    capture_sizes: list[int] | str | None = setting(None, "comma-separated decode batch sizes to capture, e.g. 1,2,4,8")
    max_capture_size: int | None = setting(None, "the largest decode batch size captured")
    capture_config: str | None = setting(
        None,
        "YAML of tuned capture sizes (written by `engine tune-capture`): its capture_sizes / max_capture_size and "
        "hpu:/npu: sections replace the device YAML's; --capture-sizes wins over it",
    )
    kv_events_config: str | None = setting(
        None,
        "KV cache events for KV-aware routers, as vLLM's JSON: e.g. '{\"enable_kv_cache_events\": true, "
        '"publisher": "zmq", "endpoint": "tcp://*:5557"}\' (docs/server.md#kv-cache-events)',
    )
    speculative_config: str | None = setting(
        None,
        'speculative decoding as vLLM\'s JSON: e.g. \'{"method": "ngram", "num_speculative_tokens": 4, '
        '"prompt_lookup_max": 4, "prompt_lookup_min": 2}\' (docs/speculative.md); runs without overlap scheduling',
    )
    speculative_algorithm: str | None = setting(
        None,
        "SGLang's spelling of --speculative-config: NGRAM, STANDALONE (a draft model) or EAGLE3 (an EAGLE-3 head); "
        "docs/speculative.md",
    )
    speculative_num_steps: int | None = setting(None, "SGLang: draft tokens per request and step (a chain)")
    speculative_num_draft_tokens: int | None = setting(
        None, "SGLang: tokens each verify step scores per request (the drafts and one more)"
    )
    speculative_draft_model_path: str | None = setting(
        None, "SGLang: the draft model (STANDALONE) or the EAGLE-3 head's folder (EAGLE3)"
    )
    speculative_eagle_topk: int | None = setting(None, "SGLang: drafts per position; only 1 (chains) is supported")
    enable_lora: bool = setting(False, "serve LoRA adapters (docs/lora.md)")
    max_loras: int = setting(4, "LoRA adapters in device slots at once")
    max_cpu_loras: int | None = setting(
        None,
        "LoRA adapters kept loaded in host memory, swapped into the device slots as requests need them "
        "(default: --max-loras)",
    )
    max_lora_rank: int = setting(16, "the largest LoRA rank an adapter may have")
    lora_modules: str | None = setting(
        None, "LoRA adapters to load at start, name=path[,name=path...] (implies --enable-lora)"
    )
    disable_graphs: bool = setting(False, "run every step eagerly")
    strict_graphs: bool = setting(False, "fail if anything compiles after warm-up")
    compile_decode: bool | None = setting(
        None, "cuda/rocm: torch.compile the decode step before capturing graphs (default from configs/<device>.yaml)"
    )
    compile_extend: bool | None = setting(
        None,
        "torch.compile prefill, chunk and mixed steps, token count dynamic (default from configs/<device>.yaml: "
        "on for cuda; off with --disable-graphs)",
    )
    extend_capture_tokens: list[int] | str | None = setting(
        None,
        "cuda: token counts to capture extend/mixed-step CUDA graphs for, e.g. 16,64,256 ('' for none); xla: the "
        "prefill programs' token buckets (default from configs/<device>.yaml)",
    )
    enable_prefix_caching: bool = setting(
        True,
        "reuse the KV of cached prompt prefixes",
        off_names=("--disable-prefix-caching", "--disable-radix-cache"),
    )
    enable_hierarchical_cache: bool = setting(
        False,
        "keep KV pages evicted from the device pool in a host-memory tier and load them back on a prefix hit "
        "instead of recomputing them (SGLang's HiCache; docs/kv_host_tier.md)",
    )
    hicache_ratio: float = setting(
        2.0, "the host tier's size as a multiple of the device KV pool's (--hicache-size wins when set)"
    )
    hicache_size: float = setting(0.0, "the host tier's size in GiB (0: from --hicache-ratio)", metavar="GIB")
    hicache_write_policy: str = setting(
        "write_through",
        "when cached pages are copied to the host tier: write_through (as soon as they are cached, so an eviction "
        "costs no copy) or write_back (only when evicted from the device)",
        choices=HICACHE_WRITE_POLICIES,
    )
    chunked_prefill_size: int | None = setting(
        None, "prefill at most this many prompt tokens per step (<= 0: off; default from configs/<device>.yaml)"
    )
    max_extend_step_ms: float | None = setting(
        None,
        "cap the prompt tokens of an extend step so it takes at most this long, by its measured speed, which bounds "
        "how long decodes, arrivals and aborts wait behind a prefill (<= 0: off; default from configs/<device>.yaml)",
    )
    overlap_schedule: bool | None = setting(
        None,
        "schedule and prepare the next step while the device runs this one (default from configs/<device>.yaml: "
        "on for cuda/rocm, off where steps run synchronously); --no-overlap-schedule to debug",
    )
    mixed_steps: bool | None = setting(
        None,
        "run decodes and prefill chunks in one ragged step under the token budget (default from "
        "configs/<device>.yaml: on for cuda/rocm); --no-mixed-steps keeps separate prefill and decode steps",
    )
    debug_kv_invariant: bool = setting(False, "check the KV pool invariant after every step")
    freeze_gc: bool | None = setting(
        None,
        "after start-up, move the engine's Python objects (modules, compiled code: ~370k) out of the cyclic garbage "
        "collector's scans until shutdown, as vLLM does (engine/gc_freeze.py; default: on for serve and bench "
        "throughput, which hold one engine for the process's life, off for a library engine)",
    )
    tensor_parallel_size: int = setting(
        1,
        "split the model over N ranks, one process each (NCCL on CUDA, gloo on CPU); docs/tensor_parallel.md",
        names=("--tensor-parallel-size", "--tp"),
        metavar="N",
    )
    dist_timeout_s: float = setting(
        600.0,
        "tensor parallelism: how long a collective (and start-up) waits for the other ranks before the engine fails "
        "naming the rank that did not respond",
        names=("--dist-timeout",),
        metavar="SECONDS",
    )
    warmup: bool = setting(
        True, "run one short request through the real step path at start-up (first-call costs paid there)"
    )
    seed: int = setting(0, "the engine's random seed")
    device_options: dict[str, dict[str, Any]] = setting_factory(
        dict,
        "device sections over the device YAML's, key by key, as a JSON object: "
        '{"hpu": {"graph_mode": "lazy"}} (docs/configuration.md)',
        parse=_parse_device_options,
        on_command_line=True,
    )
    device_config: dict[str, Any] = setting_factory(dict, "the device YAML, as resolve() read it")

    def resolve(self, platform: Platform) -> EngineConfig:
        """Fill every unset value from the device's YAML; validate."""
        defaults = load_yaml_config(platform.default_config())
        if self.capture_config:
            defaults = _with_capture_config(defaults, self.capture_config, platform.name, self.model)
        values: dict[str, Any] = {}
        if self.capture_sizes is not None and self.max_capture_size is None:
            # Sizes given explicitly: their largest is the maximum, not the YAML's.
            values["max_capture_size"] = max(parse_sizes(self.capture_sizes) or [1])
        for f in fields(self):
            if f.name in values:
                continue
            if getattr(self, f.name) is None and f.name in defaults:
                values[f.name] = defaults[f.name]
        resolved = replace(self, **values, device_config=_with_device_options(defaults, self.device_options, platform))
        if resolved.dtype == "auto":
            max_batch = min(
                int(resolved.max_num_seqs or 1), int(resolved.max_capture_size or resolved.max_num_seqs or 1)
            )
            resolved.dtype = defaults.get("dtype") or str(platform.default_dtype(max_batch)).replace("torch.", "")
        if resolved.dtype not in DTYPES:
            raise EngineError(f"unknown dtype {resolved.dtype!r}; choose one of {', '.join(DTYPES)} or auto")
        if resolved.kv_cache_dtype == "auto":
            resolved.kv_cache_dtype = defaults.get("kv_cache_dtype") or resolved.dtype
        if resolved.quantization not in QUANTIZATIONS:
            raise EngineError(
                f"unknown quantization {resolved.quantization!r}; choose one of {', '.join(QUANTIZATIONS)}"
            )
        if resolved.gguf_activations not in GGUF_ACTIVATIONS:
            raise EngineError(
                f"unknown GGUF activations {resolved.gguf_activations!r}; choose one of {', '.join(GGUF_ACTIVATIONS)}"
            )
        if resolved.quantization == "gguf" and not platform.runs_gguf_blocks:
            raise EngineError(
                f"--quantization gguf runs on the cpu only (its kernels); on {platform.name} use auto or none"
            )
        if resolved.kv_cache_dtype not in KV_DTYPES:
            raise EngineError(
                f"unknown kv_cache_dtype {resolved.kv_cache_dtype!r}; choose one of {', '.join(KV_DTYPES)} or auto"
            )
        for name in POSITIVE_INT_SETTINGS:
            value = getattr(resolved, name)
            if value is None or int(value) < 1:
                raise EngineError(f"{name} must be a positive integer, got {value!r}")
        tp = resolved.tensor_parallel_size
        if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
            raise EngineError(f"tensor_parallel_size must be a positive integer, got {tp!r}")
        if not float(resolved.dist_timeout_s) > 0:
            raise EngineError(f"dist_timeout_s must be positive, got {resolved.dist_timeout_s!r}")
        if resolved.enable_hierarchical_cache:
            _check_hierarchical_cache(resolved)
        sglang = sglang_speculative_config(
            resolved.speculative_algorithm,
            resolved.speculative_num_steps,
            resolved.speculative_num_draft_tokens,
            resolved.speculative_draft_model_path,
            resolved.speculative_eagle_topk,
        )
        if sglang is not None:
            if resolved.speculative_config:
                raise EngineError("--speculative-algorithm (SGLang's flags) and --speculative-config: give one")
            resolved.speculative_config = json.dumps(sglang)
        if resolved.lora_modules:
            resolved.enable_lora = True
        if resolved.enable_lora:
            if resolved.speculative_config:
                raise EngineError("--enable-lora with --speculative-config is not supported yet")
            if resolved.max_loras < 1 or resolved.max_lora_rank < 1:
                raise EngineError(
                    f"--max-loras and --max-lora-rank must be >= 1, got {resolved.max_loras}, {resolved.max_lora_rank}"
                )
        sizes = parse_sizes(resolved.capture_sizes) or [1]
        # Never capture beyond what the scheduler can batch (vLLM caps at max_num_seqs too): a decode step's
        # rows, which a verify step multiplies by 1 + its drafts (the settings are checked here, at start).
        spec = SpeculativeConfig.parse(resolved.speculative_config)
        max_rows = resolved.positive_int("max_num_seqs") * (1 + (spec.num_speculative_tokens if spec else 0))
        max_size = min(resolved.max_capture_size or sizes[-1], max_rows)
        resolved.capture_sizes = cap_sizes(sizes, max_size)
        return resolved

    def positive_int(self, name: PositiveIntSetting) -> int:
        """One of POSITIVE_INT_SETTINGS of a resolved config (resolve() fills and checks them)."""
        value = getattr(self, name)
        if value is None:
            raise EngineError(f"{name} is not set: EngineConfig.resolve() fills it")
        return int(value)

    def resolved_capture_sizes(self) -> list[int]:
        """The decode capture sizes of a resolved config (resolve() leaves them a sorted list)."""
        if not isinstance(self.capture_sizes, list):
            raise EngineError(f"capture_sizes {self.capture_sizes!r} are not resolved: EngineConfig.resolve() does it")
        return list(self.capture_sizes)

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def kv_torch_dtype(self) -> torch.dtype:
        return KV_DTYPES[self.kv_cache_dtype]
