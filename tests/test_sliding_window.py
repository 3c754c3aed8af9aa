"""Sliding-window attention (Mistral-7B-v0.1's 4096 tokens; here a tiny Mistral with a 24-token window).

Every query sees its last `window` positions. Held against HF transformers
(which applies the window) far past the window: prompts longer than it, long
generations, chunked prefill, page sizes 1 and 16, graphs on and off, prompts
arriving at different steps. A window on some layers only (Qwen2's
`max_window_layers`; Gemma 2's alternate layers, in test_hf_parity.py) is
each layer's own. Where the backend has no windows (HPU, NPU) the context
stops at the window, where full attention is exactly the windowed computation.
"""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch
from conftest import build_tiny_checkpoint, track
from helpers import run_staggered

from engine.engine import Engine
from engine.errors import InvalidRequestError
from engine.sampling_params import SamplingParams

WINDOW = 24


@pytest.fixture(scope="module")
def windowed_mistral(tmp_path_factory: pytest.TempPathFactory) -> str:
    return build_tiny_checkpoint("mistral", str(tmp_path_factory.mktemp("mistral_window")), sliding_window=WINDOW)


def hf_greedy(path: str, prompt: list[int], new_tokens: int) -> list[int]:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        out = hf.generate(
            torch.tensor([prompt]), max_new_tokens=new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0
        )
    return out[0, len(prompt) :].tolist()


@pytest.mark.parametrize("page_size,graphs", [(1, False), (16, False), (16, True)])
def test_windowed_attention_matches_transformers_past_the_window(
    windowed_mistral: str, page_size: int, graphs: bool
) -> None:
    engine = track(
        Engine(
            model=windowed_mistral,
            device="cpu",
            dtype="float32",
            page_size=page_size,
            kv_cache_tokens=2048,
            disable_graphs=not graphs,
            capture_sizes=[1, 2, 4],
            max_num_seqs=4,
            chunked_prefill_size=16,
            max_extend_step_ms=0,
            debug_kv_invariant=True,
        )
    )
    assert engine.max_model_len > 100  # the window no longer limits the context
    rng = random.Random(page_size)
    prompts = [[rng.randrange(3, 384) for _ in range(n)] for n in (40, 9, 70)]  # past, within, far past the window
    params = SamplingParams(max_tokens=36, temperature=0.0, ignore_eos=True)
    # Arriving at different steps, the last one chunked over five steps.
    got = run_staggered(engine, prompts, params, [0, 2, 5]).token_ids
    assert got == [hf_greedy(windowed_mistral, prompt, 36) for prompt in prompts]


def test_a_window_on_some_layers_only_matches_transformers_past_it(tmp_path) -> None:
    path = build_tiny_checkpoint(
        "qwen2", str(tmp_path / "qwen2_window"), use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1
    )
    engine = track(Engine(model=path, device="cpu", dtype="float32", disable_graphs=True, kv_cache_tokens=512))
    from engine.layers.attention import Attention

    assert [m.sliding_window for m in engine.model.modules() if isinstance(m, Attention)] == [None, WINDOW]
    prompt = [5, 17, 33, 2, 90, 41, 7, 250, 3, 11] * 4
    out = engine.generate([prompt], SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True))[0]
    assert out.token_ids == hf_greedy(path, prompt, 30)


def test_without_backend_windows_the_context_stops_at_the_window(
    windowed_mistral: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The fallback for backends without sliding windows (HPU, NPU), here the CPU backend with them off."""
    from engine.layers.torch_attention import TorchAttentionBackend

    no_window = dataclasses.replace(TorchAttentionBackend.capabilities, sliding_window=False)
    monkeypatch.setattr(TorchAttentionBackend, "capabilities", no_window)
    engine = track(
        Engine(model=windowed_mistral, device="cpu", dtype="float32", disable_graphs=True, kv_cache_tokens=512)
    )
    assert engine.max_model_len == WINDOW
    with pytest.raises(InvalidRequestError, match="sliding window"):
        engine.add_request(list(range(3, 3 + WINDOW)), SamplingParams(max_tokens=4))
    prompt = [5, 17, 33, 2, 90, 41, 7, 250, 3, 11]
    out = engine.generate([prompt], SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True))[0]
    assert out.finish_reason == "length" and len(prompt) + len(out.token_ids) == WINDOW
    assert out.token_ids == hf_greedy(windowed_mistral, prompt, len(out.token_ids))
