"""CPU prefill: which of two settings buys what, in one engine, the settings alternating between rounds.

The two settings of issue #49's last step: the chunk a lone prompt runs in (512 tokens, or the whole prompt in
one step) and the dtype of the MLP's activations in long steps (float32, or bf16 into the packed bf16 GEMMs).
Both are switched on the same engine between rounds (the scheduler's chunk size, the pre-MLP norms' output
dtype), so that the four cells share weights, caches and the machine's state; the first round is a warm-up.

    PYTHONPATH=. python benchmarks/cpu_prefill_settings.py --prompt-tokens 1500 --rounds 5 \
        --output-json cpu_prefill_settings.json

Prints a table and writes JSON (every round's time to first token, in ms).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import torch

from engine.engine import Engine
from engine.layers.norm import RMSNorm
from engine.sampling_params import SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt-tokens", type=int, default=1500)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--small-chunk", type=int, default=512)
    parser.add_argument("--output-json", default="bench_results/cpu_prefill_settings.json")
    args = parser.parse_args()
    engine = Engine(device="cpu")
    norms = [m for m in engine.model.modules() if isinstance(m, RMSNorm) and m.many_rows_dtype is not None]
    if not norms:
        raise SystemExit("this engine runs no MLP on bf16 activations (no packed bf16 prefill copy on this CPU)")
    bf16 = norms[0].many_rows_dtype
    whole = max(engine.scheduler.chunked_prefill_size or 0, args.prompt_tokens)
    cells = [(mlp, chunk) for mlp in ("float32", "bf16") for chunk in (args.small_chunk, whole)]
    rng = random.Random(0)
    params = SamplingParams(max_tokens=1, temperature=0.0)
    times: dict[str, list[float]] = {}
    for index in range(args.rounds):
        for mlp, chunk in cells if index % 2 else cells[::-1]:
            engine.scheduler.chunked_prefill_size = chunk
            for norm in norms:
                norm.many_rows_dtype = bf16 if mlp == "bf16" else None
            prompt = [rng.randrange(100, 40000) for _ in range(args.prompt_tokens)]
            start = time.perf_counter()
            engine.generate([prompt], params)
            times.setdefault(f"{mlp} MLP, chunk {chunk}", []).append(1e3 * (time.perf_counter() - start))
    print(
        f"{args.prompt_tokens}-token prompt, time to first token (median of rounds 2-{args.rounds}), "
        f"{torch.get_num_threads()} threads"
    )
    for name, values in times.items():
        print(f"{name:>28}: {statistics.median(values[1:]):8.0f} ms  {[round(v) for v in values]}")
    with open(args.output_json, "w", encoding="utf-8") as handle:
        json.dump({"prompt_tokens": args.prompt_tokens, "ttft_ms": times}, handle, indent=2)


if __name__ == "__main__":
    main()
