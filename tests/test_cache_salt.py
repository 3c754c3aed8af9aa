"""vLLM's cache_salt (issue #48, item 4): requests of different salts never share a prefix-cache page.

By hand on the radix tree (namespaces), then end to end on a tiny engine: a prompt cached under one salt is a
miss under another and under none, a hit under its own, and the tokens are the same either way.
"""

from __future__ import annotations

import random

import pytest
from conftest import track
from helpers import StepRecorder

from engine.engine import Engine
from engine.errors import InvalidRequestError
from engine.radix_cache import RadixCache
from engine.sampling_params import SamplingParams


def test_namespaces_never_share_a_page_and_evict_like_any_other() -> None:
    freed: list[int] = []
    tree = RadixCache(page_size=2, free_pages=freed.extend)
    tree.insert([1, 2, 3, 4], [10, 11], namespace="tenant-a")
    assert tree.match_prefix([1, 2, 3, 4], "tenant-a").pages == [10, 11]
    assert tree.match_prefix([1, 2, 3, 4], "tenant-b").pages == []
    assert tree.match_prefix([1, 2, 3, 4]).pages == []  # no salt is a namespace of its own
    # The same tokens under another salt get pages of their own, even where a first page is equal.
    other = tree.insert([1, 2, 5, 6], [20, 21], namespace="tenant-b")
    assert other.pages == [20, 21]
    # Within one namespace an edge still splits and shares its first page.
    split = tree.insert([1, 2, 7, 8], [30, 31], namespace="tenant-a")
    assert split.pages == [10, 31]
    assert tree.match_prefix([1, 2, 7, 8], "tenant-a").pages == [10, 31]
    assert tree.match_prefix([1, 2, 7, 8], "tenant-b").pages == [20]
    tree.check_counts()
    assert tree.evict(100) == 5 and sorted(freed) == [10, 11, 20, 21, 31]
    assert tree.total_pages == 0 and not tree.root.children
    tree.check_counts()


@pytest.mark.parametrize("salt", ["", 7, b"x"])
def test_a_salt_must_be_a_non_empty_string(salt: object) -> None:
    with pytest.raises(InvalidRequestError, match="cache_salt must be a non-empty string"):
        SamplingParams(cache_salt=salt)  # type: ignore[arg-type]


def _hits(engine: Engine, prompt: list[int], salt: str | None) -> tuple[int, list[int]]:
    """Prompt tokens served from the cache for one request, and its tokens."""
    before = engine.stats().prefix_cache_hit_tokens
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, cache_salt=salt)
    output = engine.generate([prompt], params)[0]
    return engine.stats().prefix_cache_hit_tokens - before, output.token_ids


def test_a_prompt_cached_under_one_salt_is_a_miss_under_another(tiny_checkpoints: dict[str, str]) -> None:
    engine = track(
        Engine(
            model=tiny_checkpoints["llama"],
            device="cpu",
            dtype="float32",
            disable_graphs=True,
            kv_cache_tokens=4096,
            max_num_seqs=8,
            page_size=16,
            debug_kv_invariant=True,
            max_extend_step_ms=0,
        )
    )
    rng = random.Random(3)
    secret = [rng.randrange(3, engine.model_config.vocab_size) for _ in range(100)]
    first, tokens = _hits(engine, secret, "tenant-a")
    assert first == 0
    assert _hits(engine, secret, "tenant-b") == (0, tokens)  # another tenant: computed again, same tokens
    assert _hits(engine, secret, None) == (0, tokens)  # an unsalted request: likewise
    own, own_tokens = _hits(engine, secret, "tenant-a")
    assert own == 96 and own_tokens == tokens  # its own salt: six full pages from the cache
    # Arriving together: a request never waits for another salt's prefill to reuse it (which would be a
    # timing leak, and a wait for nothing); both compute the prompt.
    params = [SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True, cache_salt=salt) for salt in ("c", "d")]
    computed = engine.stats().prefill_computed_tokens
    fresh = [rng.randrange(3, engine.model_config.vocab_size) for _ in range(64)]
    with StepRecorder(engine) as steps:
        engine.generate([fresh, fresh], params)
    assert steps.extend_sizes[0] == 2, steps.steps  # both in the first prefill
    assert engine.stats().prefill_computed_tokens - computed == 2 * 64
