"""Which replica a request goes to (`engine serve --data-parallel-size N`): SGLang's router policies.

- **cache_aware** (the default): each replica's prefix cache is mirrored, approximately, by a tree of the
  prompts routed to it, in pages of the engine's page size. A request goes to the replica whose tree holds
  the longest prefix of its prompt, if that prefix is more than `cache_threshold` of the prompt; otherwise
  to the replica with the smallest tree (the most room for a new prefix). If the load is out of balance
  (the busiest replica has more than `balance_abs_threshold` requests over the idlest *and* more than
  `balance_rel_threshold` times its count), the idlest replica takes it, whatever its cache holds.
- **round_robin**: in turn.
- **shortest_queue**: the replica with the fewest requests in flight.

The trees only approximate the engines' radix caches (they never see an eviction): a replica's tree is
cut back to its `max_pages` least recently used pages, as the SGLang router's is by size.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

POLICIES = ("cache_aware", "round_robin", "shortest_queue")


@dataclass
class _Node:
    children: dict[tuple[int, ...], _Node] = field(default_factory=dict)
    # replica -> when it last routed a prompt through this page (a logical clock)
    owners: dict[int, int] = field(default_factory=dict)


class PrefixTree:
    """Prompts as chains of pages (tuples of page_size token ids), each page marked with the replicas whose
    prompts passed through it."""

    def __init__(self, page_size: int, max_pages: int) -> None:
        if page_size < 1 or max_pages < 1:
            raise ValueError(f"page_size and max_pages must be >= 1, got {page_size} and {max_pages}")
        self.page_size = page_size
        self.max_pages = max_pages
        self.root = _Node()
        self.pages: dict[int, int] = {}  # replica -> pages it owns
        self._clock = itertools.count(1)

    def _chunks(self, tokens: Sequence[int]) -> list[tuple[int, ...]]:
        full = len(tokens) - len(tokens) % self.page_size
        return [tuple(tokens[i : i + self.page_size]) for i in range(0, full, self.page_size)]

    def matched_tokens(self, tokens: Sequence[int]) -> dict[int, int]:
        """Per replica, the tokens of the longest prefix of `tokens` its routed prompts share (whole pages)."""
        matched: dict[int, int] = {}
        node = self.root
        for depth, chunk in enumerate(self._chunks(tokens), start=1):
            child = node.children.get(chunk)
            if child is None:
                break
            for replica in child.owners:
                matched[replica] = depth * self.page_size
            node = child
        return matched

    def insert(self, tokens: Sequence[int], replica: int) -> None:
        now = next(self._clock)
        node = self.root
        for chunk in self._chunks(tokens):
            child = node.children.get(chunk)
            if child is None:
                child = node.children[chunk] = _Node()
            if replica not in child.owners:
                self.pages[replica] = self.pages.get(replica, 0) + 1
            child.owners[replica] = now
            node = child
        if self.pages.get(replica, 0) > self.max_pages:
            self._evict(replica, self.pages[replica] - self.max_pages)

    def remove_replica(self, replica: int) -> None:
        """Forget what a replica held (it died: its engine's cache is gone with it)."""
        self._evict(replica, self.pages.get(replica, 0))

    def _evict(self, replica: int, count: int) -> None:
        """Drop the replica's `count` least recently used pages, leaves first (a page's descendants were
        used no earlier than it was, so taking the oldest stamps never leaves an orphan above a kept page)."""
        owned: list[tuple[int, int, _Node, _Node]] = []  # (stamp, -depth, node, parent)
        stack: list[tuple[_Node, int]] = [(self.root, 0)]
        while stack:
            node, depth = stack.pop()
            for child in node.children.values():
                if replica in child.owners:
                    owned.append((child.owners[replica], -depth - 1, child, node))
                stack.append((child, depth + 1))
        owned.sort(key=lambda item: (item[0], item[1]))
        for _, _, node, parent in owned[:count]:
            del node.owners[replica]
            self.pages[replica] -= 1
            if not node.owners and not node.children:
                for key, child in list(parent.children.items()):
                    if child is node:
                        del parent.children[key]
                        break


@dataclass
class RoutingPolicy:
    name: str = "cache_aware"
    cache_threshold: float = 0.5
    balance_abs_threshold: int = 32
    balance_rel_threshold: float = 1.0001

    def __post_init__(self) -> None:
        if self.name not in POLICIES:
            raise ValueError(f"unknown router policy {self.name!r}; choose from {', '.join(POLICIES)}")
        if not 0.0 <= self.cache_threshold <= 1.0:
            raise ValueError(f"the router's cache threshold must be in [0, 1], got {self.cache_threshold}")
        if self.balance_abs_threshold < 0 or self.balance_rel_threshold < 1.0:
            raise ValueError(
                "the router's balance thresholds must be >= 0 (absolute) and >= 1 (relative), got "
                f"{self.balance_abs_threshold} and {self.balance_rel_threshold}"
            )


class Router:
    """Chooses a replica among those up, by the policy; `load` is each replica's requests in flight."""

    def __init__(self, policy: RoutingPolicy, page_size: int, max_pages: int) -> None:
        self.policy = policy
        self.tree = PrefixTree(page_size, max_pages)
        self._turn = itertools.count()
        self.decisions = {"cache": 0, "balance": 0, "capacity": 0, "round_robin": 0, "shortest_queue": 0}

    def choose(self, tokens: Sequence[int], load: dict[int, int]) -> int:
        """The replica for a prompt; `load` holds every replica that is up (at least one)."""
        if not load:
            raise ValueError("no replica is up")
        up = sorted(load)
        name = self.policy.name
        if name == "round_robin":
            replica, why = up[next(self._turn) % len(up)], "round_robin"
        elif name == "shortest_queue":
            replica, why = min(up, key=lambda r: (load[r], r)), "shortest_queue"
        else:
            replica, why = self._cache_aware(tokens, load, up)
        self.decisions[why] += 1
        if name == "cache_aware":
            self.tree.insert(tokens, replica)
        return replica

    def _cache_aware(self, tokens: Sequence[int], load: dict[int, int], up: list[int]) -> tuple[int, str]:
        busiest, idlest = max(load.values()), min(load.values())
        if (
            busiest - idlest > self.policy.balance_abs_threshold
            and busiest > idlest * self.policy.balance_rel_threshold
        ):
            return min(up, key=lambda r: (load[r], r)), "balance"
        matched = {r: n for r, n in self.tree.matched_tokens(tokens).items() if r in load}
        if matched and tokens:
            best = max(matched, key=lambda r: (matched[r], -load[r], -r))
            if matched[best] / len(tokens) > self.policy.cache_threshold:
                return best, "cache"
        return min(up, key=lambda r: (self.tree.pages.get(r, 0), load[r], r)), "capacity"

    def replica_down(self, replica: int) -> None:
        self.tree.remove_replica(replica)
