"""OLMo-2, the family added in one file (engine/models/families/olmo2.py), held against transformers'
Olmo2ForCausalLM on a tiny random checkpoint as test_hf_parity.py holds the others: greedy ids of four
prompts arriving at different steps, eagerly at page sizes 16 and 1 and through the compiled decode
graphs, and last-position logits of prefill and decode."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from conftest import TINY_COMMON
from helpers import engine_logits, get_engine, hf_greedy, hf_last_logits
from test_hf_parity import MODES, TINY_ARRIVALS, assert_logits_close, check_run, tiny_prompts

from engine.engine import Engine
from engine.models.families.olmo2 import Olmo2ForCausalLM

# The other tiny checkpoints' shapes (tests/conftest.py TINY_COMMON: GQA 4 query heads over 2 KV heads,
# head_dim 16, a large init so that greedy margins sit far above float32 noise).
CONFIG = dict(
    TINY_COMMON,
    vocab_size=352,
    num_hidden_layers=2,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
)


def build_olmo2(folder: str, **overrides: Any) -> str:
    """A random OLMo-2 saved with save_pretrained (safetensors); norms and biases randomised (HF leaves
    them at 1 and 0) so that one loaded into the wrong place, or not at all, changes the output."""
    from transformers import AutoModelForCausalLM, Olmo2Config

    torch.manual_seed(22)
    model = AutoModelForCausalLM.from_config(Olmo2Config(**{**CONFIG, **overrides}), dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(".bias"):
                param.normal_(0.0, 0.2)
            elif "norm" in name:
                param.copy_(1.0 + 0.3 * torch.randn_like(param))
    model.save_pretrained(folder, safe_serialization=True)
    return folder


def hf_model(folder: str) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager").eval()


@pytest.fixture(scope="module")
def olmo2(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Any, list[list[int]], list[list[int]]]:
    """(folder, HF model, prompts, HF greedy continuations)."""
    folder = build_olmo2(str(tmp_path_factory.mktemp("olmo2")))
    model = hf_model(folder)
    prompts = tiny_prompts(model.config.vocab_size)
    return folder, model, prompts, [hf_greedy(model, p) for p in prompts]


def test_the_checkpoint_has_what_makes_olmo2_olmo2(olmo2: tuple) -> None:
    """The HF side really norms q over the whole projection and norms after each sublayer (not before)."""
    _, model, _, _ = olmo2
    layer = model.model.layers[0]
    assert tuple(layer.self_attn.q_norm.weight.shape) == (CONFIG["num_attention_heads"] * 16,)
    assert not hasattr(layer, "input_layernorm") and hasattr(layer, "post_feedforward_layernorm")


@pytest.mark.parametrize("mode,page_size", MODES)
def test_olmo2_greedy_matches_hf(engine_cache: Callable[..., Engine], olmo2: tuple, mode: str, page_size: int) -> None:
    folder, _, prompts, expected = olmo2
    engine = get_engine(engine_cache, folder, mode, page_size)
    assert isinstance(engine.model, Olmo2ForCausalLM)
    check_run(engine, mode, prompts, TINY_ARRIVALS, expected)


@pytest.mark.parametrize("mode,page_size", [("eager", 1), ("graphs", 16)])
def test_olmo2_logits_match_hf(engine_cache: Callable[..., Engine], olmo2: tuple, mode: str, page_size: int) -> None:
    folder, model, _, _ = olmo2
    engine = get_engine(engine_cache, folder, mode, page_size)
    graph_steps = engine.runner.graph_steps
    prompts = tiny_prompts(model.config.vocab_size, seed=1)[1:]
    for ids in prompts:
        next_token = int(hf_last_logits(model, ids).argmax())
        prefill, decode = engine_logits(engine, ids, next_token)
        assert_logits_close(prefill, hf_last_logits(model, ids), f"olmo2 prefill of {len(ids)} tokens")
        assert_logits_close(decode, hf_last_logits(model, [*ids, next_token]), f"olmo2 decode at {len(ids) + 1}")
    if mode == "graphs":
        assert engine.runner.graph_steps == graph_steps + len(prompts)


def test_olmo2_with_attention_bias_matches_hf(tmp_path) -> None:
    """`attention_bias` puts a bias on o_proj too (OLMo-2's released checkpoints have none)."""
    from conftest import track

    from engine.sampling_params import SamplingParams

    folder = build_olmo2(str(tmp_path / "olmo2_bias"), attention_bias=True)
    model = hf_model(folder)
    assert model.model.layers[0].self_attn.o_proj.bias is not None
    engine = track(Engine(model=folder, device="cpu", dtype="float32", disable_graphs=True, kv_cache_tokens=512))
    prompt = tiny_prompts(model.config.vocab_size, seed=2)[3]
    out = engine.generate([prompt], SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))[0]
    assert out.token_ids == hf_greedy(model, prompt, 16)


def test_olmo2_refuses_tensor_parallelism_naming_why(olmo2: tuple) -> None:
    """Its q/k norms span every head, which ranks holding some of the heads cannot compute alone."""
    from transformers import AutoConfig

    from engine.distributed.state import TensorParallelState, building_for
    from engine.errors import ModelLoadError
    from engine.model_config import ModelConfig

    config = ModelConfig.from_hf(AutoConfig.from_pretrained(olmo2[0]))
    refused = pytest.raises(ModelLoadError, match=r"q/k norms span every head.*--tensor-parallel-size 1")
    with building_for(TensorParallelState(rank=0, world_size=2)), torch.device("meta"), refused:
        config.model_class(config)
