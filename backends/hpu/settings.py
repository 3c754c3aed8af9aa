"""Every Gaudi setting, declared once: the keys of the `hpu:` section of configs/hpu.yaml.

The engine reads the section from its resolved config (EngineConfig.device_config: the device YAML, a
--capture-config's tuned `hpu:` section over it, then --device-options / the generated --hpu-* flags), and
the platform and its runners take their values from here, never from the YAML file or the environment
again. The names follow vllm-gaudi's settings (VLLM_GRAPH_..., VLLM_EXPONENTIAL_BUCKETING,
VLLM_REGIONAL_COMPILATION, VLLM_FP32_SOFTMAX, VLLM_PROMPT_USE_FUSEDSDPA, VLLM_SKIP_WARMUP,
VLLM_{PROMPT,DECODE}_*_BUCKET_*), which are environment variables there and keys here.

Two kinds of environment variable remain, for debugging on hardware only (docs/configuration.md):
ENGINE_HPU_SKIP_WARMUP (read here) and the bucket ranges ENGINE_{DECODE_BS,DECODE_BLOCK,PROMPT_BS,
PROMPT_SEQ,PROMPT_CTX}_BUCKET_{MIN,STEP,MAX} (read by backends/hpu/bucketing.py), each logged when it
overrides the config.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any

from engine.setting import setting

logger = logging.getLogger(__name__)

GRAPH_MODES = ("compile", "lazy", "eager")
TRI_STATE = ("auto", "true", "false")
SKIP_WARMUP_ENV = "ENGINE_HPU_SKIP_WARMUP"


def parse_range(text: str) -> dict[str, int]:
    """A bucket range on the command line: MIN,STEP,MAX."""
    parts = [int(p) for p in text.split(",")]
    if len(parts) != 3:
        raise ValueError(f"a bucket range is MIN,STEP,MAX, got {text!r}")
    return dict(zip(("min", "step", "max"), parts))


def tri_state(value: object, name: str) -> str:
    """auto | true | false from a YAML bool or a word."""
    if isinstance(value, bool):
        return "true" if value else "false"
    text = str(value).strip().lower()
    text = {"1": "true", "yes": "true", "on": "true", "0": "false", "no": "false", "off": "false"}.get(text, text)
    if text not in TRI_STATE:
        raise ValueError(f"hpu.{name} must be auto, true or false, got {value!r}")
    return text


def env_flag(name: str, default: bool, env: Mapping[str, str]) -> bool:
    raw = env.get(name, "").strip().lower()
    return default if not raw else raw in ("1", "true", "yes", "on")


@dataclass(frozen=True)
class HpuSettings:
    graph_mode: str | None = setting(
        None,
        "compile | lazy | eager (none: what the bridge runs, else PT_HPU_LAZY_MODE)",
        choices=GRAPH_MODES,
    )
    bucketing: str = setting("linear", "bucket spacing: linear or exponential", choices=("linear", "exponential"))
    strict: bool = setting(True, "raise if something compiles inside a decode step after warm-up, in every mode")
    regional_compilation: bool = setting(True, "compile mode: one decoder layer's graph serves every layer")
    fp32_softmax: str = setting(
        "auto", "decode softmax in fp32 (auto: the families that need it, Qwen2 / Qwen2-MoE)", choices=TRI_STATE
    )
    fused_sdpa: str = setting(
        "auto",
        "padded prompts through Habana's FusedSDPA (auto: where it imports; false: the masked matmul)",
        choices=TRI_STATE,
    )
    skip_warmup: bool = setting(
        False, "development only: buckets compile on first use (ENGINE_HPU_SKIP_WARMUP=1 overrides)"
    )
    decode_bs_bucket: dict[str, int] | None = setting(
        None,
        "decode batch-size buckets MIN,STEP,MAX (capture_sizes wins unless an env range is set)",
        parse=parse_range,
        metavar="MIN,STEP,MAX",
    )
    decode_block_bucket: dict[str, int] | None = setting(
        None, "decode KV-block buckets MIN,STEP,MAX (pages per batch)", parse=parse_range, metavar="MIN,STEP,MAX"
    )
    prompt_bs_bucket: dict[str, int] | None = setting(
        None, "prompts per padded prefill batch MIN,STEP,MAX", parse=parse_range, metavar="MIN,STEP,MAX"
    )
    prompt_seq_bucket: dict[str, int] | None = setting(
        None, "new tokens per padded prompt row MIN,STEP,MAX", parse=parse_range, metavar="MIN,STEP,MAX"
    )
    prompt_ctx_bucket: dict[str, int] | None = setting(
        None, "cached-prefix pages per prompt row MIN,STEP,MAX (max 0: off)", parse=parse_range, metavar="MIN,STEP,MAX"
    )
    max_prompt_ctx_buckets: int | None = setting(None, "warm at most this many prefix buckets, the fewest tokens first")
    max_num_batched_tokens: int | None = setting(None, "no prompt bucket pads to more tokens than this")

    @classmethod
    def from_section(cls, section: Mapping[str, Any], env: Mapping[str, str] | None = None) -> HpuSettings:
        """The settings of one `hpu:` mapping; an unknown key or value is refused by name. env (default: the
        process's): the debugging override ENGINE_HPU_SKIP_WARMUP."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(section) - known)
        if unknown:
            raise ValueError(f"unknown hpu settings {unknown}; the section takes {sorted(known)}")
        values = {k: v for k, v in section.items() if v is not None}
        for name in ("fp32_softmax", "fused_sdpa"):
            if name in values:
                values[name] = tri_state(values[name], name)
        mode = values.get("graph_mode")
        if mode is not None and str(mode).strip().lower() not in GRAPH_MODES:
            raise ValueError(f"hpu.graph_mode must be one of {GRAPH_MODES}, got {mode!r}")
        settings = cls(**values)
        env = os.environ if env is None else env
        skip = env_flag(SKIP_WARMUP_ENV, settings.skip_warmup, env)
        if skip != settings.skip_warmup:
            logger.warning("%s overrides hpu.skip_warmup: %s", SKIP_WARMUP_ENV, skip)
            settings = cls(**{**asdict(settings), "skip_warmup": skip})
        return settings

    @classmethod
    def from_device_config(cls, device_config: Mapping[str, Any], env: Mapping[str, str] | None = None) -> HpuSettings:
        """The settings of a configs/hpu.yaml-shaped mapping (its `hpu:` section)."""
        return cls.from_section(device_config.get("hpu") or {}, env)

    def as_section(self) -> dict[str, Any]:
        """The `hpu:` mapping these settings are (None values left out), as backends/hpu/bucketing.py reads it."""
        return {k: v for k, v in asdict(self).items() if v is not None}
