"""How far FP8 weights move a real model: SmolLM2-135M-Instruct (its GGUF, dequantized to bf16 and saved as
safetensors) against itself with `--quantization fp8` (every linear but the LM head per output channel to
e4m3, as the H200 runs it), teacher-forced on the reference's own greedy tokens.

    PYTHONPATH=. python benchmarks/fp8_accuracy.py --device cpu --output bench_results/fp8_accuracy.json

At every position of the reference's greedy continuations (prompts x new tokens, 256 by default) both
engines see the same prefix (a prefill of the prompt, then one eager decode step per reference token), and the
table reports the top-1 agreement rate and the KL divergence KL(reference || variant) of the next-token
distributions (mean, 99th percentile, max), plus how many tokens each variant generates greedily before it
first leaves the reference. The reference computes in float32 over the bf16 weights; the variants:
- `fp8`: the same float32 compute over the FP8-rounded weights: the weight quantization error alone (on a
  CPU the FP8 weights are dequantized once; on CUDA the weight-only kernel computes exactly this in bf16);
- `bf16`: the unquantized weights computed in bf16: the yardstick, the error every bf16 engine already has;
- `fp8-w8a8`: the CUDA method's W8A8 path (per-token e4m3 activations, `torch._scaled_mm`), which the H200
  takes above 16 rows, forced at every row; off the GPU it is the same code on torch's CPU `_scaled_mm`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import shutil
import statistics
import tempfile
from collections.abc import Iterator
from typing import Any

import torch

from engine.engine import Engine
from engine.loader.resolve import default_model_path
from engine.request import Request
from engine.sampling_params import SamplingParams
from engine.scheduler import ScheduledStep
from engine.tokenizer import encode_prompt

PROMPTS = [
    "The capital of France is",
    "Write a short poem about the sea.",
    "List three prime numbers:",
    "Explain what a hash table is in one paragraph.",
    "def fibonacci(n):",
    "The three primary colours are",
    "Translate 'good morning' into Spanish:",
    "Once upon a time, in a small village,",
]


def bf16_checkpoint(gguf_path: str, folder: str) -> str:
    """The GGUF's weights dequantized to bf16, with its config and tokenizer, as an HF folder: the tensors under
    their HF names as the engine's own GGUF loader yields them (Q/K rows un-permuted, the tied LM head absent)."""
    from safetensors.torch import save_file

    from engine.loader.resolve import gguf_config_and_tokenizer
    from engine.loader.weights import gguf_weights

    config, tokenizer_folder = gguf_config_and_tokenizer(gguf_path)
    if tokenizer_folder is None:
        raise ValueError(f"{gguf_path} carries no tokenizer")
    shutil.copytree(tokenizer_folder, folder, dirs_exist_ok=True)  # tokenizer files and the config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.save_pretrained(folder)
    state = {name: tensor.to(torch.bfloat16).contiguous() for name, tensor in gguf_weights(gguf_path, config)}
    save_file(state, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
    return folder


@torch.no_grad()
def teacher_forced_logits(engine: Engine, prompt: list[int], continuation: list[int]) -> torch.Tensor:
    """[len(continuation), vocab] float32: the next-token logits after the prompt and after each reference
    token but the last, through the engine's own prefill and decode steps."""
    request = Request("fp8-accuracy-probe", list(prompt), SamplingParams(temperature=0.0))
    if not engine.kv_manager.allocate(request, len(prompt) + len(continuation)):
        raise RuntimeError("KV pool too small for the probe")
    rows = []
    try:
        step = ScheduledStep(False, [request], [len(prompt)])
        rows.append(engine.runner.logits(step, engine.step_builder.build(step))[-1].float().clone())
        request.num_cached_tokens = request.num_tokens
        for token in continuation[:-1]:
            request.output_token_ids.append(int(token))
            step = ScheduledStep(True, [request], [])
            rows.append(engine.runner.logits(step, engine.step_builder.build(step))[0].float().clone())
            request.num_cached_tokens = request.num_tokens
    finally:
        engine.kv_manager.release(request, cache=False)
    return torch.stack(rows)


def compare(reference: torch.Tensor, variant: torch.Tensor) -> tuple[list[bool], list[float]]:
    """Per position: same argmax, and KL(reference || variant) in nats."""
    log_p, log_q = reference.log_softmax(-1), variant.log_softmax(-1)
    kl = (log_p.exp() * (log_p - log_q)).sum(-1)
    return (reference.argmax(-1) == variant.argmax(-1)).tolist(), kl.tolist()


W8A8 = "fp8-w8a8"
VARIANTS: dict[str, dict[str, Any]] = {
    # the weight rounding alone: float32 compute over e4m3 weights (on CUDA the weight-only kernel and GEMV)
    "fp8": dict(dtype="float32", quantization="fp8"),
    # the W8A8 path (activations rounded to e4m3 per token, then torch._scaled_mm with row-wise scales) that
    # the CUDA method takes above 16 rows, forced at every row count (the probe's decode rows come one at a
    # time); off the GPU the same code runs: the CUDA method's torch quantizer and torch's CPU _scaled_mm
    W8A8: dict(dtype="bfloat16", quantization="fp8"),
    # the yardstick: unquantized weights computed in bf16, the error every bf16 engine already has
    "bf16": dict(dtype="bfloat16", quantization="none"),
}


@contextlib.contextmanager
def forced_w8a8(device: str) -> Iterator[None]:
    """The CUDA FP8 linear method, W8A8 at every row count, on `device` (the CPU's own FP8 method would
    dequantize the weights at load, which measures no activation rounding)."""
    from backends.cpu.platform import CpuPlatform
    from backends.cuda import fp8_linear

    saved = fp8_linear.WEIGHT_ONLY_MAX_ROWS, fp8_linear.GEMV_ONE_ROW, CpuPlatform.fp8_linear_method
    fp8_linear.WEIGHT_ONLY_MAX_ROWS, fp8_linear.GEMV_ONE_ROW = 0, False
    if not device.startswith("cuda"):
        CpuPlatform.fp8_linear_method = lambda self: fp8_linear.CUDA_FP8  # type: ignore[method-assign]
    try:
        yield
    finally:
        fp8_linear.WEIGHT_ONLY_MAX_ROWS, fp8_linear.GEMV_ONE_ROW, CpuPlatform.fp8_linear_method = saved


def measure(device: str, new_tokens: int, prompts: list[str], variants: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Teacher-force every variant over the float32 reference's greedy continuations; the report's
    "variants" hold top-1 agreement, KL(reference || variant) mean / p99 / max and free-running prefixes."""
    # Eager steps: the figures are about the weights, and compiling three engines on two cores costs minutes.
    common = dict(device=device, kv_cache_tokens=4096, warmup=False, enable_prefix_caching=False, disable_graphs=True)
    with tempfile.TemporaryDirectory() as folder:
        bf16_checkpoint(default_model_path(), folder)
        reference = Engine(model=folder, dtype="float32", quantization="none", **common)
        tokenizer = reference.tokenizer
        encoded = [encode_prompt(tokenizer, p, chat=True) for p in prompts]
        greedy = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
        continuations = [out.token_ids for out in reference.generate(encoded, greedy)]
        want = [teacher_forced_logits(reference, p, c) for p, c in zip(encoded, continuations)]
        del reference
        report: dict[str, Any] = {
            "model": "SmolLM2-135M-Instruct (GGUF Q4_1 dequantized to bf16)",
            "device": device,
            "torch": torch.__version__,
            "positions": sum(len(c) for c in continuations),
            "variants": {},
        }
        for name, options in variants.items():
            with forced_w8a8(device) if name == W8A8 else contextlib.nullcontext():
                engine = Engine(model=folder, **options, **common)
                agree: list[bool] = []
                kls: list[float] = []
                for prompt, continuation, ref in zip(encoded, continuations, want):
                    a, k = compare(ref, teacher_forced_logits(engine, prompt, continuation))
                    agree += a
                    kls += k
                free = [out.token_ids for out in engine.generate(encoded, greedy)]
                del engine
            same_prefix = [
                next((i for i, (x, y) in enumerate(zip(f, c)) if x != y), len(c)) for f, c in zip(free, continuations)
            ]
            kls_sorted = sorted(kls)
            report["variants"][name] = {
                **options,
                "top1_agreement": sum(agree) / len(agree),
                "kl_mean": statistics.fmean(kls),
                "kl_p99": kls_sorted[min(len(kls) - 1, math.ceil(0.99 * len(kls)) - 1)],
                "kl_max": kls_sorted[-1],
                "greedy_tokens_before_first_difference": same_prefix,
            }
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])  # its first sentence is three lines
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--output", default="bench_results/fp8_accuracy.json")
    args = parser.parse_args()
    torch.manual_seed(0)
    report = measure(args.device, args.new_tokens, PROMPTS, VARIANTS)
    print(
        f"{report['positions']} teacher-forced positions over {len(PROMPTS)} prompts; "
        "reference: float32 over bf16 weights"
    )
    print(
        f"{'variant':8} {'top-1 agree':>12} {'KL mean':>10} {'KL p99':>10} {'KL max':>10}  "
        "greedy tokens before the first difference"
    )
    for name, row in report["variants"].items():
        print(
            f"{name:8} {row['top1_agreement']:>12.4f} {row['kl_mean']:>10.2e} {row['kl_p99']:>10.2e} "
            f"{row['kl_max']:>10.2e}  "
            f"{row['greedy_tokens_before_first_difference']}"
        )
    os.makedirs(os.path.dirname(args.output) or ".", exist_ok=True)
    with open(args.output, "w", encoding="utf-8") as handle:
        json.dump(report, handle, indent=1)
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
