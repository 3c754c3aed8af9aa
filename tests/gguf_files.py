"""Tiny GGUF files written from tiny HF checkpoints with the `gguf` package, as llama.cpp's converter
lays them out: its tensor names, Q/K rows permuted for the llama family, Gemma's norms stored as
1 + weight, float32 tensors and the architecture's metadata keys (no tokenizer: prompts are ids)."""

from __future__ import annotations

import json
import os
import re

import numpy as np
import torch
from safetensors.torch import load_file

# HF parameter name (layer part) -> llama.cpp name; Gemma's four norms differ from Llama's two.
_LAYER_NAMES = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
_GEMMA_LAYER_NAMES = {
    **_LAYER_NAMES,
    "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
}
_GLOBAL_NAMES = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)\.(weight|bias)$")


def _permute(weight: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's Q/K row order for the llama family (each head's two rotary halves interleaved)."""
    rows = weight.shape[0]
    return weight.reshape(heads, 2, rows // heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def quantize_k(weight: np.ndarray, bits: int) -> np.ndarray:
    """ggml's Q4_K (bits 4: [rows, cols / 256 * 144]) or Q5_K (bits 5: [rows, cols / 256 * 176]) blocks of
    a float32 [rows, cols] matrix (the `gguf` package dequantizes them but has no quantizer): per 32
    columns a 6-bit scale and minimum under the block's fp16 d and dmin, 4- or 5-bit quants (Q5_K's
    fifth bits in qh[32]: bit j of qh[l] for weight l of sub-block j). Simple, not llama.cpp's search,
    but every byte in ggml's layout."""
    rows, cols = weight.shape
    top = (1 << bits) - 1
    x = weight.astype(np.float32).reshape(rows, cols // 256, 8, 32)
    low = np.minimum(x.min(-1), 0.0)
    scale, minimum = (x.max(-1) - low) / top, -low
    d = (scale.max(-1, keepdims=True) / 63.0).astype(np.float16)
    dmin = (minimum.max(-1, keepdims=True) / 63.0).astype(np.float16)
    d32, dmin32 = np.maximum(d.astype(np.float32), 1e-12), np.maximum(dmin.astype(np.float32), 1e-12)
    sc = np.clip(np.rint(scale / d32), 1, 63).astype(np.uint8)
    mn = np.clip(np.rint(minimum / dmin32), 0, 63).astype(np.uint8)
    step = d.astype(np.float32) * sc
    q = np.clip(np.rint((x + (dmin.astype(np.float32) * mn)[..., None]) / np.maximum(step, 1e-12)[..., None]), 0, top)
    q = q.astype(np.uint8)
    scales = np.zeros((rows, cols // 256, 12), dtype=np.uint8)
    scales[..., 0:4] = sc[..., 0:4] | ((sc[..., 4:8] >> 4) << 6)
    scales[..., 4:8] = mn[..., 0:4] | ((mn[..., 4:8] >> 4) << 6)
    scales[..., 8:12] = (sc[..., 4:8] & 0x0F) | ((mn[..., 4:8] & 0x0F) << 4)
    qs = ((q[..., 0::2, :] & 0x0F) | ((q[..., 1::2, :] & 0x0F) << 4)).reshape(rows, cols // 256, 128)
    pieces = [d.view(np.uint8).reshape(rows, -1, 2), dmin.view(np.uint8).reshape(rows, -1, 2), scales]
    if bits == 5:
        pieces.append(np.bitwise_or.reduce((q >> 4) << np.arange(8, dtype=np.uint8)[:, None], axis=-2))
    blocks = np.concatenate([*pieces, qs], axis=-1)
    return blocks.reshape(rows, -1)


def quantize_q6_k(weight: np.ndarray) -> np.ndarray:
    """ggml's Q6_K blocks [rows, cols / 256 * 210]: per 16 columns an int8 scale under the block's fp16
    d, 6-bit quants q with w = d * scale * (q - 32), stored as ql[128] qh[64] scales[16] d."""
    rows, cols = weight.shape
    x = weight.astype(np.float32).reshape(rows, cols // 256, 16, 16)
    scale = np.abs(x).max(-1) / 31.0
    d = (scale.max(-1, keepdims=True) / 127.0).astype(np.float16)
    sc = np.clip(np.rint(scale / np.maximum(d.astype(np.float32), 1e-12)), 1, 127).astype(np.int8)
    step = np.maximum(d.astype(np.float32) * sc, 1e-12)
    q = (np.clip(np.rint(x / step[..., None]), -32, 31) + 32).astype(np.uint8).reshape(rows, cols // 256, 2, 4, 32)
    low = q & 0x0F
    ql = np.concatenate([low[..., 0, :] | (low[..., 2, :] << 4), low[..., 1, :] | (low[..., 3, :] << 4)], axis=-1)
    qh = (q[..., 0, :] >> 4) | ((q[..., 1, :] >> 4) << 2) | ((q[..., 2, :] >> 4) << 4) | ((q[..., 3, :] >> 4) << 6)
    blocks = np.concatenate(
        [ql.reshape(rows, -1, 128), qh.reshape(rows, -1, 64), sc.view(np.uint8), d.view(np.uint8).reshape(rows, -1, 2)],
        axis=-1,
    )
    return blocks.reshape(rows, -1)


def quantize_q3_k(weight: np.ndarray) -> np.ndarray:
    """ggml's Q3_K blocks [rows, cols / 256 * 110]: per 16 columns a signed 6-bit scale under the block's
    fp16 d, 3-bit quants with w = d * scale * q, q in -4..3 (the column of largest magnitude at -4),
    stored as hmask[32] (bit j of hmask[l]: q + 4 >= 4 for weight 32j + l) qs[64] (bits 2j..2j+1 of
    qs[32n + l]: the low 2 bits of q + 4 for weight 128n + 32j + l) scales[12] (scale + 32: low nibbles
    in bytes 0-7, j < 8 low half, high 2 bits in bytes 8-11 at bit pair j / 4) d."""
    rows, cols = weight.shape
    x = weight.astype(np.float32).reshape(rows, cols // 256, 16, 16)
    peak = np.take_along_axis(x, np.abs(x).argmax(-1)[..., None], axis=-1)[..., 0]
    scale = -peak / 4.0
    d = (np.abs(scale).max(-1, keepdims=True) / 31.0).astype(np.float16)
    sc = np.clip(np.rint(scale / np.maximum(d.astype(np.float32), 1e-12)), -32, 31).astype(np.int8)
    step = d.astype(np.float32) * sc
    safe = np.where(step == 0, 1.0, step)
    q = np.where(step[..., None] == 0, 0, np.clip(np.rint(x / safe[..., None]), -4, 3))
    q = (q + 4).astype(np.uint8).reshape(rows, cols // 256, 256)
    hmask = np.bitwise_or.reduce((q.reshape(rows, -1, 8, 32) >> 2) << np.arange(8, dtype=np.uint8)[:, None], axis=-2)
    low = (q & 3).reshape(rows, -1, 2, 4, 32)
    qs = np.bitwise_or.reduce(low << (2 * np.arange(4, dtype=np.uint8))[:, None], axis=-2).reshape(rows, -1, 64)
    u = (sc.astype(np.int16) + 32).astype(np.uint8)
    high = (u >> 4).reshape(rows, -1, 4, 4)
    scales = np.concatenate(
        [
            (u[..., 0:8] & 0x0F) | ((u[..., 8:16] & 0x0F) << 4),
            np.bitwise_or.reduce(high << (2 * np.arange(4, dtype=np.uint8))[:, None], axis=-2),
        ],
        axis=-1,
    )
    blocks = np.concatenate([hmask, qs, scales, d.view(np.uint8).reshape(rows, -1, 2)], axis=-1)
    return blocks.reshape(rows, -1)


def quantize_q2_k(weight: np.ndarray) -> np.ndarray:
    """ggml's Q2_K blocks [rows, cols / 256 * 84]: per 16 columns a 4-bit scale and minimum under the
    block's fp16 d and dmin, 2-bit quants with w = d * scale * q - dmin * minimum, stored as scales[16]
    (scale | minimum << 4) qs[64] (bits 2j..2j+1 of qs[32n + l]: weight 128n + 32j + l) d dmin."""
    rows, cols = weight.shape
    x = weight.astype(np.float32).reshape(rows, cols // 256, 16, 16)
    low = np.minimum(x.min(-1), 0.0)
    scale, minimum = (x.max(-1) - low) / 3.0, -low
    d = (scale.max(-1, keepdims=True) / 15.0).astype(np.float16)
    dmin = (minimum.max(-1, keepdims=True) / 15.0).astype(np.float16)
    sc = np.clip(np.rint(scale / np.maximum(d.astype(np.float32), 1e-12)), 1, 15).astype(np.uint8)
    mn = np.clip(np.rint(minimum / np.maximum(dmin.astype(np.float32), 1e-12)), 0, 15).astype(np.uint8)
    step = np.maximum(d.astype(np.float32) * sc, 1e-12)
    q = np.clip(np.rint((x + (dmin.astype(np.float32) * mn)[..., None]) / step[..., None]), 0, 3).astype(np.uint8)
    q = q.reshape(rows, -1, 2, 4, 32)
    qs = np.bitwise_or.reduce(q << (2 * np.arange(4, dtype=np.uint8))[:, None], axis=-2).reshape(rows, -1, 64)
    blocks = np.concatenate(
        [sc | (mn << 4), qs, d.view(np.uint8).reshape(rows, -1, 2), dmin.view(np.uint8).reshape(rows, -1, 2)], axis=-1
    )
    return blocks.reshape(rows, -1)


def quantize(weight: np.ndarray, kind: str) -> tuple[np.ndarray, object]:
    """(blocks, GGMLQuantizationType) of a float32 matrix in kind (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 through the
    `gguf` package's quantizer; Q2_K, Q3_K, Q4_K, Q5_K, Q6_K through the ones above)."""
    import gguf

    qtype = getattr(gguf.GGMLQuantizationType, kind)
    if kind in ("Q4_K", "Q5_K"):
        return quantize_k(weight, int(kind[1])), qtype
    if kind == "Q6_K":
        return quantize_q6_k(weight), qtype
    if kind == "Q3_K":
        return quantize_q3_k(weight), qtype
    if kind == "Q2_K":
        return quantize_q2_k(weight), qtype
    return gguf.quants.quantize(weight.astype(np.float32), qtype), qtype


def write_gguf(hf_folder: str, path: str, formats: dict[str, str] | None = None) -> str:
    """formats: llama.cpp tensor kind (attn_q, ffn_down, token_embd, output, ...) -> a block type to
    quantize it to ("*": every 2-D weight not named); norms and biases stay float32."""
    import gguf

    with open(os.path.join(hf_folder, "config.json"), encoding="utf-8") as handle:
        config = json.load(handle)
    # llama.cpp writes Mistral as "llama" (gguf-py has no "mistral" architecture).
    arch = {"gemma3_text": "gemma3", "mistral": "llama"}.get(config["model_type"], config["model_type"])
    gemma = arch.startswith("gemma")
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    writer = gguf.GGUFWriter(path, arch)
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_vocab_size(config["vocab_size"])
    rope = config.get("rope_parameters") or {}
    if arch == "gemma3":  # the file holds the global layers' rope; llama.cpp fixes the local layers' (10k)
        rope = rope["full_attention"]
        if rope.get("rope_type") == "linear":
            writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            writer.add_rope_scaling_factor(float(rope["factor"]))
    writer.add_rope_freq_base(float(rope.get("rope_theta", config.get("rope_theta", 10000.0))))
    if arch in ("llama", "mistral"):
        writer.add_rope_dimension_count(head_dim)
    if gemma or arch == "qwen3":  # llama.cpp writes these where the config has its own head_dim
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    if gemma:
        if config.get("sliding_window"):
            writer.add_sliding_window(config["sliding_window"])
        if config.get("attn_logit_softcapping"):
            writer.add_attn_logit_softcapping(config["attn_logit_softcapping"])
        if config.get("final_logit_softcapping"):
            writer.add_final_logit_softcapping(config["final_logit_softcapping"])
    names = _GEMMA_LAYER_NAMES if gemma else _LAYER_NAMES
    tensors = {}
    for shard in sorted(f for f in os.listdir(hf_folder) if f.endswith(".safetensors")):
        tensors.update(load_file(os.path.join(hf_folder, shard)))
    for name, tensor in tensors.items():
        array = tensor.to(torch.float32).numpy()
        match = _LAYER.match(name)
        if match:
            layer, part, suffix = match.groups()
            gguf_name = f"blk.{layer}.{names[part]}.{suffix}"
        else:
            base, suffix = name.rsplit(".", 1)
            gguf_name = f"{_GLOBAL_NAMES[base]}.{suffix}"
        if arch in ("llama", "mistral") and name.endswith(("q_proj.weight", "k_proj.weight")):
            array = _permute(array, heads if "q_proj" in name else kv_heads)
        if gemma and name.endswith("norm.weight"):
            array = array + 1.0  # llama.cpp stores Gemma's (1 + w)
        kind = gguf_name.split(".")[-2]
        block_type = (formats or {}).get(kind, (formats or {}).get("*")) if array.ndim == 2 else None
        if block_type is not None:
            blocks, qtype = quantize(array, block_type)
            writer.add_tensor(gguf_name, np.ascontiguousarray(blocks), raw_dtype=qtype)
            continue
        writer.add_tensor(gguf_name, np.ascontiguousarray(array))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
