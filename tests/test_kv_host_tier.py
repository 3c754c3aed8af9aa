"""The host-memory KV tier under the radix cache (issue #45, engine/kv_host_tier.py, engine/hierarchical_cache.py).

The fuzz drives the real KVCacheManager over a real (tiny) KV pool and host tier with no model: every "computed"
token writes its k/v as (token, position) and (layer, token * 7 + position), so after every operation the test
checks the pool invariant of both tiers and that every page the tree holds, on the device or the host, holds the
k/v of exactly the tokens its path spells; a prefix loaded back from the host must read as if it were computed.
The end-to-end test runs SmolLM2 on a multi-turn workload that overflows a small device pool, with the tier on and
off: the same greedy tokens, and prefixes served from the host.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from collections.abc import Iterator

import pytest
import torch
from conftest import REPO_ROOT, release_cached, track

from engine.engine import Engine
from engine.errors import EngineError
from engine.hierarchical_cache import HierarchicalRadixCache
from engine.kv_cache import KVPool
from engine.kv_host_tier import CopyFence, HostKVPool, StepEnds
from engine.kv_manager import KVCacheManager
from engine.radix_cache import RadixNode
from engine.request import Request
from engine.sampling_params import SamplingParams

LAYERS = 2


def make_manager(
    device_pages: int, host_pages: int, page_size: int, write_through: bool, evict_ahead: bool | None = None
) -> tuple[KVCacheManager, KVPool, HostKVPool]:
    pool = KVPool(LAYERS, device_pages + 1, page_size, 1, 2, torch.float32, torch.device("cpu"))
    host = HostKVPool(pool, host_pages, torch.device("cpu"))
    manager = KVCacheManager(
        pool.allocator, page_size, True, host_tier=host, write_through=write_through, evict_ahead=evict_ahead
    )
    return manager, pool, host


def expected(token: int, position: int, layer: int) -> tuple[list[float], list[float]]:
    return [float(token), float(position)], [float(layer), float(token * 7 + position)]


def compute(pool: KVPool, manager: KVCacheManager, request: Request, upto: int) -> None:
    """A step ran over the request's tokens [num_cached_tokens, upto): their k/v are in its pages."""
    table = manager.page_table(request)
    ps = pool.page_size
    for position in range(request.num_cached_tokens, upto):
        slot = table[position // ps] * ps + position % ps
        for layer, (k, v) in enumerate(pool.caches):
            kk, vv = expected(request.all_token_ids[position], position, layer)
            k[slot] = torch.tensor([kk])
            v[slot] = torch.tensor([vv])
    request.num_cached_tokens = upto
    manager.cache_computed(request)


def assert_pages_hold(
    caches: list[tuple[torch.Tensor, torch.Tensor]], pages: list[int], tokens: list[int], start: int, ps: int
) -> None:
    for i, page in enumerate(pages):
        for j in range(ps):
            position = start + i * ps + j
            for layer, (k, v) in enumerate(caches):
                kk, vv = expected(tokens[i * ps + j], position, layer)
                assert k[page * ps + j].flatten().tolist() == kk, f"k of page {page} slot {j} (position {position})"
                assert v[page * ps + j].flatten().tolist() == vv, f"v of page {page} slot {j} (position {position})"


def assert_tree_data(tree: HierarchicalRadixCache, pool: KVPool, host: HostKVPool) -> None:
    """Every page of every node, on either tier, holds its tokens' k/v at their positions."""
    stack: list[tuple[RadixNode, int]] = [(child, 0) for child in tree.root.children.values()]
    while stack:
        node, start = stack.pop()
        tokens = list(node.key)
        if node.pages:
            assert_pages_hold(pool.caches, node.pages, tokens, start, pool.page_size)
        if node.host_pages:
            assert_pages_hold(host.slot_caches(), node.host_pages, tokens, start, pool.page_size)
        stack.extend((child, start + len(node.key)) for child in node.children.values())


class Fuzz:
    """Requests over shared conversation histories: admissions (with loads back), chunks, decodes, finishes,
    aborts (also right after a match, with its load just issued), retractions and redos, evictions, resets."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.ps = self.rng.choice([1, 2, 4])
        self.manager, self.pool, self.host = make_manager(
            self.rng.randint(6, 30), self.rng.randint(1, 40), self.ps, self.rng.random() < 0.5, evict_ahead=True
        )
        tree = self.manager.tree
        assert isinstance(tree, HierarchicalRadixCache)
        self.tree = tree
        self.histories = [[self.rng.randrange(1, 50) for _ in range(60)] for _ in range(4)]
        self.running: list[Request] = []
        self.retracted: list[Request] = []
        self.next_id = 0

    def check(self) -> None:
        self.manager.check_invariant()
        assert_tree_data(self.tree, self.pool, self.host)
        for request in self.running:
            pages = self.manager.page_table(request)[: request.num_cached_tokens // self.ps]
            assert_pages_hold(self.pool.caches, pages, request.all_token_ids, 0, self.ps)

    def admit(self, request: Request | None = None) -> None:
        if request is None:
            history = self.rng.choice(self.histories)
            tokens = history[: self.rng.randint(2, len(history))] + [
                self.rng.randrange(1, 50) for _ in range(self.rng.randint(0, 6))
            ]
            request = Request(f"r{self.next_id}", tokens, SamplingParams(max_tokens=8))
            self.next_id += 1
        cached = self.manager.match_prefix(request)
        # A loaded-back prefix reads exactly as a computed one.
        assert_pages_hold(self.pool.caches, request.shared_pages, request.all_token_ids, 0, self.ps)
        assert cached == len(request.shared_pages) * self.ps
        roll = self.rng.random()
        if roll < 0.1:
            self.manager.release(request)  # aborted right after its match (its load issued, never fenced)
        elif roll < 0.2 or not self.manager.allocate(request, request.num_tokens + 1):
            self.manager.undo_match(request)  # not admitted after all
        else:
            # The prompt in one or two chunks.
            if request.num_tokens - cached > 1 and self.rng.random() < 0.4:
                compute(self.pool, self.manager, request, self.rng.randint(cached + 1, request.num_tokens - 1))
                self.check()
            compute(self.pool, self.manager, request, request.num_tokens)
            self.running.append(request)

    def decode(self) -> None:
        request = self.rng.choice(self.running)
        request.output_token_ids.append(self.rng.randrange(1, 50))
        while not self.manager.allocate(request, request.num_tokens + 1):
            victim = min(self.running, key=lambda r: r.num_tokens)  # the scheduler's retraction
            self.retract(victim)
            if victim is request:
                return
        compute(self.pool, self.manager, request, request.num_tokens)

    def retract(self, request: Request) -> None:
        self.running.remove(request)
        self.manager.release(request)
        request.num_cached_tokens = 0
        self.retracted.append(request)

    def step(self) -> None:
        op = self.rng.random()
        if op < 0.35 or not self.running:
            if self.retracted and self.rng.random() < 0.5:
                self.admit(self.retracted.pop(0))  # the redo: its computed pages come from either tier
            else:
                self.admit()
        elif op < 0.6:
            self.decode()
        elif op < 0.75:
            self.manager.release(self.running.pop(self.rng.randrange(len(self.running))))  # finished
        elif op < 0.82:
            request = self.running.pop(self.rng.randrange(len(self.running)))
            request.num_cached_tokens = max(0, request.num_cached_tokens - 1)  # aborted with a token in flight
            self.manager.release(request)
        elif op < 0.9:
            self.retract(self.rng.choice(self.running))
        elif op < 0.93:
            self.manager.fence()  # a launch: a step's worth of pages evicted ahead
        elif op < 0.97:
            self.tree.evict(self.rng.randint(1, 8))
        elif op < 0.99:
            self.tree.evict_host(self.rng.randint(1, 8))
        else:
            self.manager.reset_prefix_cache()
        self.check()


@pytest.mark.parametrize("seed", range(12))
def test_fuzz_inserts_evictions_reloads_aborts_and_retractions(seed: int) -> None:
    fuzz = Fuzz(seed)
    for _ in range(300):
        fuzz.step()
    for request in fuzz.running:
        fuzz.manager.release(request)
    fuzz.manager.reset_prefix_cache()
    fuzz.check()
    assert fuzz.manager.available_pages == fuzz.manager.total_pages
    assert fuzz.host.num_free == fuzz.host.allocator.total
    assert fuzz.tree.evicted_pages_total > 0


@pytest.mark.parametrize("write_through", [True, False])
def test_an_evicted_prefix_is_loaded_back_from_the_host(write_through: bool) -> None:
    manager, pool, host = make_manager(device_pages=4, host_pages=8, page_size=2, write_through=write_through)
    first = Request("a", list(range(1, 9)), SamplingParams())
    manager.match_prefix(first)
    assert manager.allocate(first, 8)
    compute(pool, manager, first, 8)
    manager.release(first)
    assert host.stats.written_tokens == (8 if write_through else 0)
    other = Request("b", list(range(20, 28)), SamplingParams())  # takes the whole pool: "a" goes to the host
    manager.match_prefix(other)
    assert manager.allocate(other, 8)
    assert host.stats.written_tokens == 8 and manager.evictable_pages == 0
    compute(pool, manager, other, 8)
    manager.release(other)
    again = Request("c", [*range(1, 9), 99], SamplingParams())
    assert manager.match_prefix(again) == 8  # all four pages, loaded back
    assert host.stats.hits == 1 and host.stats.loaded_tokens == 8
    assert_pages_hold(pool.caches, again.shared_pages, again.all_token_ids, 0, 2)
    manager.release(again)
    manager.check_invariant()


def test_a_write_through_never_drops_a_prefix_for_a_copy() -> None:
    """A full host keeps what it alone holds: the next node's write-through waits (it is written if evicted), so
    the two tiers hold the sum of their sizes, one prefix on the host and another on the device."""
    manager, pool, host = make_manager(device_pages=4, host_pages=4, page_size=1, write_through=True)
    for name, first in (("a", 1), ("b", 11)):
        request = Request(name, list(range(first, first + 5)), SamplingParams())
        manager.match_prefix(request)
        assert manager.allocate(request, 4)  # the pool's four pages: "a" leaves the device for "b"
        compute(pool, manager, request, 4)
        manager.release(request)
        manager.check_invariant()
    assert host.stats.written_tokens == 4 and host.stats.evicted_pages == 0  # "b" was not copied over "a"
    again = Request("c", list(range(1, 6)), SamplingParams())
    assert manager.match_prefix(again) == 4 and host.stats.hits == 1  # "a", loaded back from the host
    assert_pages_hold(pool.caches, again.shared_pages, again.all_token_ids, 0, 1)
    manager.release(again)
    manager.check_invariant()


def test_a_partial_load_keeps_the_rest_on_the_host() -> None:
    manager, pool, host = make_manager(device_pages=4, host_pages=8, page_size=1, write_through=False)
    first = Request("a", [1, 2, 3, 4, 5], SamplingParams())
    manager.match_prefix(first)
    assert manager.allocate(first, 4)
    compute(pool, manager, first, 4)
    manager.release(first)
    holder = Request("b", [9, 9], SamplingParams())  # two private pages: "a" goes to the host, two pages stay free
    assert manager.allocate(holder, 2)
    again = Request("c", [1, 2, 3, 4, 5], SamplingParams())
    assert manager.match_prefix(again) == 2  # what fits; the other two pages stay on the host
    assert_pages_hold(pool.caches, again.shared_pages, again.all_token_ids, 0, 1)
    manager.check_invariant()
    manager.release(again)
    manager.release(holder)
    final = Request("d", [1, 2, 3, 4, 5], SamplingParams())
    assert manager.match_prefix(final) == 4 and host.stats.hits == 2
    assert_pages_hold(pool.caches, final.shared_pages, final.all_token_ids, 0, 1)
    manager.release(final)
    manager.check_invariant()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.uint8])
def test_the_triton_page_mover_moves_what_torch_moves(dtype: torch.dtype) -> None:
    """The CUDA mover (one launch for every layer's pages; the Triton interpreter here) against the portable one:
    the same host pages after a write, the same device pages after a load; bytes, where a page is no whole
    number of int32 words (uint8, head_dim 6)."""
    pytest.importorskip("triton")
    from backends.cuda.kv_pages import TritonPageMover

    cpu = torch.device("cpu")
    pool = KVPool(3, 9, 4, 2, 6, dtype, cpu)
    generator = torch.Generator().manual_seed(0)
    for k, v in pool.caches:
        for tensor in (k, v):
            tensor.copy_(torch.randint(0, 120, tensor.shape, generator=generator).to(dtype))
    original = [t.clone() for kv in pool.caches for t in kv]
    hosts = [HostKVPool(pool, 6, cpu), HostKVPool(pool, 6, cpu, TritonPageMover())]
    hosts[1]._chunk_pages = 2  # copies staged in chunks, as a big copy is (STAGING_BYTES)
    for host in hosts:
        host.write([3, 1, 7], [0, 1, 2])
        host.write([5, 6], [4, 5])
    written = [0, 1, 2, 4, 5]
    assert torch.equal(hosts[0].pages[written], hosts[1].pages[written])
    assert hosts[0].pages.dtype == (torch.uint8 if dtype == torch.uint8 else torch.int32)
    for host in hosts:
        for tensor in (t for kv in pool.caches for t in kv):
            tensor.zero_()
        host.load(written, [2, 4, 6, 8, 1])
        moved = [t.clone() for kv in pool.caches for t in kv]
        for before, after in zip(original, moved, strict=True):
            for source, target in ((3, 2), (1, 4), (7, 6), (5, 8), (6, 1)):
                assert torch.equal(after[target * 4 : target * 4 + 4], before[source * 4 : source * 4 + 4])


class _Copy:
    """A copy's end as CopyFence sees a CUDA event: whether it has run."""

    def __init__(self) -> None:
        self.done = False

    def query(self) -> bool:
        return self.done


def test_the_next_step_waits_only_for_the_copies_it_must() -> None:
    """Freed pages wait for the last copy that read them, not the copies issued since; a load is always
    waited for; pages whose copy has run, or that no copy read, wait for nothing."""
    fence = CopyFence()
    first, second, third = _Copy(), _Copy(), _Copy()
    fence.read_pages([1, 2], 1, first)  # a write-through of pages 1-2
    fence.read_pages([3], 2, second)
    fence.read_pages([4], 3, third)
    assert fence.take() is None  # write-throughs alone hold no step up
    fence.pages_reused([1, 9])
    assert fence.take() is first  # not the later copies
    fence.pages_reused([2])
    assert fence.take() is first  # each page keeps its reader until it is freed
    first.done = True
    second.done = True
    fence.pages_reused([3])
    assert fence.take() is None  # its copy has run
    fence.pages_reused([4])
    load = _Copy()
    fence.wait_for(4, load)  # a load issued after: the latest needed covers the earlier one
    assert fence.take() is load
    assert fence.take() is None


@pytest.mark.parametrize("copied", [True, False])
def test_a_prefix_evicted_before_its_write_through_ran_is_dropped_not_waited_for(copied: bool) -> None:
    """A device leaf whose write-through has run goes to the host and comes back on a hit. One whose write has not
    run yet (a pool with no room beyond its running requests evicts what a request cached a moment ago) leaves the
    tree instead: the next step must not wait for that write, queued behind every earlier copy."""
    manager, pool, host = make_manager(device_pages=4, host_pages=8, page_size=2, write_through=True)
    first = Request("a", list(range(1, 9)), SamplingParams())
    manager.match_prefix(first)
    assert manager.allocate(first, 8)
    compute(pool, manager, first, 8)
    pages = manager.page_table(first)
    manager.release(first)
    assert host.stats.written_tokens == 8
    write = _Copy()  # the CPU copies at once: here "a"'s write-through is still on the write stream
    write.done = copied
    host._write_fence.read_pages(pages, 1, write)
    host._device_read.update(dict.fromkeys(pages, write))
    other = Request("b", list(range(20, 28)), SamplingParams())  # takes the whole pool: "a" leaves the device
    manager.match_prefix(other)
    assert manager.allocate(other, 8)
    assert host._write_fence.take() is None  # no step waits: the copy has run, or it is dropped
    assert host.stats.evicted_pages == (0 if copied else 4)
    compute(pool, manager, other, 8)
    manager.release(other)
    manager.check_invariant()
    again = Request("c", [*range(1, 9), 99], SamplingParams())
    assert manager.match_prefix(again) == (8 if copied else 0)
    assert host.stats.hits == (1 if copied else 0)
    manager.release(again)
    manager.check_invariant()


def test_settings_are_checked() -> None:
    with pytest.raises(EngineError, match="needs the prefix cache"):
        Engine(device="cpu", enable_hierarchical_cache=True, enable_prefix_caching=False, warmup=False)


# ---- end to end on SmolLM2 -------------------------------------------------------------------------------------


def conversations(num: int, turns: int, seed: int = 0) -> list[list[list[int]]]:
    """Per conversation, each turn's prompt: the whole history so far (earlier prompts) and a new message."""
    rng = random.Random(seed)
    result = []
    for _ in range(num):
        history = [rng.randrange(100, 20000) for _ in range(96)]
        prompts = []
        for _ in range(turns):
            history = history + [rng.randrange(100, 20000) for _ in range(rng.randint(10, 30))]
            prompts.append(list(history))
        result.append(prompts)
    return result


def run_turns(engine: Engine, convs: list[list[list[int]]]) -> list[list[int]]:
    """Turn by turn, every conversation's next turn at once (their histories no longer fit the pool together)."""
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    outputs: list[list[int]] = []
    for turn in range(len(convs[0])):
        for result in engine.generate([conv[turn] for conv in convs], params):
            outputs.append(list(result.token_ids))
    return outputs


@pytest.fixture(scope="module")
def tier_engines() -> Iterator[dict[str, Engine]]:
    # A pool of 480 tokens: one turn of the five conversations fits, their histories together do not.
    common = dict(
        device="cpu",
        dtype="float32",
        page_size=16,
        kv_cache_tokens=480,
        max_num_seqs=4,
        disable_graphs=True,
        max_extend_step_ms=0,
        debug_kv_invariant=True,
    )
    engines = {
        "off": Engine(**common),
        "write_through": Engine(**common, enable_hierarchical_cache=True, hicache_ratio=4.0),
        "write_back": Engine(
            **common, enable_hierarchical_cache=True, hicache_ratio=4.0, hicache_write_policy="write_back"
        ),
    }
    yield engines
    for engine in engines.values():
        release_cached(engine)


def test_greedy_tokens_are_the_same_with_the_host_tier(tier_engines: dict[str, Engine]) -> None:
    convs = conversations(5, 3)
    reference = run_turns(track(tier_engines["off"]), convs)
    for policy in ("write_through", "write_back"):
        engine = track(tier_engines[policy])
        assert run_turns(engine, convs) == reference, policy
        stats = engine.stats()
        assert stats.host_hits > 0 and stats.host_loaded_tokens > 0, policy
        assert stats.host_written_tokens > 0 and stats.host_copy_seconds > 0
        # Loaded back rather than recomputed: fewer prompt tokens ran through the model.
        assert stats.prefill_computed_tokens < tier_engines["off"].stats().prefill_computed_tokens


def test_metrics_name_the_host_tier(tier_engines: dict[str, Engine]) -> None:
    from engine.server.metrics import _engine_series

    names = {name for _, name, _, _ in _engine_series(tier_engines["write_back"].stats())}
    assert {"engine:hicache_host_hits", "engine:hicache_loaded_bytes", "engine:hicache_copy_seconds"} <= names
    assert not any("hicache" in name for _, name, _, _ in _engine_series(tier_engines["off"].stats()))


def test_the_benchmark_runs_a_tiny_case(tmp_path: object) -> None:
    out = os.path.join(str(tmp_path), "kv_host_tier.json")
    argv = [
        sys.executable,
        os.path.join(REPO_ROOT, "benchmarks", "kv_host_tier.py"),
        "--device",
        "cpu",
        "--conversations",
        "4",
        "--turns",
        "2",
        "--history-tokens",
        "64",
        "--turn-tokens",
        "16",
        "--output-tokens",
        "2",
        "--page-size",
        "16",
        "--concurrency",
        "2",
        "--trace-dir",
        os.path.join(str(tmp_path), "traces"),
        "--output-json",
        out,
    ]
    env = {**os.environ, "PYTHONPATH": REPO_ROOT}
    result = subprocess.run(argv, capture_output=True, text=True, timeout=600, env=env, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    with open(out) as f:
        report = json.load(f)
    assert {row["workload"] for row in report["rows"]} == {"multi-turn", "no reuse"}
    traces = sorted(os.listdir(os.path.join(str(tmp_path), "traces")))  # a chrome trace of each run
    assert traces == [f"{w}_tier-{t}_0.json.gz" for w in ("multi-turn", "no-reuse") for t in ("off", "on")]
    # Exactness is test_greedy_tokens_are_the_same_with_the_host_tier's (a fixed schedule); the benchmark's
    # extend steps follow the machine's speed, so its chunks, and with them float sums, may differ.
    assert 0 < report["same_tokens"]["multi-turn"] <= 1 and report["rows"][1]["host_hits"] > 0
    assert "host tier" in result.stdout


def test_flags_are_sglangs() -> None:
    from engine.cli import build_parser, engine_config_from_args

    argv = ["run", "--enable-hierarchical-cache", "--hicache-size", "2.5", "--hicache-write-policy", "write_back"]
    config = engine_config_from_args(build_parser().parse_args(argv))
    assert config.enable_hierarchical_cache and config.hicache_size == 2.5
    assert config.hicache_write_policy == "write_back" and config.hicache_ratio == 2.0
    with pytest.raises(SystemExit):
        build_parser().parse_args(["run", "--hicache-write-policy", "write_through_selective"])


def test_a_load_waits_only_for_the_steps_that_may_use_its_pages() -> None:
    """StepEnds: an end recorded before each launch; a load into pages unused since step count T waits for the
    end before step T only (nothing once it has run), and for all queued work where no step was launched since."""
    steps = StepEnds()
    ends = [_Copy() for _ in range(4)]
    for step, end in enumerate(ends):
        steps.launching(step, end)  # steps 0..3 launched; 3 is in flight
    assert steps.before(0) is None  # nothing launched before step 0
    assert steps.before(2) is ends[2]
    assert steps.before(4) is True  # steps up to the one in flight: no end recorded after it yet
    ends[0].done = ends[1].done = ends[2].done = True  # steps 0 and 1 have run
    assert steps.before(2) is None and steps.before(3) is ends[3]
    after_three = _Copy()
    steps.launching(4, after_three)
    assert steps.before(3) is ends[3] and steps.before(4) is after_three and steps.before(5) is True
    ends[3].done = True
    assert steps.before(3) is None and steps.before(4) is after_three


@pytest.mark.parametrize("write_through", [True, False])
def test_freed_pages_carry_the_steps_that_may_still_use_them(write_through: bool) -> None:
    """Pages freed by a request: every step launched so far may use them; pages of an evicted cache node: only
    the steps launched before its last request let go of it. So a write-through follows every launched step
    (its pages were just computed), and the write-back of an evicted node only the steps before its release,
    which on CUDA overlaps it with the step in flight instead of making the next step wait for both."""
    manager, pool, host = make_manager(device_pages=4, host_pages=8, page_size=1, write_through=write_through)
    allocator = manager.allocator
    writes: list[int | None] = []
    copy = host._copy

    def recording_copy(device_pages: list[int], host_pages: list[int], to_host: bool, after_steps_before: int | None):
        if to_host:
            writes.append(after_steps_before)
        return copy(device_pages, host_pages, to_host, after_steps_before)

    host._copy = recording_copy  # type: ignore[method-assign]
    first = Request("a", [1, 2, 3, 4, 5], SamplingParams())
    manager.match_prefix(first)
    assert manager.allocate(first, 4)
    compute(pool, manager, first, 4)
    manager.fence()
    manager.fence()  # two steps launched with "a" in them
    manager.release(first)  # the node is let go at count 2
    for _ in range(5):
        manager.fence()  # five steps launched since, none with "a"
    other = Request("b", [9, 9, 9, 9, 9], SamplingParams())
    manager.match_prefix(other)
    assert manager.allocate(other, 4)  # evicts "a" to the host
    assert writes == ([None] if write_through else [2])
    assert allocator.unused_since(allocator.pages_of("b")) == 2
    manager.release(other, cache=False)  # b's own pages, freed now
    assert allocator.unused_since(list(range(1, 5))) == 7
    manager.check_invariant()


@pytest.mark.parametrize("copied", [True, False])
def test_pages_evicted_ahead_wait_for_their_write_back_only_when_handed_out_again(copied: bool) -> None:
    """Before a launch the manager frees as many pages as that step took (a quarter of the pool at most) by
    evicting least recently used prefixes to the host: their write-backs run beside the step, and freeing the
    pages makes no step wait. The step that takes the pages again waits for a write still reading them, and only
    then (here with the write's end held open, as if it were still on the CUDA write stream)."""
    manager, pool, host = make_manager(device_pages=8, host_pages=8, page_size=1, write_through=False, evict_ahead=True)
    assert not make_manager(8, 8, 1, False)[0].evict_ahead  # by default only where copies are asynchronous
    write = _Copy()
    write.done = copied
    copy = host._copy

    def held_open_copy(device_pages: list[int], host_pages: list[int], to_host: bool, after_steps_before: int | None):
        copy(device_pages, host_pages, to_host, after_steps_before)  # the CPU's copy has run; its end is the test's
        return write if to_host else None

    host._copy = held_open_copy  # type: ignore[method-assign]
    first = Request("a", [1, 2, 3, 4, 5], SamplingParams())
    manager.match_prefix(first)
    assert manager.allocate(first, 4)
    compute(pool, manager, first, 4)
    manager.release(first)  # "a" cached: 4 evictable pages, 4 free
    second = Request("b", [9, 8, 7, 6, 5], SamplingParams())
    manager.match_prefix(second)
    assert manager.allocate(second, 4)  # the pool is full: 4 in use, 4 cached
    a_pages = manager.tree.all_pages()
    manager.fence()  # 8 pages taken since start, at most 2 kept free: "a" (one node of 4 pages) goes to the host
    assert manager.allocator.num_free == 4 and host.stats.written_tokens == 4
    assert host._write_fence.take() is None  # freeing them holds no step up
    third = Request("c", [4, 4, 4], SamplingParams())
    manager.match_prefix(third)
    assert manager.allocate(third, 3)
    taken = manager.allocator.pages_of("c")
    assert set(taken) <= set(a_pages)  # "a"'s pages, handed out again
    assert host._write_fence.take() is (None if copied else write)  # the next step waits if the write has not run
    manager.fence()  # 3 taken since the last launch: 1 free, so nothing more is evicted ("a" is on the host only)
    assert manager.allocator.num_free == 1 and host.stats.written_tokens == 4
    for request in (second, third):
        manager.release(request, cache=False)
    manager.check_invariant()
    again = Request("d", [1, 2, 3, 4, 9], SamplingParams())
    assert manager.match_prefix(again) == 4  # loaded back from the host
    manager.release(again)
    manager.check_invariant()
