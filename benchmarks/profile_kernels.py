"""Where a decode graph's device time goes: the kernels of one replay, grouped by name.

    PYTHONPATH=. python benchmarks/profile_kernels.py --device cuda --model llama-3-8b --load-format dummy \
        --batch-sizes 1,32 --context 512 --replays 20

Fills a batch of `--context`-token prompts, decodes once so the graph's static buffers hold the batch,
then replays that batch's graph under torch.profiler (CUPTI records the kernels inside graph launches).
Per batch size: each kernel name's launches and device microseconds per replay, their sum, and the
replay's own time so that the gap between kernels shows. On the CPU: host ops' self time. Prints tables, writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

from engine.cli import add_engine_args, engine_config_from_args
from engine.engine import Engine
from engine.profiling import time_by_name
from engine.sampling_params import SamplingParams
from engine.tuning.measure import steady_ms


def kernel_table(engine: Engine, batch: int, context: int, replays: int) -> dict[str, Any]:
    vocab = engine.model_config.vocab_size
    generator = torch.Generator().manual_seed(batch)
    params = SamplingParams(max_tokens=100_000, temperature=0.0, ignore_eos=True)
    ids = [
        engine.add_request(torch.randint(0, vocab, (context,), generator=generator).tolist(), params)
        for _ in range(batch)
    ]
    while len(engine.scheduler.running) < batch:
        engine.step()
    engine.step()
    runner = engine.runner.graph_runner
    padded = runner.padded_size(batch)
    sync = engine.platform.synchronize
    replay_ms = steady_ms(sync, lambda: runner._replay(padded), 30)
    on_gpu = engine.device.type == "cuda"
    sync()
    with profile(activities=[ProfilerActivity.CUDA if on_gpu else ProfilerActivity.CPU]) as prof:
        for _ in range(replays):
            runner._replay(padded)
        sync()
    rows = [(name, count / replays, us / replays) for name, count, us in time_by_name(prof, on_gpu)]
    for request_id in ids:
        engine.abort(request_id)
    kernels_us = sum(us for _, _, us in rows)
    return {
        "batch_size": batch,
        "padded": padded,
        "context": context,
        "replay_ms": replay_ms,
        "kernel_us_sum": kernels_us,
        "launches": sum(n for _, n, _ in rows),
        "kernels": [{"name": name, "launches": n, "us": us} for name, n, us in rows],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_engine_args(parser)
    parser.add_argument("--batch-sizes", default="1,32")
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--replays", type=int, default=20)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--output", default="bench_results/profile_kernels.json")
    args = parser.parse_args()
    engine = Engine(engine_config_from_args(args))
    results = []
    for batch in (int(b) for b in args.batch_sizes.split(",")):
        table = kernel_table(engine, batch, args.context, args.replays)
        results.append(table)
        print(
            f"\n==== batch {batch} (graph {table['padded']}), context {args.context}: "
            f"replay {table['replay_ms']:.3f} ms, "
            f"kernels {table['kernel_us_sum'] / 1e3:.3f} ms in {table['launches']:.0f} launches"
        )
        print(f"{'us/replay':>10} {'launches':>9}  kernel")
        for row in table["kernels"][: args.top]:
            print(f"{row['us']:10.1f} {row['launches']:9.1f}  {row['name'][:110]}")
    os.makedirs(os.path.dirname(args.output) or ".", exist_ok=True)
    with open(args.output, "w") as handle:
        json.dump(
            {
                "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
                "torch": torch.__version__,
                "results": results,
            },
            handle,
            indent=1,
        )
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
