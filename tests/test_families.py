"""A model family is one file (engine/models/families/): the registry finds it there, its declaration
says how its configs read, and nothing else in the engine, the graphs or the backends names a family."""

from __future__ import annotations

import importlib
import pkgutil
import re
import sys
import types
from pathlib import Path

import pytest
import torch
from conftest import build_tiny_checkpoint, track
from helpers import hf_greedy

import engine.models.families as family_package
from engine.engine import Engine
from engine.errors import ModelLoadError
from engine.model_config import ModelConfig
from engine.models import registry
from engine.sampling_params import SamplingParams

ROOT = Path(__file__).resolve().parent.parent


def test_every_file_in_the_families_package_is_one_registered_family() -> None:
    files = sorted(m.name for m in pkgutil.iter_modules(family_package.__path__))
    assert [f.name for f in registry.families()] == files
    for name in files:
        family = importlib.import_module(f"engine.models.families.{name}").FAMILY
        for model_type in family.model_types:
            assert registry.family_for(model_type) is family
        for architecture in family.architectures:
            assert registry.family_for("not-a-model", [architecture]) is family
        for arch in family.gguf.archs if family.gguf else ():
            assert registry.family_for_gguf_arch(arch) is family


FAMILY_SOURCE = """
from engine.models.decoder import DecoderForCausalLM
from engine.models.family import Family

FAMILY = Family(name="{name}", model_types=("{model_type}",), architectures=(), model_class=DecoderForCausalLM)
"""


@pytest.fixture
def families_in(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """Point the registry at a package of family files written by the test (and back afterwards)."""
    package = types.ModuleType("test_family_files")
    package.__path__ = [str(tmp_path)]  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, package.__name__, package)
    monkeypatch.setattr(registry, "family_package", package)
    registry._index.cache_clear()
    yield tmp_path
    registry._index.cache_clear()
    for name in [name for name in sys.modules if name.startswith(f"{package.__name__}.")]:
        del sys.modules[name]


def test_a_new_file_is_a_new_family_and_a_name_claimed_twice_is_refused(families_in: Path) -> None:
    (families_in / "alpha.py").write_text(FAMILY_SOURCE.format(name="alpha", model_type="alpha"))
    assert registry.supported_model_types() == ["alpha"]
    registry._index.cache_clear()
    (families_in / "beta.py").write_text(FAMILY_SOURCE.format(name="beta", model_type="alpha"))
    with pytest.raises(ValueError, match=r"model_type 'alpha' is claimed by families 'alpha' and 'beta'"):
        registry.supported_model_types()


def test_a_file_without_a_family_or_named_otherwise_is_refused(families_in: Path) -> None:
    (families_in / "helpers.py").write_text("X = 1\n")
    with pytest.raises(TypeError, match=r"test_family_files\.helpers defines no FAMILY"):
        registry.families()
    registry._index.cache_clear()
    (families_in / "helpers.py").unlink()
    (families_in / "delta.py").write_text(FAMILY_SOURCE.format(name="gamma", model_type="gamma"))
    with pytest.raises(ValueError, match=r"delta declares family 'gamma': a family is named after its file"):
        registry.families()


def test_no_family_is_named_outside_its_file() -> None:
    """No model_type or GGUF architecture string in the engine, the graphs or the backends outside the
    family files: a family's knowledge is read from its FAMILY, not compared against its name. The
    server's reasoning and tool-call parsers are named after model makers, not families."""
    names = {n for f in registry.families() for n in (*f.model_types, *(f.gguf.archs if f.gguf else ()))}
    alternatives = "|".join(map(re.escape, sorted(names)))
    pattern = re.compile(rf"""["']({alternatives})["']""")
    allowed = {"engine/server/tool_parsers.py", "engine/server/launch.py", "engine/server/reasoning.py"}
    found = [
        f"{path.relative_to(ROOT)}:{number}: {line.strip()}"
        for package in ("engine", "graphs", "backends")
        for path in sorted((ROOT / package).rglob("*.py"))
        if "families" not in path.parts and str(path.relative_to(ROOT)) not in allowed
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        if pattern.search(line)
    ]
    assert found == []


def config_of(class_name: str, **kwargs: object) -> ModelConfig:
    import transformers

    shapes = dict(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)
    return ModelConfig.from_hf(getattr(transformers, class_name)(**{**shapes, **kwargs}))


@pytest.mark.parametrize(
    "class_name,kwargs,biases,qk_norm",
    [
        ("LlamaConfig", {"attention_bias": True}, (True, True), False),
        ("MistralConfig", {}, (False, False), False),
        ("Qwen2Config", {}, (True, False), False),
        ("Qwen2MoeConfig", {"qkv_bias": True}, (True, False), False),
        ("Qwen3Config", {}, (False, False), True),
        ("Qwen3MoeConfig", {"attention_bias": True}, (True, True), True),
        ("Olmo2Config", {"attention_bias": True}, (True, True), False),
    ],
)
def test_each_family_reads_its_biases_and_qk_norms(class_name: str, kwargs: dict, biases: tuple, qk_norm: bool) -> None:
    config = config_of(class_name, **kwargs)
    assert (config.qkv_bias, config.o_proj_bias) == biases
    assert config.qk_norm is qk_norm


@pytest.mark.parametrize(
    "class_name,kwargs,windows",
    [
        ("MistralConfig", {"sliding_window": 32}, [32, 32]),  # the config's window, every layer
        ("Qwen2Config", {"sliding_window": 32, "use_sliding_window": False}, [None, None]),  # carried, not used
        ("Qwen2Config", {"sliding_window": 32, "use_sliding_window": True, "max_window_layers": 1}, [None, 32]),
        ("Olmo2Config", {"sliding_window": 32}, [None, None]),  # no window in this family at all
    ],
)
def test_each_family_has_its_sliding_window_rule(class_name: str, kwargs: dict, windows: list) -> None:
    assert config_of(class_name, **kwargs).layer_windows == windows


def test_a_llama_with_attention_bias_has_its_o_proj_bias_too(tmp_path: Path) -> None:
    """transformers' Llama puts `attention_bias` on o_proj as well as q/k/v (the checkpoint's o_proj.bias
    had no home here before the Llama family read it)."""
    from transformers import AutoModelForCausalLM

    folder = build_tiny_checkpoint("llama_plain", str(tmp_path / "llama_bias"), attention_bias=True)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager").eval()
    engine = track(Engine(model=folder, device="cpu", dtype="float32", disable_graphs=True, kv_cache_tokens=512))
    prompt = [(13 * i) % 300 + 3 for i in range(21)]
    out = engine.generate([prompt], SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))[0]
    assert out.token_ids == hf_greedy(model, prompt, 16)


def test_a_gguf_of_a_family_without_a_gguf_layout_is_refused_naming_what_is_read(tmp_path: Path) -> None:
    import gguf
    from transformers import Phi3Config

    from engine.loader.weights import gguf_weights

    path = str(tmp_path / "phi3.gguf")
    writer = gguf.GGUFWriter(path, "phi3")
    writer.add_tensor("blk.0.attn_qkv.weight", torch.zeros(4, 4).numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelLoadError, match=r"architecture 'phi3' are not supported \(readable: gemma2, .*qwen3\)"):
        next(gguf_weights(path, Phi3Config()))
