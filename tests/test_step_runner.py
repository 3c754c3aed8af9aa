"""The step contract (graphs/step_runner.py) and the one capture loop (graphs/capture_loop.py)."""

from __future__ import annotations

import logging
from typing import Any

import pytest
from helpers import run_staggered

from engine.engine import Engine
from engine.sampling_params import SamplingParams
from graphs.capture_loop import CaptureReport, capture_loop
from graphs.step_runner import EagerStepRunner, StepInputs, StepKind, StepResult, StepRunner


def test_the_capture_loop_orders_times_and_logs_every_size(caplog: pytest.LogCaptureFixture) -> None:
    report = CaptureReport("test graphs")
    seen = []
    with caplog.at_level(logging.INFO, logger="graphs.capture_loop"):
        for size in capture_loop(report, [4, 1, 8, 2, 4], free_memory=iter([100, 40]).__next__):
            seen.append(size)
    assert seen == [8, 4, 2, 1] and report.sizes == seen  # largest first, each once
    assert set(report.seconds_per_size) == set(seen) and report.seconds >= sum(report.seconds_per_size.values())
    assert report.memory_bytes == 60  # the drop in free memory across the loop
    assert "captured test graphs [8, 4, 2, 1]" in caplog.text and "memory 0.0 MiB" in caplog.text

    report = CaptureReport("smallest first")
    assert list(capture_loop(report, [3, 1, 2], largest_first=False)) == [1, 2, 3]


def test_a_capture_that_raises_ends_the_loop_without_a_report(caplog: pytest.LogCaptureFixture) -> None:
    report = CaptureReport("failing graphs")
    with caplog.at_level(logging.INFO, logger="graphs.capture_loop"), pytest.raises(RuntimeError):
        for size in capture_loop(report, [1, 2]):
            raise RuntimeError(f"size {size} failed")
    assert report.seconds == 0.0 and "captured failing graphs" not in caplog.text


class _Recording(StepRunner):
    """Takes the steps of its kinds up to max_seqs requests, runs them eagerly, and records what it saw."""

    def __init__(self, name: str, kinds: frozenset[StepKind], max_seqs: int, eager: EagerStepRunner) -> None:
        self.name = name
        self.kinds = kinds
        self.max_seqs = max_seqs
        self.eager = eager
        self.seen: list[tuple[StepKind, int, int]] = []

    def can_run(self, inputs: StepInputs) -> bool:
        return inputs.shape.num_seqs <= self.max_seqs

    def run(self, inputs: StepInputs) -> StepResult:
        shape = inputs.shape
        self.seen.append((shape.kind, shape.num_seqs, shape.num_tokens))
        assert shape.num_tokens == inputs.batch().input_ids.shape[0]  # the shape says what the batch holds
        return self.eager.run(inputs)


def test_each_step_goes_to_the_first_runner_of_its_kind_that_takes_it(tiny_checkpoints: dict[str, str]) -> None:
    """A mixed-step engine with two recording runners before the eager one: decode steps of up to 2 requests
    go to the first, extend and mixed steps of up to 3 to the second, everything else to the eager runner;
    the tokens are the plain eager engine's."""
    options: dict[str, Any] = dict(
        model=tiny_checkpoints["llama"],
        device="cpu",
        dtype="float32",
        disable_graphs=True,
        page_size=8,
        max_num_seqs=4,
        kv_cache_tokens=1024,
        enable_prefix_caching=False,
        max_extend_step_ms=0,
        mixed_steps=True,
    )
    prompts = [[5, 9, 14], list(range(3, 40)), [7] * 19, [11, 12, 13, 14, 15, 16]]
    arrivals = [0, 0, 3, 7]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    want = run_staggered(Engine(**options), prompts, params, arrivals).token_ids

    engine = Engine(**options)
    runner = engine.runner
    eager = runner.step_runners[-1]
    assert isinstance(eager, EagerStepRunner) and [r.name for r in runner.step_runners] == ["eager"]
    decode = _Recording("small decodes", frozenset({StepKind.DECODE}), 2, eager)
    prefill = _Recording("small prefills", frozenset({StepKind.EXTEND, StepKind.MIXED}), 3, eager)
    runner.step_runners = [decode, prefill, eager]
    got = run_staggered(engine, prompts, params, arrivals).token_ids
    assert got == want
    assert decode.seen and all(kind is StepKind.DECODE and seqs <= 2 for kind, seqs, _ in decode.seen)
    assert {kind for kind, _, _ in prefill.seen} == {StepKind.EXTEND, StepKind.MIXED}, prefill.seen
    assert all(seqs <= 3 for _, seqs, _ in prefill.seen)
    assert runner.eager_steps > 0  # the decodes of 3 and 4 requests, the steps too big for the second
    total = len(decode.seen) + len(prefill.seen) + runner.eager_steps
    assert sum(runner.steps_run.values()) == total  # every step ran exactly once, on one runner
