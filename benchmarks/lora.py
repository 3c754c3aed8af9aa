"""LoRA adapters: offline throughput over many adapters against the base model, the batch-1 decode step's
overhead, and how long an adapter takes to load.

    # The device run (issue #44): Llama-3-8B's shape with dummy weights, 8 random rank-16 adapters on all seven
    # projections (PEFT folders written to a temporary folder for that shape), 1,000 offline requests.
    PYTHONPATH=. python benchmarks/lora.py --device cuda --model llama-3-8b --load-format dummy \
        --num-prompts 1000 --num-adapters 8 --rank 16 --output-json bench_results/lora_h100.json
    # Small, on the CPU: SmolLM2's shape with dummy weights (the embedded GGUF runs too, without --model, but its
    # base engine takes the native GGUF decode step, which LoRA turns off: not a like-for-like comparison).
    PYTHONPATH=. python benchmarks/lora.py --device cpu --model smollm2-135m --load-format dummy --num-prompts 16 \
        --input-len 16,48 --output-len 8,24 --num-adapters 4 --rank 8 --iters 10 --context 64 --warm-requests 8

Three engines in turn, one at a time in the process (each shut down and its memory freed before the next):
- base: LoRA off, the requests without adapters;
- lora: --enable-lora with one slot per adapter (--max-loras = --num-adapters), the adapters loaded at run time
  (each load timed: read, checked, copied into its slots, synchronised), then the same requests spread over the
  adapters round robin, and again without adapters (what LoRA's slots cost the base model's requests).
Offline throughput is output tokens/s over the whole run (engine.step() until done, as `engine bench
throughput`). The batch-1 decode step is timed through ModelRunner.launch as the engine runs it (the decode
graph of one row where captured), back to back between two synchronisations, median of 5 groups: on the base
engine, and on the LoRA engine with an adapter row and with a base row.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import random
import statistics
import tempfile
import time
from typing import Any

import torch

from engine.engine import Engine
from engine.profiling import time_by_name
from engine.sampling_params import SamplingParams
from engine.tuning.measure import steady_ms

logger = logging.getLogger("benchmarks.lora")
MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def module_shapes(model_config: Any) -> dict[str, tuple[int, int]]:
    """PEFT module -> (out, in) of the whole (unsharded) model."""
    hidden, inter = int(model_config.hidden_size), int(model_config.intermediate_size)
    head_dim = int(model_config.head_dim)
    q, kv = int(model_config.num_attention_heads) * head_dim, int(model_config.num_key_value_heads) * head_dim
    return {
        "q_proj": (q, hidden),
        "k_proj": (kv, hidden),
        "v_proj": (kv, hidden),
        "o_proj": (hidden, q),
        "gate_proj": (inter, hidden),
        "up_proj": (inter, hidden),
        "down_proj": (hidden, inter),
    }


def write_adapter(folder: str, model_config: Any, rank: int, seed: int) -> str:
    """A PEFT folder (adapter_config.json + adapter_model.safetensors, bf16) of random rank-`rank` LoRA on every
    projection, for the model's shape: written directly, no HF model built (an 8B base would not fit a test box)."""
    from safetensors.torch import save_file

    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(int(model_config.num_hidden_layers)):
        for module, (out_features, in_features) in module_shapes(model_config).items():
            block = "self_attn" if module in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            key = f"base_model.model.model.layers.{layer}.{block}.{module}"
            a = torch.randn(rank, in_features, generator=generator) / in_features**0.5
            b = torch.randn(out_features, rank, generator=generator) * 0.01
            tensors[f"{key}.lora_A.weight"] = a.to(torch.bfloat16)
            tensors[f"{key}.lora_B.weight"] = b.to(torch.bfloat16)
    os.makedirs(folder, exist_ok=True)
    save_file(tensors, os.path.join(folder, "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(MODULES), "bias": "none"}
    with open(os.path.join(folder, "adapter_config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f)
    return folder


def _engine(args: argparse.Namespace, **overrides: Any) -> Engine:
    # No prefix cache: the same requests run more than once on an engine, and hits would shorten later runs.
    options: dict[str, Any] = {"device": args.device, "seed": 0, "enable_prefix_caching": False}
    if args.model:
        options["model"] = args.model
    if args.load_format:
        options["load_format"] = args.load_format
    if args.max_num_seqs:
        options["max_num_seqs"] = args.max_num_seqs
    options.update(overrides)
    return Engine(**options)


def _return_memory() -> None:
    """After the caller dropped its last reference to an engine (`del engine`): its device memory back."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def make_requests(args: argparse.Namespace, vocab: int) -> list[tuple[list[int], int]]:
    low_in, high_in = (int(x) for x in (args.input_len.split(",") * 2)[:2])
    low_out, high_out = (int(x) for x in (args.output_len.split(",") * 2)[:2])
    rng = random.Random(0)
    return [
        ([rng.randrange(10, vocab - 10) for _ in range(rng.randint(low_in, high_in))], rng.randint(low_out, high_out))
        for _ in range(args.num_prompts)
    ]


def offline(engine: Engine, requests: list[tuple[list[int], int]], adapters: list[str | None]) -> dict[str, Any]:
    """Every request added at once (request i with adapters[i % len]), engine.step() until all are done."""
    sync = engine.platform.synchronize
    for i, (prompt, out_len) in enumerate(requests):
        name = adapters[i % len(adapters)]
        engine.add_request(prompt, SamplingParams(max_tokens=out_len, temperature=0.0, ignore_eos=True, lora_name=name))
    sync()
    start = time.perf_counter()
    generated = 0
    while engine.has_unfinished():
        generated += sum(len(o.new_token_ids) for o in engine.step())
    sync()
    wall = time.perf_counter() - start
    # Each phase logged as it ends: a run cut short (a device call's time limit) shows how far it got.
    logger.info("offline run of %d requests: %.1f s, %.0f output tok/s", len(requests), wall, generated / wall)
    return {"requests": len(requests), "wall_s": wall, "output_tokens": generated, "output_tok_s": generated / wall}


def decode_step_ms(
    engine: Engine, args: argparse.Namespace, lora_names: list[str | None], batch: int = 1, profile: bool = False
) -> dict[str, Any]:
    """`batch` requests of --context prompt tokens decoding together (request i with lora_names[i % len]): the
    decode step's milliseconds and, with `profile`, its device kernels' time by name (per step)."""
    vocab = int(engine.model_config.vocab_size)
    rng = random.Random(1)
    request_ids = []
    # Enough new tokens to decode while the rest are prefilled (at least 2,048 prompt tokens a step), and no
    # more: the scheduler keeps pages for what running requests may still generate, and 10,000 a request kept
    # the last of 256 from being admitted in a pool made smaller by the LoRA slots (their elders decoded until
    # the pool ran out, were retracted, and so on, for minutes).
    max_tokens = 64 + 4 * -(-batch * args.context // 2048)
    for i in range(batch):
        name = lora_names[i % len(lora_names)]
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, lora_name=name)
        request_ids.append(engine.add_request([rng.randrange(10, vocab - 10) for _ in range(args.context)], params))
    while len(engine.scheduler.running) < batch or engine.scheduler.waiting or not engine.last_step_was_decode:
        engine.step()
    engine.step()  # overlap scheduling: nothing left in flight that the timed steps would race
    # The scheduler's own next step: it holds the page each request's next token needs (a step built from the
    # running list alone misses the pages of requests at a page boundary). Launched again and again, it rewrites
    # the same KV slots, which is all the timing needs.
    step = engine.scheduler.schedule()
    assert step is not None and step.is_decode and step.num_decodes == batch, step

    def launch() -> None:
        sampled = engine.runner.launch(step, engine.step_builder.build(step))
        assert sampled is not None
        sampled.token_ids.sum().item()  # read back, as the engine reads its tokens

    result: dict[str, Any] = {"batch": batch, "ms": steady_ms(engine.platform.synchronize, launch, args.iters)}
    logger.info("decode step of %d rows (adapters %s): %.3f ms", batch, sorted(set(map(str, lora_names))), result["ms"])
    if profile:
        with torch.profiler.profile(activities=profiler_activities()) as prof:
            for _ in range(args.iters):
                launch()
            engine.platform.synchronize()
        kernels = time_by_name(prof, on_gpu=torch.cuda.is_available())
        per_step = [(name, calls // args.iters, us / args.iters) for name, calls, us in kernels[:25]]
        result["kernels_us_per_step"] = per_step
        result["lora_kernels_us_per_step"] = sum(us for name, _, us in kernels if "lora" in name) / args.iters
    for request_id in request_ids:
        engine.abort(request_id)
    while engine.has_unfinished():
        engine.step()
    return result


def profiler_activities() -> list[torch.profiler.ProfilerActivity]:
    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    return activities


def warm(engine: Engine, requests: list[tuple[list[int], int]], adapters: list[str | None]) -> None:
    """The first requests, run once untimed: the step shapes a run meets (the CPU compiles its steps per token
    bucket on first use) compiled before the clock starts."""
    offline(engine, requests, adapters)


def run(args: argparse.Namespace) -> dict[str, Any]:
    report: dict[str, Any] = {
        "torch": torch.__version__,
        "device": args.device,
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "model": args.model or "embedded SmolLM2",
        "load_format": args.load_format,
        "num_prompts": args.num_prompts,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "num_adapters": args.num_adapters,
        "rank": args.rank,
        "context": args.context,
    }
    engine = _engine(args)
    requests = make_requests(args, int(engine.model_config.vocab_size))
    batches = [int(b) for b in args.decode_batches.split(",")]
    if requests:
        warm(engine, requests[: args.warm_requests], [None])
    report["base"] = {
        "offline": offline(engine, requests, [None]) if requests else None,
        "decode": [decode_step_ms(engine, args, [None], batch, args.kernel_profile) for batch in batches],
    }
    model_config, runners = engine.model_config, engine.runner.describe()
    report["base"]["runners"] = runners
    engine.shutdown()
    del engine  # the base model's weights and pool go before the LoRA engine loads its own (an 8B twice: OOM)
    _return_memory()

    with tempfile.TemporaryDirectory(prefix="lora_bench_") as root:
        started = time.perf_counter()
        folders = {
            f"adapter{i}": write_adapter(os.path.join(root, f"adapter{i}"), model_config, args.rank, seed=i)
            for i in range(args.num_adapters)
        }
        report["adapter_write_s"] = time.perf_counter() - started
        report["adapter_bytes"] = os.path.getsize(os.path.join(folders["adapter0"], "adapter_model.safetensors"))
        engine = _engine(args, enable_lora=True, max_loras=args.num_adapters, max_lora_rank=args.rank)
        assert engine.lora is not None
        load_s = []
        for name, folder in folders.items():
            engine.platform.synchronize()
            started = time.perf_counter()
            engine.load_lora_adapter(name, folder)
            engine.platform.synchronize()
            load_s.append(time.perf_counter() - started)
        names: list[str | None] = list(folders)
        if requests:
            warm(engine, requests[: args.warm_requests], [*names, None])
        report["lora"] = {
            "matmul": engine.lora.kernels.name,
            "load_s": load_s,
            "offline": offline(engine, requests, names) if requests else None,
            "offline_base_rows": offline(engine, requests, [None]) if requests else None,
            # Batch 1: the first adapter's row; larger batches: the adapters round robin.
            "decode": [decode_step_ms(engine, args, names, batch, args.kernel_profile) for batch in batches],
            "decode_base_rows": [decode_step_ms(engine, args, [None], batch) for batch in batches],
            "runners": engine.runner.describe(),
        }
        engine.shutdown()
        del engine
        _return_memory()
    base, lora = report["base"], report["lora"]
    summary: dict[str, Any] = {
        "decode_overhead": lora["decode"][0]["ms"] / base["decode"][0]["ms"] - 1.0,
        "decode_overhead_base_row": lora["decode_base_rows"][0]["ms"] / base["decode"][0]["ms"] - 1.0,
        "load_s_median": statistics.median(lora["load_s"]),
    }
    if requests:
        summary["throughput_vs_base"] = lora["offline"]["output_tok_s"] / base["offline"]["output_tok_s"]
        summary["base_rows_throughput_vs_base"] = (
            lora["offline_base_rows"]["output_tok_s"] / base["offline"]["output_tok_s"]
        )
    report["summary"] = summary
    return report


def print_table(report: dict[str, Any]) -> None:
    base, lora, summary = report["base"], report["lora"], report["summary"]
    print(f"\nLoRA matmul: {lora['matmul']}; {report['num_adapters']} adapters of rank {report['rank']}")
    if base["offline"] is not None:
        print(f"{'offline run':<34}{'out tok/s':>11}{'vs base':>9}{'wall s':>9}")
        rows = [
            ("base model (LoRA off)", base["offline"], 1.0),
            (f"{report['num_adapters']} adapters, round robin", lora["offline"], summary["throughput_vs_base"]),
            ("base rows, LoRA on", lora["offline_base_rows"], summary["base_rows_throughput_vs_base"]),
        ]
        for label, run_, ratio in rows:
            print(f"{label:<34}{run_['output_tok_s']:>11.1f}{ratio:>9.3f}{run_['wall_s']:>9.1f}")
    print(f"\n{'decode step ms':<16}{'base':>9}{'adapters':>10}{'vs base':>9}{'base rows':>11}{'vs base':>9}")
    for plain, mixed, base_rows in zip(base["decode"], lora["decode"], lora["decode_base_rows"], strict=True):
        print(
            f"{'batch ' + str(plain['batch']):<16}{plain['ms']:>9.3f}{mixed['ms']:>10.3f}"
            f"{mixed['ms'] / plain['ms'] - 1:>+9.1%}{base_rows['ms']:>11.3f}{base_rows['ms'] / plain['ms'] - 1:>+9.1%}"
        )
    for mixed in lora["decode"]:
        if "kernels_us_per_step" in mixed:
            lora_us = mixed["lora_kernels_us_per_step"]
            print(f"\nbatch {mixed['batch']} with adapters: LoRA kernels {lora_us:.0f} us a step")
            for name, calls, us in mixed["kernels_us_per_step"][:15]:
                print(f"  {us:>9.1f} us {calls:>5}x  {name[:100]}")
    loads = ", ".join(f"{s * 1e3:.0f}" for s in lora["load_s"])
    size_mib = report["adapter_bytes"] / 2**20
    print(f"adapter load ms ({size_mib:.0f} MiB files): {loads}; median {summary['load_s_median'] * 1e3:.0f}")
    throughput = f"{summary['throughput_vs_base']:.1%}" if "throughput_vs_base" in summary else "not run"
    print(f"goals: throughput >= 85% of base: {throughput}; batch-1 overhead <= 10%: {summary['decode_overhead']:+.1%}")


def compare_cpu_paths(args: argparse.Namespace) -> dict[str, Any]:
    """The CPU's two torch paths for the LoRA matmul (engine/lora/matmul.py) on one projection of SmolLM2's
    q/k/v shape (576 -> 960, three parts) at --rank: milliseconds per call by slots and rows, every row an
    adapter's."""
    from engine.lora.matmul import DENSE_LORA, GATHER_LORA

    in_features, out_features, width = 576, 960, 3 * args.rank
    rows_out = []
    for num_slots in (1, 2, 4, 8):
        lora_a = torch.randn(num_slots, width, in_features)
        lora_b = torch.randn(num_slots, width, out_features)
        for rows in (1, 16, 256):
            x, out = torch.randn(rows, in_features), torch.randn(rows, out_features)
            slots = torch.arange(rows) % num_slots
            row: dict[str, Any] = {"slots": num_slots, "rows": rows}
            tensors = (out, x, lora_a, lora_b, slots)
            for kernels in (DENSE_LORA, GATHER_LORA):
                row[kernels.name] = steady_ms(lambda: None, lambda k=kernels, t=tensors: k.apply(*t), args.iters)
            rows_out.append(row)
    print(f"{'slots':>5} {'rows':>5} {'dense ms':>9} {'gather ms':>10}")
    for row in rows_out:
        print(f"{row['slots']:>5} {row['rows']:>5} {row['dense']:>9.3f} {row['gather']:>10.3f}")
    return {"mode": "compare_cpu_paths", "threads": torch.get_num_threads(), "rank": args.rank, "rows": rows_out}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--model", default=None, help="a path or preset (default: the embedded SmolLM2)")
    parser.add_argument("--load-format", default=None)
    parser.add_argument("--max-num-seqs", type=int, default=None, help="default: the platform's")
    parser.add_argument("--num-prompts", type=int, default=1000, help="offline requests (0: decode steps only)")
    parser.add_argument("--input-len", default="256,768", help="prompt lengths: N, or MIN,MAX drawn uniformly")
    parser.add_argument("--output-len", default="128,384", help="output lengths: N, or MIN,MAX drawn uniformly")
    parser.add_argument("--num-adapters", type=int, default=8)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--context", type=int, default=512, help="prompt tokens of the batch-1 decode request")
    parser.add_argument("--iters", type=int, default=50, help="timed decode steps per case")
    parser.add_argument("--decode-batches", default="1", help="decode step batches to time, comma-separated")
    parser.add_argument("--kernel-profile", action="store_true", help="the device kernels of the timed decode steps")
    parser.add_argument("--warm-requests", type=int, default=64, help="the first requests, run once untimed")
    parser.add_argument("--compare-cpu-paths", action="store_true", help="only time the CPU's dense and gather paths")
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.compare_cpu_paths:
        report = compare_cpu_paths(args)
    else:
        report = run(args)
        print_table(report)
    if args.output_json:
        os.makedirs(os.path.dirname(args.output_json) or ".", exist_ok=True)
        with open(args.output_json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
