"""`engine bench serving`: an online benchmark client for any OpenAI-compatible server.

Sends streaming /v1/completions requests at a fixed concurrency or at a Poisson
request rate and reports throughput, time to first token (TTFT), inter-token
latency (ITL, the gaps between streamed chunks, as vLLM's benchmark_serving
measures it) and end-to-end latency. Prompts are synthetic text of a chosen
length range, so no dataset is needed; `--ignore-eos` (a vLLM/SGLang extension)
makes every completion exactly --output-len tokens long. `--dataset-name words`
(the default) writes prompts of random words; with `--dataset-name random` (as vLLM
and SGLang name it) the prompts are random token ids (--input-len in tokens) and
every chunk carries its token ids (`return_token_ids`, as vLLM streams them): the
way to load a server whose model has no tokenizer (`--load-format dummy`), whose
chunks carry no text. The flags are named as in vLLM's and SGLang's benchmark
scripts (engine/bench_args.py).
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import contextlib
import json
import logging
import math
import multiprocessing
import os
import random
import statistics
import time
from dataclasses import asdict, dataclass, field

from engine.bench_args import add_old_switch, add_renamed

WORDS = [
    "graph",
    "engine",
    "token",
    "batch",
    "cache",
    "page",
    "kernel",
    "tensor",
    "latency",
    "throughput",
    "scheduler",
    "request",
    "model",
    "layer",
    "attention",
    "decode",
    "prefill",
    "stream",
    "server",
    "client",
    "sample",
    "logits",
    "vocabulary",
    "prompt",
    "answer",
    "river",
    "mountain",
    "city",
    "garden",
    "window",
    "music",
    "paper",
    "story",
    "question",
    "morning",
    "evening",
    "winter",
    "summer",
]


CONNECTIONS_PER_CLIENT = 16  # requests in flight per HTTP client (see run_benchmark)
MAX_CLIENTS = 128


@dataclass
class RequestResult:
    ok: bool
    prompt_words: int
    output_tokens: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    itls: list[float] = field(default_factory=list)
    error: str = ""
    sent: float = 0.0  # perf_counter when the request went out (the run's timeline)


def add_bench_serving_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--base-url", default="http://127.0.0.1:30000", help="server root (without /v1)")
    parser.add_argument("--model", default=None, help="model id (default: the first of /v1/models)")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--num-prompts", type=int, default=64, help="requests to send")
    add_renamed(parser, "--max-concurrency", "--concurrency", type=int, default=None, help="requests in flight at once")
    parser.add_argument(
        "--request-rate", type=float, default=None, help="Poisson arrivals per second (default: all at once)"
    )
    parser.add_argument(
        "--dataset-name",
        choices=["words", "random"],
        default="words",
        help="words: prompts of random words; random: of random token ids, each chunk carrying its token ids",
    )
    add_old_switch(parser, "--token-ids", "dataset_name", "random", "--dataset-name random")
    parser.add_argument(
        "--input-len", default="16,128", help="prompt length range, MIN,MAX: in words (in tokens with random)"
    )
    parser.add_argument("--output-len", default="32,128", help="completion length range in tokens, MIN,MAX")
    parser.add_argument(
        "--ignore-eos",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="send ignore_eos so completions have exactly the requested length",
    )
    parser.add_argument("--vocab-size", type=int, default=32000, help="--dataset-name random: ids are drawn below this")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=600.0)
    parser.add_argument(
        "--disable-stream",
        action="store_true",
        help="non-streaming requests (SGLang's flag): one JSON response each; TTFT is then the whole latency",
    )
    parser.add_argument(
        "--client-processes",
        type=int,
        default=1,
        help="client processes, each sending its share of the requests (concurrency and rate split among "
        "them): one Python process reading 512 streams of decode-speed chunks is CPU-bound, and then delays "
        "what it measures",
    )
    add_renamed(parser, "--output-json", "--output", default=None, help="write the results as JSON here")


def _range(text: str) -> tuple[int, int]:
    low, _, high = text.partition(",")
    return int(low), int(high or low)


def make_workload(
    num: int, input_len: str, output_len: str, seed: int, vocab_size: int | None = None
) -> list[tuple[str | list[int], int]]:
    """(prompt, max_tokens) pairs: prompts of words, or of token ids below vocab_size when it is given."""
    rng = random.Random(seed)
    (in_lo, in_hi), (out_lo, out_hi) = _range(input_len), _range(output_len)
    workload: list[tuple[str | list[int], int]] = []
    for _ in range(num):
        length = rng.randint(in_lo, in_hi)
        if vocab_size:
            prompt: str | list[int] = [rng.randrange(vocab_size) for _ in range(length)]
        else:
            prompt = " ".join(rng.choice(WORDS) for _ in range(length))
        workload.append((prompt, rng.randint(out_lo, out_hi)))
    return workload


async def _one(client, url: str, body: dict, headers: dict, prompt_words: int) -> RequestResult:
    result = RequestResult(ok=False, prompt_words=prompt_words)
    start = result.sent = time.perf_counter()
    last = None
    chunks = 0
    try:
        async with client.stream("POST", url, json=body, headers=headers) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                event = json.loads(data)
                if "error" in event:
                    result.error = str(event["error"])
                    return result
                if event.get("usage"):
                    result.output_tokens = int(event["usage"].get("completion_tokens") or 0)
                if not event.get("choices") or not (
                    event["choices"][0].get("text") or event["choices"][0].get("token_ids")
                ):
                    continue
                now = time.perf_counter()
                if last is None:
                    result.ttft = now - start
                else:
                    result.itls.append(now - last)
                last = now
                chunks += 1
        result.latency = time.perf_counter() - start
        result.output_tokens = result.output_tokens or chunks  # servers without usage: one token per chunk
        result.ok = last is not None
    except Exception as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    return result


async def _one_whole(client, url: str, body: dict, headers: dict, prompt_words: int) -> RequestResult:
    """A non-streaming request: the first token arrives with the last, so TTFT is the latency."""
    result = RequestResult(ok=False, prompt_words=prompt_words)
    start = result.sent = time.perf_counter()
    try:
        response = await client.post(url, json=body, headers=headers)
        if response.status_code != 200:
            result.error = f"HTTP {response.status_code}: {response.content[:200]!r}"
            return result
        payload = response.json()
        result.output_tokens = int((payload.get("usage") or {}).get("completion_tokens") or 0)
        result.latency = result.ttft = time.perf_counter() - start
        result.ok = bool(payload.get("choices"))
    except Exception as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    return result


def _percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {"mean": 0.0, "median": 0.0, "p99": 0.0}
    ordered = sorted(values)
    p99 = ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]
    return {"mean": statistics.fmean(ordered), "median": statistics.median(ordered), "p99": p99}


async def run_benchmark(args: argparse.Namespace) -> dict:
    """One client process: every request of the workload, summarised."""
    sent = await _send_workload(args, shard=(0, 1), start_at=None)
    return summarize(args, [sent])


@dataclass
class ShardResults:
    """What one client process sent and saw: its requests in workload order, and its clocks."""

    base: str
    model: str
    results: list[RequestResult]
    start: float  # perf_counter (CLOCK_MONOTONIC: one clock for every process of the host) of the first send
    end: float
    cpu_s: float


def _share(total: int | float | None, shard: tuple[int, int]) -> int | float | None:
    """Shard k of n's part of a concurrency cap (the remainder to the first ones) or of a request rate."""
    index, count = shard
    if total is None or count == 1:
        return total
    if isinstance(total, float):
        return total / count
    return total // count + (1 if index < total % count else 0)


async def _send_workload(args: argparse.Namespace, shard: tuple[int, int], start_at: float | None) -> ShardResults:
    """Send shard k of n of the workload (requests k, k + n, ...), at its share of the concurrency and rate;
    start_at: a perf_counter time to begin at (the processes of one run start together)."""
    import httpx

    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    base = args.base_url.rstrip("/")
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    # Several clients, each with a pool of a few connections: httpcore hands a request a connection by
    # scanning its whole pool, so one client of 512 connections spends most of the client's CPU there
    # (py-spy: 74% of this process at concurrency 512, non-streaming) and throttles the server it measures.
    cap = _share(args.max_concurrency, shard)
    rate = _share(args.request_rate, shard)
    lanes = min(MAX_CLIENTS, math.ceil(cap / CONNECTIONS_PER_CLIENT)) if cap else MAX_CLIENTS
    async with contextlib.AsyncExitStack() as stack:
        clients = [
            await stack.enter_async_context(httpx.AsyncClient(timeout=args.timeout, limits=limits))
            for _ in range(lanes)
        ]
        in_flight = [0] * lanes
        client = clients[0]
        model = args.model
        if model is None:
            listing = await client.get(f"{base}/v1/models", headers=headers)
            listing.raise_for_status()
            model = listing.json()["data"][0]["id"]
        token_ids = args.dataset_name == "random"
        workload = make_workload(
            args.num_prompts, args.input_len, args.output_len, args.seed, args.vocab_size if token_ids else None
        )[shard[0] :: shard[1]]
        gate = asyncio.Semaphore(int(cap)) if cap else None
        rng = random.Random(args.seed + 1 + shard[0])

        async def send(prompt: str | list[int], max_tokens: int) -> RequestResult:
            body = {
                "model": model,
                "prompt": prompt,
                "max_tokens": max_tokens,
                "temperature": 0.0,
            }
            if not args.disable_stream:
                body |= {"stream": True, "stream_options": {"include_usage": True}}
            if args.ignore_eos:
                body["ignore_eos"] = True
            if token_ids:
                body["return_token_ids"] = True
            size = len(prompt) if isinstance(prompt, list) else len(prompt.split())
            one = _one_whole if args.disable_stream else _one
            async with gate or contextlib.nullcontext():
                lane = in_flight.index(min(in_flight))  # the least busy client
                in_flight[lane] += 1
                try:
                    return await one(clients[lane], f"{base}/v1/completions", body, headers, size)
                finally:
                    in_flight[lane] -= 1

        if start_at is not None:
            await asyncio.sleep(max(0.0, start_at - time.perf_counter()))
        start = time.perf_counter()
        cpu_start = time.process_time()
        tasks = []
        for prompt, max_tokens in workload:
            tasks.append(asyncio.create_task(send(prompt, max_tokens)))
            if rate:
                await asyncio.sleep(rng.expovariate(rate))
        results = await asyncio.gather(*tasks)
        end = time.perf_counter()
        cpu = time.process_time() - cpu_start
    return ShardResults(base, model, list(results), start, end, cpu)


def summarize(args: argparse.Namespace, shards: list[ShardResults]) -> dict:
    """The run's figures over every client process's requests, timed from the first process's start."""
    start = min(shard.start for shard in shards)
    duration = max(shard.end for shard in shards) - start
    results = [r for shard in shards for r in shard.results]
    ok = [r for r in results if r.ok]
    output_tokens = sum(r.output_tokens for r in ok)
    summary = {
        "base_url": shards[0].base,
        "model": shards[0].model,
        "num_prompts": args.num_prompts,
        "concurrency": args.max_concurrency,
        "request_rate": args.request_rate,
        "stream": not args.disable_stream,
        "client_processes": len(shards),
        # The busiest client process's CPU time over the wall time: near 1.0, it is the bottleneck.
        "client_cpu_fraction": max(shard.cpu_s for shard in shards) / duration,
        "client_start_spread_s": max(shard.start for shard in shards) - start,
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "duration_s": duration,
        "request_throughput": len(ok) / duration,
        "output_throughput": output_tokens / duration,
        "total_output_tokens": output_tokens,
        "ttft_s": _percentiles([r.ttft for r in ok]),
        "itl_s": _percentiles([gap for r in ok for gap in r.itls]),
        "e2e_latency_s": _percentiles([r.latency for r in ok]),
        "errors": sorted({r.error for r in results if not r.ok})[:5],
    }
    summary["requests"] = [asdict(r) | {"itls": None, "sent": r.sent - start} for r in results]
    return summary


START_MARGIN_S = 5.0  # for the client processes to start (spawn, imports, HTTP clients) before the run begins


def _shard_process(args: argparse.Namespace, shard: tuple[int, int], start_at: float) -> ShardResults:
    logging.getLogger("httpx").setLevel(logging.WARNING)
    return asyncio.run(_send_workload(args, shard, start_at))


def run_benchmark_processes(args: argparse.Namespace) -> dict:
    """The run over --client-processes processes (one: in this process), summarised as one."""
    count = max(1, min(args.client_processes, args.max_concurrency or args.client_processes))  # a cap each
    if count == 1:
        return asyncio.run(run_benchmark(args))
    if args.model is None:  # every process would ask; ask once
        args.model = asyncio.run(_first_model(args))
    start_at = time.perf_counter() + START_MARGIN_S
    context = multiprocessing.get_context("spawn")  # no fork of a parent that may hold threads and sockets
    with concurrent.futures.ProcessPoolExecutor(count, mp_context=context) as pool:
        futures = [pool.submit(_shard_process, args, (index, count), start_at) for index in range(count)]
        shards = [future.result() for future in futures]
    late = max(shard.start for shard in shards) - start_at
    if late > 0.5:
        logging.getLogger(__name__).warning("client processes started %.1f s after the run's start", late)
    return summarize(args, shards)


async def _first_model(args: argparse.Namespace) -> str:
    import httpx

    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    async with httpx.AsyncClient(timeout=args.timeout) as client:
        listing = await client.get(f"{args.base_url.rstrip('/')}/v1/models", headers=headers)
        listing.raise_for_status()
        return str(listing.json()["data"][0]["id"])


def format_table(s: dict) -> str:
    ms = lambda v: f"{1000 * v:.1f}"  # noqa: E731
    rows = [
        ("concurrency / rate", f"{s['concurrency'] or '-'} / {s['request_rate'] or 'inf'}"),
        ("completed / failed", f"{s['completed']} / {s['failed']}"),
        ("duration (s)", f"{s['duration_s']:.2f}"),
        ("request throughput (req/s)", f"{s['request_throughput']:.2f}"),
        ("output throughput (tok/s)", f"{s['output_throughput']:.1f}"),
        ("TTFT median / p99 (ms)", f"{ms(s['ttft_s']['median'])} / {ms(s['ttft_s']['p99'])}"),
        ("ITL median / p99 (ms)", f"{ms(s['itl_s']['median'])} / {ms(s['itl_s']['p99'])}"),
        ("E2E latency median / p99 (s)", f"{s['e2e_latency_s']['median']:.2f} / {s['e2e_latency_s']['p99']:.2f}"),
        ("client processes; busiest one's CPU / wall", f"{s['client_processes']}; {s['client_cpu_fraction']:.2f}"),
    ]
    if "load_avg_1m" in s:
        rows.append(
            ("load average 1m before / after", f"{s['load_avg_1m']['before']:.2f} / {s['load_avg_1m']['after']:.2f}")
        )
    width = max(len(k) for k, _ in rows)
    lines = [f"serving benchmark: {s['model']} at {s['base_url']}"] + [f"  {k:<{width}}  {v}" for k, v in rows]
    if s["errors"]:
        lines.append("  errors: " + "; ".join(s["errors"]))
    return "\n".join(lines)


def cmd_bench_serving(args: argparse.Namespace) -> int:
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not one INFO line per request
    load_before = os.getloadavg()[0]
    summary = run_benchmark_processes(args)
    # The 1-minute load average around the run: on a shared box, a sign of contention.
    summary["load_avg_1m"] = {"before": load_before, "after": os.getloadavg()[0]}
    print(format_table(summary))
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(summary, f, indent=2)
    return 0 if summary["failed"] == 0 else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench_serving", description=__doc__.splitlines()[0])
    add_bench_serving_args(parser)
    return cmd_bench_serving(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
