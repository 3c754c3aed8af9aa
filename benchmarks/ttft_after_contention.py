"""Time to first token of one prompt before and after a run under CPU contention (issue #49's reproduction).

    PYTHONPATH=. python benchmarks/ttft_after_contention.py --input-len 400 --output-json bench_results/ttft.json

The embedded model on the CPU with the default extend-step time limit: the prompt is timed twice on a quiet
machine, once while a busy loop runs on one core (a second process), then four more times quiet. Each run is a
fresh prompt of the same length (no prefix-cache hits). The extend-step budget learned during the contended
run must not slow the quiet runs after it: the table gives each run and the ratio of the quiet runs after to
those before (medians).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import random
import statistics
import time
from typing import Any

import torch

from engine.engine import Engine
from engine.sampling_params import SamplingParams


def _spin(stop: Any) -> None:
    while not stop.is_set():
        pass


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--input-len", type=int, default=400)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--output-json", default="bench_results/ttft_contention.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    engine = Engine(device="cpu")
    rng = random.Random(0)
    vocab = engine.model_config.vocab_size
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    runs: list[dict[str, Any]] = []
    for phase in ["quiet"] * 2 + ["contended"] + ["quiet after"] * 4:
        stop = multiprocessing.Event()
        spinner = multiprocessing.Process(target=_spin, args=(stop,)) if phase == "contended" else None
        if spinner is not None:
            spinner.start()
        prompt = [rng.randrange(3, vocab) for _ in range(args.input_len)]
        start = time.perf_counter()
        engine.generate([prompt], params)
        seconds = time.perf_counter() - start
        if spinner is not None:
            stop.set()
            spinner.join()
        runs.append({"phase": phase, "ttft_s": seconds})
        print(f"{phase:>12} {seconds * 1e3:8.1f} ms", flush=True)
    before = statistics.median(r["ttft_s"] for r in runs if r["phase"] == "quiet")
    after = statistics.median(r["ttft_s"] for r in runs if r["phase"] == "quiet after")
    print(f"quiet after / quiet before (medians): {after / before:.2f}")
    os.makedirs(os.path.dirname(args.output_json) or ".", exist_ok=True)
    with open(args.output_json, "w", encoding="utf-8") as handle:
        json.dump(
            {"input_len": args.input_len, "threads": args.threads, "runs": runs, "after_over_before": after / before},
            handle,
            indent=2,
        )


if __name__ == "__main__":
    main()
