"""Start-up, compile time per bucket, prefill time and decode tok/s of one engine on --device xla (or cpu).

Issue #47's figures: run once per device, each in a process of its own (a process that imported torchax cannot
torch.compile the CPU platform's graphs), e.g.

    PYTHONPATH=. python benchmarks/xla_cpu.py --device xla --output-json xla.json
    PYTHONPATH=. python benchmarks/xla_cpu.py --device cpu --output-json cpu.json

Decode tok/s at batch B: B prompts generate N tokens and then 1 token (prefix caching off, so both pay the same
prefill); the difference is N-1 decode steps of B rows. The engine runs with the device's YAML defaults
(configs/<device>.yaml) except where a flag here says otherwise.
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from typing import Any

from engine import Engine, SamplingParams


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--device", default="xla")
    parser.add_argument("--model", default=None, help="default: the embedded SmolLM2")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--quantization", default="auto", help="none: GGUF dequantized at load on the CPU too")
    parser.add_argument("--batch-sizes", default="1,4")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--prompt-words", type=int, default=200, help="the prefill case's prompt, in words")
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--output-json", default=None)
    return parser.parse_args()


def timed(engine: Engine, prompts: list[str], tokens: int) -> float:
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    start = time.perf_counter()
    engine.generate(prompts, params)
    return time.perf_counter() - start


def main() -> None:
    args = parse_args()
    sizes = [int(size) for size in args.batch_sizes.split(",")]
    options: dict[str, Any] = dict(
        device=args.device,
        dtype=args.dtype,
        quantization=args.quantization,
        enable_prefix_caching=False,
        max_num_seqs=max(sizes),
    )
    if args.model:
        options["model"] = args.model
    if args.max_model_len:
        options["max_model_len"] = args.max_model_len
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    start = time.perf_counter()
    engine = Engine(**options)
    result: dict[str, Any] = {"options": options, "build_s": round(time.perf_counter() - start, 2)}
    result["captured"] = {
        runner.name: {str(size): round(s, 2) for size, s in runner.report.seconds_per_size.items()}
        for runner in engine.runner.step_runners
        if runner.report is not None
    }
    prompt = " ".join(["word"] * args.prompt_words)
    result["prefill_s"] = min(timed(engine, [prompt], 1) for _ in range(args.repeats))
    decode = {}
    for size in sizes:
        prompts = [f"Story number {i}: once upon a time" for i in range(size)]
        full = min(timed(engine, prompts, args.new_tokens) for _ in range(args.repeats))
        first = min(timed(engine, prompts, 1) for _ in range(args.repeats))
        decode[str(size)] = round(size * (args.new_tokens - 1) / (full - first), 1)
    result["decode_tok_s"] = decode
    result["max_model_len"] = engine.max_model_len
    result["device_facts"] = engine.platform.device_facts()
    engine.shutdown()
    print(json.dumps(result, indent=1))
    if args.output_json:
        with open(args.output_json, "w", encoding="utf-8") as handle:
            json.dump(result, handle, indent=1)


if __name__ == "__main__":
    main()
