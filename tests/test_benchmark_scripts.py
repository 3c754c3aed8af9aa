"""benchmarks/ that run (issue #40): every script imports and answers --help on a CPU-only machine, the ones
that can run on a CPU run a tiny case, and the `engine bench` subcommands take vLLM's and SGLang's flag names
(engine/bench_args.py), their old names still working but hidden.

Each script runs in a process of its own, `python benchmarks/X.py ...` with the repository root on PYTHONPATH
and no GPU visible. Each of them imports torch (~1.5 s), so the first test of this file starts them all, one
per CPU core at a time, and each test waits for its own. A script added to benchmarks/ is covered by the glob.
"""

from __future__ import annotations

import argparse
import ast
import concurrent.futures
import glob
import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from conftest import REPO_ROOT, build_tiny_checkpoint

BENCHMARKS = os.path.join(REPO_ROOT, "benchmarks")
SCRIPTS = sorted(os.path.basename(path) for path in glob.glob(os.path.join(BENCHMARKS, "*.py")))
# Modules the scripts import rather than scripts: each must import on a CPU-only machine, and has no __main__.
HELPERS = {"gpu_timing.py", "serve_process.py"}
TIMEOUT_S = 300


@dataclass(frozen=True)
class TinyCase:
    """A few seconds of a script's real work on the CPU: its arguments (given the output folder and a tiny
    checkpoint's) and a check of what it printed and wrote."""

    argv: Callable[[Path, str], list[str]]
    check: Callable[[subprocess.CompletedProcess, Path], None]


def _check_profile_sampling(result: subprocess.CompletedProcess, out: Path) -> None:
    report = json.loads((out / "profile_sampling.json").read_text())
    assert report["device"] == "cpu" and set(report["ms"]) == {
        "greedy",
        "temperature",
        "top_k_top_p",
        "top_k_top_p_penalty",
    }


def _check_gguf_formats(result: subprocess.CompletedProcess, out: Path) -> None:
    report = json.loads((out / "gguf_formats.json").read_text())
    formats = {row["format"] for row in report["results"]}
    assert report["shape"] == [64, 256] and {"Q4_0", "Q8_0", "Q4_K", "Q6_K"} <= formats


def _check_profile_decode(result: subprocess.CompletedProcess, out: Path) -> None:
    assert "==== batch 1, context 8: 2 decode steps" in result.stdout
    assert "==== batch 3, context 8: 2 decode steps" in result.stdout


def _check_router_overhead(result: subprocess.CompletedProcess, out: Path) -> None:
    report = json.loads((out / "router_overhead.json").read_text())
    rows = {row["policy"]: row for row in report["results"]}
    assert set(rows) == {"cache_aware", "shortest_queue", "round_robin"}
    assert rows["cache_aware"]["tree_pages"] > 0 and rows["round_robin"]["tree_pages"] == 0
    assert all(row["median_us"] > 0 and row["decisions_per_s"] > 0 for row in rows.values())
    assert "cache_aware" in result.stdout


TINY: dict[str, TinyCase] = {
    "router_overhead.py": TinyCase(
        lambda out, model: [
            *("--replicas", "2", "--cached-prompts", "40", "--requests", "40", "--prompt-len", "96"),
            *("--output-json", str(out / "router_overhead.json")),
        ],
        _check_router_overhead,
    ),
    "profile_sampling.py": TinyCase(
        lambda out, model: [
            *("--device", "cpu", "--batch-size", "4", "--vocab", "512", "--context", "16", "--iters", "5"),
            *("--output", str(out / "profile_sampling.json")),
        ],
        _check_profile_sampling,
    ),
    "gguf_formats.py": TinyCase(
        lambda out, model: [
            *("--out-features", "64", "--in-features", "256", "--matrices", "1", "--rows", "1", "--repeats", "1"),
            *("--output", str(out / "gguf_formats.json")),
        ],
        _check_gguf_formats,
    ),
    # The engine's own API (add_request, scheduler.running, step, abort) as the script drives it.
    "profile_decode.py": TinyCase(
        lambda out, model: [
            *("--device", "cpu", "--model", model, "--disable-graphs"),
            *("--batch-sizes", "1,3", "--context", "8", "--steps", "2", "--top", "3"),
        ],
        _check_profile_decode,
    ),
}


def _env() -> dict[str, str]:
    # No GPU: a script that touched one at import, or to print its help, fails here as on a CPU-only machine.
    return {**os.environ, "PYTHONPATH": REPO_ROOT, "CUDA_VISIBLE_DEVICES": "", "HIP_VISIBLE_DEVICES": ""}


def _run(argv: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, *argv], cwd=REPO_ROOT, env=_env(), capture_output=True, text=True, timeout=TIMEOUT_S
    )


def _docstring(name: str) -> str:
    return ast.get_docstring(ast.parse(Path(BENCHMARKS, name).read_text(encoding="utf-8"))) or ""


@dataclass
class Runs:
    out: Path
    futures: dict[tuple[str, str], concurrent.futures.Future]

    def result(self, kind: str, name: str) -> subprocess.CompletedProcess:
        return self.futures[kind, name].result()


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Runs]:
    out = tmp_path_factory.mktemp("benchmarks")
    workers = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 2
    with concurrent.futures.ThreadPoolExecutor(max_workers=workers) as pool:
        futures: dict[tuple[str, str], concurrent.futures.Future] = {}
        for name in SCRIPTS:
            if name in HELPERS:
                futures["help", name] = pool.submit(_run, ["-c", f"import benchmarks.{name[:-3]}"])
            else:
                futures["help", name] = pool.submit(_run, [os.path.join(BENCHMARKS, name), "--help"])
        model = build_tiny_checkpoint("llama_plain", str(out / "tiny_llama"))  # while those run
        for name, case in TINY.items():
            futures["tiny", name] = pool.submit(_run, [os.path.join(BENCHMARKS, name), *case.argv(out, model)])
        yield Runs(out, futures)


@pytest.mark.parametrize("name", SCRIPTS)
def test_script_imports_and_answers_help_without_a_gpu(name: str, runs: Runs) -> None:
    result = runs.result("help", name)
    assert result.returncode == 0, result.stderr[-4000:]
    has_main = 'if __name__ == "__main__":' in Path(BENCHMARKS, name).read_text(encoding="utf-8")
    if name in HELPERS:
        assert not has_main, f"{name} runs as a script: take it out of HELPERS"
        return
    assert has_main and result.stdout.startswith("usage: "), result.stdout[:2000]
    # The parser's description: the docstring's first line (argparse rewraps it).
    first_line = _docstring(name).splitlines()[0]
    assert " ".join(first_line.split()) in " ".join(result.stdout.split()), result.stdout[:2000]


@pytest.mark.parametrize("name", sorted(TINY))
def test_script_runs_a_tiny_case_on_the_cpu(name: str, runs: Runs) -> None:
    result = runs.result("tiny", name)
    assert result.returncode == 0, (result.stdout[-2000:], result.stderr[-4000:])
    TINY[name].check(result, runs.out)


# ---- engine bench: shared flag names ---------------------------------------------------------


def _parse(argv: str) -> argparse.Namespace:
    from engine.cli import build_parser

    return build_parser().parse_args(argv.split())


def _help(argv: str, capsys: pytest.CaptureFixture[str]) -> str:
    capsys.readouterr()
    with pytest.raises(SystemExit):
        _parse(argv + " --help")
    return capsys.readouterr().out


@pytest.mark.parametrize(
    "argv, expected",
    [
        (
            "bench --input-len 8 --output-len 4 --seed 3 --output-json a.json",
            dict(input_len=8, output_len=4, seed=3, output_json="a.json"),
        ),
        (
            "bench latency --batch-size 2 --input-len 8 --output-len 4 --seed 3 --output-json a.json",
            dict(batch_size=2, input_len=8, output_len=4, seed=3, output_json="a.json"),
        ),
        (
            "bench throughput --num-prompts 7 --input-len 8 --output-len 4 --seed 3 --output-json a.json",
            dict(num_prompts=7, input_len="8", output_len="4", seed=3, output_json="a.json"),
        ),
        (
            "bench serving --num-prompts 7 --max-concurrency 2 --request-rate 1.5 --dataset-name random "
            "--input-len 8 --output-len 4 --seed 3 --output-json a.json",
            dict(
                num_prompts=7,
                max_concurrency=2,
                request_rate=1.5,
                dataset_name="random",
                input_len="8",
                output_len="4",
                seed=3,
                output_json="a.json",
            ),
        ),
    ],
)
def test_bench_subcommands_take_vllm_and_sglang_flag_names(argv: str, expected: dict) -> None:
    args = vars(_parse(argv))
    assert {key: args[key] for key in expected} == expected


@pytest.mark.parametrize(
    "old, new, hidden",
    [
        ("bench --output a.json", "bench --output-json a.json", ["--output "]),
        ("bench latency --output a.json", "bench latency --output-json a.json", ["--output "]),
        (
            "bench throughput --num-requests 7 --output a.json",
            "bench throughput --num-prompts 7 --output-json a.json",
            ["--num-requests", "--output "],
        ),
        (
            "bench serving --concurrency 3 --token-ids --output a.json",
            "bench serving --max-concurrency 3 --dataset-name random --output-json a.json",
            ["--concurrency", "--token-ids", "--output "],
        ),
    ],
)
def test_old_bench_flag_names_still_work_hidden(
    old: str, new: str, hidden: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    assert vars(_parse(old)) == vars(_parse(new))
    said = capsys.readouterr().err
    assert all(f"{flag.strip()} is an old name" in said for flag in hidden), said
    text = _help(new.split(" --")[0], capsys)
    assert not [flag for flag in hidden if flag in text], text


def test_bench_serving_defaults_are_unchanged_by_the_renames() -> None:
    args = _parse("bench serving")
    assert (args.max_concurrency, args.dataset_name, args.output_json, args.num_prompts) == (None, "words", None, 64)
    throughput = _parse("bench throughput")
    assert (throughput.num_prompts, throughput.output_json) == (1000, "bench_results/offline_throughput.json")
