"""Settings live in one place: each EngineConfig field (and each key of a device section, hpu:) is declared
once, its command-line flag made from that declaration (engine/setting.py, engine/cli_flags.py); the device
YAML, --capture-config, --device-options and the --hpu-* flags resolve into EngineConfig.device_config, which
the platform reads (never the YAML file or the environment again); ENGINE_* variables are for debugging and
tests only, each listed in docs/configuration.md."""

from __future__ import annotations

import argparse
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

from backends.cpu.platform import CpuPlatform
from backends.hpu.platform import HpuPlatform
from backends.hpu.settings import HpuSettings
from engine.cli import build_parser, engine_config_from_args
from engine.cli_flags import add_setting_flags, values_from_args
from engine.config import EngineConfig
from engine.errors import EngineError
from engine.setting import described_fields, setting

ROOT = Path(__file__).resolve().parent.parent


def _run_args(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["run", *argv])


def test_every_field_has_its_flag_and_no_flags_mean_the_defaults() -> None:
    parser = build_parser()
    run = parser.parse_args(["run"])
    for f, spec in described_fields(EngineConfig):  # raises for a field declared without setting()
        assert hasattr(run, f.name) == spec.on_command_line, f.name
    assert engine_config_from_args(run) == EngineConfig()


def test_flags_set_their_fields() -> None:
    config = engine_config_from_args(
        _run_args(
            "--disable-prefix-caching",
            "--tp",
            "2",
            "--no-warmup",
            "--compile-decode",
            "--max-prefill-tokens",
            "100",
            "--dist-timeout",
            "5",
            "--kv-cache-memory-fraction",
            "0.5",
        )
    )
    assert not config.enable_prefix_caching and config.tensor_parallel_size == 2 and not config.warmup
    assert config.compile_decode is True and config.mixed_steps is None  # a --x/--no-x flag not given: unset
    assert (config.max_prefill_tokens, config.dist_timeout_s, config.kv_cache_memory_fraction) == (100, 5.0, 0.5)
    with pytest.raises(SystemExit):
        _run_args("--dtype", "float64")  # choices come from the definition too


def test_a_new_field_gets_its_flag() -> None:
    @dataclass
    class Settings:
        rounds: int = setting(3, "how many rounds")
        fast: bool | None = setting(None, "go fast")
        name: str = setting("a", "a name", names=("--label",), choices=("a", "b"))

    parser = argparse.ArgumentParser()
    add_setting_flags(parser, Settings)
    assert values_from_args(parser.parse_args(["--rounds", "5", "--no-fast", "--label", "b"]), Settings) == {
        "rounds": 5,
        "fast": False,
        "name": "b",
    }
    assert Settings(**values_from_args(parser.parse_args([]), Settings)) == Settings()

    @dataclass
    class Undeclared:
        rounds: int = 3

    with pytest.raises(TypeError, match="rounds"):
        add_setting_flags(argparse.ArgumentParser(), Undeclared)


def test_device_section_flags_and_options_reach_the_platform() -> None:
    args = _run_args(
        "--device",
        "hpu",
        "--hpu-graph-mode",
        "lazy",
        "--hpu-decode-block-bucket",
        "4,4,32",
        "--device-options",
        '{"hpu": {"strict": false, "graph_mode": "compile"}}',
    )
    config = engine_config_from_args(args)
    assert config.device_options == {
        "hpu": {"strict": False, "graph_mode": "lazy", "decode_block_bucket": {"min": 4, "step": 4, "max": 32}}
    }  # a flag wins over the same key of --device-options
    platform = HpuPlatform()
    resolved = config.resolve(platform)
    platform.configure(resolved)
    settings = platform.settings
    assert settings.graph_mode == "lazy" and settings.strict is False
    assert settings.decode_block_bucket == {"min": 4, "step": 4, "max": 32}
    assert settings.prompt_seq_bucket == {"min": 128, "step": 128, "max": 4096}  # the YAML's, under the overrides
    assert platform.graph_mode() == "lazy"
    assert engine_config_from_args(_run_args()).device_options == {}  # no section flag given: nothing overridden


def test_unknown_sections_keys_and_values_are_refused_by_name() -> None:
    with pytest.raises(EngineError, match=r"'npu'.*cpu has no such section"):
        EngineConfig(device="cpu", device_options={"npu": {"max_graphs": 4}}).resolve(CpuPlatform())
    platform = HpuPlatform()
    typo = EngineConfig(device="hpu", device_options={"hpu": {"graph_mod": "lazy"}}).resolve(platform)
    with pytest.raises(ValueError, match="graph_mod"):
        platform.configure(typo)
    with pytest.raises(ValueError, match="fused_sdpa"):
        HpuSettings.from_section({"fused_sdpa": "sometimes"})
    with pytest.raises(ValueError, match="graph_mode"):
        HpuSettings.from_section({"graph_mode": "fast"})
    with pytest.raises(SystemExit):
        _run_args("--device-options", '["hpu"]')  # not an object of sections


def test_skip_warmup_is_a_setting_with_a_debugging_override() -> None:
    assert not HpuSettings.from_section({}, env={}).skip_warmup
    assert HpuSettings.from_section({"skip_warmup": True}, env={}).skip_warmup
    assert HpuSettings.from_section({}, env={"ENGINE_HPU_SKIP_WARMUP": "1"}).skip_warmup
    assert HpuSettings.from_section({"fp32_softmax": True}, env={}).fp32_softmax == "true"  # YAML bools read


def _engine_variables_read() -> set[str]:
    """Every ENGINE_* name the engine's code mentions (a read, or the prefix a family's names are built from)."""
    names: set[str] = set()
    for folder in ("engine", "graphs", "backends"):
        for path in (ROOT / folder).rglob("*.py"):
            names |= set(re.findall(r"ENGINE_[A-Z0-9_]*[A-Z0-9]", path.read_text(encoding="utf-8")))
    return names


def _expand(name: str) -> set[str]:
    """ENGINE_{A,B}_X_{C,D} -> the four names it stands for."""
    match = re.search(r"\{([A-Z0-9_,]+)\}", name)
    if match is None:
        return {name}
    head, tail = name[: match.start()], name[match.end() :]
    return set().union(*(_expand(head + part + tail) for part in match.group(1).split(",")))


def test_every_environment_variable_is_listed_in_one_doc() -> None:
    doc = (ROOT / "docs" / "configuration.md").read_text(encoding="utf-8")
    listed = set().union(*(_expand(n) for n in re.findall(r"`(ENGINE_[A-Z0-9_{},]*[A-Z0-9}])`", doc)))
    for name in sorted(_engine_variables_read()):
        assert name in listed or any(full.startswith(name) for full in listed), (
            f"{name} is read by the engine but not listed in docs/configuration.md"
        )
    # The switches that became settings are read no more.
    gone = {
        "ENGINE_FREEZE_GC",
        "ENGINE_HPU_GRAPH_MODE",
        "ENGINE_HPU_STRICT",
        "ENGINE_HPU_FUSED_SDPA",
        "ENGINE_CUDA_GEMV",
    }
    assert not gone & _engine_variables_read()
