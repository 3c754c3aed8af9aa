"""LoRA adapters against HF PEFT on the same weights: one batch mixing four adapters and base-model rows gives
PEFT's greedy ids for every row; loading and unloading at run time; bad adapters refused by name."""

from __future__ import annotations

import os
from typing import Any

import peft
import pytest
import torch

from engine.engine import Engine
from engine.errors import InvalidRequestError
from engine.sampling_params import SamplingParams
from tests.conftest import release_cached, track
from tests.helpers import hf_greedy

NEW_TOKENS = 12
# Four adapters over different module sets and ranks (one at the maximum), alpha differing from the rank.
ADAPTERS = {
    "attn": dict(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]),
    "mlp": dict(r=4, lora_alpha=4, target_modules=["gate_proj", "up_proj", "down_proj"]),
    "all": dict(
        r=16,
        lora_alpha=32,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    ),
    "qv_rs": dict(r=2, lora_alpha=8, target_modules=["q_proj", "v_proj"], use_rslora=True),
}


@pytest.fixture(scope="module")
def adapters(tiny_llama: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """name -> a PEFT folder of random A and B (init_lora_weights=False: B is not zero) for the tiny llama."""
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("lora")
    folders = {}
    for seed, (name, options) in enumerate(ADAPTERS.items()):
        torch.manual_seed(100 + seed)
        base = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)
        model = peft.get_peft_model(base, peft.LoraConfig(init_lora_weights=False, lora_dropout=0.0, **options))
        with torch.no_grad():  # peft's random init is small; larger B makes every adapter change the tokens
            for param_name, param in model.named_parameters():
                if "lora_B" in param_name:
                    param.normal_(0.0, 0.3)
        folders[name] = str(root / name)
        model.save_pretrained(folders[name])
    return folders


def _peft_greedy(tiny_llama: str, folder: str | None, prompt: list[int]) -> list[int]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32, attn_implementation="eager")
    if folder is not None:
        model = peft.PeftModel.from_pretrained(model, folder)
    return hf_greedy(model.eval(), prompt, NEW_TOKENS)


def _engine(tiny_llama: str, **options: Any) -> Engine:
    return track(
        Engine(
            model=tiny_llama,
            device="cpu",
            dtype="float32",
            page_size=16,
            kv_cache_tokens=2048,
            max_num_seqs=16,
            debug_kv_invariant=True,
            **options,
        )
    )


@pytest.mark.parametrize("mode", ["eager", "graphs", "graphs-folded"])
def test_one_batch_of_four_adapters_and_base_rows_gives_pefts_tokens(
    mode: str, tiny_llama: str, adapters: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Eager, and in the CPU's compiled decode graphs (15 rows replay the graph of 16, its padding row a base row);
    "folded": every projection's A folded into its base weight (as on CUDA: plain weights, not oneDNN-packed
    ones; and no limit on the slots' rows, which the tiny model's narrow projections would exceed)."""
    import engine.lora.layers as lora_layers
    from backends.cpu.packed_linear import PACKING_ENV

    if mode.endswith("folded"):
        monkeypatch.setenv(PACKING_ENV, "0")
        monkeypatch.setattr(lora_layers, "FOLD_MAX_FRACTION", 0)
    modules = ",".join(f"{name}={path}" for name, path in adapters.items())
    graphs = {"disable_graphs": True} if mode == "eager" else {"capture_sizes": "16"}
    engine = _engine(tiny_llama, lora_modules=modules, max_lora_rank=16, **graphs)
    assert engine.lora_adapters() == adapters
    assert engine.lora is not None
    folded = {layer.method.folded for layer in engine.lora.projections.values()}  # type: ignore[attr-defined]
    assert folded == {mode.endswith("folded")}
    prompts = [[5, 17, 99, 23, 8, 41], [200, 3, 77, 77, 12], [9, 8, 7, 6, 5, 4, 3, 150]]
    cases = [(name, prompt) for name in [None, *adapters] for prompt in prompts]
    params = [
        SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True, lora_name=name) for name, _ in cases
    ]
    outputs = engine.generate([prompt for _, prompt in cases], params)  # one batch: 15 rows, 5 kinds
    for (name, prompt), output in zip(cases, outputs):
        want = _peft_greedy(tiny_llama, adapters[name] if name else None, prompt)
        assert output.token_ids == want, (name, prompt)
    if mode == "graphs":
        assert engine.runner.graph_steps > 0, engine.runner.describe()
    # The adapters do change the model (a test that cannot fail otherwise).
    base = [o.token_ids for (name, _), o in zip(cases, outputs) if name is None]
    for adapter in adapters:
        assert [o.token_ids for (name, _), o in zip(cases, outputs) if name == adapter] != base, adapter
    engine.shutdown()


def test_more_adapters_than_slots_take_turns_in_them(tiny_llama: str, adapters: dict[str, str]) -> None:
    """One device slot, four adapters in host memory (vLLM's --max-cpu-loras): a batch asking for all four and
    the base model runs them in turns (a request waits while its adapter has no slot, and the least recently
    used adapter no request holds gives its slot up), each with PEFT's tokens; the KV invariant holds."""
    engine = _engine(tiny_llama, enable_lora=True, max_loras=1, max_cpu_loras=4, max_lora_rank=16, disable_graphs=True)
    for name, path in adapters.items():
        engine.load_lora_adapter(name, path)
    assert engine.lora is not None and list(engine.lora.slots) == ["attn"]  # the first took the free slot
    prompt = [5, 17, 99, 23, 8, 41]
    names = [None, *adapters, "attn"]
    params = [SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True, lora_name=n) for n in names]
    outputs = engine.generate([prompt] * len(names), params)
    for name, output in zip(names, outputs):
        assert output.token_ids == _peft_greedy(tiny_llama, adapters[name] if name else None, prompt), name
    # The waiting adapters took the slot in the order they were asked for: the last of them holds it now.
    assert list(engine.lora.slots) == ["qv_rs"] and not engine._lora_waiting
    engine.shutdown()


def test_prefix_cache_never_shares_kv_between_adapters(tiny_llama: str, adapters: dict[str, str]) -> None:
    engine = _engine(tiny_llama, enable_lora=True, max_lora_rank=16)
    engine.load_lora_adapter("attn", adapters["attn"])
    prompt = list(range(3, 60))  # three full pages
    base = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    engine.generate(prompt, base)
    hits = engine.stats().prefix_cache_hit_tokens
    with_adapter = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, lora_name="attn")
    engine.generate(prompt, with_adapter)
    assert engine.stats().prefix_cache_hit_tokens == hits  # the base model's pages are not the adapter's
    engine.generate(prompt, with_adapter)
    assert engine.stats().prefix_cache_hit_tokens > hits  # the adapter's own pages are
    engine.shutdown()


def test_load_and_unload_at_run_time_and_bad_adapters(tiny_llama: str, adapters: dict[str, str], tmp_path: Any) -> None:
    engine = _engine(tiny_llama, enable_lora=True, max_loras=2, max_lora_rank=8)
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True, lora_name="attn")
    with pytest.raises(InvalidRequestError, match="'attn' is not loaded"):
        engine.add_request([5, 6, 7], params)
    engine.load_lora_adapter("attn", adapters["attn"])
    # A request runs while another adapter is loaded and unloaded: its tokens are PEFT's all the same.
    request_id = engine.add_request([5, 17, 99, 23], params)
    engine.step()
    engine.load_lora_adapter("mlp", adapters["mlp"])
    with pytest.raises(InvalidRequestError, match="in use by 1 request"):
        engine.unload_lora_adapter("attn")
    engine.unload_lora_adapter("mlp")
    outputs = {}
    while engine.has_unfinished():
        for output in engine.step():
            outputs[output.request_id] = output
    assert outputs[request_id].token_ids == _peft_greedy(tiny_llama, adapters["attn"], [5, 17, 99, 23])
    engine.unload_lora_adapter("attn")
    # Bad adapters: each refused by name, nothing half-loaded (the slot stays free for the next load).
    corrupt = tmp_path / "corrupt"
    corrupt.mkdir()
    (corrupt / "adapter_config.json").write_text("{not json")
    (corrupt / "adapter_model.safetensors").write_bytes(b"garbage")
    other_base = tmp_path / "other"
    other_base.mkdir()
    with open(os.path.join(adapters["attn"], "adapter_config.json"), encoding="utf-8") as f:
        (other_base / "adapter_config.json").write_text(f.read())
    from safetensors.torch import load_file, save_file

    # The same adapter for a model twice as wide: its A matrices take 128 inputs, the tiny llama has 64.
    tensors = load_file(os.path.join(adapters["attn"], "adapter_model.safetensors"))
    wider = {k: torch.cat([v, v], dim=-1) if "lora_A" in k else v for k, v in tensors.items()}
    save_file(wider, str(other_base / "adapter_model.safetensors"))
    bad = {
        str(tmp_path / "missing"): "is not a PEFT adapter folder",
        str(corrupt): "cannot read",
        adapters["all"]: "rank 16 is over --max-lora-rank 8",
        str(other_base): "an adapter of another base model",
    }
    for path, message in bad.items():
        with pytest.raises(InvalidRequestError, match=message):
            engine.load_lora_adapter("bad", path)
    assert engine.lora_adapters() == {}
    engine.load_lora_adapter("a", adapters["attn"])
    engine.load_lora_adapter("b", adapters["mlp"])
    with pytest.raises(
        InvalidRequestError, match="2 adapters are loaded \\(a, b\\); unload one or raise --max-cpu-loras"
    ):
        engine.load_lora_adapter("c", adapters["qv_rs"])
    with pytest.raises(InvalidRequestError, match="'a' is already loaded"):
        engine.load_lora_adapter("a", adapters["attn"])
    engine.shutdown()
    with pytest.raises(InvalidRequestError, match="LoRA is off"):
        _engine(tiny_llama).add_request([1, 2], SamplingParams(lora_name="attn"))


# ---- the server --------------------------------------------------------------------------------
def _smollm2_adapter(folder: str, seed: int) -> str:
    """A random rank-4 adapter on SmolLM2-135M's q/v projections, written in PEFT's layout."""
    from safetensors.torch import save_file

    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(30):
        for module, out_features in (("q_proj", 576), ("v_proj", 192)):
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(4, 576, generator=generator) * 0.1
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(out_features, 4, generator=generator) * 0.1
    os.makedirs(folder, exist_ok=True)
    save_file(tensors, os.path.join(folder, "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"], "bias": "none"}
    with open(os.path.join(folder, "adapter_config.json"), "w", encoding="utf-8") as f:
        f.write(__import__("json").dumps(config))
    return folder


@pytest.mark.parametrize("transport", ["--no-engine-process", "--engine-process"])
def test_the_server_serves_adapters_by_name_and_loads_them_at_run_time(
    transport: str, tmp_path: Any, engine_cache: Any
) -> None:
    """vLLM's API: the adapter's name as `model`, /v1/models listing it, /v1/load_lora_adapter and
    /v1/unload_lora_adapter; SGLang's `lora_path`; the answers are the in-process engine's. The engine on the
    server's thread and in a process of its own (the load and unload commands cross its pipe)."""
    import httpx

    from tests.server_helpers import start_server

    first = _smollm2_adapter(str(tmp_path / "first"), 1)
    second = _smollm2_adapter(str(tmp_path / "second"), 2)
    local = engine_cache(None, lora_modules=f"first={first},second={second}")
    prompt = "Write a short poem about the sea."
    want = {
        name: local.generate(prompt, SamplingParams(max_tokens=12, temperature=0.0, lora_name=name))[0].text
        for name in (None, "first", "second")
    }
    assert len(set(want.values())) == 3  # each adapter changes the text
    release_cached(local)
    server = start_server(transport, "--lora-modules", f"first={first}", "--max-loras", "2", log_name="server-lora")
    try:
        url = server.base_url

        def complete(**fields: Any) -> httpx.Response:
            body = {"prompt": prompt, "max_tokens": 12, "temperature": 0, **fields}
            return httpx.post(f"{url}/v1/completions", json=body, timeout=120)

        models = httpx.get(f"{url}/v1/models").json()["data"]
        base = models[0]["id"]
        assert [(m["id"], m["parent"]) for m in models] == [(base, None), ("first", base)]
        assert complete().json()["choices"][0]["text"] == want[None]
        assert complete(model="first").json()["choices"][0]["text"] == want["first"]
        assert complete(model=base, lora_path="first").json()["choices"][0]["text"] == want["first"]
        missing = complete(model="second")
        assert missing.status_code in (400, 404) and "second" in missing.text
        loaded = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "second", "lora_path": second})
        assert loaded.status_code == 200 and "added successfully" in loaded.text
        assert complete(model="second").json()["choices"][0]["text"] == want["second"]
        full = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "third", "lora_path": second})
        assert full.status_code == 400 and "unload one or raise --max-cpu-loras" in full.text
        gone = httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "second"})
        assert gone.status_code == 200 and "removed successfully" in gone.text
        bad = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "bad", "lora_path": str(tmp_path)})
        assert bad.status_code == 400 and "is not a PEFT adapter folder" in bad.text
        assert [m["id"] for m in httpx.get(f"{url}/v1/models").json()["data"]] == [base, "first"]
        again = httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "second"})
        assert again.status_code == 400 and "'second' is not loaded" in again.text
        metrics = server.wait_idle(timeout=20)
        assert metrics["engine:kv_pages_used"] == 0
    finally:
        server.stop()
