"""The data-parallel router's policies (engine/server/prefix_routing.py), on token ids alone."""

from __future__ import annotations

import pytest

from engine.server.prefix_routing import PrefixTree, Router, RoutingPolicy

PAGE = 4


def _doc(seed: int, pages: int) -> list[int]:
    return [seed * 1000 + i for i in range(pages * PAGE)]


def test_a_prompt_follows_the_replica_that_holds_its_prefix() -> None:
    router = Router(RoutingPolicy(), PAGE, max_pages=1000)
    docs = [_doc(seed, 8) for seed in range(3)]
    first = [router.choose([*doc, 7, 7], {0: 0, 1: 0}) for doc in docs]
    # Empty trees: each new document goes where the tree is smallest, so they spread over both replicas.
    assert sorted(set(first)) == [0, 1]
    again = [router.choose([*doc, 9, 9, 9], {0: 0, 1: 0}) for doc in docs]
    assert again == first  # each question follows its document
    assert router.decisions["cache"] == 3 and router.decisions["capacity"] == 3


def test_a_short_shared_prefix_is_not_enough() -> None:
    """Below the cache threshold (half the prompt) the smallest tree wins, not the partial match."""
    router = Router(RoutingPolicy(cache_threshold=0.5), PAGE, max_pages=1000)
    shared = _doc(1, 2)
    assert router.choose(shared + _doc(2, 6), {0: 0, 1: 0}) == 0
    assert router.choose(shared + _doc(3, 6), {0: 0, 1: 0}) == 1  # 2 of 8 pages matched on replica 0


def test_an_overloaded_replica_loses_its_cache_hits_to_the_idlest() -> None:
    policy = RoutingPolicy(balance_abs_threshold=4, balance_rel_threshold=1.5)
    router = Router(policy, PAGE, max_pages=1000)
    doc = _doc(1, 8)
    assert router.choose(doc, {0: 0, 1: 0}) == 0
    assert router.choose(doc, {0: 4, 1: 0}) == 0  # a difference of 4 is within the threshold
    assert router.choose(doc, {0: 5, 1: 0}) == 1  # 5 over, and more than 1.5x: the idlest takes it
    # 2 over: balanced enough for the cache to decide again; both replicas hold the prompt now, and the less
    # loaded of the two takes it.
    assert router.choose(doc, {0: 12, 1: 10}) == 1
    assert router.choose(doc, {0: 10, 1: 12}) == 0
    assert router.decisions["balance"] == 1 and router.decisions["cache"] == 3


def test_a_replica_that_is_down_is_never_chosen_and_its_tree_is_dropped() -> None:
    router = Router(RoutingPolicy(), PAGE, max_pages=1000)
    doc = _doc(1, 8)
    assert router.choose(doc, {0: 0, 1: 0}) == 0
    router.replica_down(0)
    assert router.tree.pages.get(0, 0) == 0
    assert router.choose(doc, {1: 0}) == 1
    with pytest.raises(ValueError, match="no replica is up"):
        router.choose(doc, {})


@pytest.mark.parametrize("name, expected", [("round_robin", [0, 1, 0, 1]), ("shortest_queue", [1, 1, 0, 0])])
def test_the_other_policies(name: str, expected: list[int]) -> None:
    router = Router(RoutingPolicy(name), PAGE, max_pages=1000)
    loads = [{0: 3, 1: 1}, {0: 3, 1: 2}, {0: 1, 1: 2}, {0: 2, 1: 2}]
    assert [router.choose(_doc(1, 2), load) for load in loads] == expected


def test_the_tree_keeps_its_most_recently_used_pages() -> None:
    tree = PrefixTree(PAGE, max_pages=10)
    old, new = _doc(1, 8), _doc(2, 8)
    tree.insert(old, 0)
    tree.insert(new, 0)  # 16 pages: the 6 oldest go, deepest first
    assert tree.pages[0] == 10
    assert tree.matched_tokens(new) == {0: 8 * PAGE}
    assert tree.matched_tokens(old) == {0: 2 * PAGE}  # the old prompt's first pages remain
    tree.insert(new[: 2 * PAGE], 1)
    assert tree.matched_tokens(new) == {0: 8 * PAGE, 1: 2 * PAGE}


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"name": "random"}, "unknown router policy"),
        ({"cache_threshold": 1.5}, "cache threshold"),
        ({"balance_rel_threshold": 0.5}, "balance thresholds"),
    ],
)
def test_bad_settings_are_refused(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        RoutingPolicy(**kwargs)
