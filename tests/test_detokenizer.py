"""Incremental detokenization gives exactly the text of a full decode, step by step and at the end."""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import pytest

from engine.detokenizer import IncrementalDetokenizer
from engine.loader import resolve_model_source
from engine.sampling_params import SamplingParams
from engine.tokenizer import load_tokenizer


@pytest.fixture(scope="module")
def smol_tokenizer() -> Any:
    return load_tokenizer(resolve_model_source(None, "auto").tokenizer_dir)


def sequences(tokenizer: Any) -> list[list[int]]:
    """Random ids (byte fragments, invalid UTF-8, special tokens) and text with multi-byte characters."""
    rng = random.Random(0)
    text = tokenizer("héllo wörld 你好 😀👍🏽 naïve café — ok", add_special_tokens=False)["input_ids"]
    randoms = [[rng.randrange(tokenizer.vocab_size) for _ in range(rng.randint(1, 60))] for _ in range(60)]
    return [text, text * 3, *randoms]


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_text_so_far_is_always_a_prefix_and_the_flush_is_exact(smol_tokenizer: Any, skip_special_tokens: bool) -> None:
    for ids in sequences(smol_tokenizer):
        detokenizer = IncrementalDetokenizer(smol_tokenizer, skip_special_tokens)
        text = ""
        for end in range(1, len(ids) + 1):
            text += detokenizer.step(ids[:end])
            full = smol_tokenizer.decode(ids[:end], skip_special_tokens=skip_special_tokens)
            assert full.startswith(text), (ids[:end], text, full)
            # Only a trailing incomplete character (and what shares its token) is ever held back.
            assert text == full or full.endswith("\ufffd") or len(full) - len(text) <= 8
        assert detokenizer.flush(ids) == smol_tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


def test_engine_streams_add_up_to_the_full_decode(engine_cache: Callable[..., Any]) -> None:
    """Sampled SmolLM2 output (temperature 1: odd tokens, emoji): final text == decode(token ids), deltas add up."""
    engine = engine_cache(None)
    prompts = ["Write three emoji and a word in Chinese:", "Liste des mots accentués :", "Say hi"]
    params = [SamplingParams(max_tokens=40, temperature=1.0, seed=s, ignore_eos=True) for s in (1, 2, 3)]
    streamed: dict[str, str] = {}
    finals = {}
    for output in engine.stream(prompts, params):
        streamed[output.request_id] = streamed.get(output.request_id, "") + output.new_text
        if output.finished:
            finals[output.request_id] = output
    for request_id, output in finals.items():
        assert output.text == engine.tokenizer.decode(output.token_ids, skip_special_tokens=True)
        assert streamed[request_id] == output.text
