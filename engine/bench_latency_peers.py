"""Time to first token on the CPU beside HF transformers and llama.cpp, for `engine bench latency --peers`.

One prompt at a time (batch 1), each input length timed in alternating rounds: the engine, then HF transformers
in float32 and in bf16, then llama.cpp (llama-cpp-python, the same GGUF file and thread count), again and
again, so that a noisy shared machine slows every system alike; medians are reported. Time to first token is
the wall time from handing over the prompt ids to holding the first new token: for HF one forward pass and the
argmax of its last logits, for llama.cpp `eval` of the prompt and one sampled token.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from engine.bench import load_hf_model, load_llama_cpp
from engine.engine import Engine
from engine.sampling_params import SamplingParams

FirstToken = Callable[[list[int]], int]


def engine_first_token(engine: Engine) -> FirstToken:
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)

    def run(prompt: list[int]) -> int:
        return engine.generate([prompt], params)[0].token_ids[0]

    return run


def hf_first_token(model: Any) -> FirstToken:
    @torch.no_grad()
    def run(prompt: list[int]) -> int:
        logits = model(torch.tensor([prompt]), use_cache=True, logits_to_keep=1).logits
        return int(logits[0, -1].argmax())

    return run


def llama_cpp_first_token(llm: Any) -> FirstToken:
    def run(prompt: list[int]) -> int:
        llm.reset()
        llm.eval(prompt)
        return int(llm.sample(top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0))

    return run


def load_peers(args: Any, context: int) -> dict[str, FirstToken]:
    """The peers that can read this model: HF in float32 and bf16, llama.cpp for a GGUF file."""
    peers: dict[str, FirstToken] = {}
    for dtype in ("float32", "bfloat16"):
        model = load_hf_model(args.model, args.load_format, dtype)
        if model is not None:
            peers[f"HF {dtype}"] = hf_first_token(model)
    try:
        peers["llama.cpp"] = llama_cpp_first_token(load_llama_cpp(args.model, torch.get_num_threads(), context))
    except (ImportError, ValueError) as exc:
        print(f"llama.cpp left out: {exc}")
    return peers


def time_first_tokens(
    systems: dict[str, FirstToken], prompts: list[list[int]], rounds: int
) -> dict[str, dict[str, Any]]:
    """Per system: median seconds to the first token over `rounds` alternating rounds (a warm-up round first,
    untimed), each round a fresh prompt of the same length, and the first tokens each system gave."""
    seconds: dict[str, list[float]] = {name: [] for name in systems}
    tokens: dict[str, list[int]] = {name: [] for name in systems}
    for index, prompt in enumerate(prompts[: rounds + 1]):
        for name, first_token in systems.items():
            start = time.perf_counter()
            token = first_token(prompt)
            if index:
                seconds[name].append(time.perf_counter() - start)
                tokens[name].append(token)
    return {
        name: {"ttft_s": statistics.median(seconds[name]), "ttft_s_all": seconds[name], "first_tokens": tokens[name]}
        for name in systems
    }


def cpu_path(engine: Engine) -> str:
    """What the engine's prefill runs on this CPU: the ISA, the GGUF block kernels or the dense GEMM, and attention."""
    from backends.cpu.features import cpu_features
    from backends.cpu.gguf_linear import PREFILL_MIN_ROWS, describe_paths
    from backends.cpu.prefill_weights import has_prefill_copy

    methods = {getattr(getattr(m, "method", None), "name", "") for m in engine.model.modules()}
    gguf = sorted(name for name in methods if name.startswith("gguf"))
    dtype = str(engine.config.torch_dtype).replace("torch.", "")
    linear = f"GGUF block kernels ({', '.join(gguf)}; {describe_paths()})" if gguf else f"dense {dtype} GEMM"
    if has_prefill_copy(engine.model):
        linear = f"oneDNN bf16 GEMM over a packed bf16 copy (steps of >= {PREFILL_MIN_ROWS} rows; fewer: {linear})"
    rows = getattr(getattr(engine.model, "attention_backend", None), "bf16_prefill_rows", 0)
    attention = f"bf16 kernel (requests of >= {rows} new tokens; fewer: float32 SDPA)" if rows else "float32 SDPA"
    return (
        f"{cpu_features().describe()}, {torch.get_num_threads()} threads; model {dtype}; prefill linear: {linear}; "
        f"prefill attention: {attention}"
    )


def print_table(cases: list[dict[str, Any]], names: list[str]) -> None:
    peers = [n for n in names if n != "engine"]
    head = f"{'input':>6}{'engine ms':>11}{'prompt tok/s':>14}" + "".join(f"{n + ' ms':>17}" for n in peers)
    print(head + f"{'vs best peer':>14}")
    for case in cases:
        systems = case["systems"]
        engine_s = systems["engine"]["ttft_s"]
        best = min((systems[n]["ttft_s"] for n in peers), default=None)
        row = f"{case['input_len']:>6}{engine_s * 1e3:>11.1f}{case['input_len'] / engine_s:>14.0f}"
        row += "".join(f"{systems[n]['ttft_s'] * 1e3:>17.1f}" for n in peers)
        print(row + (f"{engine_s / best:>13.2f}x" if best else f"{'-':>14}"))
