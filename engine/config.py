"""Engine settings: user overrides on top of configs/<device>.yaml."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field, fields, replace
from typing import Any, Literal

import torch

from engine.capture_sizes import cap_sizes, parse_sizes
from engine.errors import EngineError
from engine.platform import Platform, load_yaml_config

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
    for section in ("hpu", "npu"):
        if isinstance(tuned.get(section), dict):
            merged[section] = {**(defaults.get(section) or {}), **tuned[section]}
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
GGUF_ACTIVATIONS = ("auto", "float32", "int8x2", "int8")


@dataclass
class EngineConfig:
    model: str | None = None  # None: the embedded SmolLM2-135M-Instruct GGUF
    device: str = "auto"
    dtype: str = "auto"
    kv_cache_dtype: str = "auto"  # auto: the model dtype (the CPU YAML asks for float32)
    load_format: str = "auto"
    # How quantized checkpoint weights run: "auto" (FP8 checkpoints in FP8; GGUF blocks kept on the CPU
    # where its kernels exist, dequantized elsewhere), "fp8" (a dense checkpoint's linears quantized to
    # FP8 at load), "gguf" (kept, or an error), "none" (always dequantized).
    quantization: str = "auto"
    # How the CPU's GGUF block kernels take the inputs of decode-sized matmuls: "auto" (int8x2),
    # "float32" (exact), "int8x2" (each block of 32 activations as two int8 levels, ~16 bits, integer dot
    # products) or "int8" (one level: llama.cpp's numerics); docs/quantization.md.
    gguf_activations: str = "auto"
    page_size: int | None = None
    max_num_seqs: int | None = None
    max_model_len: int | None = None
    max_prefill_tokens: int | None = None
    kv_cache_tokens: int | None = None  # explicit pool size; overrides the memory fraction
    kv_cache_memory_fraction: float | None = None
    capture_sizes: list[int] | str | None = None
    max_capture_size: int | None = None
    # A YAML of tuned capture sizes (`engine tune-capture` writes one): its capture_sizes / max_capture_size
    # (and hpu:/npu: sections) replace the device YAML's; explicit capture_sizes still win.
    capture_config: str | None = None
    disable_graphs: bool = False
    strict_graphs: bool = False  # raise if anything compiles after warm-up
    compile_decode: bool | None = None  # cuda/rocm: torch.compile the step before capturing it
    # Prefill, chunk and mixed steps through torch.compile'd layers, token count dynamic (off with disable_graphs).
    compile_extend: bool | None = None
    # cuda/rocm: CUDA graphs of extend and mixed steps for these token counts (None: the YAML; [] or "": none).
    extend_capture_tokens: list[int] | str | None = None
    enable_prefix_caching: bool = True
    chunked_prefill_size: int | None = None  # tokens of prompt per step; <= 0 disables chunking
    # Shrink the prompt-token budget so one extend step takes at most this long (measured per token),
    # which bounds how long decodes, arrivals and aborts wait behind a prefill (None: the budget alone).
    max_extend_step_ms: float | None = None
    # Launch step N+1 before reading step N's tokens back, so host work hides behind device work
    # (None: the device's YAML; on for cuda/rocm, off where steps run synchronously).
    overlap_schedule: bool | None = None
    # One ragged step: running decodes and prefill chunks share a step under the token budget
    # (None: the device's YAML; on for cuda/rocm; off where prefill and decode graphs differ).
    mixed_steps: bool | None = None
    debug_kv_invariant: bool = False  # check the KV pool invariant after every step
    # Once built, the engine's Python objects (modules, dynamo/inductor's compiled code: ~370k of them) leave
    # the cyclic GC's generations until shutdown() (engine/gc_freeze.py). For a process that serves one engine:
    # `engine serve` and `engine bench throughput` turn it on. None: ENGINE_FREEZE_GC=1, else off.
    freeze_gc: bool | None = None
    # Tensor parallelism: this many ranks, one process each (rank 0 is this process; docs/tensor_parallel.md).
    tensor_parallel_size: int = 1
    # How long a tensor-parallel collective (and start-up) waits for the other ranks before the engine fails
    # naming the rank that did not come: a hung rank ends in an error, not a silent hang.
    dist_timeout_s: float = 600.0
    warmup: bool = True  # one short request through the real step path at start-up (first-call costs)
    seed: int = 0
    device_config: dict[str, Any] = field(default_factory=dict)  # the YAML, as read

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
        resolved = replace(self, **values, device_config=defaults)
        if resolved.freeze_gc is None:
            resolved.freeze_gc = os.environ.get("ENGINE_FREEZE_GC", "0") not in ("0", "false", "off", "")
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
        if resolved.quantization == "gguf" and platform.name != "cpu":
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
        sizes = parse_sizes(resolved.capture_sizes) or [1]
        max_size = min(resolved.max_capture_size or sizes[-1], resolved.positive_int("max_num_seqs"))
        # Never capture beyond what the scheduler can batch (vLLM caps at max_num_seqs too).
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
