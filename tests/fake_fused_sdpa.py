"""A stand-in for Habana's `habana_frameworks.torch.hpex.kernels.FusedSDPA`, for CPU tests only.

The real kernel runs only on Gaudi hardware, which cannot exist on the machines these tests run on. This
fake implements, with plain torch ops, the semantics backends/hpu/fused_sdpa.py relies on (the call as
vllm-hpu-extension's ModuleFusedSDPA makes it), so that the plumbing around the call can be tested:

  FusedSDPA.apply(query [B, H, S, D], key [B, KVH, L, D], value [B, KVH, L, D], attn_mask, dropout_p,
                  is_causal, scale, softmax_mode, recompute_mode, valid_sequence_lengths, padding_side)
  -> [B, H, S, D]

- GQA: H a multiple of KVH, each kv head serving H / KVH consecutive query heads;
- attn_mask: additive (float, -inf hides) or boolean (True keeps), broadcast to [B, H, S, L];
- is_causal: key j visible to query i only when j <= i (S == L);
- valid_sequence_lengths [B] with padding_side "right": keys at or past the row's length hidden;
- softmax_mode "fp32": scores and softmax in fp32, "fast": in the input dtype; recompute_mode: ignored.

It says nothing about the real kernel's numerics, speed or exact support matrix: nothing here ran on Gaudi.
"""

from __future__ import annotations

import itertools
import sys
import types
from typing import Any, ClassVar

import pytest
import torch


class FakeFusedSDPA:
    """Records every call (calls: the keyword view of each) and computes the documented result."""

    calls: ClassVar[list[dict[str, Any]]] = []

    @staticmethod
    def apply(
        query,
        key,
        value,
        attn_mask,
        dropout_p,
        is_causal,
        scale,
        softmax_mode,
        recompute_mode,
        valid_sequence_lengths,
        padding_side="left",
    ):
        FakeFusedSDPA.calls.append(
            dict(
                attn_mask=attn_mask,
                dropout_p=dropout_p,
                is_causal=is_causal,
                scale=scale,
                softmax_mode=softmax_mode,
                recompute_mode=recompute_mode,
                valid_sequence_lengths=valid_sequence_lengths,
                padding_side=padding_side,
                shapes=(tuple(query.shape), tuple(key.shape)),
            )
        )
        assert dropout_p == 0.0 and softmax_mode in ("fast", "fp32")
        heads, kv_heads = query.shape[1], key.shape[1]
        key = key.repeat_interleave(heads // kv_heads, dim=1)
        value = value.repeat_interleave(heads // kv_heads, dim=1)
        stat = torch.float32 if softmax_mode == "fp32" else query.dtype
        scores = torch.matmul(query, key.transpose(-1, -2)).to(stat) * scale  # [B, H, S, L]
        s, length = scores.shape[-2], scores.shape[-1]
        keep = torch.ones(scores.shape, dtype=torch.bool)
        if is_causal:
            assert s == length, "causal form without a prefix only"
            keep &= torch.ones(s, length, dtype=torch.bool).tril()
        if valid_sequence_lengths is not None:
            assert padding_side == "right"
            keep &= torch.arange(length).view(1, 1, 1, -1) < valid_sequence_lengths.view(-1, 1, 1, 1)
        if attn_mask is not None:
            if attn_mask.dtype == torch.bool:
                keep &= attn_mask
            else:
                scores = scores + attn_mask.to(stat)
        scores = scores.masked_fill(~keep, float("-inf"))
        return torch.matmul(torch.softmax(scores, dim=-1).to(value.dtype), value)


def install_fake_fused_sdpa(monkeypatch: pytest.MonkeyPatch) -> type[FakeFusedSDPA]:
    """Put the fake where `from habana_frameworks.torch.hpex.kernels import FusedSDPA` finds it (for this test
    only: monkeypatch restores sys.modules), with an empty call record."""
    names = [
        "habana_frameworks",
        "habana_frameworks.torch",
        "habana_frameworks.torch.hpex",
        "habana_frameworks.torch.hpex.kernels",
    ]
    modules = {name: types.ModuleType(name) for name in names}
    modules["habana_frameworks.torch.hpex.kernels"].FusedSDPA = FakeFusedSDPA  # type: ignore[attr-defined]
    for parent, child in itertools.pairwise(names):
        setattr(modules[parent], child.rsplit(".", 1)[1], modules[child])
    for name, module in modules.items():
        monkeypatch.setitem(sys.modules, name, module)
    FakeFusedSDPA.calls = []
    return FakeFusedSDPA
