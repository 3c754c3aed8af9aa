"""Prompt (prefill) attention over a padded [rows, tokens per row] batch, in static-shape torch ops.

Gaudi compiles one recipe per tensor shape. The ragged prefill (one SDPA per request, each of its own
length: engine.layers.torch_attention.extend_attention) gives the compiler a new graph for every new
prompt length; a batch padded to a prompt bucket gives it one per bucket. A row's queries are its own
new tokens; its keys and values are, in this order,

- its cached prefix (bucket (rows, seq, ctx) only): `ctx` whole KV pages gathered from the paged cache
  by the row's page ids (`ctx_pages`, padded with the dummy page 0), `ctx * page_size` keys of which the
  first `ctx_len` (the prefix length) are visible to every query of the row; the rest (page padding, and
  in a prefix that ends mid-page the slots this step's new tokens were just written to) are masked;
- its new tokens: causal, and only the first `len_r` (the row's own length),

so attention is one batched masked softmax:

  scores[r, h, i, j] = q[r, i] . k[r, j] * scale + bias[r, i, j]   (j over ctx * page_size + seq keys),

as vllm-hpu-extension's naive prompt attention does (ops.py `_naive_prompt_attention`, with the past keys
put in front by `_get_context`: GQA by unflattening the query heads per kv head, not by repeating K/V, and
the softmax in fp32 only when asked), with the mask vllm-gaudi's HpuModelAdapter builds (`_set_attn_bias`:
past keys masked from the context length on, then triu causal OR key >= seq_len). Query rows past a
prompt's end (and padded rows, whose length counts as 1 and whose context is empty) still see key 0 of
their own tokens, so no softmax row is empty and nothing is NaN; their outputs are never read.

The gather is device-side (`index_select` on the cache viewed as pages) inside each layer, from page ids
sent once per step: no host round trip, and shapes fixed by the bucket. On Gaudi, FusedSDPA can replace
the softmax (backends/hpu/fused_sdpa.py); `prompt_keys_values` is shared by both.

UNTESTED ON GAUDI HARDWARE: checked on CPU against the ragged extend attention.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class HpuPromptMetadata:
    """What the padded prompt attention reads; AttentionMetadata.platform_metadata of a padded prefill step.
    Built on the device once per step (not per layer) from the rows' lengths."""

    seq_lens: torch.Tensor  # [rows] int32: new tokens of each row, 0 for padded rows
    seq: int  # tokens per row (the bucket's)
    # [rows, 1, seq, ctx * page_size + seq] additive (0 visible, -inf masked); None: causal within seq_lens,
    # left to FusedSDPA's is_causal flag and valid lengths (a step without a prefix, fused path only).
    attn_bias: torch.Tensor | None
    ctx_pages: torch.Tensor | None = None  # [rows, ctx] int64 page ids of each row's prefix; None: no prefix
    page_size: int = 0

    @classmethod
    def from_lengths(
        cls,
        seq_lens: torch.Tensor,
        seq: int,
        dtype: torch.dtype,
        ctx_lens: torch.Tensor | None = None,
        ctx_pages: torch.Tensor | None = None,
        page_size: int = 0,
        with_bias: bool = True,
    ) -> HpuPromptMetadata:
        """seq_lens [rows] (tokens of each row, 0 for padded rows) on the device; seq: tokens per row.
        With a prefix: ctx_lens [rows] (cached tokens of each row, 0 for none) and ctx_pages [rows, ctx].
        with_bias=False (no prefix only): no mask tensor, for FusedSDPA's causal flag.
        Static shapes: only the values of the inputs reach the tensors, never their shapes."""
        if ctx_pages is not None and (ctx_lens is None or page_size < 1):
            raise ValueError("a prefix needs ctx_lens and page_size along with ctx_pages")
        pages = ctx_pages.long() if ctx_pages is not None else None
        if not with_bias and pages is None:
            return cls(seq_lens, seq, None)
        return cls(seq_lens, seq, prompt_bias(seq_lens, seq, dtype, ctx_lens, pages, page_size), pages, page_size)

    @property
    def rows(self) -> int:
        return self.seq_lens.shape[0]

    @property
    def ctx_tokens(self) -> int:
        """Prefix keys per row (ctx pages * page_size), 0 without a prefix."""
        return 0 if self.ctx_pages is None else self.ctx_pages.shape[1] * self.page_size


def prompt_bias(
    seq_lens: torch.Tensor,
    seq: int,
    dtype: torch.dtype,
    ctx_lens: torch.Tensor | None = None,
    ctx_pages: torch.Tensor | None = None,
    page_size: int = 0,
) -> torch.Tensor:
    """The additive mask [rows, 1, seq, ctx_tokens + seq]; see the module docstring."""
    device = seq_lens.device
    index = torch.arange(seq, device=device, dtype=torch.int32)
    causal = index.unsqueeze(0) <= index.unsqueeze(1)  # [seq query, seq key]: key j <= query i
    # A padded row (length 0) attends to its key 0, as a padded decode row reads one slot.
    lengths = seq_lens.to(torch.int32).clamp(min=1)
    valid = index.unsqueeze(0) < lengths.unsqueeze(1)  # [rows, seq key]
    visible = causal.unsqueeze(0) & valid.unsqueeze(1)  # [rows, seq, seq]
    if ctx_pages is not None:
        assert ctx_lens is not None
        rows = seq_lens.shape[0]
        ctx_tokens = ctx_pages.shape[1] * page_size
        keys = torch.arange(ctx_tokens, device=device, dtype=torch.int32)
        past = keys.unsqueeze(0) < ctx_lens.to(torch.int32).unsqueeze(1)  # [rows, ctx_tokens]: the cached prefix
        visible = torch.cat([past.unsqueeze(1).expand(rows, seq, ctx_tokens), visible], dim=-1)
    bias = torch.zeros(visible.shape, dtype=dtype, device=device).masked_fill(~visible, float("-inf"))
    return bias.unsqueeze(1)


def prompt_keys_values(
    k: torch.Tensor,
    v: torch.Tensor,
    meta: HpuPromptMetadata,
    k_cache: torch.Tensor | None = None,
    v_cache: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's keys and values [rows, ctx_tokens + seq, kv_heads, dim]: its prefix pages gathered from the
    caches ([slots, kv_heads, dim], viewed as pages: no copy before the gather), then its new tokens."""
    rows, seq = meta.rows, meta.seq
    kv_heads, dim = k.shape[1], k.shape[2]
    keys, values = k.view(rows, seq, kv_heads, dim), v.view(rows, seq, kv_heads, dim)
    if meta.ctx_pages is None:
        return keys, values
    if k_cache is None or v_cache is None:
        raise ValueError("a prompt batch with a cached prefix needs the KV caches")
    pages = meta.ctx_pages.reshape(-1)

    def past(cache: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
        gathered = cache.view(-1, meta.page_size, kv_heads, dim).index_select(0, pages)
        return gathered.view(rows, meta.ctx_tokens, kv_heads, dim).to(new.dtype)

    return torch.cat([past(k_cache, keys), keys], dim=1), torch.cat([past(v_cache, values), values], dim=1)


def padded_prompt_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    meta: HpuPromptMetadata,
    scale: float,
    fp32_softmax: bool = False,
    k_cache: torch.Tensor | None = None,
    v_cache: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [rows * seq, heads, dim], k/v [rows * seq, kv_heads, dim] (row after row) -> [rows * seq, heads, dim].
    With a prefix (meta.ctx_pages), k_cache/v_cache [slots, kv_heads, dim] hold it (this step's k/v already
    stored: the gather reads them back only where the mask hides them).

    The matmuls run in the query's dtype (bf16 on Gaudi); fp32_softmax keeps the scores and the softmax in
    fp32 for the models that need it (the same flag as decode: backends/hpu/attention.py).
    """
    rows, seq = meta.rows, meta.seq
    heads, dim = q.shape[1], q.shape[2]
    kv_heads = k.shape[1]
    group = heads // kv_heads
    keys, values = prompt_keys_values(k, v, meta, k_cache, v_cache)  # [rows, keys, kv_heads, dim]
    bias = meta.attn_bias
    if bias is None:  # built for FusedSDPA's causal flag, run here instead: the mask, per layer (rare)
        bias = prompt_bias(meta.seq_lens, seq, q.dtype)
    # [rows, kv_heads, group, seq, dim] queries against [rows, kv_heads, 1, keys, dim] keys: GQA by broadcast.
    query = (q * scale).view(rows, seq, kv_heads, group, dim).permute(0, 2, 3, 1, 4)
    keys = keys.permute(0, 2, 1, 3).unsqueeze(2)
    values = values.permute(0, 2, 1, 3).unsqueeze(2)
    scores = torch.matmul(query, keys.transpose(-1, -2))  # [rows, kv_heads, group, seq, keys]
    stat = torch.float32 if fp32_softmax else q.dtype
    scores = scores.to(stat) + bias.to(stat).unsqueeze(2)  # bias [rows, 1, 1, seq, keys]
    probs = torch.softmax(scores, dim=-1).to(values.dtype)
    out = torch.matmul(probs, values)  # [rows, kv_heads, group, seq, dim]
    return out.permute(0, 3, 1, 2, 4).reshape(rows * seq, heads, dim)
