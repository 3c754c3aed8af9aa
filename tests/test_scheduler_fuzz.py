"""The scheduler and the KV manager under random traffic, checked slot by slot.

The model is replaced by a ledger: every step "writes" into each slot it
computes the tuple of tokens up to that position, and before every step each
request must read, at every cached position, exactly its own tokens. That is
the property the real model relies on, checked here over thousands of steps
with random page sizes, tight pools, chunked prefill, the prefix cache on or
off, prompt-logprob requests, aborts (of waiting, running and chunked requests)
and failed steps, request groups (fair admission retracts for them) and cache
salts, far more than model-backed tests can afford.

With overlap, a step is launched (scheduler.on_step_launched) before the
previous step's tokens are handed back, as Engine.step does: requests carry a
pending token the host does not know yet, finish one step late, and are
aborted or retracted while their token is still "on the device". The ledger
holds the device's view (host tokens + pending ones).
"""

from __future__ import annotations

import random

import pytest

from engine.kv_cache import PageAllocator
from engine.kv_manager import KVCacheManager, pages_needed
from engine.request import Request, RequestStatus
from engine.sampling_params import SamplingParams
from engine.scheduler import ScheduledStep, Scheduler
from engine.step_message import slot_of


class SlotLedger:
    """What each KV slot holds: the token prefix it was computed for."""

    def __init__(self, kv: KVCacheManager) -> None:
        self.kv = kv
        self.content: dict[int, tuple[str | None, tuple[int, ...]]] = {}  # slot -> (cache salt, token prefix)
        self.pending: dict[int, list[int]] = {}  # id(request) -> its sampled tokens the host has not seen

    def tokens(self, request: Request) -> list[int]:
        return request.all_token_ids + self.pending.get(id(request), [])

    def positions(self, step: ScheduledStep, index: int, request: Request) -> range:
        if step.is_decode:
            assert len(self.tokens(request)) == request.num_tokens_with_pending
            return range(request.num_tokens_with_pending - 1, request.num_tokens_with_pending)
        assert not request.num_pending_tokens, "a request is prefilled with a token still pending"
        return range(request.num_cached_tokens, request.num_cached_tokens + step.extend_lens[index])

    def run(self, step: ScheduledStep, context: str) -> None:
        """Check every read of the step, then record its writes."""
        page_size = self.kv.page_size
        private: set[int] = set()
        free = set(self.kv.allocator._free)
        for index, request in enumerate(step.requests):
            assert request.status is RequestStatus.RUNNING
            table = self.kv.page_table(request)
            own = self.kv.allocator.pages_of(request.request_id)
            assert not private & set(own), f"{context}: a private page is held by two requests"
            private |= set(own)
            assert not set(table) & free, f"{context}: {request.request_id} reads a free page"
            positions = self.positions(step, index, request)
            assert positions.start == request.num_cached_tokens and len(positions) > 0
            assert len(table) >= pages_needed(positions.stop, page_size), f"{context}: page table too short"
            tokens = self.tokens(request)
            for position in range(positions.start):
                slot = slot_of(table, position, page_size)
                assert self.content.get(slot) == (request.params.cache_salt, tuple(tokens[: position + 1])), (
                    f"{context}: {request.request_id} reads a stale slot at position {position}"
                )
            # Writes land in private pages only: a shared (cached) page is never overwritten.
            assert positions.start >= len(request.shared_pages) * page_size, f"{context}: write into a shared page"
        for index, request in enumerate(step.requests):
            table, tokens = self.kv.page_table(request), self.tokens(request)
            for position in self.positions(step, index, request):
                # Written under the request's salt: a request of another salt must never read it.
                self.content[slot_of(table, position, page_size)] = (
                    request.params.cache_salt,
                    tuple(tokens[: position + 1]),
                )


def simulate(seed: int, steps: int = 300, overlap: bool = False) -> int:
    """Random arrivals, aborts, stops and failed steps; returns how many retractions happened."""
    rng = random.Random(seed)
    page_size = rng.choice([1, 2, 4, 16])
    num_pages = rng.randint(8, 60)
    kv = KVCacheManager(PageAllocator(num_pages + 1), page_size, enable_prefix_cache=rng.random() < 0.8)
    max_len = num_pages * page_size
    scheduler = Scheduler(kv, rng.randint(1, 6), rng.choice([8, 64, 1000]), rng.choice([None, 3, 8, 32]), max_len)
    ledger = SlotLedger(kv)
    stems = [[rng.randrange(1, 5) for _ in range(rng.randint(0, 3 * page_size + 3))] for _ in range(3)]
    live: dict[str, Request] = {}
    in_flight: list[ScheduledStep] = []

    def launch(step: ScheduledStep, context: str) -> None:
        ledger.run(step, context)
        scheduler.on_step_launched(step)
        for request in step.sampled_requests:  # "the device samples": the host sees it on completion
            ledger.pending.setdefault(id(request), []).append(rng.randrange(1, 5))
        in_flight.append(step)

    def complete(step: ScheduledStep) -> None:
        for request in step.sampled_requests:
            token = ledger.pending[id(request)].pop(0)
            request.num_pending_tokens -= 1
            if request.finished:
                continue  # finished or aborted after the step was launched: its token is dropped
            request.output_token_ids.append(token)
            stop = rng.random() < 0.05  # a stop token or string, which the scheduler cannot foresee
            if stop or len(request.output_token_ids) >= request.params.max_tokens or request.num_tokens >= max_len:
                live.pop(request.request_id, None)
                scheduler.finish(request, "stop" if stop else "length")

    def step_once(context: str, arrivals: bool) -> bool:
        if arrivals and rng.random() < 0.4 and len(live) < 12:
            tokens = (rng.choice(stems) + [rng.randrange(1, 5) for _ in range(rng.randint(1, 10))])[: max_len - 2]
            # Request groups (the choices of one API call: fair admission retracts for them) and cache salts
            # (equal tokens under another salt must never read these slots).
            params = SamplingParams(
                max_tokens=rng.randint(1, 20),
                temperature=0.0,
                group=rng.choice([None, None, "g1", "g2"]),
                cache_salt=rng.choice([None, None, "s1"]),
            )
            if rng.random() < 0.15:
                params.prompt_logprobs = 1
            request = Request(f"r{context}", tokens, params)
            live[request.request_id] = request
            scheduler.add(request)
        if arrivals and rng.random() < 0.05 and live:
            scheduler.finish(live.pop(rng.choice(sorted(live))), "abort")  # waiting, running, chunked or pending
        step = scheduler.schedule()
        if step is None:
            assert in_flight or not scheduler.has_work(), f"{context}: schedule() returned nothing with work left"
        else:
            assert len(step.requests) <= scheduler.max_num_seqs
            assert all(not r.finished for r in step.requests), f"{context}: a finished request was scheduled"
            if arrivals and rng.random() < 0.03:  # the launch failed: Engine.step finishes its requests
                for request in step.requests:
                    live.pop(request.request_id, None)
                    scheduler.finish(request, "abort")
                step = None
            else:
                launch(step, context)
        # Overlap: the previous step completes after this one is launched; otherwise this one at once.
        completed = len(in_flight) > (1 if overlap and step is not None else 0)
        if completed:
            complete(in_flight.pop(0))
        assert len(in_flight) <= 1
        kv.check_invariant()
        return step is not None or completed  # progress

    for t in range(steps):
        step_once(f"seed {seed} step {t}", arrivals=True)
    for t in range(3000):  # drain: everything left must finish
        if not scheduler.has_work() and not in_flight:
            break
        assert step_once(f"seed {seed} drain {t}", arrivals=False), (
            f"seed {seed} drain: nothing scheduled with work left"
        )
    assert not scheduler.has_work() and not in_flight, f"seed {seed}: did not drain"
    assert kv.pages_in_use == 0
    assert not any(ledger.pending.values()), "a pending token was never handed back"
    return scheduler.num_retractions


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
@pytest.mark.parametrize("block", range(4))
def test_random_traffic_never_reads_stale_kv_or_leaks(block: int, overlap: bool) -> None:
    retractions = sum(simulate(seed, overlap=overlap) for seed in range(block * 50, block * 50 + 50))
    assert retractions > 0  # the tight pools really were tight
