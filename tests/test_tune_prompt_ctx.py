"""`engine tune-capture --device hpu --prefix-lengths ...`: the prefix (context) buckets of Gaudi prefill steps
with a cached prefix, from a synthetic cost table. NEVER RUN ON GAUDI: the figures are made up; what is checked
is the pricing (the prefill runner's own bucket choice), the search and that the written file loads back as
the buckets the engine would warm."""

from __future__ import annotations

import json
import os

import pytest
import yaml
from conftest import REPO_ROOT

from backends.hpu.bucketing import BucketRange, choose_prompt_ctx_bucket, make_buckets, resolve_bucket_config
from engine.tuning.distribution import parse_spec
from engine.tuning.prompt_ctx import CtxCost, ctx_steps, evaluate_ctx, propose_ctx_buckets

PAGE = 128
MAX_LEN = 4096
# rows, new tokens per row, context pages per row, ms: a pass's weight read, per token, per token and key.
CTX_POINTS = [
    [1, 128, 1, 12.2],
    [1, 512, 4, 20.5],
    [1, 128, 16, 15.0],
    [1, 1024, 8, 34.0],
    [2, 256, 2, 17.0],
    [1, 2048, 12, 75.0],
]
PROMPT_POINTS = [[1, 128, 12.0], [1, 1024, 30.0], [1, 4096, 110.0], [4, 512, 45.0]]


def case():
    """New tokens 200-260 after prefixes of 1,000-1,100 tokens (8-9 pages): the default context buckets
    (1, 4, 8, ..., 32 pages) pad a 9-page prefix to 12."""
    cost = CtxCost.fit(CTX_POINTS, PAGE)
    steps = ctx_steps(parse_spec("200-260"), parse_spec("1000-1100"), PAGE, MAX_LEN)
    bs, seq = [1], make_buckets(BucketRange(128, 128, 4096), "linear")

    def evaluate(r: BucketRange | None, ctx: list[int] | None = None):
        buckets = ctx if ctx is not None else (make_buckets(r, "linear") if r is not None else [])
        return evaluate_ctx(r, buckets, bs, seq, PAGE, MAX_LEN, 4096, 64, steps, cost, 3.0)

    return cost, steps, evaluate


def test_cost_fit_recovers_its_terms_and_needs_four_points() -> None:
    truth = CtxCost(10.0, 0.02, 1e-6, 3e-6, PAGE)
    points = [
        [r, s, c, truth(r, s, c)] for r, s, c in [(1, 128, 1), (1, 512, 4), (2, 256, 8), (1, 1024, 2), (4, 128, 16)]
    ]
    fitted = CtxCost.fit(points, PAGE)
    assert fitted.d == pytest.approx(truth.d, rel=1e-6) and fitted.a == pytest.approx(truth.a, rel=1e-6)
    with pytest.raises(ValueError, match="at least four ctx_points"):
        CtxCost.fit(points[:3], PAGE)


def test_steps_count_prefixes_in_pages_and_drop_what_does_not_fit() -> None:
    steps = ctx_steps(parse_spec("100:1,3900:1"), parse_spec("300:1"), PAGE, MAX_LEN)
    assert [(n, k) for _, n, k in steps] == [(100, 3)]  # 3,900 new tokens after 3 pages exceed 4,096
    assert sum(p for p, _, _ in steps) == pytest.approx(1.0)


def test_prefix_buckets_pad_less_than_the_defaults() -> None:
    _cost, steps, evaluate = case()
    current = evaluate(BucketRange(1, 4, 32))
    assert current.covers and current.padded_tokens > 100  # 9 pages pad to 12
    proposal = propose_ctx_buckets(steps, current, evaluate, [1, 2, 4, 8])
    chosen = proposal.chosen
    assert chosen.padded_tokens < current.padded_tokens and chosen.expected_ms < current.expected_ms
    assert chosen.buckets <= 64 and chosen.ctx_range.max == 9
    # Priced with the prefill runner's own choice: recompute one step by hand.
    _p, n, k = steps[0]
    bucket = choose_prompt_ctx_bucket(1, n, k, chosen.triples, PAGE)
    assert bucket[2] >= k and bucket[1] >= n
    assert chosen.expected_ms == min(e.expected_ms for e in proposal.candidates if e.covers)
    # Off (no context buckets) covers nothing: a prefixed step would run unpadded.
    assert not evaluate(None).covers


def test_a_bucket_cap_that_leaves_prefixes_out_is_refused() -> None:
    cost, steps, _ = case()

    def capped(r: BucketRange | None, ctx: list[int] | None = None):
        return evaluate_ctx(r, make_buckets(r, "linear"), [1], [128, 256], PAGE, MAX_LEN, 4096, 0, steps, cost, 3.0)

    with pytest.raises(ValueError, match="no context bucket range covers"):
        propose_ctx_buckets(steps, capped(BucketRange(1, 4, 32)), capped, [1])


def test_tune_capture_hpu_writes_prefix_buckets_that_load_back(tmp_path: pytest.TempPathFactory) -> None:
    from engine.cli import main

    table = {
        "hpu_buckets": {
            "points": [[1, 8, 10.1], [64, 512, 16.4], [32, 256, 13.2], [8, 1024, 20.3]],
            "eager_points": [[1, 8, 60], [64, 512, 100], [8, 1024, 120]],
            "warmup_s_per_bucket": 2.0,
            "prompt_points": PROMPT_POINTS,
            "ctx_points": CTX_POINTS,
            "warmup_s_per_prompt_bucket": 3.0,
        }
    }
    path, output = str(tmp_path / "hpu.json"), str(tmp_path / "hpu.yaml")
    with open(path, "w", encoding="utf-8") as handle:
        json.dump(table, handle)
    assert (
        main(
            [
                "tune-capture",
                "--device",
                "hpu",
                "--cost-table",
                path,
                "--distribution",
                "1-4:0.1,33-36:0.6",
                "--prompt-lengths",
                "200-260",
                "--prefix-lengths",
                "1000-1100",
                "--output",
                output,
            ]
        )
        == 0
    )
    with open(output, encoding="utf-8") as handle:
        text = handle.read()
    with open(output[: -len(".yaml")] + ".json", encoding="utf-8") as handle:
        report = json.load(handle)["prompt_ctx"]
    written = yaml.safe_load(text)["hpu"]
    assert "ENGINE_PROMPT_CTX_BUCKET_MAX=" in text and "Never run on Gaudi hardware" in text
    assert written["prompt_ctx_bucket"] == report["chosen"]["prompt_ctx_bucket"]
    assert report["chosen"]["padded_tokens"] < report["current"]["padded_tokens"]
    with open(os.path.join(REPO_ROOT, "configs", "hpu.yaml"), encoding="utf-8") as handle:
        device = yaml.safe_load(handle)
    loaded = resolve_bucket_config({**device, "hpu": {**device["hpu"], **written}}, env={})
    chosen = BucketRange(**written["prompt_ctx_bucket"])
    assert loaded.prompt_ctx == make_buckets(chosen, loaded.strategy)
    assert len(loaded.prompt_ctx_triples(device["max_model_len"] - 1)) == report["chosen"]["buckets"]


def test_tune_capture_hpu_without_prefix_lengths_leaves_the_context_buckets(tmp_path: pytest.TempPathFactory) -> None:
    from engine.cli import main

    table = {
        "hpu_buckets": {
            "points": [[1, 8, 10.1], [64, 512, 16.4], [32, 256, 13.2]],
            "eager_points": [[1, 8, 60], [64, 512, 100], [8, 1024, 120]],
            "ctx_points": CTX_POINTS,
        }
    }
    path, output = str(tmp_path / "hpu.json"), str(tmp_path / "hpu.yaml")
    with open(path, "w", encoding="utf-8") as handle:
        json.dump(table, handle)
    assert main(["tune-capture", "--device", "hpu", "--cost-table", path, "--output", output]) == 0
    with open(output, encoding="utf-8") as handle:
        text = handle.read()
    assert "Prefix (ctx) buckets not tuned: no --prefix-lengths." in text
    assert "prompt_ctx_bucket" not in (yaml.safe_load(text).get("hpu") or {})
