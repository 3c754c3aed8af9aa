"""Helpers shared by the test files (plain functions; fixtures live in conftest.py)."""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from engine.engine import Engine
from engine.request import Request, RequestOutput
from engine.sampling_params import SamplingParams
from engine.scheduler import ScheduledStep

NEW_TOKENS = 32


def hpu_device_config(**hpu: Any) -> dict[str, Any]:
    """configs/hpu.yaml with these keys of its hpu: section replaced (a bucket range as (min, step, max)): what
    an engine's resolved device_config holds, for HPU runners built in a test."""
    from engine.platform import CONFIG_DIR, load_yaml_config

    config = load_yaml_config(f"{CONFIG_DIR}/hpu.yaml")
    ranges = {k: dict(zip(("min", "step", "max"), v)) if isinstance(v, tuple) else v for k, v in hpu.items()}
    return {**config, "hpu": {**config["hpu"], **ranges}}


def graph_options(page_size: int, capture_sizes: str = "1,2,4") -> dict[str, Any]:
    """Options of a shared graph engine: max_num_seqs equals the largest capture size.

    Strict: a recompile while serving raises RecompileError, in whichever test it happens.
    """
    largest = max(int(s) for s in capture_sizes.split(","))
    return dict(
        page_size=page_size, capture_sizes=capture_sizes, max_num_seqs=largest, disable_graphs=False, strict_graphs=True
    )


# The two step loops: the CPU default (each step's tokens read before the next is scheduled, decode and prefill
# in steps of their own) and the CUDA default (step N+1 launched before step N's tokens are read, decode rows
# and prefill chunks in one step), with the KV invariant checked after every step. A test of something the
# loop could change (tokens, stops, retraction, failure isolation) runs under both.
LOOPS: dict[str, dict[str, Any]] = {
    "sync": {},
    "overlap+mixed": {"overlap_schedule": True, "mixed_steps": True, "debug_kv_invariant": True},
}


def get_engine(
    engine_cache: Callable[..., Engine], model: str | None, mode: str, page_size: int, **options: Any
) -> Engine:
    """The shared engine of a (model, eager|graphs, page size) case; max 4 sequences in both modes."""
    if mode == "graphs":
        return engine_cache(model, **graph_options(page_size), **options)
    return engine_cache(model, page_size=page_size, max_num_seqs=4, **options)


def greedy(max_tokens: int = NEW_TOKENS, **kwargs: Any) -> SamplingParams:
    """Greedy decoding that never stops early (the HF side has EOS disabled to match)."""
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kwargs)


@torch.no_grad()
def hf_greedy(model: Any, prompt_ids: Sequence[int], new_tokens: int = NEW_TOKENS, **generation: Any) -> list[int]:
    """HF transformers generate(do_sample=False) of exactly `new_tokens` tokens for one prompt.

    Prompts run one at a time (no padding). EOS is disabled in the generation config: with an EOS
    id set, min_new_tokens masks the EOS logit to -inf, which changes the argmax wherever EOS
    would win, while our ignore_eos only keeps going; without one both sides take the plain argmax.
    """
    # generate() fills unset (None) fields from model.generation_config, so EOS is switched off
    # there, for the duration of the call.
    saved_eos = model.generation_config.eos_token_id
    config = copy.deepcopy(model.generation_config)
    config.eos_token_id = None
    config.do_sample = False
    config.max_new_tokens = new_tokens
    config.min_new_tokens = new_tokens
    for name, value in generation.items():  # e.g. repetition_penalty
        setattr(config, name, value)
    input_ids = torch.tensor([list(prompt_ids)], dtype=torch.long)
    try:
        model.generation_config.eos_token_id = None
        out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), generation_config=config)
    finally:
        model.generation_config.eos_token_id = saved_eos
    tokens = out[0, input_ids.shape[1] :].tolist()
    assert len(tokens) == new_tokens
    return tokens


@torch.no_grad()
def hf_last_logits(model: Any, token_ids: Sequence[int]) -> torch.Tensor:
    """HF logits [vocab] (float32) at the last position of one unpadded sequence."""
    return model(torch.tensor([list(token_ids)], dtype=torch.long)).logits[0, -1].float()


class StepRecorder:
    """Records (is_decode, batch size) of every step the engine's scheduler hands out, and for each
    the number of its decode requests (`num_decodes`: > 0 in an extend step means a mixed step).

    Wraps Scheduler.schedule on this one engine instance (observation only: the scheduled step
    is returned unchanged); use as a context manager.
    """

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.steps: list[tuple[bool, int]] = []
        self.num_decodes: list[int] = []
        self.num_tokens: list[int] = []  # tokens each step runs (a decode row is one)

    @property
    def extend_sizes(self) -> list[int]:
        """Requests prefilling in each step that prefills (a mixed step's decodes not counted)."""
        return [size - n for (is_decode, size), n in zip(self.steps, self.num_decodes) if not is_decode]

    @property
    def decode_sizes(self) -> list[int]:
        return [size for is_decode, size in self.steps if is_decode]

    def __enter__(self) -> StepRecorder:
        scheduler = self.engine.scheduler
        original = scheduler.schedule

        def schedule():
            step = original()
            if step is not None:
                self.steps.append((step.is_decode, len(step.requests)))
                self.num_decodes.append(step.num_decodes)
                self.num_tokens.append(step.num_decodes + sum(step.extend_lens))
            return step

        scheduler.schedule = schedule  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc: object) -> None:
        del self.engine.scheduler.schedule  # back to the class's method


@dataclass
class StaggeredRun:
    outputs: list[RequestOutput]
    decode_sizes: list[int] = field(default_factory=list)  # batch size of every decode step, in order
    recorder: StepRecorder | None = None  # every step the scheduler handed out (kinds, sizes, decodes)

    @property
    def token_ids(self) -> list[list[int]]:
        return [o.token_ids for o in self.outputs]


def run_staggered(
    engine: Engine,
    prompts: Sequence[str | list[int]],
    params: SamplingParams | Sequence[SamplingParams],
    arrivals: Sequence[int],
    max_steps: int = 2000,
) -> StaggeredRun:
    """Add prompt i just before step arrivals[i] (add_request between step() calls); run to the end."""
    per_prompt = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
    index_of: dict[str, int] = {}
    finals: dict[int, RequestOutput] = {}
    step = 0
    with StepRecorder(engine) as recorder:
        while len(finals) < len(prompts):
            for i, arrival in enumerate(arrivals):
                if arrival == step:
                    index_of[engine.add_request(prompts[i], per_prompt[i])] = i
            for output in engine.step():
                if output.finished:
                    finals[index_of[output.request_id]] = output
            step += 1
            assert step < max_steps, "requests did not finish"
    return StaggeredRun([finals[i] for i in range(len(prompts))], recorder.decode_sizes, recorder)


@torch.no_grad()
def engine_logits(engine: Engine, token_ids: Sequence[int], next_token: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Our logits [vocab] at the last prompt position (prefill) and after feeding next_token (decode).

    Goes through engine.runner.logits with hand-built ScheduledSteps (and their messages), so the decode step takes the
    graph runner when the engine has one; pages come from (and go back to) the engine's allocator.
    """
    request = Request("logits-probe", list(token_ids), SamplingParams(temperature=0.0))
    kv = engine.kv_manager
    # Through the KV manager, which evicts cached pages of earlier tests when the pool is full.
    assert kv.allocate(request, len(token_ids) + 1), "KV pool too small for the probe"
    try:
        step = ScheduledStep(False, [request], [len(token_ids)])
        prefill = engine.runner.logits(step, engine.step_builder.build(step))[-1].clone()
        request.num_cached_tokens = request.num_tokens
        request.output_token_ids.append(int(next_token))
        step = ScheduledStep(True, [request], [])
        decode = engine.runner.logits(step, engine.step_builder.build(step))[0].clone()
    finally:
        kv.release(request, cache=False)  # frees its persistent decode row too
    return prefill, decode


def repeats(tokens: Sequence[int]) -> int:
    """How many tokens repeat an earlier token of the same sequence."""
    return len(tokens) - len(set(tokens))


def load_tiny_llama(folder: str, num_hidden_layers: int = 2) -> tuple[Any, Any]:
    """(model, ModelConfig) of a small random Llama saved to folder and loaded on the CPU in float32: the
    vendor-backend tests' model (4 heads over 2 KV heads, so GQA is exercised)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from engine.loader import load_model, resolve_model_source

    config = LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        initializer_range=0.2,
        max_position_embeddings=512,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(folder)
    return load_model(resolve_model_source(folder), torch.float32, torch.device("cpu"))
