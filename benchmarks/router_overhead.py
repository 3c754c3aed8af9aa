"""What the data-parallel router adds to a request: the time of one routing decision and the decisions per
second one core makes, with trees as large as a busy server's, against the policies that keep no tree.

    PYTHONPATH=. python benchmarks/router_overhead.py --replicas 2,8 --cached-prompts 2000 --output-json router.json

Each replica's tree is filled with `--cached-prompts` prompts (a few shared system prompts, documents and
questions of `--prompt-len` tokens, as multi-turn and RAG traffic looks), then `--requests` new prompts of
the same kinds are routed one by one, timing each `Router.choose` (the prefix walk, the load check and the
insert); the HTTP side's work per request is not included. Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time
from typing import Any

from engine.server.prefix_routing import Router, RoutingPolicy


def _prompts(rng: random.Random, count: int, length: int, systems: list[list[int]]) -> list[list[int]]:
    """Prompts that start with one of a few system prompts, often continue a document seen before, then differ."""
    documents = [[rng.randrange(32000) for _ in range(length // 2)] for _ in range(max(1, count // 8))]
    prompts = []
    for _ in range(count):
        head = rng.choice(systems) + (rng.choice(documents) if rng.random() < 0.7 else [])
        tail = [rng.randrange(32000) for _ in range(max(1, length - len(head)))]
        prompts.append((head + tail)[:length])
    return prompts


def measure(policy: str, replicas: int, cached: list[list[int]], new: list[list[int]], page: int) -> dict[str, Any]:
    router = Router(RoutingPolicy(policy), page, max_pages=1 << 20)
    rng = random.Random(1)
    for prompt in cached:
        router.choose(prompt, {r: rng.randrange(8) for r in range(replicas)})
    times = []
    for prompt in new:
        load = {r: rng.randrange(8) for r in range(replicas)}
        start = time.perf_counter()
        router.choose(prompt, load)
        times.append(time.perf_counter() - start)
    ordered = sorted(times)
    median = statistics.median(ordered)
    return {
        "policy": policy,
        "replicas": replicas,
        "median_us": 1e6 * median,
        "p99_us": 1e6 * ordered[round(0.99 * (len(ordered) - 1))],
        "decisions_per_s": len(times) / sum(times),
        "tree_pages": sum(router.tree.pages.values()),
        "decisions": dict(router.decisions),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replicas", default="2,8", help="comma list of replica counts")
    parser.add_argument("--cached-prompts", type=int, default=2000, help="prompts routed before timing")
    parser.add_argument("--requests", type=int, default=2000, help="prompts timed")
    parser.add_argument("--prompt-len", type=int, default=2048, help="tokens per prompt")
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--output-json", default="bench_results/router_overhead.json")
    args = parser.parse_args()
    rng = random.Random(0)
    systems = [[rng.randrange(32000) for _ in range(256)] for _ in range(4)]
    cached = _prompts(rng, args.cached_prompts, args.prompt_len, systems)
    new = _prompts(rng, args.requests, args.prompt_len, systems)
    rows = [
        measure(policy, int(replicas), cached, new, args.page_size)
        for replicas in args.replicas.split(",")
        for policy in ("cache_aware", "shortest_queue", "round_robin")
    ]
    print(f"{'policy':>15} {'replicas':>8} {'median us':>10} {'p99 us':>9} {'decisions/s':>12} {'tree pages':>11}")
    for row in rows:
        print(
            f"{row['policy']:>15} {row['replicas']:>8} {row['median_us']:>10.1f} {row['p99_us']:>9.1f} "
            f"{row['decisions_per_s']:>12.0f} {row['tree_pages']:>11}"
        )
    report = {"args": vars(args), "results": rows}
    os.makedirs(os.path.dirname(args.output_json) or ".", exist_ok=True)
    with open(args.output_json, "w", encoding="utf-8") as handle:
        json.dump(report, handle, indent=2)


if __name__ == "__main__":
    main()
