"""What structured output costs: the same requests with and without a JSON schema, in one engine.

    PYTHONPATH=. python benchmarks/structured_output.py --engine-args="--device cpu" --num-prompts 16

Each request samples (temperature 0.8) up to --max-tokens tokens; the constrained run adds a JSON
schema whose strings and arrays let the text run long, so both runs decode about as many tokens.
Reports output tok/s, the median decode step, and how many outputs stopped and parsed as JSON
(a constrained one cut off at --max-tokens is a valid prefix, not yet a document). The
unconstrained run, before and after, is the peer; the difference is the
grammar's cost: the host's bitmask fill, the mask on the device, and the one-step-deep overlap given
up while a constrained request runs (engine/engine.py, Engine.step).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import time

from engine.bench_args import add_renamed
from engine.cli import add_engine_args, engine_config_from_args
from engine.engine import Engine
from engine.sampling_params import SamplingParams
from engine.structured import GrammarSpec

SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "scores": {"type": "array", "items": {"type": "integer"}},
    },
    "required": ["title", "tags", "scores"],
}


def _run(engine: Engine, prompts: list[list[int]], params: SamplingParams) -> dict:
    for index, prompt in enumerate(prompts):
        engine.add_request(prompt, params, request_id=f"bench-{time.monotonic_ns()}-{index}")
    steps: list[float] = []
    finals = []
    start = time.perf_counter()
    while engine.has_unfinished():
        step_start = time.perf_counter()
        outputs = engine.step()
        if engine.last_step_was_decode:
            steps.append(time.perf_counter() - step_start)
        finals += [o for o in outputs if o.finished]
    wall = time.perf_counter() - start
    tokens = sum(len(o.token_ids) for o in finals)
    parsed = 0
    for output in finals:
        try:
            json.loads(output.text)
            parsed += 1
        except json.JSONDecodeError:
            pass
    return {
        "requests": len(finals),
        "output_tokens": tokens,
        "wall_s": wall,
        "output_tok_s": tokens / wall,
        "decode_step_ms_median": 1000 * statistics.median(steps) if steps else None,
        "finished_stop": sum(o.finish_reason == "stop" for o in finals),
        "parsed_json": parsed,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine-args", default="", help="engine flags (engine run's), e.g. '--device cuda'")
    add_renamed(parser, "--num-prompts", "--num-requests", type=int, default=64, help="requests per run")
    add_renamed(parser, "--input-len", "--prompt-len", type=int, default=128, help="prompt tokens per request")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--output", default="bench_results/structured_output.json")
    args = parser.parse_args()
    engine_parser = argparse.ArgumentParser()
    add_engine_args(engine_parser)
    engine_args = engine_parser.parse_args(shlex.split(args.engine_args))
    engine = Engine(engine_config_from_args(engine_args))
    vocab = engine.model_config.vocab_size
    prompts = [[(7 * i + 13 * j) % (vocab - 1) + 1 for j in range(args.input_len)] for i in range(args.num_prompts)]
    free = SamplingParams(max_tokens=args.max_tokens, temperature=0.8, ignore_eos=True)
    constrained = SamplingParams(max_tokens=args.max_tokens, temperature=0.8, grammar=GrammarSpec.json_schema(SCHEMA))
    _run(engine, prompts, free)  # warm both paths (a first shape compiles, the grammar compiles) once
    _run(engine, prompts, constrained)
    report = {
        "engine_args": args.engine_args,
        "num_requests": args.num_prompts,
        "prompt_len": args.input_len,
        "max_tokens": args.max_tokens,
        "runs": {},
    }
    for name, params in (("unconstrained", free), ("json_schema", constrained), ("unconstrained_again", free)):
        report["runs"][name] = _run(engine, prompts, params)
    print(f"{'run':>20} {'out tok/s':>10} {'decode step ms':>15} {'stopped':>8} {'parsed JSON':>12}")
    for name, run in report["runs"].items():
        step = run["decode_step_ms_median"]
        print(
            f"{name:>20} {run['output_tok_s']:>10.0f} {step if step is None else round(step, 2):>15} "
            f"{run['finished_stop']:>8} {run['parsed_json']:>5}/{run['requests']}"
        )
    runs = report["runs"]
    base = statistics.mean([runs[n]["output_tok_s"] for n in ("unconstrained", "unconstrained_again")])
    base_step = statistics.mean(
        [runs[n]["decode_step_ms_median"] or 0.0 for n in ("unconstrained", "unconstrained_again")]
    )
    report["json_schema_vs_unconstrained"] = runs["json_schema"]["output_tok_s"] / base
    report["json_schema_decode_step_ms_added"] = (runs["json_schema"]["decode_step_ms_median"] or 0.0) - base_step
    print(
        f"json_schema / unconstrained output tok/s: {report['json_schema_vs_unconstrained']:.2f}; "
        f"decode step +{report['json_schema_decode_step_ms_added']:.2f} ms"
    )
    os.makedirs(os.path.dirname(args.output) or ".", exist_ok=True)
    with open(args.output, "w", encoding="utf-8") as handle:
        json.dump(report, handle, indent=1)


if __name__ == "__main__":
    main()
