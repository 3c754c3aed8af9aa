"""`engine bench throughput`: N offline requests of random token ids and lengths (ignore_eos), HF's
`generate_batch` beside it.

    engine bench throughput --device cuda --model llama-3-8b --load-format dummy \
        --num-prompts 1000 --input-len 256,768 --output-len 128,384 --hf-requests 300 --output-json offline.json

(`python -m engine.bench_throughput` runs the same.) Prints a table and writes JSON: output and
total tokens/s, wall time, the time spent in prefill, decode and mixed steps (on CUDA along the
device's timeline; every step by kind and size class there, and with --profile-steps the kernels of a
window of steps) with the decode steps' count and mean batch, to hold against
`benchmarks/gpu_decode.py`'s replay times, and HF transformers' continuous-batching
`generate_batch` (paged sdpa) on the first --hf-requests of the same requests, in one process.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import statistics
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch

from engine.bench_args import add_renamed
from engine.bench_latency import matmul_params
from engine.cli import add_engine_args, engine_config_from_args
from engine.engine import Engine
from engine.profiling import time_by_name
from engine.sampling_params import SamplingParams
from graphs.cuda_graph_runner import CudaGraphRunner


def make_requests(
    count: int, input_len: tuple[int, int], output_len: tuple[int, int], vocab: int, seed: int
) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    return [
        ([rng.randrange(vocab) for _ in range(rng.randint(*input_len))], rng.randint(*output_len)) for _ in range(count)
    ]


def run_engine(
    engine: Engine, requests: list[tuple[list[int], int]], profile_steps: tuple[int, int] | None = None
) -> dict[str, Any]:
    """profile_steps (first, count): torch.profiler over those steps, their kernels grouped by name."""
    sync = engine.platform.synchronize
    runner = engine.runner.graph_runner
    graphs = runner if isinstance(runner, CudaGraphRunner) else None
    if graphs is not None:
        graphs.replay_events = []  # the device time of every decode graph, summed below
    timeline = _DeviceTimeline(engine) if engine.device.type == "cuda" else None
    for prompt, out_len in requests:
        engine.add_request(prompt, SamplingParams(max_tokens=out_len, temperature=0.0, ignore_eos=True))
    seconds = {"prefill": 0.0, "decode": 0.0, "mixed": 0.0}
    decode_steps = 0
    decode_batch: list[int] = []
    generated = 0
    sync()
    start = time.perf_counter()
    if timeline is not None:
        timeline.start()
    profiler = None
    step_index = 0
    while engine.has_unfinished():
        if profile_steps is not None and step_index == profile_steps[0]:
            profiler = _StepProfiler(engine)
        step_start = time.perf_counter()
        outputs = engine.step()
        elapsed = time.perf_counter() - step_start
        step_index += 1
        if profiler is not None and step_index == profile_steps[0] + profile_steps[1]:
            profiler.stop()
        generated += sum(len(o.new_token_ids) for o in outputs)
        if engine.last_step_was_decode:
            seconds["decode"] += elapsed
            decode_steps += 1
            decode_batch.append(len(outputs))
        else:
            seconds["prefill"] += elapsed  # the host cannot tell a mixed step's outputs apart
    sync()
    wall = time.perf_counter() - start
    if profiler is not None and profiler.kernels is None:
        profiler.stop()  # the run ended inside the window
    prompt_tokens = sum(len(p) for p, _ in requests)
    if timeline is not None:
        # With overlap, a step() call waits for the step before the one it launches, and a launch that
        # has to synchronize takes the previous step's time with it: on CUDA the split is taken from the
        # device's own timeline instead (from the end of one launched step's work to the end of the next).
        seconds = timeline.split()
    replay_s = None
    if graphs is not None and graphs.replay_events is not None:
        replay_s = sum(start_event.elapsed_time(end_event) for start_event, end_event in graphs.replay_events) / 1e3
        graphs.replay_events = None
    return {
        "requests": len(requests),
        "wall_s": wall,
        "output_tokens": generated,
        "output_tok_s": generated / wall,
        "total_tok_s": (generated + prompt_tokens) / wall,
        "prefill_steps_s": seconds["prefill"],
        "decode_steps_s": seconds["decode"],
        "mixed_steps_s": seconds["mixed"],  # decodes and prefill chunks in one step (mixed_steps)
        "decode_steps": decode_steps,
        "mean_decode_batch": statistics.mean(decode_batch) if decode_batch else 0.0,
        # Device time of the decode graphs themselves; decode_steps_s / this is the host's overhead.
        "decode_graph_replay_s": replay_s,
        "decode_steps_over_replay": seconds["decode"] / replay_s if replay_s else None,
        "step_classes": timeline.summary(2.0 * matmul_params(engine)) if timeline is not None else None,
        # Every launched step in order, (kind, decode rows, prefill tokens, device ms): where the slow ones fall.
        "steps": [list(step) for step in timeline.steps()] if timeline is not None else None,
        "profile": {"steps": list(profile_steps), "kernels": profiler.kernels} if profiler is not None else None,
    }


class _StepProfiler:
    """torch.profiler over a window of steps: on CUDA each kernel name's launches and device time, summed
    (CUPTI sees the kernels inside graph replays too); on the CPU host ops' self time."""

    def __init__(self, engine: Engine) -> None:
        from torch.profiler import ProfilerActivity, profile

        self.sync = engine.platform.synchronize
        self.on_gpu = engine.device.type == "cuda"
        self.kernels: list[dict[str, Any]] | None = None
        self.sync()
        self.profile = profile(activities=[ProfilerActivity.CUDA if self.on_gpu else ProfilerActivity.CPU])
        self.profile.__enter__()

    def stop(self) -> None:
        self.sync()
        self.profile.__exit__(None, None, None)
        self.kernels = [
            {"name": name, "launches": count, "ms": us / 1e3}
            for name, count, us in time_by_name(self.profile, self.on_gpu)
        ]


class _DeviceTimeline:
    """A CUDA event after every launched step: each step's share of the device timeline."""

    def __init__(self, engine: Engine) -> None:
        self.marks: list[tuple[str, torch.cuda.Event]] = []
        self.sizes: list[tuple[int, int]] = []  # per launched step: (decode rows, prefill tokens)
        self.origin = torch.cuda.Event(enable_timing=True)
        launch = engine.runner.launch

        def timed_launch(step, message, *args):
            sampled = launch(step, message, *args)
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks.append(("decode" if step.is_decode else "mixed" if step.is_mixed else "prefill", event))
            decode_rows = message.decode.batch_size if message.decode is not None else 0
            extend_tokens = len(message.extend.input_ids) if message.extend is not None else 0
            self.sizes.append((decode_rows, extend_tokens))
            return sampled

        engine.runner.launch = timed_launch  # type: ignore[method-assign]

    def start(self) -> None:
        self.origin.record()

    def split(self) -> dict[str, float]:
        """Seconds in prefill, decode and mixed steps along the device's timeline."""
        seconds = {"prefill": 0.0, "decode": 0.0, "mixed": 0.0}
        for kind, _, _, ms in self.steps():
            seconds[kind] += ms / 1e3
        return seconds

    def steps(self) -> list[tuple[str, int, int, float]]:
        """(kind, decode rows, prefill tokens, device ms) of every launched step."""
        torch.cuda.synchronize()
        rows = []
        previous = self.origin
        for (kind, event), (decode_rows, extend_tokens) in zip(self.marks, self.sizes):
            rows.append((kind, decode_rows, extend_tokens, previous.elapsed_time(event)))
            previous = event
        return rows

    def summary(self, flops_per_token: float) -> list[dict[str, Any]]:
        return step_classes(self.steps(), flops_per_token)


def step_classes(steps: list[tuple[str, int, int, float]], flops_per_token: float) -> list[dict[str, Any]]:
    """Steps (kind, decode rows, prefill tokens, device ms) grouped by kind and size class (tokens up to the
    next power of two): count, mean decode rows and prefill tokens, mean and total device time, and the
    matmul rate those tokens imply (flops_per_token: 2 x the parameters a token multiplies; attention not counted)."""
    classes: dict[tuple[str, int], list[tuple[int, int, float]]] = defaultdict(list)
    for kind, decode_rows, extend_tokens, ms in steps:
        tokens = decode_rows + extend_tokens
        size_class = 0 if tokens <= 0 else 1 << (tokens - 1).bit_length()
        classes[(kind, size_class)].append((decode_rows, extend_tokens, ms))
    table = []
    for (kind, size_class), members in sorted(classes.items()):
        total_ms = sum(ms for _, _, ms in members)
        tokens = sum(d + e for d, e, _ in members)
        table.append(
            {
                "kind": kind,
                "tokens_up_to": size_class,
                "steps": len(members),
                "mean_decode_rows": statistics.mean(d for d, _, _ in members),
                "mean_prefill_tokens": statistics.mean(e for _, e, _ in members),
                "mean_ms": total_ms / len(members),
                "median_ms": statistics.median(ms for _, _, ms in members),
                "max_ms": max(ms for _, _, ms in members),
                "total_s": total_ms / 1e3,
                "matmul_tflops": tokens * flops_per_token / (total_ms / 1e3) / 1e12 if total_ms else 0.0,
            }
        )
    return table


class _SyncReport:
    """Where the engine synchronizes with the device: torch's sync debug mode, one count per call site."""

    def __init__(self) -> None:
        import collections
        import traceback
        import warnings

        self.sites: collections.Counter = collections.Counter()
        self._previous = warnings.showwarning

        def record(message, category, filename, lineno, file=None, line=None):
            if "synchronizing CUDA operation" not in str(message):
                return self._previous(message, category, filename, lineno, file, line)
            ours = [
                f"{os.path.relpath(f.filename)}:{f.lineno} {f.name}"
                for f in traceback.extract_stack()
                if "/torch/" not in f.filename and "warnings" not in f.filename
            ][-3:]
            self.sites[" <- ".join(reversed(ours))] += 1

        warnings.showwarning = record
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")

    def stop(self) -> dict[str, int]:
        import warnings

        torch.cuda.set_sync_debug_mode("default")
        warnings.showwarning = self._previous
        return dict(self.sites.most_common())


def run_hf(
    model_name: str,
    load_format: str,
    dtype: str,
    device: str,
    requests: list[tuple[list[int], int]],
    sync: Callable[[], None],
) -> dict[str, Any]:
    """HF transformers' continuous batching on the same prompts; max_new_tokens = their mean output length.
    sync: the engine's platform's (waits for the device the model runs on)."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    from engine.loader.resolve import resolve_model_source

    source = resolve_model_source(model_name, load_format)
    torch_dtype = getattr(torch, dtype)
    load_start = time.perf_counter()
    if load_format == "dummy" or source.kind == "preset":
        # Random weights initialised on the device: on the host, 8B parameters took minutes (the reason
        # an earlier HF run never reached generate_batch within the call).
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(
                source.hf_config, dtype=torch_dtype, attn_implementation="paged|sdpa"
            )
    else:
        model = AutoModelForCausalLM.from_pretrained(source.path, dtype=torch_dtype, attn_implementation="paged|sdpa")
    model = model.to(device).eval()
    print(f"HF model ready in {time.perf_counter() - load_start:.1f} s", flush=True)
    new_tokens = int(statistics.mean(n for _, n in requests))
    generation = GenerationConfig(max_new_tokens=new_tokens, do_sample=False, eos_token_id=-1, pad_token_id=0)
    inputs = [prompt for prompt, _ in requests]
    model.generate_batch(inputs=inputs[:8], generation_config=generation)  # warm-up (graph capture, kernels)
    sync()
    start = time.perf_counter()
    outputs = model.generate_batch(inputs=inputs, generation_config=generation)
    sync()
    wall = time.perf_counter() - start
    generated = sum(len(o.generated_tokens) for o in outputs.values())
    del model
    gc.collect()
    return {
        "requests": len(inputs),
        "max_new_tokens": new_tokens,
        "wall_s": wall,
        "output_tokens": generated,
        "output_tok_s": generated / wall,
    }


def add_bench_throughput_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("bench throughput")
    add_renamed(group, "--num-prompts", "--num-requests", type=int, default=1000, help="requests to run")
    group.add_argument("--input-len", default="256,768", help="prompt lengths: N, or MIN,MAX drawn uniformly")
    group.add_argument("--output-len", default="128,384", help="output lengths: N, or MIN,MAX drawn uniformly")
    group.add_argument(
        "--hf-requests", type=int, default=300, help="HF generate_batch on the first N requests (0: skip)"
    )
    group.add_argument("--sync-report", action="store_true", help="CUDA: list where the engine waited for the device")
    group.add_argument(
        "--profile-steps",
        default=None,
        metavar="FIRST,COUNT",
        help="CUDA: torch.profiler over COUNT steps from step FIRST; prints the top kernels",
    )
    add_renamed(
        group,
        "--output-json",
        "--output",
        default="bench_results/offline_throughput.json",
        help="JSON file for the results",
    )


def _length_range(text: str) -> tuple[int, int]:
    values = [int(x) for x in text.split(",")]
    return (values[0], values[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_engine_args(parser)  # the engine's own flags: --model, --device, --dtype, --load-format, --max-num-seqs, ...
    add_bench_throughput_args(parser)
    cmd_bench_throughput(parser.parse_args())


def cmd_bench_throughput(args: argparse.Namespace) -> None:
    input_len, output_len = _length_range(args.input_len), _length_range(args.output_len)
    engine = Engine(engine_config_from_args(args, freeze_gc=args.freeze_gc is not False))  # shutdown() unfreezes
    dtype = engine.config.dtype
    requests = make_requests(
        args.num_prompts, input_len, output_len, engine.model_config.vocab_size, args.seed
    )  # --seed: the engine's flag
    report: dict[str, Any] = {
        "torch": torch.__version__,
        "device": args.device,
        "model": args.model,
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "input_len": input_len,
        "output_len": output_len,
        "tensor_parallel_size": engine.tp.world_size,
    }
    syncs = _SyncReport() if args.sync_report and torch.cuda.is_available() else None
    profile_steps = tuple(int(x) for x in args.profile_steps.split(",")) if args.profile_steps else None
    report["engine"] = run_engine(engine, requests, profile_steps)
    if syncs is not None:
        report["engine"]["host_syncs"] = syncs.stop()  # the timings of this run include the report's own cost
        for site, count in report["engine"]["host_syncs"].items():
            print(f"sync x{count}: {site}")
    engine_device, engine_sync = engine.device, engine.platform.synchronize
    engine.shutdown()  # tensor parallelism: the other ranks' GPUs are free before HF loads
    del engine
    gc.collect()
    torch.cuda.empty_cache() if torch.cuda.is_available() else None
    _write(args.output_json, report)  # the engine's figures survive a peer that runs out of time
    e = report["engine"]
    print(
        f"engine: {e['output_tok_s']:.0f} output tok/s, {e['total_tok_s']:.0f} total tok/s in {e['wall_s']:.1f} s; "
        f"prefill steps {e['prefill_steps_s']:.1f} s, decode steps {e['decode_steps_s']:.1f} s, "
        f"mixed steps {e['mixed_steps_s']:.1f} s "
        f"({e['decode_steps']} steps, mean batch {e['mean_decode_batch']:.0f}; graph replays "
        f"{e['decode_graph_replay_s'] or float('nan'):.1f} s, "
        f"steps/replays {e['decode_steps_over_replay'] or float('nan'):.2f})",
        flush=True,
    )
    if e["step_classes"]:
        print(
            f"{'step':<8}{'tokens <=':>10}{'steps':>7}{'decode rows':>12}{'prefill tok':>12}{'mean ms':>9}"
            f"{'median ms':>10}{'max ms':>9}{'total s':>9}{'matmul TFLOP/s':>15}"
        )
        for row in e["step_classes"]:
            print(
                f"{row['kind']:<8}{row['tokens_up_to']:>10}{row['steps']:>7}{row['mean_decode_rows']:>12.0f}"
                f"{row['mean_prefill_tokens']:>12.0f}{row['mean_ms']:>9.2f}{row['median_ms']:>10.2f}{row['max_ms']:>9.1f}"
                f"{row['total_s']:>9.2f}{row['matmul_tflops']:>15.0f}"
            )
    if e["profile"]:
        print(f"kernels of steps {e['profile']['steps'][0]}..+{e['profile']['steps'][1]} (device ms, launches):")
        for row in e["profile"]["kernels"][:30]:
            print(f"{row['ms']:10.2f} {row['launches']:7d}  {row['name'][:120]}")
    if args.hf_requests:
        report["hf_generate_batch"] = run_hf(
            args.model, args.load_format, dtype, str(engine_device), requests[: args.hf_requests], engine_sync
        )
    e = report["engine"]
    print(
        f"{'':<32}{'requests':>9}{'wall s':>9}{'out tok/s':>11}{'total tok/s':>12}{'prefill s':>10}{'decode s':>10}"
        f"{'mixed s':>9}"
    )
    print(
        f"{'engine':<32}{e['requests']:>9}{e['wall_s']:>9.1f}{e['output_tok_s']:>11.0f}{e['total_tok_s']:>12.0f}"
        f"{e['prefill_steps_s']:>10.1f}{e['decode_steps_s']:>10.1f}{e['mixed_steps_s']:>9.1f}"
    )
    if "hf_generate_batch" in report:
        h = report["hf_generate_batch"]
        print(f"{'HF generate_batch (paged|sdpa)':<32}{h['requests']:>9}{h['wall_s']:>9.1f}{h['output_tok_s']:>11.0f}")
    _write(args.output_json, report)


def _write(path: str, report: dict[str, Any]) -> None:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w", encoding="utf-8") as handle:
        json.dump(report, handle, indent=2)


if __name__ == "__main__":
    main()
