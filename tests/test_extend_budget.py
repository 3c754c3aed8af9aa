"""The extend-step time budget: how many prompt tokens fit while others wait, learned from every step, never
stuck small after one slow step, and a request alone held only to the longer LONE_EXTEND_STEP_S."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from engine.engine import Engine
from engine.extend_timing import ExtendStepTime
from engine.kv_cache import PageAllocator
from engine.kv_manager import KVCacheManager
from engine.request import Request
from engine.sampling_params import SamplingParams
from engine.scheduler import LONE_EXTEND_STEP_S, MIN_EXTEND_BUDGET, PROMPT_LOGPROB_TOKEN_WEIGHT, Scheduler

# A CPU's extend step in these tests: 100 ms fixed, 1 ms a prompt token (300 ms fit 200 tokens).
FIXED_S, PER_TOKEN_S = 0.1, 0.001


def step_seconds(tokens: int, slowdown: float = 1.0) -> float:
    return slowdown * (FIXED_S + PER_TOKEN_S * tokens)


def _scheduler() -> Scheduler:
    kv = KVCacheManager(PageAllocator(257), 16, enable_prefix_cache=False)
    scheduler = Scheduler(kv, 8, 4096, 512, 4096, max_extend_step_s=0.3)
    for tokens in (128, 400, 60, 300):  # steps of several sizes, as a server sees them
        scheduler.record_extend_time(tokens, step_seconds(tokens))
    return scheduler


def _decoding(scheduler: Scheduler) -> None:
    """One request prefilled and decoding: an extend step now stalls it, so the time budget applies."""
    scheduler.add(Request("decoding", [1, 2, 3], SamplingParams(max_tokens=64)))
    step = scheduler.schedule()
    assert step is not None and not step.is_decode
    scheduler.on_step_launched(step)
    assert [r.request_id for r in scheduler.running] == ["decoding"]


def test_the_model_separates_the_fixed_cost_from_the_cost_per_token() -> None:
    model = ExtendStepTime()
    assert model.tokens_within(0.3) is None
    model.observe(128, step_seconds(128))  # one size so far: all of it counted per token (the cautious reading)
    assert model.fixed_s == 0 and model.tokens_within(0.3) == int(0.3 / (step_seconds(128) / 128))
    model.observe(400, step_seconds(400))
    assert model.fixed_s == pytest.approx(FIXED_S) and model.per_token_s == pytest.approx(PER_TOKEN_S)
    assert model.tokens_within(0.3) == 200 and model.tokens_within(0.05) == 0


@pytest.mark.parametrize("prompt_logprobs", [None, 1])
def test_a_chunk_fits_the_time_budget_by_its_kind_of_token(prompt_logprobs: int | None) -> None:
    scheduler = _scheduler()
    _decoding(scheduler)
    scheduler.add(Request("r", list(range(1, 801)), SamplingParams(max_tokens=4, prompt_logprobs=prompt_logprobs)))
    step = scheduler.schedule()
    if step is not None and step.is_decode:  # the decode owed after an extend comes first
        step = scheduler.schedule()
    assert step is not None and not step.is_decode
    expected = 200 if prompt_logprobs is None else 200 // PROMPT_LOGPROB_TOKEN_WEIGHT
    assert step.extend_lens == [int(expected)]


def test_prompt_logprob_steps_teach_their_weight_and_not_the_plain_speed() -> None:
    scheduler = _scheduler()
    plain = scheduler.extend_time.tokens_within(0.3)
    # 40 prompt-logprob tokens in 0.9 s: 0.1 s fixed, 20 ms a token: 20x a plain one.
    scheduler.record_extend_time(40, FIXED_S + 40 * 0.02, logprob_tokens=40)
    assert scheduler.prompt_logprob_token_weight == pytest.approx(0.5 * PROMPT_LOGPROB_TOKEN_WEIGHT + 0.5 * 20)
    assert scheduler.extend_time.tokens_within(0.3) == plain


def test_a_request_alone_has_the_longer_lone_limit() -> None:
    scheduler = _scheduler()
    scheduler.add(Request("alone", list(range(1, 2001)), SamplingParams(max_tokens=4)))
    step = scheduler.schedule()
    assert step is not None and step.extend_lens == [512]  # the chunk size, not the 200 tokens that fit 300 ms
    slow = _scheduler()
    for tokens in (128, 400, 128, 400):
        slow.record_extend_time(tokens, step_seconds(tokens, slowdown=4.0))  # 0.4 s fixed, 4 ms a token
    slow.add(Request("alone", list(range(1, 2001)), SamplingParams(max_tokens=4)))
    step = slow.schedule()
    fit = (LONE_EXTEND_STEP_S - 4 * FIXED_S) / (4 * PER_TOKEN_S)  # what fits the lone limit: 400 tokens
    # Cut by the lone limit (as the estimate has it), not by the chunk size nor by the 300 ms limit's ~50 tokens.
    assert step is not None and 0.8 * fit <= step.extend_lens[0] <= 1.25 * fit, step.extend_lens


def test_the_budget_never_falls_under_the_floor() -> None:
    scheduler = _scheduler()
    for tokens in (128, 400, 128, 400):
        scheduler.record_extend_time(tokens, step_seconds(tokens, slowdown=20.0))  # 2.6-10 s steps
    _decoding(scheduler)
    scheduler.add(Request("r", list(range(1, 801)), SamplingParams(max_tokens=4)))
    step = scheduler.schedule()
    if step is not None and step.is_decode:
        step = scheduler.schedule()
    assert step is not None and step.extend_lens == [MIN_EXTEND_BUDGET]


def test_one_slow_step_does_not_leave_the_budget_stuck() -> None:
    """The stuck state of issue #49: one prefill under CPU contention (5x slower) shrank the chunk, and the
    short chunks after it taught nothing, so the budget never grew back. Now one slow step is outvoted by the
    steps around it; a CPU that stays busy moves the budget within a few steps, and once it is quiet again
    the chunks that the shrunken budget cut teach it back within a few more (growing at most 2x a step)."""
    scheduler = _scheduler()
    model = scheduler.extend_time
    assert model.tokens_within(0.3) == 200
    scheduler.record_extend_time(400, step_seconds(400, slowdown=5.0))
    assert model.tokens_within(0.3) == 200
    for tokens in (128, 300, 60, 200):  # busy for a while: every step 3x slower
        scheduler.record_extend_time(tokens, step_seconds(tokens, slowdown=3.0))
    assert model.tokens_within(0.3) == 0  # even the fixed part is over 300 ms: chunks of MIN_EXTEND_BUDGET
    budgets = []
    for _ in range(8):  # quiet again, the chunks as the budget cuts them
        tokens = max(MIN_EXTEND_BUDGET, model.tokens_within(0.3) or 0)
        scheduler.record_extend_time(tokens, step_seconds(tokens))
        budgets.append(model.tokens_within(0.3))
    assert budgets[6] is not None and budgets[6] >= 190, budgets
    assert budgets[-1] == 200, budgets


@pytest.fixture
def cpu_engine() -> Iterator[Engine]:
    """The embedded model with the CPU default's 300 ms limit on extend steps (the shared engines turn it off);
    no prefix cache, so the same prompt is computed whole every time."""
    from conftest import track

    yield track(
        Engine(device="cpu", kv_cache_tokens=4096, max_num_seqs=4, max_extend_step_ms=300, enable_prefix_caching=False)
    )


def test_a_lone_prompt_is_not_cut_and_the_budget_recovers_after_a_contended_one(
    cpu_engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The reproduction of issue #49 on the real engine: prompts run, one run with every step 5x slower (a busy
    CPU), then quiet again. A prompt alone is one step every time (within the lone limit, even 5x slower);
    after four quiet requests the budget is back to what the quiet steps taught, and a prompt beside a
    decoding request is cut to that budget, not to the contended one.

    The engine's steps run for real, but the durations it records are the modelled CPU's (step_seconds):
    the wall clock of a test beside other test workers is itself contended, and would make this a coin toss."""
    prompt = list(range(10, 250))
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    scheduler = cpu_engine.scheduler
    scheduler.extend_time = ExtendStepTime()  # forget the warm-up's wall-clock step
    real_record = scheduler.record_extend_time
    measured: list[float] = []
    slowdown = 1.0

    def record(tokens: int, seconds: float, logprob_tokens: int = 0) -> None:
        measured.append(seconds)
        real_record(tokens, step_seconds(tokens, slowdown), logprob_tokens)

    monkeypatch.setattr(scheduler, "record_extend_time", record)

    def extend_steps(prompts: list[list[int]], stagger: bool = False) -> list[int]:
        """Prompt tokens of every extend step while `prompts` run (stagger: the first decodes meanwhile)."""
        lens: list[int] = []
        real_schedule = scheduler.schedule

        def schedule():  # type: ignore[no-untyped-def]
            step = real_schedule()
            if step is not None and not step.is_decode:
                lens.append(sum(step.extend_lens))
            return step

        with monkeypatch.context() as patch:
            patch.setattr(scheduler, "schedule", schedule)
            cpu_engine.add_request(prompts[0], SamplingParams(max_tokens=40, ignore_eos=True) if stagger else params)
            if stagger:
                cpu_engine.step()  # the first request prefills alone, then decodes while the second prefills
                cpu_engine.step()
            for other in prompts[1:]:
                cpu_engine.add_request(other, params)
            while cpu_engine.has_unfinished():
                cpu_engine.step()
        return lens

    for _ in range(3):
        assert extend_steps([prompt]) == [len(prompt)]
    quiet_budget = scheduler.extend_time.tokens_within(0.3)
    slowdown = 5.0
    assert extend_steps([prompt]) == [len(prompt)]  # alone: not cut (1.7 s, within LONE_EXTEND_STEP_S)
    slowdown = 1.0
    for _ in range(4):
        assert extend_steps([prompt]) == [len(prompt)]
    budget = scheduler.extend_time.tokens_within(0.3)
    assert quiet_budget is not None and budget is not None and budget >= 0.8 * quiet_budget, (budget, quiet_budget)
    long_prompt = list(range(10, 810))
    beside = extend_steps([[5, 6, 7], long_prompt], stagger=True)
    assert beside[0] == 3 and sum(beside[1:]) == len(long_prompt)
    assert beside[1] >= min(len(long_prompt), max(MIN_EXTEND_BUDGET, int(0.8 * budget))), (beside, budget)
    assert len(measured) == 8 + len(beside) and all(seconds > 0 for seconds in measured)  # every step was timed
