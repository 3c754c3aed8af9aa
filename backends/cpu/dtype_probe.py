"""Choose the CPU's default model dtype by measuring this CPU, not by guessing from its flags.

Decode streams every weight once per step, so bfloat16 halves the bytes read;
but where the CPU has no native bf16 dot product, oneDNN cannot pack bf16
weights and the matmuls are emulated. Measured on a 2-core EPYC without
AVX512: bf16 was 1.68x faster than float32 at batch 1 and 2.6x slower at
batch 16. With AVX512-BF16 it was faster at both. So the probe times the
engine's own linear path (`engine::linear`, oneDNN-packed where this CPU can
pack, the native GEMV where it applies) in both dtypes, at batch 1 and at the
largest batch the engine will run, over weights too big for the caches, and
picks the dtype whose worst slowdown against the better dtype at each batch
size is smallest (ties: float32, the exact one). The result is cached on disk
by CPU flags, torch version, thread count and batch size, so the probe's
~1 s is paid once per machine.
"""

from __future__ import annotations

import json
import logging
import os
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import nn

from backends.cpu.features import cpu_features
from engine.platform import cache_dir

logger = logging.getLogger(__name__)

PROBE_VERSION = 1
# Six 2048x2048 linears: 48 MiB in bf16, 96 MiB in float32, beyond any L3 of the machines here,
# so the probe streams weights from memory as a decode step does.
PROBE_LAYERS = 6
PROBE_DIM = 2048
CANDIDATES = (torch.bfloat16, torch.float32)


@dataclass
class DtypeChoice:
    dtype: str
    reason: str
    step_ms: dict[str, dict[str, float]]  # dtype -> batch size -> median ms of the probe step
    cached: bool = False


def _cache_path() -> Path:
    return Path(cache_dir("cpu_dtype_probe.json"))


def _cache_key(batch_sizes: list[int]) -> str:
    features = cpu_features()
    from backends.cpu.native import DISABLE_ENV
    from backends.cpu.packed_linear import PACKING_ENV

    parts = [
        f"v{PROBE_VERSION}",
        features.arch,
        ",".join(sorted(features.flags)),
        torch.__version__,
        f"threads={torch.get_num_threads()}",
        f"batches={batch_sizes}",
        f"packing={os.environ.get(PACKING_ENV, '1')}",
        f"native={os.environ.get(DISABLE_ENV, '1')}",
    ]
    return "|".join(parts)


def _time_step(layers: nn.Sequential, batch: int, dtype: torch.dtype, repeats: int = 5) -> float:
    x = torch.full((batch, PROBE_DIM), 0.01, dtype=dtype)
    timings = []
    with torch.no_grad():
        for index in range(repeats + 2):
            start = time.perf_counter()
            hidden = x
            for layer in layers:
                hidden = torch.ops.engine.linear(hidden, layer.weight, None)
            if index >= 2:  # two warm-up runs: oneDNN's JIT and first-touch page faults
                timings.append(time.perf_counter() - start)
    return statistics.median(timings) * 1000.0


def measure(batch_sizes: list[int]) -> dict[str, dict[str, float]]:
    """Median probe-step ms for every candidate dtype and batch size."""
    from backends.cpu.packed_linear import pack_linear_weights

    results: dict[str, dict[str, float]] = {}
    for dtype in CANDIDATES:
        layers = nn.Sequential(*[nn.Linear(PROBE_DIM, PROBE_DIM, bias=False, dtype=dtype) for _ in range(PROBE_LAYERS)])
        with torch.no_grad():
            for layer in layers:
                layer.weight.uniform_(-0.02, 0.02)
        pack_linear_weights(layers, batch_hint=max(batch_sizes), quiet=True)
        name = str(dtype).replace("torch.", "")
        results[name] = {str(batch): _time_step(layers, batch, dtype) for batch in batch_sizes}
        del layers
    return results


def decide(step_ms: dict[str, dict[str, float]]) -> tuple[str, str]:
    """(dtype, reason): the smallest worst-case slowdown over the probed batch sizes; float32 on a tie."""
    batches = list(next(iter(step_ms.values())))
    worst = {}
    for name, times in step_ms.items():
        worst[name] = max(times[b] / min(other[b] for other in step_ms.values()) for b in batches)
    best = min(worst.values())
    choice = "float32" if worst.get("float32") == best else min(worst, key=worst.get)
    detail = ", ".join(
        f"{name} " + "/".join(f"{step_ms[name][b]:.1f}" for b in batches) + f" ms (worst {worst[name]:.2f}x)"
        for name in step_ms
    )
    return choice, f"probe of {PROBE_LAYERS} {PROBE_DIM}x{PROBE_DIM} linears at batch {'/'.join(batches)}: {detail}"


def choose_dtype(max_batch: int) -> DtypeChoice:
    """The default dtype for an engine that decodes batches of 1..max_batch on this CPU."""
    batch_sizes = sorted({1, max(1, int(max_batch))})
    key = _cache_key(batch_sizes)
    path = _cache_path()
    try:
        cached = json.loads(path.read_text())
        if key in cached:
            entry = cached[key]
            return DtypeChoice(entry["dtype"], entry["reason"], entry["step_ms"], cached=True)
    except (OSError, ValueError, KeyError, TypeError):
        cached = {}
    start = time.perf_counter()
    step_ms = measure(batch_sizes)
    dtype, reason = decide(step_ms)
    choice = DtypeChoice(dtype, f"{reason}; measured in {time.perf_counter() - start:.1f} s", step_ms)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        cached = cached if isinstance(cached, dict) else {}
        entry = asdict(choice)
        entry.pop("cached")
        cached[key] = entry
        scratch = path.with_suffix(f".{os.getpid()}.tmp")
        scratch.write_text(json.dumps(cached, indent=1))
        os.replace(scratch, path)  # atomic: concurrent engines never read a half-written file
    except OSError as exc:
        logger.debug("could not cache the dtype probe: %s", exc)
    return choice
