"""A model whose attention has a sliding window (Mistral-7B-v0.1: 4096 tokens).

Sliding-window attention is not implemented yet, so the engine stops the
context at the window, where full causal attention computes exactly what the
window does: every key of every position is inside it. Held against HF
transformers (which applies the window) on a tiny Mistral with a 24-token window.
"""

from __future__ import annotations

import pytest
import torch

from engine.engine import Engine
from engine.errors import InvalidRequestError
from engine.sampling_params import SamplingParams
from tests.conftest import build_tiny_checkpoint, track

WINDOW = 24


@pytest.fixture(scope="module")
def windowed_mistral(tmp_path_factory: pytest.TempPathFactory) -> str:
    return build_tiny_checkpoint("mistral", str(tmp_path_factory.mktemp("mistral_window")), sliding_window=WINDOW)


def test_context_stops_at_the_window_with_the_tokens_of_transformers(windowed_mistral: str) -> None:
    from transformers import AutoModelForCausalLM

    engine = track(Engine(model=windowed_mistral, device="cpu", dtype="float32", disable_graphs=True, kv_cache_tokens=512))
    assert engine.model_config.sliding_window == WINDOW and engine.max_model_len == WINDOW
    prompt = [5, 17, 33, 2, 90, 41, 7, 250, 3, 11]
    out = engine.generate([prompt], SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True))[0]
    assert out.finish_reason == "length" and len(prompt) + len(out.token_ids) == WINDOW

    hf = AutoModelForCausalLM.from_pretrained(windowed_mistral, dtype=torch.float32).eval()
    with torch.no_grad():
        want = hf.generate(torch.tensor([prompt]), max_new_tokens=len(out.token_ids), do_sample=False,
                           eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
    assert out.token_ids == want


def test_a_prompt_past_the_window_is_refused_naming_it(windowed_mistral: str) -> None:
    engine = track(Engine(model=windowed_mistral, device="cpu", dtype="float32", disable_graphs=True, kv_cache_tokens=512))
    with pytest.raises(InvalidRequestError, match="sliding window"):
        engine.add_request(list(range(3, 3 + WINDOW)), SamplingParams(max_tokens=4))
    assert engine.kv_pages_in_use() == 0
