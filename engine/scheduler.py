"""Continuous batching with prefix reuse, chunked prefill and retraction under memory pressure.

A step is an extend (prefill, possibly one chunk of a long prompt), a decode
of every running request, or with `mixed_steps` both at once: one ragged
step in which each running request runs one token and prefill chunks fill
the rest of the token budget (vLLM's "no decoding phase nor prefill phase").
Pure-decode steps stay pure, so they keep their batch-size graphs. Policies,
after SGLang's scheduler:

- admission: a waiting request first reuses its longest cached prefix; it is
  admitted only if the pages it needs leave a reserve for the running
  requests' future tokens (their remaining max_tokens x `new_token_ratio`,
  a ratio that decays while decoding goes well and resets on a retraction),
  so that new prefills do not starve running decodes;
- chunked prefill: at most `chunked_prefill_size` prompt tokens run per step;
  (the budget of one extend step, shared by its requests); a prompt that does
  not fit continues over several steps, one request at a time, and a
  decode step for the running requests runs between two of its chunks (in
  the same step as each chunk, with mixed steps);
- retraction: when decode cannot get a page even after evicting cached pages,
  the request that costs least to redo (fewest tokens) gives its pages back
  (its computed pages stay in the prefix cache) and goes back to the front of
  the queue; it is recomputed later and continues where it left off;
- fair admission between request groups (the prompts x n choices of one API
  call share a group, `SamplingParams.group`): waiting requests are admitted
  in turn by group, the group holding the fewest running slots first, and a
  short request of a group holding fewer slots than the chunked prefill's
  goes before that chunk's next part; when every slot is taken and a group
  waits below its fair share (max_num_seqs / groups with work), the group
  holding the most slots gives one back, retracted as above (its KV stays
  cached, so its redo is a cache hit). So a new arrival is admitted within
  a step or two however many sequences one call asked for (docs/scheduling.md).
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from os.path import commonprefix
from typing import TYPE_CHECKING

from engine.errors import InvalidRequestError
from engine.extend_timing import ExtendStepTime
from engine.kv_manager import KVCacheManager, pages_needed
from engine.request import Request, RequestStatus

if TYPE_CHECKING:
    from engine.config import EngineConfig

# SGLang's defaults for the decode reserve ratio.
INIT_NEW_TOKEN_RATIO = 0.7
MIN_NEW_TOKEN_RATIO = 0.14
NEW_TOKEN_RATIO_DECAY = (INIT_NEW_TOKEN_RATIO - MIN_NEW_TOKEN_RATIO) / 600
MIN_EXTEND_BUDGET = 32  # prompt tokens per extend step however slow the steps are: prefill must progress
# A prompt token whose logprobs were asked for (echo) costs this many plain ones until measured: its
# step also runs the LM head, a log-softmax and a top-k at every position, and builds an entry for
# each (4.5 ms against 1.15 ms a token for SmolLM2 on a 2-core CPU).
PROMPT_LOGPROB_TOKEN_WEIGHT = 4.0
# Where extend steps are kept short (max_extend_step_s), a request alone may take a step this long: nobody waits
# on it, so it is not held to the limit, but one that arrives meanwhile waits for the step to end, and issue
# #48's goal for such a newcomer is 2 s. A 1,500-token prompt fits in one step on a 2-core AVX512-BF16 CPU.
LONE_EXTEND_STEP_S = 2.0


def group_of(request: Request) -> str:
    """The admission group of a request: its API call's (SamplingParams.group), else its own."""
    return request.params.group or request.request_id


def max_step_tokens(
    max_num_seqs: int, max_prefill_tokens: int, chunked_prefill_size: int | None, mixed_steps: bool
) -> int:
    """The most tokens one step can run: the prompt-token budget (a mixed step's decodes are taken from
    it, down to MIN_EXTEND_BUDGET left for prefill) or a full decode batch."""
    chunk = chunked_prefill_size if chunked_prefill_size and chunked_prefill_size > 0 else None
    budget = min(max_prefill_tokens, chunk or max_prefill_tokens)
    if mixed_steps:
        budget = max(budget, max_num_seqs + MIN_EXTEND_BUDGET)
    return max(budget, max_num_seqs)


def max_step_tokens_for(config: EngineConfig) -> int:
    """max_step_tokens of the scheduler a resolved config builds."""
    return max_step_tokens(
        config.positive_int("max_num_seqs"),
        config.positive_int("max_prefill_tokens"),
        config.chunked_prefill_size,
        bool(config.mixed_steps),
    )


@dataclass
class ScheduledStep:
    is_decode: bool
    requests: list[Request]  # a mixed step: its decode requests first, then its extend requests
    # tokens of each extend request that run this step (a chunk, or all uncached tokens)
    extend_lens: list[int]
    # whether each request's step ends at its last token, so it samples a next token
    sample_mask: list[bool] = field(default_factory=list)
    num_decodes: int = 0  # an extend step's leading decode requests (one token each): a mixed step
    # A verify step (speculative decoding; a decode step with drafts): each request's draft tokens (maybe
    # none); it runs its last token and its drafts as consecutive decode rows, each of which samples.
    drafts: list[list[int]] | None = None

    def __post_init__(self) -> None:
        if self.is_decode:
            self.num_decodes = len(self.requests)
        if not self.sample_mask:
            extend = [r.num_cached_tokens + n == r.num_tokens for r, n in zip(self.extend_requests, self.extend_lens)]
            self.sample_mask = [True] * self.num_decodes + extend

    @property
    def is_mixed(self) -> bool:
        return not self.is_decode and self.num_decodes > 0

    @property
    def decode_requests(self) -> list[Request]:
        return self.requests[: self.num_decodes]

    @property
    def extend_requests(self) -> list[Request]:
        return self.requests[self.num_decodes :]

    @property
    def is_verify(self) -> bool:
        return self.drafts is not None

    @property
    def sampled_requests(self) -> list[Request]:
        return [r for r, sampled in zip(self.requests, self.sample_mask) if sampled]

    @property
    def logit_row_requests(self) -> list[Request]:
        """The request of each row of logits the step samples (a verify step: 1 + drafts rows per request)."""
        if self.drafts is None:
            return self.sampled_requests
        return [r for r, drafts in zip(self.requests, self.drafts) for _ in range(1 + len(drafts))]

    @property
    def logit_row_drafts(self) -> list[tuple[int, list[int]]] | None:
        """A verify step: for each row of logits, (j, its request's drafts): the row predicts the token after
        the first j drafts, so position-dependent logit edits (a grammar's mask, min_tokens) treat those j
        drafts as already taken. None for any other step."""
        if self.drafts is None:
            return None
        return [(offset, drafts) for drafts in self.drafts for offset in range(1 + len(drafts))]

    def parts(self) -> list[ScheduledStep]:
        """A mixed step as its decode step and its extend step (failure isolation re-runs them apart)."""
        if not self.is_mixed:
            return [self]
        d = self.num_decodes
        return [
            ScheduledStep(True, self.decode_requests, []),
            ScheduledStep(False, self.extend_requests, self.extend_lens, self.sample_mask[d:]),
        ]


@dataclass
class _ExtendPlan:
    """An extend step being filled: its budget of prompt tokens left, and the requests admitted so far."""

    budget: float  # fractional once weighted tokens (prompt logprobs) are taken
    timed: bool  # steps are kept short in time (prompt-logprob tokens weigh more)
    reserve: float  # tokens the running requests (and those admitted now) will still write
    requests: list[Request] = field(default_factory=list)
    lens: list[int] = field(default_factory=list)

    def add(self, request: Request, n: int, weight: float) -> None:
        self.requests.append(request)
        self.lens.append(n)
        self.budget -= n * weight

    def step(self) -> ScheduledStep | None:
        return ScheduledStep(False, self.requests, self.lens) if self.requests else None


class Scheduler:
    def __init__(
        self,
        kv: KVCacheManager,
        max_num_seqs: int,
        max_prefill_tokens: int,
        chunked_prefill_size: int | None = None,
        max_model_len: int | None = None,
        max_extend_step_s: float | None = None,
        mixed_steps: bool = False,
        drafter: Callable[[list[Request], list[int]], list[list[int]]] | None = None,
    ) -> None:
        """drafter(requests, limits): for each running request at most its limit of draft tokens (speculative
        decoding, all of a step's requests at once); decode steps become verify steps when some have drafts."""
        self.kv = kv
        self.page_size = kv.page_size
        self.max_num_seqs = max_num_seqs
        self.max_prefill_tokens = max_prefill_tokens
        self.chunked_prefill_size = chunked_prefill_size if chunked_prefill_size and chunked_prefill_size > 0 else None
        self.max_model_len = max_model_len or kv.total_pages * kv.page_size
        self.mixed_steps = mixed_steps
        self.drafter = drafter
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # prefilled; decoding
        self.chunked: Request | None = None  # the one request part-way through a chunked prefill
        self.new_token_ratio = INIT_NEW_TOKEN_RATIO
        self.num_retractions = 0
        self._decode_owed = False  # an extend just ran: decode the running requests before the next one
        # Fairness and responsiveness: while other requests decode or wait, an extend step may take at most
        # this long, so they wait at most that. The engine reports how long every extend step took; the
        # fitted cost (fixed + per token) says how many prompt tokens fit, never fewer than MIN_EXTEND_BUDGET.
        # A request alone (nothing decoding, nothing else waiting) has the longer LONE_EXTEND_STEP_S: nobody's
        # tokens wait on it, and fewer steps save their fixed cost (issue #49: one slow step had cut a lone prompt
        # into small chunks; the estimate now learns from every step).
        self.max_extend_step_s = max_extend_step_s
        self.extend_time = ExtendStepTime()
        self.prompt_logprob_token_weight = PROMPT_LOGPROB_TOKEN_WEIGHT  # measured once such steps have run

    def check_fits(self, request: Request) -> None:
        """Refuse a request the KV pool could never hold."""
        if pages_needed(request.num_tokens + 1, self.page_size) > self.kv.total_pages:
            # Engine.add_request keeps prompts under max_model_len, which the pool always holds.
            raise InvalidRequestError(
                f"request {request.request_id} needs {request.num_tokens + 1} tokens of KV; "
                f"the pool holds {self.kv.total_pages * self.page_size}"
            )

    def add(self, request: Request) -> None:
        self.check_fits(request)
        self.waiting.append(request)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.chunked)

    @property
    def num_prefilling(self) -> int:
        return 1 if self.chunked is not None else 0

    # ---- one step -----------------------------------------------------------------------
    def schedule(self) -> ScheduledStep | None:
        if self.mixed_steps:
            return self._schedule_mixed()
        if not (self._decode_owed and self.running):
            self._give_a_slot_to_a_waiting_group()
            step = self._schedule_extend()
            if step is not None:
                return step
        self._decode_owed = False
        if self.running:
            self._reserve_decode_pages()
        decoding = [r for r in self.running if not self._finishes_on_pending_token(r)]
        if decoding:
            self.new_token_ratio = max(MIN_NEW_TOKEN_RATIO, self.new_token_ratio - NEW_TOKEN_RATIO_DECAY)
            drafts = self._drafts(decoding) if self.drafter is not None else None
            if drafts is not None:
                return ScheduledStep(True, decoding, [], drafts=drafts)
            return ScheduledStep(True, decoding, [])
        return self._schedule_extend()  # everything was retracted (or is finishing): a prefill, if any

    def _drafts(self, decoding: list[Request]) -> list[list[int]] | None:
        """Each request's drafts, within its max_tokens and the model length, and the pages to write them
        (none where the pool has no free page for them: drafts never retract or evict anyone); None when
        no request has any (a plain decode step)."""
        assert self.drafter is not None
        # Every input token is on the host (speculation runs without overlap scheduling).
        limits = [
            min(
                request.params.max_tokens - len(request.output_token_ids) - 1,
                self.max_model_len - request.num_tokens - 1,
            )
            for request in decoding
        ]
        drafts = []
        for request, proposed in zip(decoding, self.drafter(decoding, limits)):
            if proposed and self.kv.allocate(request, request.num_tokens + len(proposed), evict=False):
                drafts.append(proposed)
            else:
                drafts.append([])
        return drafts if any(drafts) else None

    def on_verified(self, request: Request, accepted: int) -> None:
        """A verify step kept `accepted` of the request's drafts: their KV counts as computed (the rest is
        overwritten by later steps). Called before the kept tokens are appended."""
        request.num_cached_tokens += accepted

    def trim_drafts(self, request: Request) -> None:
        """After a verify step: free the pages that only rejected drafts used."""
        self.kv.trim(request, request.num_tokens)

    def _schedule_mixed(self) -> ScheduledStep | None:
        """Every running request decodes; prefill chunks take what is left of the token budget."""
        self._give_a_slot_to_a_waiting_group()
        if self.running:
            self._reserve_decode_pages()  # retractions first: their pages may admit no one this step
        decoding = [r for r in self.running if not self._finishes_on_pending_token(r)]
        extend = self._schedule_extend(decode_tokens=len(decoding))
        if decoding:
            self.new_token_ratio = max(MIN_NEW_TOKEN_RATIO, self.new_token_ratio - NEW_TOKEN_RATIO_DECAY)
        if extend is None:
            return ScheduledStep(True, decoding, []) if decoding else None
        if not decoding:
            return extend
        return ScheduledStep(False, decoding + extend.requests, extend.extend_lens, num_decodes=len(decoding))

    def on_step_launched(self, step: ScheduledStep) -> None:
        """The step is on the device: advance each request as if it had run, cache computed pages.

        Safe before the step has run because the device runs steps in launch order: whatever reads
        these pages (a later step of the request, or another request reusing the cached prefix)
        runs after this step has written them. Each sampled request now has one more token pending.
        """
        for request in step.decode_requests:
            # A verify step's drafts count as computed once they are accepted (on_verified).
            request.num_cached_tokens = request.num_tokens_with_pending
            request.num_pending_tokens += 1
        if step.is_decode:
            return
        for request, n, sampled in zip(step.extend_requests, step.extend_lens, step.sample_mask[step.num_decodes :]):
            request.num_cached_tokens += n
            self.kv.stats.computed_tokens += n
            self.kv.cache_computed(request)
            if sampled:
                request.num_pending_tokens += 1
                self.running.append(request)
        # Running requests get a decode step between two extend steps (a chunk of a long prompt or a
        # batch of new prompts alike): a burst of arrivals cannot starve the streams already running.
        self._decode_owed = True

    def _finishes_on_pending_token(self, request: Request) -> bool:
        """Its pending token (not yet seen by the host) is its last by length: no step for it."""
        if not request.num_pending_tokens:
            return False
        produced = len(request.output_token_ids) + request.num_pending_tokens
        return produced >= request.params.max_tokens or request.num_tokens_with_pending >= self.max_model_len

    def finish(self, request: Request, reason: str) -> None:
        """Release a request's pages, whatever state it is in; its computed pages stay cached."""
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        self.kv.release(request)
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        if self.chunked is request:
            self.chunked = None

    # ---- extend -------------------------------------------------------------------------
    def record_extend_time(self, tokens: int, seconds: float, logprob_tokens: int = 0) -> None:
        """How long an extend step of `tokens` prompt tokens took (fed by the engine); `logprob_tokens`
        of them belonged to requests that asked for prompt logprobs.

        Every plain step teaches the step-time model (engine/extend_timing.py), whatever its size. Steps
        with prompt-logprob tokens teach their weight instead (their cost per token over a plain one, the
        plain part and the fixed cost taken off), from MIN_EXTEND_BUDGET such tokens on.
        """
        if logprob_tokens:
            plain = self.extend_time.predict(tokens - logprob_tokens)
            per_token = self.extend_time.per_token_s
            if plain is not None and per_token and logprob_tokens >= MIN_EXTEND_BUDGET:
                weight = max(1.0, (seconds - plain) / logprob_tokens / per_token)
                self.prompt_logprob_token_weight = 0.5 * self.prompt_logprob_token_weight + 0.5 * weight
            return
        self.extend_time.observe(tokens, seconds)

    def _token_weight(self, request: Request, timed: bool) -> float:
        """What one prompt token of this request costs in the extend budget, in plain tokens."""
        return self.prompt_logprob_token_weight if timed and request.params.prompt_logprobs is not None else 1.0

    def _time_budget(self) -> int | None:
        """Prompt tokens one extend step may take to stay within max_extend_step_s (LONE_EXTEND_STEP_S for a
        request alone); None without a limit or before the first step."""
        if self.max_extend_step_s is None:
            return None
        alone = not self.running and len(self.waiting) + (self.chunked is not None) <= 1
        fit = self.extend_time.tokens_within(
            max(self.max_extend_step_s, LONE_EXTEND_STEP_S) if alone else self.max_extend_step_s
        )
        return None if fit is None else max(MIN_EXTEND_BUDGET, fit)

    def _schedule_extend(self, decode_tokens: int = 0) -> ScheduledStep | None:
        """decode_tokens: tokens of this step already taken by decodes (a mixed step)."""
        # Prompt tokens this step may still take; fractional once weighted tokens (_token_weight) are taken.
        budget: float = min(self.max_prefill_tokens, self.chunked_prefill_size or self.max_prefill_tokens)
        stall_budget = self._time_budget() if self.chunked_prefill_size is not None else None
        # Prompt-logprob tokens weigh more wherever steps are kept short in time, a request alone included (one
        # 1,900-token prompt with logits at every position took 11 s in one step on two CPU cores).
        timed = self.max_extend_step_s is not None and self.chunked_prefill_size is not None
        if stall_budget is not None:
            budget = min(budget, stall_budget)
        if decode_tokens:
            # Never below MIN_EXTEND_BUDGET: a full decode batch must not starve prefill for good.
            budget = max(budget - decode_tokens, min(budget, MIN_EXTEND_BUDGET))
        # The decode reserve is O(running) to compute: only when someone waits to be admitted.
        plan = _ExtendPlan(budget, timed, self._decode_reserve_tokens() if self.waiting else 0.0)
        order, ahead = self._admission_order()
        if ahead:
            # Short prompts of groups holding fewer slots than the chunked prefill's go before its next part,
            # which keeps a share of the budget so that it always progresses.
            keep = min(float(MIN_EXTEND_BUDGET), plan.budget / 2)
            plan.budget -= keep
            self._admit(plan, ahead, self.chunked)
            plan.budget += keep
        if self.chunked is not None and not self._continue_chunk(plan):
            return plan.step()  # no pages for the chunk: decodes will finish and free some
        self._admit(plan, order)
        return plan.step()

    def _continue_chunk(self, plan: _ExtendPlan) -> bool:
        """The chunked prefill's next part, from what is left of the budget; False if there are no pages for it."""
        request = self.chunked
        assert request is not None
        weight = self._token_weight(request, plan.timed)
        n = min(request.num_tokens - request.num_cached_tokens, max(1, int(plan.budget / weight)))
        if not self.kv.allocate(request, self._tokens_to_hold(request, n)):
            return False
        plan.add(request, n, weight)
        if request.num_cached_tokens + n == request.num_tokens:
            self.chunked = None
        return True

    def _admit(self, plan: _ExtendPlan, candidates: list[Request], chunk: Request | None = None) -> None:
        """Admit waiting requests, in this order, while the budget, the slots and the pages last; `chunk`: the
        chunked prefill, not in the plan yet, whose prompt they would rather wait for than compute again."""
        sharing = [chunk] if chunk is not None else []
        for request in candidates:
            if plan.budget <= 0 or len(self.running) + len(plan.requests) + len(sharing) >= self.max_num_seqs:
                break
            if request.status is not RequestStatus.WAITING or request.num_pending_tokens:
                # Admitted already (ahead of the chunk), or retracted with a token still on the device:
                # prefilled once the host has it.
                continue
            self.kv.match_prefix(request)
            remaining = request.num_tokens - request.num_cached_tokens
            if self._shares_uncached_prefix(
                request, plan.requests + sharing, plan.lens + [r.num_tokens - r.num_cached_tokens for r in sharing]
            ):
                # Its prefix is being computed in this very step: wait one step and reuse it.
                self.kv.undo_match(request)
                continue
            if self.chunked_prefill_size is None:
                if plan.requests and remaining > plan.budget:  # whole prompts only; the first always goes
                    self.kv.undo_match(request)
                    break
                n = remaining
            else:
                weight = self._token_weight(request, plan.timed)
                n = min(remaining, int(plan.budget / weight))
                if n < 1 and plan.requests:
                    self.kv.undo_match(request)
                    break  # the budget is spent
                n = max(n, 1)
                if n < remaining and self.chunked is not None:
                    self.kv.undo_match(request)
                    break  # one chunked prefill at a time
            hold = self._tokens_to_hold(request, n)
            if not self._admissible(request, hold, plan.reserve, first=not self.running and not plan.requests):
                self.kv.undo_match(request)
                break
            if not self.kv.allocate(request, hold):
                self.kv.undo_match(request)
                break
            self.waiting.remove(request)
            request.status = RequestStatus.RUNNING
            if request.num_preemptions == 0:  # a retracted request's redo is not a new query
                self.kv.stats.query_tokens += request.num_tokens
                self.kv.stats.hit_tokens += request.num_cached_tokens
            plan.reserve += self._remaining_budget(request) * self.new_token_ratio
            plan.add(request, n, self._token_weight(request, plan.timed))
            if n < remaining:
                self.chunked = request

    # ---- fairness between request groups ----------------------------------------------------
    def _slots_by_group(self) -> Counter[str]:
        """Running slots (the chunked prefill's included) each request group holds."""
        held = Counter(group_of(r) for r in self.running)
        if self.chunked is not None:
            held[group_of(self.chunked)] += 1
        return held

    def _admission_order(self) -> tuple[list[Request], list[Request]]:
        """The waiting requests in the order admission considers them, and those of them that go before the
        chunked prefill's next part.

        Round robin over groups: the k-th waiting request of a group holding h slots comes at h + k, ties in
        arrival order. With every request a group of its own (the engine's API, or n=1 calls) that is plain
        arrival order. Ahead of the chunk: requests of groups holding fewer slots than the chunk's group.
        """
        if not self.waiting:
            return [], []
        held = self._slots_by_group()
        counts: Counter[str] = Counter()
        keyed: list[tuple[int, int, Request]] = []
        for position, request in enumerate(self.waiting):
            group = group_of(request)
            keyed.append((held[group] + counts[group], position, request))
            counts[group] += 1
        if len(counts) > 1:
            keyed.sort(key=lambda item: (item[0], item[1]))
        order = [request for _, _, request in keyed]
        if self.chunked is None:
            return order, []
        chunk_held = held[group_of(self.chunked)]
        return order, [request for request in order if held[group_of(request)] < chunk_held]

    def _give_a_slot_to_a_waiting_group(self) -> None:
        """Every slot taken, and a group waits below its fair share (max_num_seqs over the groups with work)
        while another holds more: that group's cheapest running request to redo gives its slot back.

        Never with every group at one slot (the engine's own API: each request a group), so plain traffic is
        never preempted; and never down to an even split, so two groups cannot trade a slot back and forth.
        """
        if not self.waiting or len(self.running) + (self.chunked is not None) < self.max_num_seqs:
            return
        held = self._slots_by_group()
        top_group, top = held.most_common(1)[0]
        if top <= 1:
            return
        waiting_groups = {group_of(r) for r in self.waiting if not r.num_pending_tokens}
        fair = max(1, self.max_num_seqs // len(waiting_groups | set(held)))
        if top <= fair or not any(held[g] < fair and held[g] + 1 < top for g in waiting_groups):
            return
        candidates = [r for r in self.running if group_of(r) == top_group]
        if not candidates:
            return  # its one extra slot is the chunked prefill: it finishes soon
        # Prompt logprobs never come from the cache, so such a request would redo its whole prompt.
        victim = min(reversed(candidates), key=lambda r: (r.params.prompt_logprobs is not None, r.num_tokens))
        self._retract(victim, memory_pressure=False)

    def max_step_tokens(self) -> int:
        return max_step_tokens(self.max_num_seqs, self.max_prefill_tokens, self.chunked_prefill_size, self.mixed_steps)

    def _tokens_to_hold(self, request: Request, n: int) -> int:
        # The step that ends the prompt also needs a slot for the token it samples (fed next step).
        ends_prompt = request.num_cached_tokens + n == request.num_tokens
        return request.num_cached_tokens + n + (1 if ends_prompt else 0)

    def _remaining_budget(self, request: Request) -> int:
        produced = len(request.output_token_ids) + request.num_pending_tokens
        return max(0, min(request.params.max_tokens - produced, self.max_model_len - request.num_tokens_with_pending))

    def _decode_reserve_tokens(self) -> float:
        return sum(self._remaining_budget(r) for r in self.running) * self.new_token_ratio

    def _admissible(self, request: Request, hold: int, reserve: float, first: bool) -> bool:
        """Pages for this request, and a reserve left for what running requests will still write."""
        table = len(request.shared_pages) + len(self.kv.allocator.pages_of(request.request_id))
        need = pages_needed(hold, self.page_size) - table
        if first:
            return need <= self.kv.available_pages  # nothing else runs: admit whatever fits
        return self.kv.available_pages - need >= pages_needed(int(reserve), self.page_size)

    def _shares_uncached_prefix(self, request: Request, admitted: list[Request], lens: list[int]) -> bool:
        """Will a request admitted this step cache at least one more full page of this one's prefix?"""
        if self.kv.tree is None or request.params.prompt_logprobs is not None:
            return False  # no cache, or a request that never reuses it anyway
        tokens = request.all_token_ids
        matchable = len(tokens) - 1  # a match always leaves one token to run
        for other, n in zip(admitted, lens):
            if other.params.cache_namespace != request.params.cache_namespace:
                continue  # another salt's pages are never shared (nor waited for: that wait would be a timing leak)
            # commonprefix compares element by element, so it serves lists of token ids (commonpath takes paths).
            shared = commonprefix([tokens, other.all_token_ids])  # noqa: RUF071
            common = min(len(shared), matchable, other.num_cached_tokens + n)
            if common // self.page_size > request.num_cached_tokens // self.page_size:
                return True
        return False

    # ---- decode -------------------------------------------------------------------------
    def _reserve_decode_pages(self) -> None:
        """Each running request needs a slot for the token it feeds this step; retract if there is none."""
        for request in list(self.running):
            if request.status is not RequestStatus.RUNNING or self._finishes_on_pending_token(request):
                continue  # retracted for an earlier request (O(1): no scan of the running list), or done
            while not self.kv.allocate(request, request.num_tokens_with_pending):
                victim = self._cheapest_to_redo()
                self._retract(victim)
                if victim is request:
                    break

    def _cheapest_to_redo(self) -> Request:
        candidates = list(self.running) + ([self.chunked] if self.chunked is not None else [])
        # Fewest tokens to recompute; among equals the newest (it has waited least).
        return min(reversed(candidates), key=self._tokens_to_redo)

    def _tokens_to_redo(self, request: Request) -> int:
        """What retracting the request makes it compute again (the chunked one: its chunks so far)."""
        return request.num_cached_tokens if request is self.chunked else request.num_tokens

    def _retract(self, request: Request, memory_pressure: bool = True) -> None:
        """Back to the front of the queue, its pages released; memory_pressure False: it gave its slot to another
        request group, which says nothing about the decode reserve."""
        self.kv.release(request)  # computed pages stay cached; the decode row goes with the pages
        request.num_cached_tokens = 0
        request.status = RequestStatus.WAITING
        request.num_preemptions += 1
        self.num_retractions += 1
        if memory_pressure:
            self.new_token_ratio = INIT_NEW_TOKEN_RATIO
        if request is self.chunked:
            self.chunked = None
        else:
            self.running.remove(request)
        self.waiting.appendleft(request)
