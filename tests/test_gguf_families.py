"""GGUF beyond the embedded SmolLM2 file: Qwen2, Qwen3, Llama, Mistral (which llama.cpp writes as
"llama"), Gemma 2 and Gemma 3, from tiny float32 GGUF files written as llama.cpp lays them out
(tests/gguf_files.py), through the same weight loaders as safetensors. Held against transformers
on the safetensors checkpoint the GGUF was written from: greedy ids over 32 tokens, prompts
arriving at different steps."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from conftest import build_tiny_checkpoint, track
from gguf_files import write_gguf
from helpers import run_staggered

from engine.engine import Engine
from engine.errors import ModelLoadError
from engine.sampling_params import SamplingParams

# (tiny spec, overrides). Gemma's query scale is not in GGUF metadata: llama.cpp uses key_length. A Gemma 3
# GGUF cannot say which layers are global (llama.cpp fixes every sixth) nor the local rope base (10k).
GEMMA3_LAYOUT = {
    "num_hidden_layers": 6,
    "query_pre_attn_scalar": 16,
    "layer_types": ["sliding_attention"] * 5 + ["full_attention"],
}
FAMILIES = [
    ("qwen2", {}),
    ("qwen3", {}),
    ("llama_plain", {}),
    ("mistral", {}),
    ("gemma2", {"query_pre_attn_scalar": 16}),
    ("gemma3", GEMMA3_LAYOUT),
]


def hf_greedy(folder: str, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        return [
            model.generate(
                torch.tensor([p]), max_new_tokens=new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0
            )[0, len(p) :].tolist()
            for p in prompts
        ]


@pytest.fixture(autouse=True)
def private_gguf_cache(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ENGINE_CACHE_DIR", str(tmp_path / "cache"))


@pytest.mark.parametrize("name,overrides", FAMILIES, ids=[name for name, _ in FAMILIES])
def test_a_gguf_gives_the_tokens_of_its_safetensors_checkpoint(tmp_path, name: str, overrides: dict) -> None:
    folder = build_tiny_checkpoint(name, str(tmp_path / name), **overrides)
    path = write_gguf(folder, str(tmp_path / f"{name}.gguf"))
    engine = track(
        Engine(
            model=path,
            device="cpu",
            dtype="float32",
            disable_graphs=True,
            kv_cache_tokens=1024,
            page_size=16 if name != "qwen2" else 1,
            cpu_prefill_weights="gguf",  # exact float32 numerics, as HF's float32 (a bf16 prefill flips near-ties)
        )
    )
    assert engine.tokenizer is None  # these files carry no vocabulary: prompts are token ids
    vocab = engine.model_config.vocab_size
    generator = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, vocab, (n,), generator=generator).tolist() for n in (5, 40, 17)]
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    got = run_staggered(engine, prompts, params, [0, 1, 3]).token_ids
    assert got == hf_greedy(folder, prompts, 32)
    assert engine.kv_pages_in_use() == 0


def test_a_gguf_tensor_with_no_counterpart_is_refused_naming_it(tmp_path) -> None:
    import gguf

    folder = build_tiny_checkpoint("qwen2", str(tmp_path / "qwen2"))
    path = write_gguf(folder, str(tmp_path / "plain.gguf"))
    reader = gguf.GGUFReader(path)
    writer = gguf.GGUFWriter(str(tmp_path / "extra.gguf"), "qwen2")
    for key, field in reader.fields.items():
        if not key.startswith(("GGUF.", "general.architecture")):
            writer.add_key_value(
                key, field.contents(), field.types[0], field.types[-1] if len(field.types) > 1 else None
            )
    for tensor in reader.tensors:
        writer.add_tensor(tensor.name, np.array(tensor.data).reshape([int(d) for d in reversed(tensor.shape)]))
    writer.add_tensor("blk.0.mystery.weight", np.zeros(4, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelLoadError, match=r"GGUF tensor 'blk\.0\.mystery\.weight' has no counterpart in the qwen2"):
        Engine(
            model=str(tmp_path / "extra.gguf"), device="cpu", dtype="float32", disable_graphs=True, kv_cache_tokens=256
        )
    assert os.path.isfile(path)
