"""Tensor parallelism over gloo on the CPU: two real processes, the engine's own launcher, float32.

Greedy ids must be the ones a single rank gives (the same weights, summed in another order: float32 keeps
every argmax of these tiny models far from a tie), eagerly with overlap scheduling and mixed steps (so
pending input tokens come from every rank's copy of the sampled tokens) and through the compiled decode
graphs, strict (the collectives are opaque ops inside the compiled layer and head: fullgraph would refuse a
graph break). The KV invariant is checked after every step on every rank (debug_kv_invariant: rank 0's pool,
and each worker's pool and decode rows against rank 0's). A killed or hung rank, and SIGTERM on rank 0, end
in bounded time with a clear error / every process gone. Each rank runs one thread (conftest).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from conftest import REPO_ROOT, build_tiny_checkpoint
from helpers import greedy, run_staggered

import graphs.tensor_parallel_runner as tp_runner
from engine.distributed.state import tp_state
from engine.engine import Engine
from engine.errors import EngineError, EngineStoppedError, RankFailedError
from engine.sampling_params import SamplingParams

NEW_TOKENS = 24
PROMPTS = [[5, 6, 7, 8, 9], list(range(20, 57)), [10, 11, 12], list(range(100, 117))]
ARRIVALS = [0, 2, 4, 7]  # decode batches of 1, 2, 3 and 4 rows (2 and 3 padded to the captured 4)
BASE = dict(device="cpu", dtype="float32", page_size=16, kv_cache_tokens=2048, max_num_seqs=4, max_extend_step_ms=0)
MODES: dict[str, dict[str, Any]] = {
    # Overlap scheduling: each decode row's input token is read from the rows' last sampled tokens, which
    # the workers only have through rank 0's broadcast; mixed steps: decode rows and a prefill in one step.
    "eager": dict(disable_graphs=True, overlap_schedule=True, mixed_steps=True),
    "graphs": dict(disable_graphs=False, capture_sizes="1,4", strict_graphs=True),
}


@pytest.fixture(scope="module")
def checkpoints(tiny_checkpoints: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """The tiny Llama with 383 tokens (the vocabulary splits unevenly: the LM head's padded block), Qwen3,
    Qwen3-MoE (MoE and dense layers) and Qwen2-MoE (a shared expert summed in the same all-reduce)."""
    folder = tmp_path_factory.mktemp("tp_models")
    return {
        "llama": build_tiny_checkpoint("llama", str(folder / "llama_383"), vocab_size=383),
        "qwen3": tiny_checkpoints["qwen3"],
        "qwen3_moe": tiny_checkpoints["qwen3_moe"],
        "qwen2_moe": tiny_checkpoints["qwen2_moe"],
    }


class OneAtATime:
    """The module's tensor-parallel engines: one process runs one at a time, so asking for another shuts the
    last one down (and checks that its worker left cleanly)."""

    def __init__(self) -> None:
        self.key: tuple[str, str] | None = None
        self.engine: Engine | None = None

    def get(self, key: tuple[str, str], build: Callable[[], Engine]) -> Engine:
        if self.key != key:
            self.close()
            self.engine, self.key = build(), key
        assert self.engine is not None
        return self.engine

    def close(self) -> None:
        if self.engine is not None:
            workers = self.engine.tp_ranks.workers if self.engine.tp_ranks is not None else []
            self.engine.shutdown()
            assert [w.exit_code for w in workers] == [0] * len(workers), "a worker did not stop cleanly"
            with pytest.raises(EngineStoppedError, match="was shut down"):
                self.engine.generate([[1, 2]], greedy(2))
        self.engine = self.key = None
        assert not tp_state().enabled


@pytest.fixture(scope="module")
def tp_engines() -> Iterator[OneAtATime]:
    engines = OneAtATime()
    yield engines
    engines.close()


_REFERENCE: dict[str, Any] = {}


def reference(model: str, folder: str) -> Any:
    """What one rank gives: the staggered run on a world-size-1 engine (eager, the CPU defaults)."""
    if model not in _REFERENCE:
        engine = Engine(model=folder, disable_graphs=True, **BASE)
        _REFERENCE[model] = run_staggered(engine, PROMPTS, params(), ARRIVALS)
        engine.check_kv_invariant()
    return _REFERENCE[model]


def params() -> list[SamplingParams]:
    """Greedy; one request also asks for its prompt's logprobs (every rank joins those LM-head slices) and
    one for its tokens' logprobs (from the gathered logits)."""
    plain = [greedy(NEW_TOKENS) for _ in PROMPTS]
    plain[1] = greedy(NEW_TOKENS, prompt_logprobs=2)
    plain[3] = greedy(NEW_TOKENS, logprobs=2)
    return plain


def tp_engine(engines: OneAtATime, model: str, folder: str, mode: str) -> Engine:
    return engines.get(
        (model, mode),
        lambda: Engine(model=folder, tensor_parallel_size=2, debug_kv_invariant=True, **BASE, **MODES[mode]),
    )


def _close(a: float | None, b: float | None) -> bool:
    return (a is None and b is None) or (a is not None and b is not None and abs(a - b) < 1e-3)


CASES = [
    ("llama", "eager"),
    ("llama", "graphs"),
    ("qwen3", "eager"),
    ("qwen3_moe", "eager"),
    ("qwen3_moe", "graphs"),
    ("qwen2_moe", "eager"),
]


@pytest.mark.parametrize(("model", "mode"), CASES, ids=[f"{m}-{mode}" for m, mode in CASES])
def test_two_ranks_give_the_single_rank_greedy_ids(
    checkpoints: dict[str, str], tp_engines: OneAtATime, model: str, mode: str
) -> None:
    want = reference(model, checkpoints[model])
    engine = tp_engine(tp_engines, model, checkpoints[model], mode)
    graph_steps = engine.runner.graph_steps
    run = run_staggered(engine, PROMPTS, params(), ARRIVALS)
    for i, (ours, theirs) in enumerate(zip(run.outputs, want.outputs)):
        assert ours.token_ids == theirs.token_ids, f"prompt {i}: tp=2 {ours.token_ids} vs tp=1 {theirs.token_ids}"
    assert {1, 2, 3, 4} <= set(run.decode_sizes), run.decode_sizes
    if mode == "graphs":
        assert engine.runner.graph_steps - graph_steps == len(run.decode_sizes)  # every decode step replayed
    else:
        steps = zip(run.recorder.steps, run.recorder.num_decodes)
        assert any(decodes and not is_decode for (is_decode, _), decodes in steps), "no mixed step ran"
    # Logprobs from the gathered logits and the prompt's from every rank's LM-head slices: tp=1's values.
    ours_prompt, theirs_prompt = run.outputs[1].prompt_logprobs, want.outputs[1].prompt_logprobs
    assert ours_prompt is not None and len(ours_prompt) == len(PROMPTS[1])
    assert all(_close(a and a.logprob, b and b.logprob) for a, b in zip(ours_prompt, theirs_prompt))
    assert all(_close(a.logprob, b.logprob) for a, b in zip(run.outputs[3].logprobs, want.outputs[3].logprobs))
    engine.check_kv_invariant()  # rank 0's pool, and every rank's decode rows against rank 0's


def test_a_sampling_failure_fails_only_its_request(
    checkpoints: dict[str, str], tp_engines: OneAtATime, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rank 0's sampling raises for one request: the workers get a failed status instead of tokens and keep
    their rows; the step is re-run in halves; the others get exactly their single-rank tokens."""
    want = reference("llama", checkpoints["llama"])
    engine = tp_engine(tp_engines, "llama", checkpoints["llama"], "eager")
    real_sample = tp_runner.sample
    calls = {"failed": 0}

    def sample_that_chokes(logits: torch.Tensor, requests: list, *rest: Any) -> Any:
        tokens = real_sample(logits, requests, *rest)
        if any(r.request_id == "culprit" and len(r.output_token_ids) == 3 for r in requests):
            calls["failed"] += 1
            raise RuntimeError("probability tensor contains inf, nan or element < 0")
        return tokens

    monkeypatch.setattr(tp_runner, "sample", sample_that_chokes)
    ids = [
        engine.add_request(prompt, greedy(NEW_TOKENS), request_id="culprit" if i == 2 else None)
        for i, prompt in enumerate(PROMPTS)
    ]
    finals: dict[str, Any] = {}
    while engine.has_unfinished():
        for output in engine.step():
            if output.finished:
                finals[output.request_id] = output
    assert calls["failed"] >= 2
    for i, request_id in enumerate(ids):
        if i == 2:
            assert finals[request_id].finish_reason == "error" and "probability tensor" in finals[request_id].error
        else:
            assert finals[request_id].token_ids == want.outputs[i].token_ids, f"request {i} changed"
    engine.check_kv_invariant()


def _small_engine(folder: str, timeout_s: float) -> Engine:
    return Engine(model=folder, tensor_parallel_size=2, disable_graphs=True, dist_timeout_s=timeout_s, **BASE)


def _generate_until_it_fails(engine: Engine, stop_worker: Callable[[int], None]) -> tuple[RankFailedError, float]:
    """Stream a long generation, stop the worker after a few tokens; the error and how long it took to come."""
    pid = engine.tp_ranks.workers[0].process.pid
    started = None
    with pytest.raises(RankFailedError) as info:
        for index, _ in enumerate(engine.stream([[5, 6, 7]], greedy(400))):
            if index == 3:
                stop_worker(pid)
                started = time.monotonic()
    assert started is not None
    return info.value, time.monotonic() - started


def test_a_killed_rank_ends_in_a_clear_error(checkpoints: dict[str, str], tp_engines: OneAtATime) -> None:
    tp_engines.close()
    engine = _small_engine(checkpoints["llama"], timeout_s=60)  # the error must not wait for any timeout
    try:
        error, seconds = _generate_until_it_fails(engine, lambda pid: os.kill(pid, signal.SIGKILL))
        assert "tensor-parallel rank 1" in str(error) and "SIGKILL" in str(error), str(error)
        assert seconds < 10, f"the error took {seconds:.1f} s"
        assert not tp_state().enabled  # every rank stopped, the group left: a new engine may start
        with pytest.raises(RankFailedError, match="rank 1"):  # the engine stays stopped, saying why
            engine.generate([[1, 2]], greedy(2))
    finally:
        engine.shutdown()


def test_a_hung_rank_ends_in_a_clear_error_after_the_timeout(
    checkpoints: dict[str, str], tp_engines: OneAtATime
) -> None:
    tp_engines.close()
    engine = _small_engine(checkpoints["llama"], timeout_s=3)
    worker = engine.tp_ranks.workers[0]
    try:
        error, seconds = _generate_until_it_fails(engine, lambda pid: os.kill(pid, signal.SIGSTOP))
        assert "tensor-parallel rank 1" in str(error) and "did not respond within the 3 s" in str(error), str(error)
        assert seconds < 15, f"the error took {seconds:.1f} s"
    finally:
        engine.shutdown()
    assert worker.exit_code == -signal.SIGKILL  # the stopped worker was killed, not left behind


SIGTERM_SCRIPT = textwrap.dedent("""
    import sys
    from engine.engine import Engine
    from engine.sampling_params import SamplingParams

    if __name__ == "__main__":
        engine = Engine(model=sys.argv[1], device="cpu", dtype="float32", disable_graphs=True, kv_cache_tokens=2048,
                        max_num_seqs=2, max_model_len=512, tensor_parallel_size=2)
        print(engine.tp_ranks.workers[0].process.pid, flush=True)
        while True:
            engine.generate([[5, 6, 7]], SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True))
""")


def test_sigterm_on_rank_0_stops_every_rank(checkpoints: dict[str, str], tmp_path: Any) -> None:
    """SIGTERM to rank 0 in the middle of generating: it exits (128 + 15) and its worker is gone too."""
    script = tmp_path / "serve_forever.py"
    script.write_text(SIGTERM_SCRIPT)
    env = {**os.environ, "PYTHONPATH": REPO_ROOT}
    process = subprocess.Popen(
        [sys.executable, str(script), checkpoints["llama"]],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        line = process.stdout.readline()
        assert line.strip().isdigit(), process.stderr.read()[-3000:]
        worker_pid = int(line)
        time.sleep(1.0)  # generating now
        sent = time.monotonic()
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=30) == 128 + signal.SIGTERM, process.stderr.read()[-3000:]
        while _alive(worker_pid) and time.monotonic() - sent < 15:
            time.sleep(0.1)
        assert not _alive(worker_pid), "the worker outlived rank 0"
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat", encoding="ascii") as handle:  # a zombie is not running any more
        return handle.read().split(")")[-1].split()[0] != "Z"


def test_what_cannot_run_tensor_parallel_is_refused_before_spawning(checkpoints: dict[str, str]) -> None:
    with pytest.raises(EngineError, match="3 does not divide the 4 attention heads"):
        Engine(model=checkpoints["llama"], tensor_parallel_size=3, **BASE)
    with pytest.raises(EngineError, match="GGUF model cannot be split"):
        Engine(model=None, tensor_parallel_size=2, **BASE)  # the embedded SmolLM2 GGUF
    with pytest.raises(EngineError, match="tensor_parallel_size must be a positive integer"):
        Engine(model=checkpoints["llama"], tensor_parallel_size=0, **BASE)
    assert not tp_state().enabled


def test_the_cli_takes_tp_and_refuses_clearly() -> None:
    from engine.cli import build_parser, engine_config_from_args

    args = build_parser().parse_args(["run", "--tp", "2", "--dist-timeout", "30"])
    config = engine_config_from_args(args)
    assert (config.tensor_parallel_size, config.dist_timeout_s) == (2, 30.0)
    assert engine_config_from_args(build_parser().parse_args(["bench", "latency"])).tensor_parallel_size == 1
    result = subprocess.run(
        [sys.executable, "-m", "engine.cli", "run", "--tensor-parallel-size", "2", "--device", "cpu", "--prompt", "hi"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2 and "GGUF model cannot be split" in result.stderr, result.stderr[-2000:]
