"""`engine bench latency --peers`: time to first token beside HF transformers, on a tiny checkpoint."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine.cli import build_parser


def test_peers_time_the_same_prompts_and_agree_on_the_first_token(tiny_llama: str, tmp_path: Path) -> None:
    output = tmp_path / "latency.json"
    args = build_parser().parse_args(
        [
            "bench",
            "latency",
            "--model",
            tiny_llama,
            "--device",
            "cpu",
            "--dtype",
            "float32",
            "--disable-graphs",
            "--peers",
            "--cases",
            "1x7,1x40",
            "--repeats",
            "2",
            "--output-json",
            str(output),
        ]
    )
    args.func(args)
    report = json.loads(output.read_text(encoding="utf-8"))
    assert "threads" in report["cpu_path"] and "prefill linear: dense float32 GEMM" in report["cpu_path"]
    assert "prefill attention: float32 SDPA" in report["cpu_path"]  # float32 matmuls: exact attention too (auto)
    assert [case["input_len"] for case in report["cases"]] == [7, 40]
    for case in report["cases"]:
        systems = case["systems"]
        assert {"engine", "HF float32", "HF bfloat16"} <= set(systems)  # llama.cpp only for a GGUF file
        for timing in systems.values():
            assert len(timing["ttft_s_all"]) == 2 and timing["ttft_s"] > 0
        # The same weights read the same prompts: the engine's first tokens are HF float32's.
        assert systems["engine"]["first_tokens"] == systems["HF float32"]["first_tokens"]


def test_peers_need_one_prompt_at_a_time(tiny_llama: str) -> None:
    args = build_parser().parse_args(
        ["bench", "latency", "--model", tiny_llama, "--device", "cpu", "--disable-graphs", "--peers"]
    )
    with pytest.raises(ValueError, match="one prompt at a time"):
        args.func(args)
