"""`engine run` end to end, as a user runs it (subprocess, the embedded SmolLM2)."""

from __future__ import annotations

import subprocess
import sys

from conftest import REPO_ROOT


def run_cli(*args: str, timeout: float = 420) -> subprocess.CompletedProcess:
    result = subprocess.run(
        [sys.executable, "-m", "engine.cli", *args],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    return result


def test_run_eager_completes_the_prompt() -> None:
    result = run_cli("run", "--prompt", "The capital of France is", "--max-tokens", "8", "--disable-graphs")
    assert result.stdout.startswith("The capital of France is")
    continuation = result.stdout[len("The capital of France is") :]
    assert "Paris" in continuation


def test_run_with_graphs_by_default() -> None:
    result = run_cli("run", "--prompt", "The capital of France is", "--max-tokens", "8", "--strict-graphs")
    assert "Paris" in result.stdout[len("The capital of France is") :]
    # The default path put a decode-graph runner first (CPU: the native GGUF step, or compiled sizes) and
    # captured through the capture loop; --strict-graphs would have failed the run had anything compiled
    # while serving.
    runners = "step runners, in the order they are offered a step: decode graphs"
    assert runners in result.stderr and "INFO graphs.capture_loop: captured " in result.stderr, result.stderr[-2000:]


def test_run_chat_and_several_prompts() -> None:
    result = run_cli(
        "run",
        "--chat",
        "--disable-graphs",
        "--max-tokens",
        "16",
        "--prompt",
        "What is the capital of France?",
        "--prompt",
        "What is the capital of Germany?",
    )
    blocks = result.stdout.split("--- ")
    assert len(blocks) == 3, result.stdout  # '' + one block per prompt
    assert "Paris" in blocks[1] and "Berlin" in blocks[2], result.stdout
    # The chat template's markers are not echoed back as text.
    assert "<|im_start|>" not in result.stdout and "assistant" not in blocks[1].split("\n", 1)[1]
