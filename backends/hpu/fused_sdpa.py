"""Prompt attention through Habana's FusedSDPA kernel, when the bridge has it. UNTESTED ON GAUDI HARDWARE.

vllm-hpu-extension runs prompt attention through `habana_frameworks.torch.hpex.kernels.FusedSDPA` by
default (its `fsdpa_impl`; kernels.py loads it lazily and falls back to the naive matmul + softmax when the
import fails), called as utils.py `ModuleFusedSDPA` does:

  FusedSDPA.apply(query, key, value, attn_mask, dropout_p, is_causal, scale, softmax_mode, recompute_mode,
                  valid_sequence_lengths, padding_side)

with query [batch, heads, q_len, dim] and key/value [batch, kv_heads, kv_len, dim] (the kv heads are not
repeated), and chooses the form as ops.py `_fsdpa_prompt_attention` does:

- no cached prefix: no mask tensor, `is_causal=True`, `valid_sequence_lengths` = the rows' lengths with
  `padding_side="right"` (padding after each row's tokens): the kernel masks padding and the future itself
  (vllm-gaudi's HpuModelAdapter then skips building the bias: `_set_attn_bias` returns early with FusedSDPA
  and no block_list);
- a cached prefix: the explicit additive mask (prefix keys up to the context length, then causal within the
  row), `is_causal=False` and no valid lengths ("causal + attn_bias is not yet supported").

`softmax_mode` is "fp32" where the model's softmax runs in fp32 (hpu.fp32_softmax), else "fast";
`recompute_mode=True` and `dropout_p=0.0`, as vllm-hpu-extension passes them for inference.

The switch: `hpu.fused_sdpa: auto | true | false` (backends/hpu/settings.py).
auto uses the kernel when `habana_frameworks.torch.hpex.kernels` imports; true requires it (an error
otherwise); false never imports it. The import happens here, when a backend is built, never when one of our
modules is imported. Without the kernel, backends/hpu/prompt_attention.py's masked matmul runs.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from backends.hpu.prompt_attention import HpuPromptMetadata, prompt_keys_values
from backends.hpu.settings import tri_state

logger = logging.getLogger(__name__)

PADDING_SIDE = "right"  # each row's tokens first, its padding after (prefill.pad_prompt_batch)


def load_fused_sdpa(setting: str | bool = "auto") -> Any | None:
    """The FusedSDPA kernel class, or None for the masked-matmul fallback (see the module docstring)."""
    mode = tri_state(setting, "fused_sdpa")
    if mode == "false":
        return None
    try:
        from habana_frameworks.torch.hpex.kernels import FusedSDPA
    except (ImportError, AttributeError) as exc:
        if mode == "true":
            message = f"hpu.fused_sdpa is true but FusedSDPA does not import: {exc}"
            raise RuntimeError(message) from exc
        return None
    logger.info("HPU prompt attention: FusedSDPA (habana_frameworks.torch.hpex.kernels)")
    return FusedSDPA


def fused_prompt_attention(
    fused_sdpa: Any,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    meta: HpuPromptMetadata,
    scale: float,
    fp32_softmax: bool = False,
    k_cache: torch.Tensor | None = None,
    v_cache: torch.Tensor | None = None,
) -> torch.Tensor:
    """padded_prompt_attention's contract (same arguments, same result) through `fused_sdpa.apply`."""
    rows, seq = meta.rows, meta.seq
    heads, dim = q.shape[1], q.shape[2]
    keys, values = prompt_keys_values(k, v, meta, k_cache, v_cache)  # [rows, keys, kv_heads, dim]
    query = q.view(rows, seq, heads, dim).transpose(1, 2)
    keys, values = keys.transpose(1, 2), values.transpose(1, 2)
    softmax_mode = "fp32" if fp32_softmax else "fast"
    if meta.attn_bias is None:
        # Padded rows count as one token, as in the mask: no row of the kernel's softmax is empty.
        valid = meta.seq_lens.to(torch.int32).clamp(min=1)
        out = fused_sdpa.apply(query, keys, values, None, 0.0, True, scale, softmax_mode, True, valid, PADDING_SIDE)
    else:
        mask = meta.attn_bias.to(q.dtype)
        out = fused_sdpa.apply(query, keys, values, mask, 0.0, False, scale, softmax_mode, True, None, PADDING_SIDE)
    return out.transpose(1, 2).reshape(rows * seq, heads, dim)
