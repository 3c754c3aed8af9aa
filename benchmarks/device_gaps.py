"""Where the device waits during the offline run: idle gaps between kernels and what the host was doing.

    PYTHONPATH=. python benchmarks/device_gaps.py --device cuda --model llama-3-8b --load-format dummy \
        --skip-steps 4 --steps 6 --output docs/results/h200_device_gaps.json

Queues the offline benchmark's 1,000 requests (engine/bench_throughput.py's lengths), runs --skip-steps steps,
then times --steps steps without a profiler (host ms each, the allocator's counters around them) and the
same number under torch.profiler (CPU and CUDA). From the trace: the device's busy share, the CUDA runtime
calls by host time, every gap of more than --gap-ms between kernels with the host ops open at its start,
and the host ops inside each step that took more than --slow-op-ms (an op that waits for the device shows
here: it found cuBLAS blocking at a new LM-head row count, engine/logit_rows.py). Prints tables, writes JSON.
"""

from __future__ import annotations

import argparse
import collections
import json
import time
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

from engine.bench_args import add_renamed
from engine.bench_throughput import make_requests
from engine.cli import add_engine_args, engine_config_from_args
from engine.engine import Engine
from engine.sampling_params import SamplingParams

ALLOCATOR_COUNTERS = ("num_alloc_retries", "num_device_alloc", "num_device_free", "num_sync_all_streams")


def analyse(prof: profile, gap_us: float, slow_op_us: float) -> dict[str, Any]:
    events = prof.events()
    kernels = sorted(
        (e.time_range.start, e.time_range.end, e.name)
        for e in events
        if e.device_type == torch.autograd.DeviceType.CUDA
    )
    host = [
        (e.time_range.start, e.time_range.end, e.name) for e in events if e.device_type == torch.autograd.DeviceType.CPU
    ]
    runtime: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0])
    for start, end, name in host:
        if name.startswith("cu"):
            runtime[name][0] += 1
            runtime[name][1] += (end - start) / 1e3
    gaps = []
    if kernels:
        busy_until = kernels[0][1]
        for start, end, name in kernels[1:]:
            if start - busy_until > gap_us:
                open_ops = [n for s, e, n in host if s <= busy_until <= e and not n.startswith("cu")]
                gaps.append({"ms": (start - busy_until) / 1e3, "next_kernel": name[:80], "host_in": open_ops[-6:]})
            busy_until = max(busy_until, end)
    steps = sorted((s, e) for s, e, n in host if n == "STEP")
    slow_ops = []
    for index, (step_start, step_end) in enumerate(steps):
        inside = sorted((s, e, n) for s, e, n in host if step_start < s and e <= step_end)
        outer_end = -1.0
        for start, end, name in inside:  # outermost ops only
            if start >= outer_end:
                outer_end = end
                if end - start > slow_op_us:
                    slow_ops.append(
                        {"step": index, "op": name[:80], "at_ms": (start - step_start) / 1e3, "ms": (end - start) / 1e3}
                    )
    span = (kernels[-1][1] - kernels[0][0]) / 1e3 if kernels else 0.0
    return {
        "kernel_span_ms": span,
        "kernels": len(kernels),
        "gaps": gaps,
        "gap_total_ms": sum(g["ms"] for g in gaps),
        "step_host_ms": [(e - s) / 1e3 for s, e in steps],
        "slow_host_ops": slow_ops,
        "runtime_calls": sorted(([n, c, ms] for n, (c, ms) in runtime.items()), key=lambda r: -r[2])[:12],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_engine_args(parser)
    add_renamed(parser, "--num-prompts", "--num-requests", type=int, default=1000, help="requests queued")
    parser.add_argument("--skip-steps", type=int, default=4)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--gap-ms", type=float, default=0.3)
    parser.add_argument("--slow-op-ms", type=float, default=5.0)
    parser.add_argument("--output", default="")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA or ROCm GPU (the trace's device side)")
    engine = Engine(engine_config_from_args(args))
    for prompt, output_len in make_requests(
        args.num_prompts, (256, 768), (128, 384), engine.model_config.vocab_size, 0
    ):
        engine.add_request(prompt, SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True))
    for _ in range(args.skip_steps):
        engine.step()
    torch.cuda.synchronize()
    before = torch.cuda.memory_stats()
    unprofiled = []
    for _ in range(args.steps):
        started = time.perf_counter()
        engine.step()
        unprofiled.append((time.perf_counter() - started) * 1e3)
    torch.cuda.synchronize()
    after = torch.cuda.memory_stats()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(args.steps):
            with torch.profiler.record_function("STEP"):
                engine.step()
        torch.cuda.synchronize()
    report = analyse(prof, args.gap_ms * 1e3, args.slow_op_ms * 1e3)
    report.update(
        {
            "gpu": torch.cuda.get_device_name(),
            "torch": torch.__version__,
            "model": args.model,
            "unprofiled_step_host_ms": unprofiled,
            "allocator": {k: after.get(k, 0) - before.get(k, 0) for k in ALLOCATOR_COUNTERS},
        }
    )
    print(f"unprofiled steps, host ms: {[round(x, 1) for x in unprofiled]}; allocator over them: {report['allocator']}")
    print(
        f"profiled steps, host ms: {[round(x, 1) for x in report['step_host_ms']]}; kernels span "
        f"{report['kernel_span_ms']:.1f} ms"
    )
    print(f"device idle gaps > {args.gap_ms} ms: {len(report['gaps'])}, {report['gap_total_ms']:.1f} ms in all")
    for gap in report["gaps"][:20]:
        print(f"  {gap['ms']:7.2f} ms before {gap['next_kernel'][:40]:40s} host in: {' > '.join(gap['host_in'])}")
    print(f"host ops over {args.slow_op_ms} ms inside a step (outermost):")
    for op in report["slow_host_ops"][:40]:
        print(f"  step {op['step']}  at {op['at_ms']:7.1f} ms  {op['ms']:8.2f} ms  {op['op']}")
    print("CUDA runtime calls (count, host ms):")
    for name, count, ms in report["runtime_calls"]:
        print(f"  {name:40s} {count:7d} {ms:9.2f}")
    if args.output:
        with open(args.output, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
