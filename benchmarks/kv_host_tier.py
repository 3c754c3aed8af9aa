"""The host-memory KV tier (issue #45, docs/kv_host_tier.md): multi-turn conversations whose histories outgrow the
device pool, with the tier against recomputation, same run; and a workload with no reuse, for what the tier costs.

    # The issue's case: 200 conversations x 4 turns over 4k-token histories, the device pool sized to a quarter of
    # them (Llama-3-8B shape, random weights), the host tier 3x the device pool (~80 GiB page-locked).
    PYTHONPATH=. python benchmarks/kv_host_tier.py --device cuda --model llama-3-8b --load-format dummy \
        --conversations 200 --turns 4 --history-tokens 4096 --concurrency 16 --hicache-ratio 3 \
        --output-json kv_host_tier.json
    # Small sizes on the CPU (the embedded SmolLM2): the same logic, host memory on both sides.
    OMP_NUM_THREADS=2 PYTHONPATH=. python benchmarks/kv_host_tier.py --device cpu --conversations 8 --turns 3 \
        --history-tokens 256 --turn-tokens 32 --output-tokens 4 --concurrency 2 --hicache-ratio 4 --repeats 3 \
        --output-json kv_host_tier_cpu.json

Each conversation is one history of --history-tokens and, per turn, --turn-tokens more; turn t's prompt is the
history with the first t+1 messages (independent of the answers, so both engines see the same prompts). Turns
go round robin over the conversations with --concurrency requests in flight (closed loop: a conversation's next
turn waits for its previous one), so by the time a conversation comes back every other one has passed and its
prefix has left a pool that holds --pool-fraction of all histories. Time to first token is measured from
add_request to the step that returns the first token. The engines run one after the other in this process
(two Llama-3-8B pools do not fit one GPU together): recomputation first, then the tier, on the same workload.
The no-reuse workload sends as many unique prompts of the final turn's length.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import random
import statistics
import time
from typing import Any

import torch

from engine.engine import Engine
from engine.profiling import chrome_trace
from engine.sampling_params import SamplingParams


def conversations(args: argparse.Namespace, vocab: int, seed: int) -> list[list[list[int]]]:
    """Per conversation, each turn's prompt."""
    rng = random.Random(seed)
    result = []
    for _ in range(args.conversations):
        history = [rng.randrange(100, vocab - 100) for _ in range(args.history_tokens)]
        turns = []
        for _ in range(args.turns):
            history = history + [rng.randrange(100, vocab - 100) for _ in range(args.turn_tokens)]
            turns.append(list(history))
        result.append(turns)
    return result


def run(engine: Engine, convs: list[list[list[int]]], args: argparse.Namespace) -> dict[str, Any]:
    """Turns round robin, closed loop at --concurrency; per request its time to first token and its tokens."""
    params = SamplingParams(max_tokens=args.output_tokens, temperature=0.0, ignore_eos=True)
    pending = [(turn, conv) for turn in range(len(convs[0])) for conv in range(len(convs))]
    done_turns = [0] * len(convs)  # turns of each conversation finished
    busy: set[int] = set()  # conversations with a turn in flight
    in_flight: dict[str, tuple[int, int, float]] = {}  # request id -> (conversation, turn, added at)
    ttft: dict[tuple[int, int], float] = {}
    tokens: dict[tuple[int, int], list[int]] = {}
    prompt_tokens = output_tokens = 0
    start = time.perf_counter()
    while pending or in_flight:
        while len(in_flight) < args.concurrency:
            ready = next(
                (i for i, (turn, conv) in enumerate(pending) if done_turns[conv] == turn and conv not in busy), None
            )
            if ready is None:
                break
            turn, conv = pending.pop(ready)
            request_id = engine.add_request(convs[conv][turn], params)
            in_flight[request_id] = (conv, turn, time.perf_counter())
            prompt_tokens += len(convs[conv][turn])
            busy.add(conv)
        for output in engine.step():
            conv, turn, added = in_flight[output.request_id]
            if (conv, turn) not in ttft and output.token_ids:
                ttft[(conv, turn)] = time.perf_counter() - added
            if output.finished:
                del in_flight[output.request_id]
                tokens[(conv, turn)] = list(output.token_ids)
                output_tokens += len(output.token_ids)
                done_turns[conv] = turn + 1
                busy.discard(conv)
    engine.platform.synchronize()
    wall = time.perf_counter() - start
    stats = engine.stats()
    later = [seconds for (conv, turn), seconds in ttft.items() if turn > 0] or list(ttft.values())
    return {
        "requests": len(ttft),
        "wall_s": wall,
        "requests_per_s": len(ttft) / wall,
        "output_tok_s": output_tokens / wall,
        "total_tok_s": (prompt_tokens + output_tokens) / wall,
        "median_ttft_ms": 1000 * statistics.median(ttft.values()),
        "median_ttft_later_turns_ms": 1000 * statistics.median(later),
        "prefix_hit_rate": stats.prefix_cache_hit_rate,
        "prefill_computed_tokens": stats.prefill_computed_tokens,
        "retractions": stats.num_retractions,
        "host_hits": stats.host_hits,
        "host_loaded_tokens": stats.host_loaded_tokens,
        "host_loaded_gib": stats.host_loaded_bytes / 2**30,
        "host_written_tokens": stats.host_written_tokens,
        "host_written_gib": stats.host_written_bytes / 2**30,
        "host_copy_s": stats.host_copy_seconds,
        "tokens": [tokens[key] for key in sorted(tokens)],
    }


# (heading, row key, format) of each column of the table.
COLUMNS = [
    ("workload", "workload", "<11"),
    ("tier", "tier", "<4"),
    ("rep", "repeat", ">3"),
    ("req/s", "requests_per_s", ">7.2f"),
    ("out tok/s", "output_tok_s", ">10.1f"),
    ("tok/s", "total_tok_s", ">9.0f"),
    ("TTFT ms", "median_ttft_ms", ">9.1f"),
    ("later", "median_ttft_later_turns_ms", ">9.1f"),
    ("hit", "prefix_hit_rate", ">6.1%"),
    ("computed", "prefill_computed_tokens", ">9"),
    ("host hits", "host_hits", ">9"),
    ("loaded", "host_loaded_tokens", ">9"),
    ("written", "host_written_tokens", ">9"),
    ("copy s", "host_copy_s", ">7.3f"),
]


def print_table(rows: list[dict[str, Any]]) -> None:
    """One line per run; "later": the median time to first token of turns after the first."""
    print(" ".join(f"{heading:{fmt[0]}{_width(fmt)}}" for heading, _, fmt in COLUMNS))
    for row in rows:
        print(" ".join(f"{row[key]:{fmt}}" for _, key, fmt in COLUMNS))


def _width(fmt: str) -> int:
    return int("".join(c for c in fmt.split(".")[0] if c.isdigit()))


def build(args: argparse.Namespace, tier: bool, kv_tokens: int) -> Engine:
    options: dict[str, Any] = {
        "device": args.device,
        "seed": 0,
        "page_size": args.page_size,
        "max_num_seqs": args.concurrency,
        "kv_cache_tokens": kv_tokens,
        "max_model_len": args.history_tokens + args.turns * args.turn_tokens + args.output_tokens + args.page_size,
    }
    for name in ("model", "load_format", "dtype"):
        if getattr(args, name):
            options[name] = getattr(args, name)
    if tier:
        options.update(
            enable_hierarchical_cache=True,
            hicache_write_policy=args.hicache_write_policy,
            hicache_ratio=args.hicache_ratio,
        )
        if args.hicache_size:
            options["hicache_size"] = args.hicache_size
    return Engine(**options)


def free_device_memory() -> None:
    """After the last reference to an engine is gone: its pool and graphs back to the device before the next
    engine is built (two Llama-3-8B engines with pools for 200 conversations do not fit an 80 GB GPU)."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        logging.info(
            "engine released: %.1f GiB of device memory still allocated", torch.cuda.memory_allocated() / 2**30
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--model", default=None, help="default: the embedded SmolLM2 (or a preset such as llama-3-8b)")
    parser.add_argument("--load-format", default=None, help="dummy: random weights of the preset's shape")
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--conversations", type=int, default=200)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--history-tokens", type=int, default=4096, help="each conversation's shared history")
    parser.add_argument("--turn-tokens", type=int, default=64, help="each turn's new message")
    parser.add_argument("--output-tokens", type=int, default=32)
    parser.add_argument("--concurrency", type=int, default=16, help="requests in flight (and max_num_seqs)")
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument(
        "--pool-fraction", type=float, default=0.25, help="the device pool holds this fraction of all final histories"
    )
    parser.add_argument(
        "--hicache-ratio",
        type=float,
        default=3.0,
        help="host tier: times the device pool (3 with --pool-fraction 0.25 holds every history)",
    )
    parser.add_argument("--hicache-size", type=float, default=0.0, help="host tier in GiB (wins over the ratio)")
    parser.add_argument("--hicache-write-policy", default="write_through", choices=("write_through", "write_back"))
    parser.add_argument("--repeats", type=int, default=1, help="runs of each engine, alternating which goes first")
    parser.add_argument(
        "--workloads",
        default="multi-turn,no-reuse",
        help="comma-separated: multi-turn (conversations that come back), no-reuse (every prompt unique)",
    )
    parser.add_argument(
        "--trace-dir",
        default=None,
        help="a torch.profiler chrome trace of each run (the compute stream's waits for the copy streams show there)",
    )
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args()
    workloads = [name.replace("-", " ").replace("multi turn", "multi-turn") for name in args.workloads.split(",")]
    unknown = set(workloads) - {"multi-turn", "no reuse"}
    if unknown:
        parser.error(f"--workloads: unknown {sorted(unknown)}; known: multi-turn, no-reuse")

    final_len = args.history_tokens + args.turns * args.turn_tokens
    # A quarter of the histories, but never less than the running batch needs (it must fit, tier or not).
    running = args.concurrency * (final_len + args.output_tokens + args.page_size)
    kv_tokens = max(int(args.pool_fraction * args.conversations * final_len), running)
    rows: list[dict[str, Any]] = []
    same: dict[str, float] = {}
    vocab = 0
    for workload in workloads:
        outputs: dict[str, list[list[int]]] = {}
        # Alternating which engine goes first from one repeat to the next: neither gains from running second.
        order = [(r, tier) for r in range(args.repeats) for tier in ((False, True) if r % 2 == 0 else (True, False))]
        for repeat, tier in order:
            engine = build(args, tier, kv_tokens)
            vocab = int(engine.model_config.vocab_size)
            convs = conversations(args, vocab, seed=1)
            if workload == "no reuse":
                # As many requests, every prompt unique: what the tier costs when nothing comes back.
                rng = random.Random(2)
                n = args.conversations * args.turns
                convs = [[[rng.randrange(100, vocab - 100) for _ in range(final_len)]] for _ in range(n)]
            trace_name = f"{workload.replace(' ', '-')}_tier-{'on' if tier else 'off'}_{repeat}"
            with chrome_trace(args.trace_dir, trace_name):
                result = run(engine, convs, args)
            outputs["on" if tier else "off"] = result.pop("tokens")
            rows.append({"workload": workload, "tier": "on" if tier else "off", "repeat": repeat, **result})
            engine.shutdown()
            del engine
            free_device_memory()
        # Greedy tokens of the last run of each: a prefix loaded back gives the tokens the device's own cache
        # would, but recomputing a prefix in other chunks than the ones that cached it moves float sums (as the
        # plain prefix cache does), and the CPU's extend-step time budget makes chunks timing-dependent.
        pairs = list(zip(outputs["on"], outputs["off"], strict=True))
        same[workload] = sum(on == off for on, off in pairs) / len(pairs)

    print_table(rows)
    summary: dict[str, dict[str, float]] = {}
    for workload in workloads:

        def median_of(key: str, tier: str, workload: str = workload) -> float:
            return statistics.median(r[key] for r in rows if r["workload"] == workload and r["tier"] == tier)

        ratios = {
            "throughput_ratio": median_of("total_tok_s", "on") / median_of("total_tok_s", "off"),
            "median_ttft_ratio": median_of("median_ttft_ms", "on") / median_of("median_ttft_ms", "off"),
        }
        summary[workload] = ratios
        print(
            f"host tier on / off, {workload} (medians of {args.repeats} run(s) each): throughput "
            f"x{ratios['throughput_ratio']:.2f}, median TTFT x{ratios['median_ttft_ratio']:.2f}, "
            f"identical greedy tokens in {same[workload]:.0%} of requests"
        )
    report = {
        "device": args.device,
        "gpu": torch.cuda.get_device_name() if args.device == "cuda" and torch.cuda.is_available() else None,
        "model": args.model or "embedded SmolLM2",
        "load_format": args.load_format,
        "conversations": args.conversations,
        "turns": args.turns,
        "history_tokens": args.history_tokens,
        "turn_tokens": args.turn_tokens,
        "output_tokens": args.output_tokens,
        "concurrency": args.concurrency,
        "kv_cache_tokens": kv_tokens,
        "hicache_ratio": args.hicache_ratio,
        "hicache_size": args.hicache_size,
        "hicache_write_policy": args.hicache_write_policy,
        "repeats": args.repeats,
        "workloads": workloads,
        "rows": rows,
        "summary": summary,
        "same_tokens": same,
    }
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    main()
