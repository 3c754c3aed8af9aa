"""Does the eager LM head block the host behind the device queue at a row count it has not run before?

    PYTHONPATH=. python benchmarks/logit_rows_block.py --output docs/results/h200_logit_rows_block.json

A Llama-3-8B-shaped head (128,256 x 4,096, bf16). Each measurement queues ~80 ms of GEMMs, then times on the
host the head's matmul for some row count: a call that only queues takes microseconds, one that waits
takes the rest of the queue. Three cases per row count: its first use, the same count again, and (the
engine's fix, engine/logit_rows.py) the count padded to a ladder whose sizes all ran once beforehand.
Prints a table, writes JSON. Needs a CUDA/ROCm GPU.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F

from engine.logit_rows import LogitRowLadder

LADDER = [1, 2, 4, 8, 16, 24, 32, 48, 64, 80, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--queue-ms", type=float, default=80.0)
    parser.add_argument("--rows", default="263,301,377,419,455,509,333,287,141,97,45,13")
    parser.add_argument("--output", default="")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA or ROCm GPU")
    device, dtype = torch.device("cuda"), torch.bfloat16
    head = torch.randn(args.vocab, args.hidden, device=device, dtype=dtype) * 0.02
    a = torch.randn(8192, args.hidden, device=device, dtype=dtype)
    b = torch.randn(14336, args.hidden, device=device, dtype=dtype)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(20):
        F.linear(a, b)
    torch.cuda.synchronize()
    gemms = max(1, round(args.queue_ms / ((time.perf_counter() - start) * 1e3 / 20)))

    def host_ms(call) -> float:
        for _ in range(gemms):
            F.linear(a, b)
        began = time.perf_counter()
        call()
        elapsed = (time.perf_counter() - began) * 1e3
        torch.cuda.synchronize()
        return elapsed

    rows = [int(r) for r in args.rows.split(",")]
    hidden = {r: torch.randn(r, args.hidden, device=device, dtype=dtype) for r in rows}
    first = {r: host_ms(lambda r=r: F.linear(hidden[r], head)) for r in rows}
    again = {r: host_ms(lambda r=r: F.linear(hidden[r], head)) for r in rows}
    # The fix, on counts the head has not run (offset by one from the rows above): a ladder warmed first.
    ladder = LogitRowLadder(LADDER, max_rows=512)
    ladder.warm(lambda h: F.linear(h, head), args.hidden, dtype, device, torch.cuda.synchronize)
    padded = {r: host_ms(lambda r=r: ladder.logits(lambda h: F.linear(h, head), hidden[r][:-1])) for r in rows}
    print(f"queue {args.queue_ms:.0f} ms of GEMMs; host ms of the head's matmul ({args.vocab} x {args.hidden}, bf16)")
    print(f"{'rows':>6}{'first use':>11}{'again':>9}{'ladder':>8}{'padded rows - 1, warmed':>25}")
    for r in rows:
        print(f"{r:>6}{first[r]:>11.2f}{again[r]:>9.2f}{ladder.padded_rows(r - 1):>8}{padded[r]:>25.2f}")
    summary = {
        name: statistics.median(values.values())
        for name, values in (("first_use_ms", first), ("again_ms", again), ("padded_warmed_ms", padded))
    }
    print("medians:", {k: round(v, 2) for k, v in summary.items()})
    if args.output:
        with open(args.output, "w") as f:
            json.dump(
                {
                    "gpu": torch.cuda.get_device_name(),
                    "torch": torch.__version__,
                    "cuda": torch.version.cuda,
                    "queue_ms": args.queue_ms,
                    "first_use_ms": first,
                    "again_ms": again,
                    "padded_warmed_ms": padded,
                    "medians": summary,
                },
                f,
                indent=1,
            )


if __name__ == "__main__":
    main()
