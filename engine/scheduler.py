"""Continuous batching: requests join and leave the running batch every step.

A step is either an extend (prefill of newly admitted requests) or a decode of
every running request. Pages are allocated on demand; when a decode step
cannot get a page, the most recently admitted request is preempted and later
recomputed (vLLM's recompute policy), so no request is ever stuck.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from engine.kv_cache import PageAllocator
from engine.request import Request, RequestStatus


@dataclass
class ScheduledStep:
    is_decode: bool
    requests: list[Request]
    # extend only: tokens of each request to run this step (all of its uncached tokens)
    extend_lens: list[int]


def pages_needed(num_tokens: int, page_size: int) -> int:
    return (num_tokens + page_size - 1) // page_size


class Scheduler:
    def __init__(
        self,
        allocator: PageAllocator,
        page_size: int,
        max_num_seqs: int,
        max_prefill_tokens: int,
    ) -> None:
        self.allocator = allocator
        self.page_size = page_size
        self.max_num_seqs = max_num_seqs
        self.max_prefill_tokens = max_prefill_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledStep | None:
        step = self._schedule_extend()
        if step is not None:
            return step
        if not self.running:
            return None
        self._reserve_decode_pages()
        return ScheduledStep(True, list(self.running), [])

    def _schedule_extend(self) -> ScheduledStep | None:
        admitted: list[Request] = []
        tokens = 0
        while self.waiting and len(self.running) + len(admitted) < self.max_num_seqs:
            request = self.waiting[0]
            new_tokens = request.num_tokens - request.num_cached_tokens
            if admitted and tokens + new_tokens > self.max_prefill_tokens:
                break
            # +1 token of headroom so the first decode step does not preempt at once.
            need = pages_needed(request.num_tokens + 1, self.page_size) - len(self.allocator.pages_of(request.request_id))
            if need > self.allocator.num_free:
                break
            self.allocator.allocate(request.request_id, need)
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            admitted.append(request)
            tokens += new_tokens
        if not admitted:
            return None
        self.running.extend(admitted)
        return ScheduledStep(False, admitted, [r.num_tokens - r.num_cached_tokens for r in admitted])

    def _reserve_decode_pages(self) -> None:
        """Each running request needs a slot for the token it feeds this step."""
        index = 0
        while index < len(self.running):
            request = self.running[index]
            need = pages_needed(request.num_tokens, self.page_size) - len(self.allocator.pages_of(request.request_id))
            if need <= 0:
                index += 1
                continue
            if need <= self.allocator.num_free:
                self.allocator.allocate(request.request_id, need)
                index += 1
                continue
            victim = self.running.pop()  # newest admitted goes back to the queue
            self._preempt(victim)
            if victim is request:
                break

    def _preempt(self, request: Request) -> None:
        self.allocator.free(request.request_id)
        request.num_cached_tokens = 0
        request.status = RequestStatus.WAITING
        request.num_preemptions += 1
        self.waiting.appendleft(request)

    def finish(self, request: Request, reason: str) -> None:
        """Release a request's pages, whatever state it is in."""
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        self.allocator.free(request.request_id)
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
