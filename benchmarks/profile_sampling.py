"""Device time of the sampler alone, greedy vs a sampled workload, and its top kernels.

    PYTHONPATH=. python benchmarks/profile_sampling.py --device cuda --batch-size 256 --vocab 128256

Random logits, requests with decode rows and penalty state as in a decode step (contexts of
--context tokens). Prints the median device time per call of each workload (calls back to back)
and torch.profiler's kernels by device time for the sampled one; writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

from engine.penalties import PenaltyState
from engine.request import Request
from engine.sampler import sample
from engine.sampling_params import SamplingParams

WORKLOADS = {
    "greedy": dict(temperature=0.0),
    "temperature": dict(temperature=0.8),
    "top_k_top_p": dict(temperature=0.8, top_p=0.9, top_k=50),
    "top_k_top_p_penalty": dict(temperature=0.8, top_p=0.9, top_k=50, repetition_penalty=1.1),
}


def _requests(batch: int, vocab: int, context: int, params: SamplingParams) -> list[Request]:
    generator = torch.Generator().manual_seed(0)
    requests = []
    for row in range(batch):
        request = Request(f"r{row}", torch.randint(0, vocab, (context,), generator=generator).tolist(), params)
        request.batch_row = row
        requests.append(request)
    return requests


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--output", default="bench_results/profile_sampling.json")
    args = parser.parse_args()
    device = torch.device(args.device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    logits = torch.randn(args.batch_size, args.vocab, device=device)
    rows = torch.arange(args.batch_size, device=device)
    report: dict = {"batch_size": args.batch_size, "vocab": args.vocab, "device": str(device), "ms": {}}
    for name, values in WORKLOADS.items():
        requests = _requests(args.batch_size, args.vocab, args.context, SamplingParams(**values))
        penalties = PenaltyState(args.batch_size, args.vocab, device)

        def call(requests=requests, penalties=penalties) -> None:
            sample(logits.clone(), requests, penalties, rows)

        for _ in range(3):
            call()
        samples = []
        for _ in range(5):
            sync()
            start = time.perf_counter()
            for _ in range(args.iters // 5):
                call()
            sync()
            samples.append((time.perf_counter() - start) * 1e3 / (args.iters // 5))
        report["ms"][name] = statistics.median(samples)
        print(
            f"{name:<22} {report['ms'][name]:.3f} ms per call (incl. a {args.batch_size}x{args.vocab} clone)",
            flush=True,
        )
        if name == "top_k_top_p_penalty" and device.type == "cuda":
            with torch.profiler.profile(
                activities=[torch.profiler.ProfilerActivity.CUDA, torch.profiler.ProfilerActivity.CPU]
            ) as prof:
                for _ in range(5):
                    call()
                sync()
            table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=18)
            print(table)
            report["profile"] = table
    os.makedirs(os.path.dirname(args.output) or ".", exist_ok=True)
    with open(args.output, "w", encoding="utf-8") as handle:
        json.dump(report, handle, indent=2)


if __name__ == "__main__":
    main()
