"""Prompt (prefill) attention over a padded [rows, tokens per row] batch, in static-shape torch ops.

Gaudi compiles one recipe per tensor shape. The ragged prefill (one SDPA per request, each of its own
length: engine.layers.torch_attention.extend_attention) gives the compiler a new graph for every new
prompt length; a batch padded to a prompt bucket (rows, seq) gives it one per bucket. Every row's
queries, keys and values are its own new tokens (prompts without a cached prefix), so attention is
one batched masked softmax:

  scores[r, h, i, j] = q[r, i] . k[r, j] * scale + bias[r, i, j],
  bias = 0 where j <= i and j < max(len_r, 1), -inf elsewhere (causal + padding mask),

as vllm-hpu-extension's naive prompt attention does (ops.py `_naive_prompt_attention`: GQA by
unflattening the query heads per kv head, not by repeating K/V, and the softmax in fp32 only when
asked), with the mask vllm-gaudi's HpuModelAdapter builds (`_set_attn_bias`: triu causal mask OR
key >= seq_len). Query rows past a prompt's end (and padded rows, whose length counts as 1) still see
key 0, so no softmax row is empty and nothing is NaN; their outputs are never read.

UNTESTED ON GAUDI HARDWARE: checked on CPU against the ragged extend attention.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class HpuPromptMetadata:
    """What padded_prompt_attention reads; AttentionMetadata.platform_metadata of a padded prefill step.
    Built on the device once per step (not per layer) from the rows' lengths."""

    attn_bias: torch.Tensor  # [rows, 1, seq, seq] additive: 0 visible, -inf masked

    @classmethod
    def from_lengths(cls, seq_lens: torch.Tensor, seq: int, dtype: torch.dtype) -> "HpuPromptMetadata":
        """seq_lens [rows] (tokens of each row, 0 for padded rows) on the device; seq: tokens per row.
        Static shapes: only the values of seq_lens reach the tensors, never their shapes."""
        index = torch.arange(seq, device=seq_lens.device, dtype=torch.int32)
        causal = index.unsqueeze(0) <= index.unsqueeze(1)  # [seq query, seq key]: key j <= query i
        # A padded row (length 0) attends to its key 0, as a padded decode row reads one slot.
        lengths = seq_lens.to(torch.int32).clamp(min=1)
        valid = index.unsqueeze(0) < lengths.unsqueeze(1)  # [rows, seq key]
        visible = causal.unsqueeze(0) & valid.unsqueeze(1)  # [rows, seq, seq]
        bias = torch.zeros(visible.shape, dtype=dtype, device=seq_lens.device).masked_fill(~visible, float("-inf"))
        return cls(bias.unsqueeze(1))

    @property
    def rows(self) -> int:
        return self.attn_bias.shape[0]

    @property
    def seq(self) -> int:
        return self.attn_bias.shape[-1]


def padded_prompt_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: HpuPromptMetadata, scale: float,
    fp32_softmax: bool = False,
) -> torch.Tensor:
    """q [rows * seq, heads, dim], k/v [rows * seq, kv_heads, dim] (row after row) -> [rows * seq, heads, dim].

    The matmuls run in the query's dtype (bf16 on Gaudi); fp32_softmax keeps the scores and the softmax in
    fp32 for the models that need it (the same flag as decode: backends/hpu/attention.py).
    """
    rows, seq = meta.rows, meta.seq
    heads, dim = q.shape[1], q.shape[2]
    kv_heads = k.shape[1]
    group = heads // kv_heads
    # [rows, kv_heads, group, seq, dim] queries against [rows, kv_heads, 1, seq, dim] keys: GQA by broadcast.
    query = (q * scale).view(rows, seq, kv_heads, group, dim).permute(0, 2, 3, 1, 4)
    keys = k.view(rows, seq, kv_heads, 1, dim).permute(0, 2, 3, 1, 4)
    values = v.view(rows, seq, kv_heads, 1, dim).permute(0, 2, 3, 1, 4)
    scores = torch.matmul(query, keys.transpose(-1, -2))  # [rows, kv_heads, group, seq, seq]
    stat = torch.float32 if fp32_softmax else q.dtype
    scores = scores.to(stat) + meta.attn_bias.to(stat).unsqueeze(2)  # bias [rows, 1, 1, seq, seq]
    probs = torch.softmax(scores, dim=-1).to(values.dtype)
    out = torch.matmul(probs, values)  # [rows, kv_heads, group, seq, dim]
    return out.permute(0, 3, 1, 2, 4).reshape(rows * seq, heads, dim)
