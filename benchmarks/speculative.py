"""Speculative decoding: what a verify step costs beside a decode step, and what n-gram drafts buy end to end.

    # The verify step (k drafts per request) against the decode step, same engine, same requests. Any weights
    # do: the step's cost does not depend on whether its drafts are accepted.
    PYTHONPATH=. python benchmarks/speculative.py steps --device cuda --model llama-3-8b --load-format dummy \
        --batch-sizes 1,8,32 --draft-tokens 1,2,3,4,5,6,7 --context 512 --output-json spec_steps.json
    # n-gram speculation against plain decoding on prompts whose answers copy from them (a real model: the
    # embedded SmolLM2 by default), alternating runs, one prompt at a time and all at once.
    PYTHONPATH=. python benchmarks/speculative.py ngram --device cpu --repeats 3 --output-json spec_ngram.json
    # The same with every request penalized (its verify rows penalized as after the drafts before each).
    PYTHONPATH=. python benchmarks/speculative.py ngram --device cpu --repeats 3 --repetition-penalty 1.1
    # For dummy weights, whose drafts nothing can guess: verify steps as they run, the kept-draft count drawn at
    # chosen acceptance rates (benchmarking only): throughput against acceptance length, plain decoding beside.
    PYTHONPATH=. python benchmarks/speculative.py simulated --device cuda --model llama-3-8b --load-format dummy \
        --batch-sizes 1,8,32 --acceptance-rates 1,0.85,0.7,0.5 --output-json spec_simulated.json
    # The same with the drafts' own cost: an EAGLE-3 head of the target's shape with dummy weights drafts every
    # step (the public Llama-3-8B head's shape for llama-3-8b), and the verify steps run its drafts; the verdict
    # is drawn.
    PYTHONPATH=. python benchmarks/speculative.py simulated --eagle3-head --device cuda --model llama-3-8b \
        --load-format dummy --batch-sizes 1,8,32 --output-json spec_simulated_eagle3.json

Prints tables and writes JSON. Steps are timed back to back between two device synchronisations (median of 5
groups), through ModelRunner.launch as the engine runs them: message, forward (the decode graphs where a step's
rows fit them), sampling. "break-even" is the acceptance length (tokens kept per request and verify step) at
which speculation only matches plain decoding: verify ms / decode ms.
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import statistics
import time
from typing import Any

from engine.engine import Engine
from engine.profiling import chrome_trace
from engine.sampling_params import SamplingParams
from engine.scheduler import ScheduledStep
from engine.tuning.measure import steady_ms

COPY_PROMPTS = [
    "Repeat this list exactly, once: apples, oranges, bananas, grapes, pears, plums, cherries, lemons, limes, figs.",
    "Copy this paragraph word for word: The committee met on Tuesday to review the budget. After a long "
    "discussion, the members agreed to postpone the vote until the next meeting, when more figures would be ready.",
    "Here is some code:\n\ndef area(width, height):\n    return width * height\n\n\ndef perimeter(width, "
    "height):\n    return 2 * (width + height)\n\nRewrite both functions with type hints and docstrings.",
    "Reformat as a bulleted list, keeping every word: red apples, green pears, yellow bananas, purple grapes, "
    "orange oranges, brown dates.",
    "Write the numbers from 1 to 40 separated by commas.",
    'Copy this JSON exactly: {"name": "Ada Lovelace", "born": 1815, "field": "mathematics", '
    '"known_for": "the first computer program"}',
]


SETTLE_TOKENS = 64  # steps mode: output tokens a request may take before every request is running


def _engine(args: argparse.Namespace, **overrides: Any) -> Engine:
    options: dict[str, Any] = {"device": args.device, "seed": 0}
    if args.model:
        options["model"] = args.model
    if args.load_format:
        options["load_format"] = args.load_format
    options.update(overrides)
    return Engine(**options)


def run_steps(args: argparse.Namespace) -> dict[str, Any]:
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    draft_tokens = [int(k) for k in args.draft_tokens.split(",")]
    largest = max(batch_sizes)
    # The platform's own max_num_seqs and capture sizes (a verify step's rows are captured up to
    # max_num_seqs x (1 + k) when speculation is configured; here the sizes the engine captures anyway).
    engine = _engine(args, kv_cache_tokens=largest * (args.context + max(draft_tokens) + SETTLE_TOKENS) + 4096)
    assert largest <= engine.config.positive_int("max_num_seqs"), "a batch larger than max_num_seqs"
    rng = random.Random(0)
    vocab = int(engine.model_config.vocab_size)
    # Few output tokens: the requests decode only until the last of them is running (a few steps; the timed
    # steps below are launched by hand and add none), and admission reserves KV for each request's whole
    # max_tokens, so a large one kept most of them waiting, and retracted, in a pool sized for the context.
    params = SamplingParams(max_tokens=SETTLE_TOKENS, temperature=0.0, ignore_eos=True)
    for _ in range(largest):
        engine.add_request([rng.randrange(10, vocab - 10) for _ in range(args.context)], params)
    while len(engine.scheduler.running) < largest or engine.scheduler.waiting or not engine.last_step_was_decode:
        engine.step()
    engine.step()  # overlap scheduling: nothing left in flight that the timed steps would race
    sync = engine.platform.synchronize
    requests = list(engine.scheduler.running)
    rows: list[dict[str, Any]] = []

    def launch(step: ScheduledStep) -> None:
        sampled = engine.runner.launch(step, engine.step_builder.build(step))
        assert sampled is not None
        sampled.token_ids.sum().item()  # the tokens are read back as the engine reads them

    for batch in batch_sizes:
        chosen = requests[:batch]
        plain = ScheduledStep(True, chosen, [])
        decode_ms = steady_ms(sync, lambda s=plain: launch(s), args.iters)
        row: dict[str, Any] = {"batch": batch, "decode_ms": decode_ms, "verify_ms": {}}
        for k in draft_tokens:
            for request in chosen:
                assert engine.kv_manager.allocate(request, request.num_tokens + k, evict=False)
            drafts = [[rng.randrange(10, vocab - 10) for _ in range(k)] for _ in chosen]
            step = ScheduledStep(True, chosen, [], drafts=drafts)
            row["verify_ms"][k] = steady_ms(sync, lambda s=step: launch(s), args.iters)
        rows.append(row)
    for request in requests:
        engine.abort(request.request_id)
    while engine.has_unfinished():
        engine.step()
    print(f"{'batch':>5} {'k':>3} {'rows':>5} {'decode ms':>10} {'verify ms':>10} {'verify/decode = break-even':>27}")
    for row in rows:
        for k, verify in row["verify_ms"].items():
            ratio = verify / row["decode_ms"]
            print(
                f"{row['batch']:>5} {k:>3} {row['batch'] * (k + 1):>5} {row['decode_ms']:>10.2f} {verify:>10.2f} "
                f"{ratio:>27.2f}"
            )
    runners = engine.runner.describe()
    engine.shutdown()
    return {
        "mode": "steps",
        "device": args.device,
        "model": args.model,
        "context": args.context,
        "runners": runners,
        "rows": rows,
    }


def run_ngram(args: argparse.Namespace) -> dict[str, Any]:
    spec = json.dumps(
        {
            "method": "ngram",
            "num_speculative_tokens": args.num_speculative_tokens,
            "prompt_lookup_max": args.prompt_lookup_max,
            "prompt_lookup_min": args.prompt_lookup_min,
        }
    )
    engines = {"plain": _engine(args), "ngram": _engine(args, speculative_config=spec)}
    # A repetition penalty (vLLM users often set 1.05-1.1) makes every request penalized: each verify row is then
    # penalized as after the drafts before it.
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, repetition_penalty=args.repetition_penalty)
    shapes = {"one at a time": [[p] for p in COPY_PROMPTS], "all at once": [COPY_PROMPTS]}
    for engine in engines.values():
        engine.generate(COPY_PROMPTS[:1], params, chat=True)  # warm
    results: dict[str, dict[str, list[float]]] = {shape: {name: [] for name in engines} for shape in shapes}
    acceptance: dict[str, list[float]] = {shape: [] for shape in shapes}
    texts_equal = True
    for _ in range(args.repeats):
        for shape, batches in shapes.items():
            outputs: dict[str, list[list[int]]] = {}
            for name, engine in engines.items():  # alternating: plain, then n-gram, on the same prompts
                speculator = engine.speculator
                if speculator is not None:
                    speculator.stats.__init__()  # type: ignore[misc]
                tokens = 0
                outputs[name] = []
                start = time.perf_counter()
                for batch in batches:
                    for output in engine.generate(batch, params, chat=True):
                        tokens += len(output.token_ids)
                        outputs[name].append(output.token_ids)
                results[shape][name].append(tokens / (time.perf_counter() - start))
                if speculator is not None:
                    acceptance[shape].append(speculator.stats.mean_acceptance_length)
            texts_equal &= outputs["plain"] == outputs["ngram"]
    print(f"{'prompts':>14} {'plain tok/s':>12} {'n-gram tok/s':>13} {'speed-up':>9} {'acceptance length':>18}")
    summary = {}
    for shape in shapes:
        plain = statistics.median(results[shape]["plain"])
        ngram = statistics.median(results[shape]["ngram"])
        length = statistics.median(acceptance[shape])
        summary[shape] = {"plain_tok_s": plain, "ngram_tok_s": ngram, "speedup": ngram / plain, "acceptance": length}
        print(f"{shape:>14} {plain:>12.1f} {ngram:>13.1f} {ngram / plain:>9.2f} {length:>18.2f}")
    print(f"greedy tokens identical with and without speculation: {texts_equal}")
    runners = engines["plain"].runner.describe()
    for engine in engines.values():
        engine.shutdown()
    return {
        "mode": "ngram",
        "device": args.device,
        "model": args.model or "embedded SmolLM2",
        "speculative_config": json.loads(spec),
        "max_tokens": args.max_tokens,
        "repetition_penalty": args.repetition_penalty,
        "runners": runners,
        "runs": results,
        "acceptance_length": acceptance,
        "summary": summary,
        "identical": texts_equal,
    }


class SimulatedDrafts:
    """Benchmarking only, for dummy weights: random drafts, and a kept-draft count drawn per request and step
    (each draft kept with probability `rate` until the first refused one) in place of the target's verdict.
    Replaying a recorded run's tokens does not work there: with random weights the greedy token flips between
    a 1-row decode step and a 5-row verify step (bf16 GEMMs of other shapes round differently), so every replayed
    draft after the first flip is refused. The verify steps run as they would; only the verdict is drawn."""

    def __init__(self, rate: float, num_tokens: int, vocab: int) -> None:
        self.rate, self.num_tokens, self.vocab = rate, num_tokens, vocab
        self.rng = random.Random(0)

    def propose_batch(self, contexts: list[list[int]], limits: list[int]) -> list[list[int]]:
        return [[self.rng.randrange(self.vocab) for _ in range(min(self.num_tokens, limit))] for limit in limits]

    def accept(self, drafts: list[int], sampled: list[int]) -> list[int]:
        kept = 0
        while kept < len(drafts) and self.rng.random() < self.rate:
            kept += 1
        return drafts[:kept] + sampled[kept : kept + 1]


def run_simulated(args: argparse.Namespace) -> dict[str, Any]:
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    rates = [float(c) for c in args.acceptance_rates.split(",")]
    k = args.num_speculative_tokens
    method = {"method": "eagle3", "model": "dummy"} if args.eagle3_head else {"method": "ngram"}
    spec = json.dumps({**method, "num_speculative_tokens": k})
    sizing = {"kv_cache_tokens": max(batch_sizes) * (args.context + args.max_tokens + 2 * k) + 8192}
    plain, speculative = _engine(args, **sizing), _engine(args, speculative_config=spec, **sizing)
    speculator = speculative.speculator
    assert speculator is not None
    real_accept = speculator.accept
    vocab = int(plain.model_config.vocab_size)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    rng = random.Random(1)
    rows = []
    for batch in batch_sizes:
        prompts = [[rng.randrange(10, vocab - 10) for _ in range(args.context)] for _ in range(batch)]
        # Each engine and case is warmed on other prompts of the same shape first (no prefix cache hits): the
        # first steps of a shape compile Triton kernels (one specialization per new argument pattern), which
        # made the first H100 run of the batched head read 0.45x at full acceptance and 0.99x at 0.85.
        warm_prompts = [[rng.randrange(10, vocab - 10) for _ in range(args.context)] for _ in range(batch)]
        warm_params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
        plain.generate(warm_prompts, warm_params)
        start = time.perf_counter()
        plain.generate(prompts, params)
        plain_tok_s = batch * args.max_tokens / (time.perf_counter() - start)
        for rate in rates:
            simulated = SimulatedDrafts(rate, k, vocab)
            # The n-gram proposer's drafts are replaced by random ones; an EAGLE-3 head drafts (and pays for) its
            # own, left on the device as in serving. Either way the verdict is drawn.
            speculator.proposer = simulated
            speculator.accept = lambda drafts, sampled, s=simulated: real_accept(drafts, s.accept(drafts, sampled))  # type: ignore[method-assign]
            speculative.generate(warm_prompts, warm_params)
            speculator.stats.__init__()  # type: ignore[misc]
            with chrome_trace(args.trace_dir, f"batch{batch}_rate{rate}"):
                start = time.perf_counter()
                speculative.generate(prompts, params)
                tok_s = batch * args.max_tokens / (time.perf_counter() - start)
            rows.append(
                {
                    "batch": batch,
                    "acceptance_rate": rate,
                    "acceptance_length": speculator.stats.mean_acceptance_length,
                    "plain_tok_s": plain_tok_s,
                    "speculative_tok_s": tok_s,
                    "speedup": tok_s / plain_tok_s,
                }
            )
    print(f"{'batch':>5} {'rate':>5} {'accept len':>11} {'plain tok/s':>12} {'spec tok/s':>11} {'speed-up':>9}")
    for row in rows:
        print(
            f"{row['batch']:>5} {row['acceptance_rate']:>5.2f} {row['acceptance_length']:>11.2f} "
            f"{row['plain_tok_s']:>12.1f} {row['speculative_tok_s']:>11.1f} {row['speedup']:>9.2f}"
        )
    runners = speculative.runner.describe()
    plain.shutdown()
    speculative.shutdown()
    return {
        "mode": "simulated",
        "device": args.device,
        "model": args.model,
        "context": args.context,
        "max_tokens": args.max_tokens,
        "num_speculative_tokens": k,
        "drafts": "a dummy EAGLE-3 head's, the verdict simulated" if args.eagle3_head else "simulated",
        "runners": runners,
        "rows": rows,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("mode", choices=["steps", "ngram", "simulated"])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--model", default=None, help="a path or preset (default: the embedded SmolLM2)")
    parser.add_argument("--load-format", default=None)
    parser.add_argument("--batch-sizes", default="1,8,32", help="steps: requests per step")
    parser.add_argument("--draft-tokens", default="1,2,3,4,5,6,7", help="steps: drafts per request")
    parser.add_argument("--context", type=int, default=512, help="steps, simulated: prompt tokens of each request")
    parser.add_argument("--iters", type=int, default=50, help="steps: timed steps per case")
    parser.add_argument("--repeats", type=int, default=3, help="ngram: alternating runs")
    parser.add_argument("--max-tokens", type=int, default=128, help="ngram, simulated: output tokens per prompt")
    parser.add_argument("--num-speculative-tokens", type=int, default=4)
    parser.add_argument("--prompt-lookup-max", type=int, default=4)
    parser.add_argument("--prompt-lookup-min", type=int, default=2)
    parser.add_argument("--repetition-penalty", type=float, default=1.0, help="ngram: every request's (1: none)")
    parser.add_argument("--acceptance-rates", default="1,0.85,0.7,0.5", help="simulated: each draft's chance")
    parser.add_argument(
        "--eagle3-head",
        action="store_true",
        help="simulated: a dummy EAGLE-3 head of the target's shape drafts every step (its cost counted)",
    )
    parser.add_argument(
        "--trace-dir", default=None, help="simulated: a torch.profiler chrome trace of each timed speculative run"
    )
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    result = {"steps": run_steps, "ngram": run_ngram, "simulated": run_simulated}[args.mode](args)
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
