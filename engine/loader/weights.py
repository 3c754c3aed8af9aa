"""Iterators of (HF tensor name, tensor) from safetensors shards and GGUF files."""

from __future__ import annotations

import functools
import glob
import json
import os
import re
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from tqdm import tqdm

from engine.errors import ModelLoadError
from engine.models.registry import families, family_for_gguf_arch

if TYPE_CHECKING:
    from engine.loader.param_loading import CheckpointTensor
    from engine.models.family import GGUFSpec

WeightIter = Iterator[tuple[str, torch.Tensor]]


def safetensors_files(folder: str) -> list[str]:
    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index, encoding="utf-8") as handle:
            weight_map = json.load(handle).get("weight_map", {})
        files = sorted({os.path.join(folder, f) for f in weight_map.values()})
        missing = [f for f in files if not os.path.isfile(f)]
        if missing:
            raise ModelLoadError(f"shards named in {index} are missing: {missing}")
        return files
    files = sorted(glob.glob(os.path.join(folder, "*.safetensors")))
    if not files:
        raise ModelLoadError(f"{folder}: no *.safetensors weights found")
    return files


def safetensors_names(folder: str) -> list[str]:
    """Every tensor name of a safetensors checkpoint, from the headers only (no tensor is read)."""
    from safetensors import SafetensorError, safe_open

    names: list[str] = []
    for path in safetensors_files(folder):
        try:
            with safe_open(path, framework="pt") as handle:
                names.extend(handle.keys())
        except SafetensorError as exc:
            raise ModelLoadError(f"{path}: corrupt or truncated safetensors file ({exc})") from exc
    return names


class SafetensorsSlice:
    """A checkpoint tensor not read yet (engine.loader.param_loading.LazyTensor): a tensor-parallel
    loader reads only its rows or columns from the memory-mapped file. Valid while its file is open,
    that is, until the iterator below moves on."""

    def __init__(self, handle: Any, name: str) -> None:
        self._handle = handle
        self._name = name
        self._slice = handle.get_slice(name)
        self.shape = tuple(self._slice.get_shape())

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        index = (slice(None),) * dim + (slice(start, start + length),)
        rows: torch.Tensor = self._slice[index]
        return rows

    def read(self) -> torch.Tensor:
        tensor: torch.Tensor = self._handle.get_tensor(self._name)
        return tensor


def safetensors_weights(folder: str, lazy: bool = False) -> Iterator[tuple[str, CheckpointTensor]]:
    """(name, tensor) of every checkpoint tensor; lazy: (name, SafetensorsSlice) instead, read by its
    loader (tensor parallelism: each rank reads only its shard)."""
    from safetensors import SafetensorError, safe_open

    files = safetensors_files(folder)
    with tqdm(desc="Loading safetensors", unit="tensor", disable=None) as bar:
        for path in files:
            try:
                with safe_open(path, framework="pt") as handle:
                    for name in handle.keys():  # noqa: SIM118 (a safe_open handle has keys() but is not iterable)
                        yield name, SafetensorsSlice(handle, name) if lazy else handle.get_tensor(name)
                        bar.update(1)
            except SafetensorError as exc:
                raise ModelLoadError(f"{path}: corrupt or truncated safetensors file ({exc})") from exc


# Tensors a GGUF may carry that the model computes itself (llama3 GGUFs store the rope frequencies).
_COMPUTED = {"rope_freqs.weight"}
_BLOCK = re.compile(r"^blk\.(\d+)\.(.+)\.(weight|bias)$")
_GLOBAL = re.compile(r"^(.+)\.(weight|bias)$")


def gguf_spec(arch: str) -> GGUFSpec | None:
    """How the family llama.cpp writes as `arch` lays its tensors out (its GGUFSpec); None: no family reads it."""
    family = family_for_gguf_arch(arch)
    return None if family is None else family.gguf


def gguf_rope_permuted(arch: str) -> bool:
    """Whether llama.cpp's converter interleaved the Q/K rows of this architecture (to undo at load)."""
    spec = gguf_spec(arch)
    return spec is not None and spec.rope_permuted


def gguf_name_to_hf(name: str, arch: str) -> str | None:
    """The HF name of a llama.cpp tensor name for this GGUF architecture; None if it has none."""
    spec = gguf_spec(arch)
    if spec is None:
        return None
    names = spec.tensor_names
    match = _BLOCK.match(name)
    if match:
        layer, base, suffix = match.groups()
        target = names.get(base)
        return None if target is None else f"{target.format(i=layer)}.{suffix}"
    match = _GLOBAL.match(name)
    if match and match.group(1) in names:
        return f"{names[match.group(1)]}.{match.group(2)}"
    return None


def open_gguf(path: str) -> Any:
    """The file's `gguf.GGUFReader`, shared by every reader of the same unchanged file in this process.

    Building a reader parses every metadata field, the tokenizer's ~50k strings and merges included:
    ~2.5 s for the embedded SmolLM2 on a 2-core CPU. Loading a model reads the file twice (the weights,
    then the CPU platform keeping the quantized blocks), and a process may build several engines.
    The reader is a read-only memory map, so sharing it is safe."""
    stat = os.stat(path)
    return _open_gguf(os.path.realpath(path), stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=4)
def _open_gguf(path: str, size: int, mtime_ns: int) -> Any:
    import gguf

    return gguf.GGUFReader(path)


def gguf_arch(reader: Any) -> str:
    """general.architecture of an open GGUFReader ("" where the file has none)."""
    return str(reader.fields["general.architecture"].contents()) if "general.architecture" in reader.fields else ""


def unpermute_rope_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation (its converter interleaves each head's two rotary halves)."""
    rows = weight.shape[0]
    head_dim = rows // num_heads
    shaped = weight.reshape(num_heads, head_dim // 2, 2, *weight.shape[1:])
    return shaped.swapaxes(1, 2).reshape(weight.shape)


def gguf_weights(path: str, hf_config: Any) -> WeightIter:
    import gguf

    try:
        reader = open_gguf(path)
    except Exception as exc:  # numpy memmap / struct errors for a truncated or foreign file
        raise ModelLoadError(f"{path}: corrupt or truncated GGUF file ({type(exc).__name__}: {exc})") from exc
    arch = gguf_arch(reader)
    spec = gguf_spec(arch)
    if spec is None:
        raise ModelLoadError(
            f"{path}: GGUF files of architecture {arch or 'unknown'!r} are not supported ({_readable()})"
        )
    heads = hf_config.num_attention_heads
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
    for tensor in tqdm(reader.tensors, desc="Dequantizing GGUF", unit="tensor", disable=None):
        if tensor.name in _COMPUTED:
            continue
        hf_name = gguf_name_to_hf(tensor.name, arch)
        if hf_name is None:
            raise ModelLoadError(
                f"{path}: GGUF tensor {tensor.name!r} has no counterpart in the {arch or 'unknown'} architecture"
            )
        try:
            array = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        except Exception as exc:
            raise ModelLoadError(f"{path}: cannot dequantize {tensor.name} ({exc})") from exc
        if spec.rope_permuted and hf_name.endswith("q_proj.weight"):
            array = unpermute_rope_rows(array, heads)
        elif spec.rope_permuted and hf_name.endswith("k_proj.weight"):
            array = unpermute_rope_rows(array, kv_heads)
        if spec.norm_offset and hf_name.endswith("norm.weight"):
            array = array - spec.norm_offset  # stored as offset + weight (Gemma's (1 + w) norms)
        yield hf_name, torch.from_numpy(np.array(array, dtype=np.float32, copy=True))


def _readable() -> str:
    """The GGUF architectures some family reads, for a refusal's message."""
    archs = sorted(arch for family in families() if family.gguf is not None for arch in family.gguf.archs)
    return f"readable: {', '.join(archs)}"
