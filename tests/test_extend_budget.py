"""The extend-step time budget: plain prompt tokens by their measured speed, prompt-logprob tokens by their weight."""

from __future__ import annotations

import pytest

from engine.kv_cache import PageAllocator
from engine.kv_manager import KVCacheManager
from engine.request import Request
from engine.sampling_params import SamplingParams
from engine.scheduler import PROMPT_LOGPROB_TOKEN_WEIGHT, Scheduler


def _scheduler() -> Scheduler:
    kv = KVCacheManager(PageAllocator(257), 16, enable_prefix_cache=False)
    scheduler = Scheduler(kv, 8, 4096, 512, 4096, max_extend_step_s=0.3)
    scheduler.record_extend_time(300, 0.6)  # 2 ms a plain token: 150 tokens fit in 300 ms
    return scheduler


@pytest.mark.parametrize("prompt_logprobs", [None, 1])
def test_a_chunk_fits_the_time_budget_by_its_kind_of_token(prompt_logprobs: int | None) -> None:
    scheduler = _scheduler()
    scheduler.add(Request("r", list(range(1, 401)), SamplingParams(max_tokens=4, prompt_logprobs=prompt_logprobs)))
    step = scheduler.schedule()
    assert step is not None and not step.is_decode
    expected = 150 if prompt_logprobs is None else int(150 / PROMPT_LOGPROB_TOKEN_WEIGHT)
    assert step.extend_lens == [expected]


def test_prompt_logprob_steps_teach_their_weight() -> None:
    scheduler = _scheduler()
    scheduler.record_extend_time(40, 0.8, logprob_tokens=40)  # 20 ms a token: 10x a plain one
    assert scheduler.prompt_logprob_token_weight == pytest.approx(0.5 * PROMPT_LOGPROB_TOKEN_WEIGHT + 0.5 * 10)
    scheduler.record_extend_time(100, 0.2)  # plain steps under 128 tokens teach nothing (mostly fixed cost)
    assert scheduler.extend_seconds_per_token == pytest.approx(0.002)
