"""`engine bench latency`: one static batch, as SGLang's bench_one_batch: prefill time, then decode ms/step.

    engine bench latency --device cuda --model llama-3-8b --load-format dummy \\
        --batch-size 8 --input-len 2048 --output-len 8 [--prefix-len 4096] --output-json latency.json

B prompts of random token ids, `input_len` new tokens each (behind a shared
`prefix_len`-token prefix that is prefilled and cached first, when given),
greedy with ignore_eos. Prefill is the wall time from the first step until
every request has its first token; decode is the median wall time per step
after that. Prefill speed is also given in TFLOP/s, counting 2 FLOPs per
matmul parameter per new token (every linear layer, the LM head included,
as the issue that set the target counts) plus causal attention (4 x head_dim
FLOPs per query-key pair per query head), next to the dense bf16 matmul rate
this GPU reaches in the same run (an 8192^3 GEMM): the hardware limit the
prefill is held against. Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time
from typing import Any

import torch

from engine.bench_args import add_renamed
from engine.cli import engine_config_from_args
from engine.engine import Engine
from engine.sampling_params import SamplingParams


def add_bench_latency_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("bench latency")
    group.add_argument("--batch-size", type=int, default=8)
    group.add_argument("--input-len", type=int, default=1024, help="new prompt tokens per request")
    group.add_argument(
        "--prefix-len", type=int, default=0, help="a shared prefix prefilled and cached before the timed batch"
    )
    group.add_argument(
        "--output-len", type=int, default=16, help="tokens per request (>= 2: one from prefill, the rest decode)"
    )
    group.add_argument("--repeats", type=int, default=3, help="timed batches; medians are reported")
    group.add_argument(
        "--cases",
        default=None,
        help="several batches in one run, BATCHxINPUT[+PREFIX] comma-separated (e.g. 8x2048,1x8192,1x4096+4096); "
        "overrides --batch-size/--input-len/--prefix-len",
    )
    group.add_argument(
        "--peers",
        action="store_true",
        help="CPU, batch 1: time to first token beside HF transformers (float32 and bf16) and llama.cpp "
        "(llama-cpp-python, GGUF models) in alternating rounds",
    )
    add_renamed(
        group, "--output-json", "--output", default="bench_results/latency.json", help="JSON file for the results"
    )


def matmul_params(engine: Engine) -> int:
    """Weights a token multiplies by: every linear layer (nn.Linear and subclasses, the LM head and MoE
    routers included) plus, in an MoE layer, the top_k experts it is routed to (not all E)."""
    from engine.layers.moe import SparseMoE

    dense = sum(m.weight.numel() for m in engine.model.modules() if isinstance(m, torch.nn.Linear))
    experts = 0
    for moe in (m for m in engine.model.modules() if isinstance(m, SparseMoE)):
        stacked = moe.experts.gate_up_proj.numel() + moe.experts.down_proj.numel()
        experts += stacked * moe.top_k // moe.experts.gate_up_proj.shape[0]
    return dense + experts


def attention_flops(engine: Engine, prefix: int, new: int) -> float:
    """Causal attention of `new` tokens behind `prefix` cached ones, one request, every layer. Under tensor
    parallelism one rank's heads, as matmul_params counts one rank's weights: one GPU's share of the work,
    held against one GPU's matmul rate."""
    cfg = engine.model_config
    pairs = new * prefix + new * (new + 1) / 2
    heads = cfg.num_attention_heads // engine.tp.world_size
    return 4.0 * cfg.head_dim * heads * cfg.num_hidden_layers * pairs


def measured_matmul_tflops(device: torch.device, dtype: torch.dtype) -> float | None:
    """The dense matmul rate this device reaches (8192^3, median of 10): the limit prefill is held to."""
    if device.type != "cuda":
        return None
    a = torch.randn(8192, 8192, device=device, dtype=dtype)
    b = torch.randn(8192, 8192, device=device, dtype=dtype)
    times = []
    for _ in range(13):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        a @ b
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return 2 * 8192**3 / statistics.median(times[3:]) / 1e12


def run_batch(engine: Engine, prompts: list[list[int]], output_len: int) -> tuple[float, list[float]]:
    """(prefill seconds, each decode step's seconds) for one static batch."""
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    sync = engine.platform.synchronize
    ids = [engine.add_request(p, params) for p in prompts]
    first_token: set[str] = set()
    sync()
    start = time.perf_counter()
    prefill_s = None
    steps: list[float] = []
    last = start
    while engine.has_unfinished():
        outputs = engine.step()
        now = time.perf_counter()
        if prefill_s is None:
            first_token.update(o.request_id for o in outputs)
            if len(first_token) == len(ids):
                # Reading the tokens back waited for the prefill's device work (not for the decode step
                # launched meanwhile with overlap scheduling, which a sync here would add).
                prefill_s = now - start
        elif outputs:
            steps.append(now - last)
        last = now
    sync()
    assert prefill_s is not None
    return prefill_s, steps


def parse_cases(args: argparse.Namespace) -> list[tuple[int, int, int]]:
    """(batch, input_len, prefix_len) of each case."""
    if not args.cases:
        return [(args.batch_size, args.input_len, args.prefix_len)]
    cases = []
    for text in args.cases.split(","):
        shape, _, prefix = text.partition("+")
        batch, _, input_len = shape.partition("x")
        cases.append((int(batch), int(input_len), int(prefix or 0)))
    return cases


def cmd_bench_latency(args: argparse.Namespace) -> None:
    engine = Engine(engine_config_from_args(args))
    if args.peers:
        bench_against_peers(engine, args)
        return
    peak = measured_matmul_tflops(engine.device, engine.config.torch_dtype)
    cases = parse_cases(args)
    too_long = [c for c in cases if c[1] + c[2] + args.output_len > engine.max_model_len]
    if too_long:
        raise ValueError(
            f"cases {too_long} need more than the context length {engine.max_model_len} (input + prefix + output)"
        )
    reports = []
    for case in cases:
        reports.append(run_case(engine, args, *case, peak=peak))
        print(f"case {case}: prefill {reports[-1]['prefill_s'] * 1e3:.1f} ms", flush=True)
    print(
        f"{'batch':>6}{'input':>7}{'prefix':>7}{'prefill ms':>11}{'prefill tok/s':>14}{'TFLOP/s':>9}{'of peak':>8}"
        f"{'decode ms/step':>15}"
    )
    for r in reports:
        share = f"{r['prefill_share_of_peak']:.0%}" if peak else "-"
        decode_ms = f"{r['decode_ms_per_step']:.2f}" if r["decode_ms_per_step"] else "-"
        print(
            f"{r['batch_size']:>6}{r['input_len']:>7}{r['prefix_len']:>7}{r['prefill_s'] * 1e3:>11.1f}"
            f"{r['prefill_tok_s']:>14.0f}{r['prefill_tflops']:>9.1f}{share:>8}{decode_ms:>15}"
        )
    if peak:
        print(f"dense {engine.config.dtype} matmul on this GPU in the same run: {peak:.0f} TFLOP/s")
    os.makedirs(os.path.dirname(args.output_json) or ".", exist_ok=True)
    with open(args.output_json, "w", encoding="utf-8") as handle:
        json.dump(
            {
                "device": str(engine.device),
                "gpu": torch.cuda.get_device_name() if engine.device.type == "cuda" else None,
                "torch": torch.__version__,
                "model": args.model,
                "dtype": engine.config.dtype,
                "tensor_parallel_size": engine.tp.world_size,
                "matmul_peak_tflops": peak,
                "cases": reports,
            },
            handle,
            indent=2,
        )


def run_case(
    engine: Engine, args: argparse.Namespace, batch: int, input_len: int, prefix_len: int, peak: float | None
) -> dict[str, Any]:
    # A stream of its own per case: cases drawing the same stream share prompt prefixes, and the prefix
    # cache then serves part of a later case (a first version of this benchmark overstated 64 x 256 so).
    rng = random.Random(f"{args.seed}:{batch}x{input_len}+{prefix_len}")
    vocab = engine.model_config.vocab_size
    prefill, decode = [], []
    for repeat in range(args.repeats + 1):  # the first batch warms up (kernels, allocator)
        prefix: list[int] = []
        if prefix_len:
            # A new prefix per batch, cached by one request before the timed batch reuses it.
            prefix = [rng.randrange(vocab) for _ in range(prefix_len)]
            engine.generate([[*prefix, rng.randrange(vocab)]], SamplingParams(max_tokens=1, ignore_eos=True))
        prompts = [prefix + [rng.randrange(vocab) for _ in range(input_len)] for _ in range(batch)]
        prefill_s, steps = run_batch(engine, prompts, args.output_len)
        if repeat:
            prefill.append(prefill_s)
            decode += steps
    new_tokens = batch * input_len
    flops = 2.0 * matmul_params(engine) * new_tokens + batch * attention_flops(engine, prefix_len, input_len)
    prefill_s = statistics.median(prefill)
    return {
        "batch_size": batch,
        "input_len": input_len,
        "prefix_len": prefix_len,
        "output_len": args.output_len,
        "prefill_s": prefill_s,
        "prefill_samples_s": prefill,
        "prefill_tok_s": new_tokens / prefill_s,
        "prefill_tflops": flops / prefill_s / 1e12,
        "prefill_share_of_peak": flops / prefill_s / 1e12 / peak if peak else None,
        "decode_ms_per_step": statistics.median(decode) * 1e3 if decode else None,
        "decode_steps": len(decode),
    }


def bench_against_peers(engine: Engine, args: argparse.Namespace) -> None:
    """--peers: each case's time to first token on the engine, HF transformers and llama.cpp, one prompt at a
    time in alternating rounds (engine/bench_latency_peers.py)."""
    from engine.bench_latency_peers import cpu_path, engine_first_token, load_peers, print_table, time_first_tokens

    if engine.device.type != "cpu":
        raise ValueError("--peers compares CPU prefill with HF transformers and llama.cpp: use --device cpu")
    cases = parse_cases(args)
    if any(batch != 1 or prefix for batch, _, prefix in cases):
        raise ValueError("--peers times one prompt at a time: give cases 1xN (no prefix)")
    path = cpu_path(engine)
    print(f"engine CPU path: {path}", flush=True)
    systems = {"engine": engine_first_token(engine), **load_peers(args, engine.max_model_len)}
    vocab = engine.model_config.vocab_size
    reports = []
    for _, input_len, _ in cases:
        rng = random.Random(f"{args.seed}:peers:{input_len}")
        prompts = [[rng.randrange(3, vocab) for _ in range(input_len)] for _ in range(args.repeats + 1)]
        reports.append({"input_len": input_len, "systems": time_first_tokens(systems, prompts, args.repeats)})
        print(
            f"input {input_len}: "
            + ", ".join(f"{n} {r['ttft_s'] * 1e3:.0f} ms" for n, r in reports[-1]["systems"].items()),
            flush=True,
        )
    print_table(reports, list(systems))
    os.makedirs(os.path.dirname(args.output_json) or ".", exist_ok=True)
    with open(args.output_json, "w", encoding="utf-8") as handle:
        json.dump(
            {
                "device": "cpu",
                "cpu_path": path,
                "torch": torch.__version__,
                "model": args.model,
                "rounds": args.repeats,
                "cases": reports,
            },
            handle,
            indent=2,
        )
