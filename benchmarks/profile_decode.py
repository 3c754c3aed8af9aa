"""Where a decode step's host time goes: cProfile over decode steps of a full batch.

    PYTHONPATH=. python benchmarks/profile_decode.py --device cuda --model llama-3-8b --load-format dummy \
        --batch-sizes 1,256 --context 512 --steps 100
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats

import torch

from engine.cli import add_engine_args, engine_config_from_args
from engine.engine import Engine
from engine.sampling_params import SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_engine_args(parser)  # the engine's own flags: --model, --device, --dtype, --load-format, ...
    parser.add_argument("--batch-sizes", default="1,256")
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--top", type=int, default=22)
    args = parser.parse_args()
    engine = Engine(engine_config_from_args(args))
    vocab = engine.model_config.vocab_size
    for batch in (int(b) for b in args.batch_sizes.split(",")):
        generator = torch.Generator().manual_seed(batch)
        ids = [
            engine.add_request(
                torch.randint(0, vocab, (args.context,), generator=generator).tolist(),
                SamplingParams(max_tokens=100_000, temperature=0.0, ignore_eos=True),
            )
            for _ in range(batch)
        ]
        while len(engine.scheduler.running) < batch:
            engine.step()
        for _ in range(5):
            engine.step()
        profile = cProfile.Profile()
        profile.enable()
        for _ in range(args.steps):
            engine.step()
        profile.disable()
        out = io.StringIO()
        stats = pstats.Stats(profile, stream=out)
        print(f"==== batch {batch}, context {args.context}: {args.steps} decode steps")
        stats.sort_stats("tottime").print_stats(args.top)
        print("\n".join(line for line in out.getvalue().splitlines() if line.strip())[:6000])
        for request_id in ids:
            engine.abort(request_id)


if __name__ == "__main__":
    main()
