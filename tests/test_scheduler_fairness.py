"""Fair admission between request groups (issue #48, item 2), on the scheduler alone (no model).

A group is the engine requests of one API call (its prompts x n choices). However many one call asked for, a
request of another group is admitted within a step or two: the waiting queue is taken in turn by group, a short
prompt goes before another group's chunked prefill, and a group holding more than its share of the slots gives
one back when every slot is taken. Without groups (the engine's own API) the order is the arrival order.
"""

from __future__ import annotations

from engine.kv_cache import PageAllocator
from engine.kv_manager import KVCacheManager
from engine.request import Request, RequestStatus
from engine.sampling_params import SamplingParams
from engine.scheduler import ScheduledStep, Scheduler


def make_scheduler(max_num_seqs: int = 8, pages: int = 512, chunk: int | None = 512) -> Scheduler:
    kv = KVCacheManager(PageAllocator(pages + 1), 16, enable_prefix_cache=True)
    return Scheduler(kv, max_num_seqs, 4096, chunk, 2048)


def request(request_id: str, prompt_len: int, max_tokens: int, group: str | None) -> Request:
    tokens = [1 + (hash((request_id, i)) % 50) for i in range(prompt_len)]
    return Request(request_id, tokens, SamplingParams(max_tokens=max_tokens, temperature=0.0, group=group))


def run_step(scheduler: Scheduler) -> ScheduledStep | None:
    """One step as the engine runs it: schedule, launch, hand every sampled request a token, finish by length."""
    step = scheduler.schedule()
    if step is None:
        return None
    scheduler.on_step_launched(step)
    for r in step.sampled_requests:
        r.num_pending_tokens -= 1
        r.output_token_ids.append(7)
        if len(r.output_token_ids) >= r.params.max_tokens:
            scheduler.finish(r, "length")
    return step


def steps_until_running(scheduler: Scheduler, target: Request, limit: int = 200) -> int:
    for count in range(1, limit + 1):
        run_step(scheduler)
        if target in scheduler.running or target.finished:
            return count
    raise AssertionError(f"{target.request_id} not admitted in {limit} steps")


def test_a_request_is_admitted_within_two_steps_of_an_n128_call() -> None:
    """Issue #48: n=128, max_tokens=300 held every slot, and a 3-token request sent 3 s later took 58 s."""
    scheduler = make_scheduler()
    for i in range(128):
        scheduler.add(request(f"big-{i}", 5, 300, "call-1"))
    for _ in range(20):
        run_step(scheduler)
    assert len(scheduler.running) == 8 and len(scheduler.waiting) == 120
    canary = request("canary", 5, 3, "call-2")
    scheduler.add(canary)
    assert steps_until_running(scheduler, canary) <= 2
    assert sum(r.params.group == "call-1" for r in scheduler.running) == 7  # one slot given back, no more
    retractions = scheduler.num_retractions
    for _ in range(3):
        run_step(scheduler)
    assert canary.finished and scheduler.num_retractions == retractions  # and no slot traded back and forth
    assert len(scheduler.running) == 8  # its slot went back to the big call
    scheduler.kv.check_invariant()


def test_two_big_calls_share_the_slots_evenly_without_thrashing() -> None:
    scheduler = make_scheduler()
    for i in range(64):
        scheduler.add(request(f"a-{i}", 5, 300, "a"))
    for _ in range(10):
        run_step(scheduler)
    for i in range(64):
        scheduler.add(request(f"b-{i}", 5, 300, "b"))
    for _ in range(30):
        run_step(scheduler)
    held = [sum(r.params.group == g for r in scheduler.running) for g in ("a", "b")]
    assert held == [4, 4], held
    retractions = scheduler.num_retractions
    for _ in range(30):
        run_step(scheduler)
    assert scheduler.num_retractions == retractions  # settled: nobody gives a slot back any more


def test_a_short_prompt_goes_before_another_calls_chunked_prefill() -> None:
    """Issue #48: six 1,900-token prompts in one call kept a 3-token request out for 72 s."""
    scheduler = make_scheduler(chunk=256)
    for i in range(6):
        scheduler.add(request(f"long-{i}", 1900, 16, "call-1"))
    run_step(scheduler)
    assert scheduler.chunked is not None
    canary = request("canary", 5, 3, "call-2")
    scheduler.add(canary)
    step = run_step(scheduler)
    assert step is not None and canary in step.requests and scheduler.chunked in step.requests
    # The chunk still progressed in that step, by what the canary left of the budget.
    assert step.extend_lens[step.requests.index(scheduler.chunked)] == 256 - 5


def test_without_groups_admission_is_first_come_first_served() -> None:
    """The engine's own API: each request is a group of its own, so nothing is reordered or retracted."""
    scheduler = make_scheduler(max_num_seqs=4)
    requests = [request(f"r{i}", 5, 50, None) for i in range(10)]
    for r in requests:
        scheduler.add(r)
    admitted: list[str] = []
    for _ in range(300):
        step = run_step(scheduler)
        if step is not None and not step.is_decode:
            admitted += [r.request_id for r in step.requests]
        if not scheduler.has_work():
            break
    assert admitted == [r.request_id for r in requests]
    assert scheduler.num_retractions == 0
    assert all(r.status is RequestStatus.FINISHED for r in requests)
