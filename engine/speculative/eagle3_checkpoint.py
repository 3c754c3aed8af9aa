"""Loading an EAGLE-3 head from its public layout, checked against the target; or dummy weights of its shape.

The layout (SGLang's and vLLM's LlamaForCausalLMEagle3): config.json and model.safetensors (or
pytorch_model.bin) holding `fc.weight`, `midlayer.*` (some checkpoints spell it `layers.0.*` or
`model.layers.0.*`), `norm.weight`, `lm_head.weight`, `d2t` (draft id -> target id offsets, needed where the
draft vocabulary is smaller than the target's), maybe `t2d` (its inverse as a mask, rebuilt from d2t when
absent) and maybe `embed_tokens.weight` (most heads share the target's embedding and leave it out). Every
expected tensor must be there with its shape, and no other: a head trained for another target fails here, by
name, rather than drafting garbage.
"""

from __future__ import annotations

import glob
import json
import os
from dataclasses import dataclass
from typing import Any

import torch

from engine.errors import ModelLoadError
from engine.speculative.eagle3_head import ARCHITECTURE, Eagle3Config, Eagle3Head

DUMMY = "dummy"  # `model` of --speculative-config: a head of the target's shape with random weights (benchmarks)
DUMMY_DRAFT_VOCAB = 32000  # the public Llama-3 EAGLE-3 heads' draft vocabulary


@dataclass(frozen=True)
class TargetShape:
    """What a head must agree with: the target's width, vocabulary and depth."""

    hidden_size: int
    vocab_size: int
    num_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    max_position_embeddings: int  # the engine's context length: the head drafts at every position up to it


def dummy_config(target: TargetShape) -> dict[str, Any]:
    """config.json of a head shaped like the public ones for this target (the Llama-3-8B head: hidden 4096,
    32 heads, 8 KV heads, intermediate 14336, a 32,000-token draft vocabulary)."""
    return {
        "architectures": [ARCHITECTURE],
        "hidden_size": target.hidden_size,
        "intermediate_size": target.intermediate_size,
        "num_attention_heads": target.num_attention_heads,
        "num_key_value_heads": target.num_key_value_heads,
        "num_hidden_layers": 1,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "max_position_embeddings": target.max_position_embeddings,
        "vocab_size": target.vocab_size,
        "draft_vocab_size": min(DUMMY_DRAFT_VOCAB, target.vocab_size),
    }


def load_eagle3_head(
    path: str, target: TargetShape, dtype: torch.dtype, device: torch.device, dummy_weights: bool = False, seed: int = 0
) -> Eagle3Head:
    """The head of `path` (a folder; DUMMY: the target's shape) on `device` in `dtype`. dummy_weights
    (--load-format dummy): only its config.json is read, the weights are random."""
    if path == DUMMY:
        config, dummy_weights = Eagle3Config.from_json(dummy_config(target)), True
    else:
        config = _read_config(path)
    _check_against_target(config, target, path)
    if dummy_weights:
        head = Eagle3Head(config, own_embedding=False, max_positions=target.max_position_embeddings)
        _fill_dummy(head, seed)
    else:
        tensors = _read_tensors(path)
        own_embedding = "embed_tokens.weight" in tensors
        head = Eagle3Head(config, own_embedding, max_positions=target.max_position_embeddings)
        _load(head, tensors, path)
    head.to(device).eval()
    # The weights take the target's dtype; the rotary tables stay float32 (cast per call, as the target's).
    for module in (head.embed_tokens, head.fc, head.midlayer, head.norm, head.lm_head):
        if module is not None:
            module.to(dtype)
    return head


def _read_config(path: str) -> Eagle3Config:
    config_path = os.path.join(path, "config.json")
    if not os.path.isfile(config_path):
        raise ModelLoadError(f"EAGLE-3 head {path}: no config.json there")
    with open(config_path, encoding="utf-8") as handle:
        values = json.load(handle)
    try:
        return Eagle3Config.from_json(values)
    except ValueError as exc:
        raise ModelLoadError(f"EAGLE-3 head {path}: {exc}") from None


def _check_against_target(config: Eagle3Config, target: TargetShape, path: str) -> None:
    problems = []
    if config.hidden_size != target.hidden_size:
        problems.append(f"hidden_size {config.hidden_size}, the target's is {target.hidden_size}")
    if config.target_hidden_size != target.hidden_size:
        problems.append(f"target_hidden_size {config.target_hidden_size}, the target's is {target.hidden_size}")
    if config.vocab_size != target.vocab_size:
        problems.append(f"vocab_size {config.vocab_size}, the target's is {target.vocab_size}")
    if not 0 < config.draft_vocab_size <= config.vocab_size:
        problems.append(f"draft_vocab_size {config.draft_vocab_size} outside 1..vocab_size")
    if problems:
        raise ModelLoadError(f"EAGLE-3 head {path} does not fit the target model: {'; '.join(problems)}")
    try:
        config.target_layers(target.num_layers)
    except ValueError as exc:
        raise ModelLoadError(f"EAGLE-3 head {path}: {exc}") from None


def _read_tensors(path: str) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint under the canonical names (midlayer.*, no `model.` prefix)."""
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    tensors: dict[str, torch.Tensor] = {}
    if files:
        from safetensors.torch import load_file

        for file in files:
            tensors.update(load_file(file))
    else:
        bins = sorted(glob.glob(os.path.join(path, "*.bin")))
        if not bins:
            raise ModelLoadError(f"EAGLE-3 head {path}: no *.safetensors or *.bin weights there")
        for file in bins:
            tensors.update(torch.load(file, map_location="cpu", weights_only=True))
    return {_canonical(name): tensor for name, tensor in tensors.items()}


def _canonical(name: str) -> str:
    name = name.removeprefix("model.")
    if name.startswith("layers.0."):
        return "midlayer." + name.removeprefix("layers.0.")
    return name


def _load(head: Eagle3Head, tensors: dict[str, torch.Tensor], path: str) -> None:
    config = head.config
    wanted: dict[str, torch.Tensor] = {**dict(head.named_parameters()), "d2t": head.d2t, "t2d": head.t2d}
    # t2d only repeats what d2t says (vLLM does not read it); d2t may go where the draft vocabulary is the
    # target's (the identity map).
    optional = {"t2d"} | ({"d2t"} if config.draft_vocab_size == config.vocab_size else set())
    missing = sorted(name for name in wanted if name not in tensors and name not in optional)
    if missing:
        raise ModelLoadError(f"EAGLE-3 head {path}: missing tensor(s) {', '.join(missing)}")
    unexpected = sorted(name for name in tensors if name not in wanted and "rotary_emb" not in name)
    if unexpected:
        raise ModelLoadError(f"EAGLE-3 head {path}: unexpected tensor(s) {', '.join(unexpected)}")
    with torch.no_grad():
        for name, dest in wanted.items():
            if name not in tensors:
                continue
            tensor = tensors[name]
            if tuple(tensor.shape) != tuple(dest.shape):
                raise ModelLoadError(
                    f"EAGLE-3 head {path}: {name} has shape {tuple(tensor.shape)}, the config gives {tuple(dest.shape)}"
                )
            dest.copy_(tensor.to(dest.dtype))
    ids = head.to_target_ids(torch.arange(config.draft_vocab_size))
    if int(ids.min()) < 0 or int(ids.max()) >= config.vocab_size:
        raise ModelLoadError(f"EAGLE-3 head {path}: d2t maps draft ids outside the target's vocabulary")
    if "t2d" not in tensors:
        head.t2d.zero_()
        head.t2d[ids] = True


def _fill_dummy(head: Eagle3Head, seed: int) -> None:
    """Small uniform weights, norms at one (as the engine's dummy format), and a random draft vocabulary."""
    generator = torch.Generator().manual_seed(seed)
    config = head.config
    with torch.no_grad():
        for name, param in head.named_parameters():
            if "norm" in name:
                param.fill_(1.0)
            else:
                param.uniform_(-0.05, 0.05, generator=generator)
        chosen = torch.randperm(config.vocab_size, generator=generator)[: config.draft_vocab_size].sort().values
        head.d2t.copy_(chosen - torch.arange(config.draft_vocab_size))
        head.t2d.zero_()
        head.t2d[chosen] = True
