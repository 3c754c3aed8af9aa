"""`engine bench`: decode throughput of this engine next to HF transformers' `generate`.

Both sides get the same token-id prompts, greedy decoding, a fixed number of new tokens
and the same dtype, in one process with the same torch thread count. Only decode is
timed: prefill costs scale with the prompt, not with the graph machinery under test.
  engine: wall time from the step where every row has its first token (the prefill step)
          to the last token, over the tokens produced in between (streamed timestamps).
  HF:     the same span inside one generate(N), timestamped by a no-op logits processor that
          runs right after each forward; generate(N) - generate(1) is kept as a cross-check.
Both therefore time the same N - 1 decode steps per row, batch * (N - 1) tokens. Engine and
HF samples are interleaved per repeat so that load from other processes hits both alike.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from datetime import UTC, datetime
from typing import Any

import torch

from engine.bench_args import add_renamed

# Public-domain prose (Moby-Dick, ch. 1): real text gives realistic token ids; rows are
# different windows over it, so no two rows of a batch are the same prompt.
SOURCE_TEXT = (
    "Call me Ishmael. Some years ago - never mind how long precisely - having little or no money in my purse, and "
    "nothing particular to interest me on shore, I thought I would sail about a little and see the watery part of the "
    "world. It is a way I have of driving off the spleen and regulating the circulation. Whenever I find myself "
    "growing grim about the mouth; whenever it is a damp, drizzly November in my soul; whenever I find myself "
    "involuntarily pausing before coffin warehouses, and bringing up the rear of every funeral I meet; and especially "
    "whenever my hypos get such an upper hand of me, that it requires a strong moral principle to prevent me from "
    "deliberately stepping into the street, and methodically knocking people's hats off - then, I account it high time "
    "to get to sea as soon as I can. This is my substitute for pistol and ball. With a philosophical flourish Cato "
    "throws himself upon his sword; I quietly take to the ship. There is nothing surprising in this."
)

# A sample that got less than this share of its threads' CPU time was slowed by other processes.
CLEAN_SHARE = 0.8


def add_bench_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("bench")
    group.add_argument("--batch-sizes", default="1,16", help="comma-separated decode batch sizes")
    group.add_argument("--dtypes", default="float32,bfloat16", help="comma-separated dtypes (overrides --dtype)")
    group.add_argument("--input-len", type=int, default=64, help="prompt length in tokens")
    group.add_argument("--output-len", type=int, default=64, help="new tokens per row (>= 2)")
    group.add_argument("--repeats", type=int, default=3, help="timed samples per row; the median is reported")
    group.add_argument("--include-eager", action="store_true", help="also time the engine with graphs disabled")
    group.add_argument("--threads", type=int, default=None, help="torch threads for both sides (default: torch's own)")
    group.add_argument("--skip-hf", action="store_true", help="do not time HF transformers")
    group.add_argument(
        "--with-int8-activations",
        action="store_true",
        help="also time the engine with --gguf-activations int8 (GGUF blocks kept on the CPU)",
    )
    group.add_argument(
        "--with-gguf-activations",
        default="",
        help="comma-separated --gguf-activations values to time beside the engine's own (e.g. float32,int8)",
    )
    group.add_argument(
        "--llama-cpp",
        action="store_true",
        help="also time llama.cpp (llama-cpp-python) on the same GGUF file, at batch size 1",
    )
    group.add_argument(
        "--llama-cpp-extra-buffers",
        default="auto",
        choices=["auto", "on", "off"],
        help="llama.cpp's extra CPU buffer types (AMX, repacked weights); auto: off on a CPU with "
        "AMX-INT8, where ggml's AMX matmul faulted (SIGSEGV in ldtilecfg) on the 2026-12-02 VM",
    )
    add_renamed(
        group,
        "--output-json",
        "--output",
        default="bench_results/cpu_bench.json",
        help="JSON file for results and raw samples",
    )


def build_prompts(tokenizer: Any | None, batch_size: int, input_len: int, vocab_size: int) -> list[list[int]]:
    """`batch_size` different windows of exactly `input_len` real-text token ids."""
    if tokenizer is None:  # dummy weights / presets have no tokenizer: fixed pseudo-random ids instead
        return torch.randint(
            1, vocab_size, (batch_size, input_len), generator=torch.Generator().manual_seed(0)
        ).tolist()
    ids = list(tokenizer.encode(SOURCE_TEXT, add_special_tokens=False))
    stride = max(1, min(input_len // 4, (len(ids) - input_len) // max(1, batch_size - 1)))
    need = (batch_size - 1) * stride + input_len
    ids = ids * (need // len(ids) + 1)  # only repeats the text if a huge batch/length asks for it
    return [ids[row * stride : row * stride + input_len] for row in range(batch_size)]


def time_engine(engine: Any, prompts: list[list[int]], output_len: int) -> tuple[float, int, list[list[int]]]:
    """(decode seconds, decode tokens, output ids) for one batch through Engine.stream."""
    from engine.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    first_seen: set[str] = set()
    t_first = t_last = 0.0
    decode_tokens = 0
    outputs: dict[str, list[int]] = {}
    order: list[str] = []
    for out in engine.stream(prompts, params):
        now = time.perf_counter()
        if out.request_id not in outputs:
            order.append(out.request_id)
        outputs[out.request_id] = out.token_ids
        if len(first_seen) == len(prompts):
            decode_tokens += len(out.new_token_ids)  # produced after every row left prefill
            t_last = now
        else:
            first_seen.add(out.request_id)
            if len(first_seen) == len(prompts):
                t_first = now
    return t_last - t_first, decode_tokens, [outputs[r] for r in order]


def llama_cpp_extra_buffers(choice: str) -> bool:
    """Whether llama.cpp gets its extra CPU buffer types. auto: not where the CPU has AMX-INT8: ggml then
    puts Q4_0/Q4_1/Q8_0/K-quant matmuls in its AMX buffer, and on the 2026-12-02 VM that kernel died
    in ldtilecfg (SIGSEGV, whole process) at the first decode; without extra buffers SmolLM2's Q4_1
    runs ggml's vec_dot kernels (Q4_1 has no repacked layout, and the tied Q8_0 head sits in the
    input buffer either way)."""
    if choice != "auto":
        return choice == "on"
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as handle:
            flags = next((line.split() for line in handle if line.startswith("flags")), [])
    except OSError:
        flags = []
    return "amx_int8" not in flags


def load_llama_cpp(model_arg: str | None, threads: int, context: int, extra_buffers: bool = True) -> Any:
    """llama-cpp-python over the same GGUF file, with the same thread count (CPU only, no GPU layers).
    extra_buffers: llama_model_params.use_extra_bufts, which Llama() does not expose (set through the
    default parameters it starts from, restored after)."""
    import llama_cpp.llama_cpp as bindings
    from llama_cpp import Llama

    from engine.loader.resolve import default_model_path

    path = default_model_path() if model_arg is None else os.path.expanduser(model_arg)
    if not path.endswith(".gguf"):
        raise ValueError("--llama-cpp needs a GGUF model")
    defaults = bindings.llama_model_default_params

    def model_params() -> Any:
        params = defaults()
        params.use_extra_bufts = extra_buffers
        return params

    bindings.llama_model_default_params = model_params
    try:
        return Llama(
            model_path=path,
            n_threads=threads,
            n_threads_batch=threads,
            n_ctx=context,
            n_batch=512,
            n_gpu_layers=0,
            verbose=False,
            seed=0,
        )
    finally:
        bindings.llama_model_default_params = defaults


def time_llama_cpp(llm: Any, prompts: list[list[int]], output_len: int) -> tuple[float, int, list[list[int]]]:
    """(decode seconds, decode tokens, output ids) of one greedy generation per prompt, one at a time
    (llama-cpp-python's generate decodes one sequence): the same span as the engine's, from the first
    new token to the last."""
    seconds, tokens, outputs = 0.0, 0, []
    for prompt in prompts:
        llm.reset()
        ids, stamps = [], []
        for token in llm.generate(prompt, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0, reset=True):
            stamps.append(time.perf_counter())
            ids.append(int(token))
            if len(ids) == output_len:
                break
        seconds += stamps[-1] - stamps[0]
        tokens += len(ids) - 1
        outputs.append(ids)
    return seconds, tokens, outputs


class _StepClock:
    """A no-op logits processor that timestamps every generate step (called right after each forward)."""

    def __init__(self) -> None:
        self.stamps: list[float] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        self.stamps.append(time.perf_counter())
        return scores


def _hf_generate(
    model: Any, input_ids: torch.Tensor, mask: torch.Tensor, new_tokens: int, pad_id: int
) -> tuple[float, list[float], torch.Tensor]:
    from transformers import LogitsProcessorList

    clock = _StepClock()
    start = time.perf_counter()
    out = model.generate(
        input_ids=input_ids,
        attention_mask=mask,
        do_sample=False,
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        pad_token_id=pad_id,
        logits_processor=LogitsProcessorList([clock]),
    )
    return time.perf_counter() - start, clock.stamps, out[:, input_ids.shape[1] :]


def time_hf(
    model: Any, prompts: list[list[int]], output_len: int, pad_id: int
) -> tuple[float, int, list[list[int]], float]:
    """(decode seconds, decode tokens, output ids, decode seconds by generate(N) - generate(1)).

    The first figure spans step 1 (prefill) to step N, as the engine's does; the second is a
    cross-check that needs no hook into generate but carries the noise of two runs.
    """
    width = max(len(p) for p in prompts)
    # Left padding with a mask, as HF wants for batched decoder-only generate (a no-op when
    # every prompt has the same length, as here, but correct for ragged prompts).
    input_ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    prefill_s, _, _ = _hf_generate(model, input_ids, mask, 1, pad_id)
    total_s, stamps, out = _hf_generate(model, input_ids, mask, output_len, pad_id)
    if len(stamps) != output_len:
        raise RuntimeError(f"HF generate ran {len(stamps)} steps, expected {output_len}")
    return stamps[-1] - stamps[0], len(prompts) * (output_len - 1), out.tolist(), total_s - prefill_s


def load_hf_model(model_arg: str | None, load_format: str, dtype: str) -> Any | None:
    """The same weights through transformers, or None where HF cannot load them (presets, dummy)."""
    from transformers import AutoModelForCausalLM

    from engine.loader.resolve import default_model_path

    if load_format == "dummy":
        return None
    path = default_model_path() if model_arg is None else os.path.expanduser(model_arg)
    torch_dtype = getattr(torch, dtype)
    if path.endswith(".gguf"):
        folder, name = os.path.split(os.path.abspath(path))
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch_dtype)
    elif os.path.isdir(path):
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype)
    else:
        return None
    return model.eval()


def _stall_us(resource: str) -> int | None:
    """Microseconds some task waited on `resource` (Linux PSI: cpu, io); None where unavailable."""
    try:
        with open(f"/proc/pressure/{resource}", encoding="utf-8") as handle:
            return int(handle.readline().rsplit("total=", 1)[1])
    except (OSError, IndexError, ValueError):
        return None


def measure(
    name: str, system: Any, prompts: list[list[int]], output_len: int, pad_id: int
) -> tuple[dict[str, float], list[list[int]]]:
    """One timed sample, with how contended the box was while it ran (this box is shared)."""
    cpu0, wall0, stalls0 = time.process_time(), time.perf_counter(), {r: _stall_us(r) for r in ("cpu", "io")}
    extra: dict[str, float] = {}
    if name == "hf":
        seconds, tokens, ids, subtracted = time_hf(system, prompts, output_len, pad_id)
        extra = {"subtraction_seconds": subtracted, "subtraction_tok_s": tokens / subtracted}
    elif name == "llama.cpp":
        seconds, tokens, ids = time_llama_cpp(system, prompts, output_len)
    else:
        seconds, tokens, ids = time_engine(system, prompts, output_len)
    wall = time.perf_counter() - wall0
    # cpu_share: CPU time granted per thread-second of wall time; well below 1 means the sample
    # did not get both cores. *_pressure: fraction of wall time some task waited for a CPU / on I/O
    # (a low share with no pressure means the process was off-CPU for another reason).
    extra["cpu_share"] = (time.process_time() - cpu0) / (wall * torch.get_num_threads())
    for resource, before in stalls0.items():
        after = _stall_us(resource)
        if before is not None and after is not None:
            extra[f"{resource}_pressure"] = (after - before) / 1e6 / wall
    return {"seconds": seconds, "tokens": tokens, "tok_s": tokens / seconds, **extra}, ids


def _common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def machine_info() -> dict[str, Any]:
    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as handle:
            cpu = next((line.split(":", 1)[1].strip() for line in handle if line.startswith("model name")), cpu)
    except OSError:
        pass
    import transformers

    return {
        "cpu_model": cpu,
        "cpu_count": os.cpu_count(),
        "torch_num_threads": torch.get_num_threads(),
        "torch_version": torch.__version__,
        "transformers_version": transformers.__version__,
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "load_average_start": os.getloadavg(),
    }


def _row(system: str, dtype: str, bs: int, samples: list[dict[str, float]], output_len: int) -> dict[str, Any]:
    tok_s = statistics.median(s["tok_s"] for s in samples)
    ms_step = statistics.median(s["seconds"] * 1000 / (output_len - 1) for s in samples)
    row: dict[str, Any] = {
        "system": system,
        "dtype": dtype,
        "batch_size": bs,
        "tok_s": tok_s,
        "ms_per_step": ms_step,
        "best_tok_s": max(s["tok_s"] for s in samples),
        "cpu_share": statistics.median(s["cpu_share"] for s in samples),
        "samples": samples,
    }
    for key in ("cpu_pressure", "io_pressure"):
        values = [s[key] for s in samples if key in s]
        row[key] = statistics.median(values) if values else None
    return row


def print_table(rows: list[dict[str, Any]]) -> None:
    hf = {(r["dtype"], r["batch_size"]): r["tok_s"] for r in rows if r["system"] == "hf"}
    best_hf = {bs: max(v for (_, b), v in hf.items() if b == bs) for (_, bs) in hf}
    llama = {(r["dtype"], r["batch_size"]): r["tok_s"] for r in rows if r["system"] == "llama.cpp"}
    header = (
        f"{'system':<18}{'dtype':<10}{'batch':>6}{'tok/s':>9}{'best':>8}{'ms/step':>9}"
        f"{'vs HF':>8}{'vs best HF':>12}{'vs llama.cpp':>14}{'cpu share':>11}{'clean':>7}"
    )
    print(header + "\n" + "-" * len(header))
    for r in rows:
        ratio = r["tok_s"] / hf[(r["dtype"], r["batch_size"])] if (r["dtype"], r["batch_size"]) in hf else None
        best = r["tok_s"] / best_hf[r["batch_size"]] if r["batch_size"] in best_hf else None
        peer = llama.get((r["dtype"], r["batch_size"]))
        versus = r["tok_s"] / peer if peer and r["system"] != "llama.cpp" else None
        clean = f"{sum(x['cpu_share'] >= CLEAN_SHARE for x in r['samples'])}/{len(r['samples'])}"
        print(
            f"{r['system']:<18}{r['dtype']:<10}{r['batch_size']:>6}{r['tok_s']:>9.1f}{r['best_tok_s']:>8.1f}"
            f"{r['ms_per_step']:>9.1f}{(f'{ratio:.2f}x' if ratio else '-'):>8}{(f'{best:.2f}x' if best else '-'):>12}"
            f"{(f'{versus:.2f}x' if versus else '-'):>14}{r['cpu_share']:>11.2f}{clean:>7}"
        )
    print(
        "tok/s, ms/step: medians over repeats; best: fastest sample; vs best HF: against the faster HF dtype at that\n"
        "batch size; cpu share: median CPU time granted / (wall x threads); clean: samples with a share >= "
        f"{CLEAN_SHARE}.\nFewer clean samples than repeats: other processes took the cores; rerun on a quiet box."
    )


def cmd_bench(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from engine.capture_sizes import parse_sizes
    from engine.cli import engine_config_from_args
    from engine.engine import Engine

    batch_sizes, dtypes = parse_sizes(args.batch_sizes) or [], [d.strip() for d in args.dtypes.split(",") if d.strip()]
    if args.output_len < 2 or args.input_len < 1 or args.repeats < 1 or not batch_sizes:
        raise ValueError("need --output-len >= 2, --input-len >= 1, --repeats >= 1 and at least one batch size")
    if args.threads:
        torch.set_num_threads(args.threads)  # before any compile: inductor bakes the thread count into its kernels
    # Capture exactly the benchmarked sizes (each CPU capture is a compile) unless told otherwise.
    capture = args.capture_sizes or ",".join(str(b) for b in batch_sizes)
    max_seqs = args.max_num_seqs or max(batch_sizes)
    variants: list[tuple[str, dict[str, Any]]] = [
        ("engine-eager" if args.disable_graphs else "engine", {"disable_graphs": args.disable_graphs})
    ]
    if args.include_eager and not args.disable_graphs:
        variants.append(("engine-eager", {"disable_graphs": True}))
    extra = [a.strip() for a in args.with_gguf_activations.split(",") if a.strip()]
    for activations in extra + (["int8"] if args.with_int8_activations and "int8" not in extra else []):
        variants.append(
            (f"engine-{activations}act", {"disable_graphs": args.disable_graphs, "gguf_activations": activations})
        )
    if len(variants) > 1 and args.tensor_parallel_size > 1:
        raise ValueError(
            "--include-eager / --with-int8-activations / --with-gguf-activations build several engines at "
            "once; a process runs one tensor-parallel engine at a time"
        )
    results: dict[str, Any] = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "command": " ".join((["engine"] if os.path.basename(sys.argv[0]) == "engine" else sys.argv[:1]) + sys.argv[1:]),
        "machine": machine_info(),
        "settings": {
            "model": args.model or "embedded SmolLM2-135M-Instruct GGUF",
            "batch_sizes": batch_sizes,
            "dtypes": dtypes,
            "input_len": args.input_len,
            "output_len": args.output_len,
            "repeats": args.repeats,
            "capture_sizes": capture,
            "max_num_seqs": max_seqs,
            "greedy": True,
            "ignore_eos": True,
            "decode_timing": "from the step giving every row its first token (prefill) to the last token; "
            "engine: Engine.stream timestamps; hf: no-op logits processor timestamps "
            "(subtraction_*: generate(N) - generate(1))",
        },
        "rows": [],
    }
    rows: list[dict[str, Any]] = results["rows"]
    for dtype in dtypes:
        systems: dict[str, Any] = {}
        for name, overrides in variants:
            start = time.perf_counter()
            systems[name] = Engine(
                engine_config_from_args(args, dtype=dtype, capture_sizes=capture, max_num_seqs=max_seqs, **overrides)
            )
            results.setdefault("engine_build_seconds", {})[f"{name}/{dtype}"] = time.perf_counter() - start
        first = next(iter(systems.values()))
        tokenizer, vocab_size = first.tokenizer, first.model_config.vocab_size
        hf_model = None if args.skip_hf else load_hf_model(args.model, args.load_format, dtype)
        if hf_model is not None:
            systems["hf"] = hf_model
            # transformers keeps GGUF weights packed only where its `kernels` hub kernels load; record
            # which path ran (dense nn.Linear + sdpa here means it dequantized, as the engine does).
            results.setdefault("hf_model", {})[dtype] = {
                "attn_implementation": hf_model.config._attn_implementation,
                "packed_gguf_modules": sum("gguf" in type(m).__name__.lower() for m in hf_model.modules()),
            }
        if args.llama_cpp:
            extra = llama_cpp_extra_buffers(args.llama_cpp_extra_buffers)
            systems["llama.cpp"] = load_llama_cpp(
                args.model, torch.get_num_threads(), args.input_len + args.output_len + 8, extra
            )
            results["llama_cpp_version"] = __import__("llama_cpp").__version__
            results["llama_cpp_extra_buffers"] = extra
        candidates = (getattr(tokenizer, "pad_token_id", None), getattr(tokenizer, "eos_token_id", None))
        pad_id = next((i for i in candidates if i is not None), 0)  # prompts are equal-length: never read

        def runs_at(name: str, bs: int) -> bool:
            return name != "llama.cpp" or bs == 1  # one sequence at a time: batch 1 is its fair case

        samples: dict[tuple[str, int], list[dict[str, float]]] = {
            (s, b): [] for s in systems for b in batch_sizes if runs_at(s, b)
        }
        last_ids: dict[tuple[str, int], list[list[int]]] = {}
        bar = tqdm(total=len(samples) * args.repeats, desc=f"bench {dtype}", unit="run")
        for bs in batch_sizes:
            prompts = build_prompts(tokenizer, bs, args.input_len, vocab_size)
            here = {name: system for name, system in systems.items() if runs_at(name, bs)}
            for name, system in here.items():  # warm-up: allocator, prefill shapes, HF caches
                bar.set_postfix_str(f"warm-up {name} bs={bs}")
                measure(name, system, prompts, 2, pad_id)
            for _ in range(args.repeats):
                for name, system in here.items():  # interleaved so background load hits all alike
                    bar.set_postfix_str(f"{name} bs={bs}")
                    sample, ids = measure(name, system, prompts, args.output_len, pad_id)
                    samples[(name, bs)].append(sample)
                    last_ids[(name, bs)] = ids
                    bar.update()
        bar.close()
        for (name, bs), runs in samples.items():
            row = _row(name, dtype, bs, runs, args.output_len)
            if name != "hf" and ("hf", bs) in last_ids:
                # Sanity check that both sides did the same work: mean greedy tokens agreeing with HF
                # before the first divergence (bf16 rounding differences make early splits normal).
                pairs = zip(last_ids[(name, bs)], last_ids[("hf", bs)])
                row["mean_prefix_agreement_with_hf"] = statistics.mean(_common_prefix(a, b) for a, b in pairs)
            rows.append(row)
        for system in systems.values():
            if isinstance(system, Engine):
                system.shutdown()  # tensor parallelism: its ranks go before the next dtype's engine starts
        del systems, hf_model
    order = {
        "engine": 0,
        "engine-float32act": 1,
        "engine-int8x2act": 1,
        "engine-int8act": 1,
        "engine-eager": 2,
        "llama.cpp": 3,
        "hf": 4,
    }
    rows.sort(key=lambda r: (dtypes.index(r["dtype"]), r["batch_size"], order.get(r["system"], 3)))
    results["machine"]["load_average_end"] = os.getloadavg()
    print_table(rows)
    os.makedirs(os.path.dirname(os.path.abspath(args.output_json)), exist_ok=True)
    with open(args.output_json, "w", encoding="utf-8") as handle:
        json.dump(results, handle, indent=2)
    print(f"\nwrote {args.output_json}")
    return 0
