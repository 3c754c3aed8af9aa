"""`engine tune-capture`: the selection (synthetic cost tables), the distributions (files, specs, the /metrics
histogram), the engine's step-size counts, and one end-to-end CPU run whose file the engine then captures.

HPU and NPU selection run here on synthetic tables only: never on Gaudi or Ascend hardware.
"""

from __future__ import annotations

import http.server
import itertools
import json
import os
import random
import shutil
import threading
from collections.abc import Iterator, Sequence

import pytest
import yaml
from conftest import REPO_ROOT, track

from backends.cpu.platform import CpuPlatform
from engine.engine import Engine
from engine.sampling_params import SamplingParams
from engine.stats import DECODE_BATCH_BOUNDS, EngineStats, StepSizeCounts
from engine.tuning.buckets import PlaneCost, evaluate_hpu, propose_hpu_buckets, step_distribution
from engine.tuning.distribution import (
    SizeDistribution,
    fetch_metrics,
    from_prometheus_text,
    load_distribution,
    load_distribution_file,
    parse_spec,
)
from engine.tuning.output import BEGIN, END, decode_values, write_tuned_yaml
from engine.tuning.select import Budget, CostModel, SizeCost, evaluate, select_sizes

CUDA_LIKE_DEFAULTS = [1, 2, 4, 8, 16, 24, 32, 48, 64]


def linear_model(sizes: list[int], per_row_ms: float = 0.05) -> CostModel:
    """A decode step that costs its weight read (5 ms) plus a little per row: padding is cheap but not free;
    eager is 4x slower. Memory and capture time grow with the size."""
    costs = [SizeCost(s, 5.0 + per_row_ms * s, memory_mib=1.0 + 0.1 * s, capture_s=0.5 + 0.01 * s) for s in sizes]
    return CostModel(costs, {1: 20.0, 128: 20.0 + 0.2 * 127})


def skewed() -> SizeDistribution:
    return parse_spec("1-4:0.1,33-36:0.6,49-52:0.3")


# ---- selection ---------------------------------------------------------------------------------------


def test_selection_is_the_exhaustive_optimum_within_every_budget() -> None:
    rng = random.Random(3)
    for _ in range(60):
        sizes = sorted(rng.sample(range(1, 40), rng.randint(1, 7)))
        costs = [SizeCost(s, 1 + 0.1 * s + rng.random(), rng.uniform(1, 10), rng.uniform(0.1, 3)) for s in sizes]
        model = CostModel(
            costs,
            {1: 5.0, 40: 5 + rng.uniform(1, 20)},
            fixed_capture_s=rng.choice([0.0, 1.0]),
            memory_mib_per_top_row=rng.choice([0.0, 0.2]),
            shared_pool=rng.choice([False, True]),
        )
        dist = SizeDistribution.from_counts({b: rng.random() ** 3 for b in range(1, 45)}, "random")
        budget = Budget(
            memory_mib=rng.choice([None, 15.0, 30.0]),
            capture_s=rng.choice([None, 3.0, 6.0]),
            max_graphs=rng.choice([None, 2, 3]),
            cover=rng.choice([None, None, sizes[-1]]),
        )
        feasible = []
        for k in range(len(sizes) + 1):
            for subset in itertools.combinations(sizes, k):
                e = evaluate(subset, dist, model)
                if budget.cover is not None and (not subset or max(subset) < budget.cover):
                    continue
                if (
                    e.memory_mib <= (budget.memory_mib or 1e18)
                    and e.capture_s <= (budget.capture_s or 1e18)
                    and e.graphs <= (budget.max_graphs or 10**9)
                ):
                    feasible.append(e)
        if not feasible:
            with pytest.raises(ValueError):
                select_sizes(dist, model, budget)
            continue
        best = min(e.expected_ms for e in feasible)
        got = select_sizes(dist, model, budget)
        assert got.expected_ms <= best * (1 + 1e-3) + 1e-9  # pruning compares resources on a 0.1% grid
        assert got.memory_mib <= (budget.memory_mib or 1e18) * (1 + 1e-9)
        assert got.capture_s <= (budget.capture_s or 1e18) * (1 + 1e-9)
        assert got.graphs <= (budget.max_graphs or 10**9)
        assert budget.cover is None or max(got.sizes) >= budget.cover


def test_skewed_distribution_gets_sizes_at_its_mass_and_less_padding_than_the_defaults() -> None:
    model = linear_model(list(range(1, 65)))
    dist = skewed()
    default = evaluate(CUDA_LIKE_DEFAULTS, dist, model)
    budget = Budget(memory_mib=default.memory_mib, capture_s=default.capture_s, max_graphs=len(CUDA_LIKE_DEFAULTS))
    tuned = select_sizes(dist, model, budget)
    assert 36 in tuned.sizes and 52 in tuned.sizes, tuned.sizes  # the top of each cluster: no padding inside it
    assert tuned.memory_mib <= default.memory_mib and tuned.capture_s <= default.capture_s
    assert len(tuned.sizes) <= len(CUDA_LIKE_DEFAULTS)
    # Defaults pad 33-36 to 48 and 49-52 to 64: ~12 rows a step; the tuned set only pads inside 1-4 and 33-36.
    assert default.padding_rows > 10 and tuned.padding_rows < 1.5, (default.padding_rows, tuned.padding_rows)
    assert tuned.expected_ms < default.expected_ms
    # Every size that serves a step lies at the distribution's mass.
    served = {min(s for s in tuned.sizes if s >= b) for b in dist.weights}
    assert all(s <= 4 or 33 <= s <= 36 or 49 <= s <= 52 for s in served), served


def test_batches_above_the_largest_size_pay_the_eager_step() -> None:
    model = linear_model([1, 2, 4, 8])
    dist = parse_spec("2:0.5,16:0.5")
    e = evaluate([1, 2, 4, 8], dist, model)
    assert e.eager_fraction == pytest.approx(0.5)
    assert e.expected_ms == pytest.approx(0.5 * (5.0 + 0.05 * 2) + 0.5 * model.eager_ms(16))
    # Eager at 16 costs ~4x a replay, but no candidate reaches 16: the tuner can only capture 2 for it.
    assert select_sizes(dist, model, Budget(max_graphs=1)).sizes == (2,)
    covered = linear_model([1, 2, 4, 8, 16])
    assert select_sizes(dist, covered, Budget(max_graphs=1)).sizes == (16,)  # one graph serving both beats eager
    assert select_sizes(dist, covered, Budget(max_graphs=2)).sizes == (2, 16)


def test_npu_graph_budget_bounds_the_number_of_sizes() -> None:
    from backends.npu.platform import NpuPlatform

    limit = NpuPlatform().max_captured_graphs(80, {"npu": {"max_graphs": 1800}})  # 1800 streams / 81 per graph
    assert limit == 22
    assert CpuPlatform().max_captured_graphs(80, {}) is None  # no limit but memory
    model = linear_model(list(range(1, 129)))
    tuned = select_sizes(load_distribution(None, None, 128), model, Budget(max_graphs=limit))
    assert len(tuned.sizes) == limit  # every extra graph helps a uniform distribution: the budget binds


def test_hpu_batch_and_block_buckets_within_the_bucket_budget() -> None:
    from backends.hpu.bucketing import BucketRange, linear_buckets, resolve_bucket_config

    step_ms = PlaneCost.fit([(1, 8, 10.1), (64, 512, 16.4), (32, 256, 13.2), (8, 1024, 20.3)])
    eager_ms = PlaneCost(60.0, 0.5, 0.05)
    steps = step_distribution(skewed(), context_tokens=1024, page_size=128)  # 8 blocks a row
    default_bs = linear_buckets(BucketRange(1, 32, 64))
    default_blocks = linear_buckets(BucketRange(128, 128, 2048))
    default = evaluate_hpu(default_bs, default_blocks, steps, step_ms, eager_ms, 32, 64 * 32)
    proposal = propose_hpu_buckets(
        steps,
        step_ms,
        eager_ms,
        list(range(1, 65)),
        [32, 64, 128],
        32,
        64 * 32,
        max_buckets=default[3],
        warmup_s_per_bucket=2.0,
    )
    assert proposal.buckets <= default[3]
    assert proposal.expected_ms < default[0] and proposal.padded_rows < default[1]
    assert 36 in proposal.batch_buckets and 52 in proposal.batch_buckets, proposal.batch_buckets
    # What it writes loads back through the HPU bucket reader into exactly these lists.
    written = {**proposal.config(), "page_size": 128, "max_model_len": 4096, "max_num_seqs": 64}
    loaded = resolve_bucket_config(written, env={})
    assert loaded.decode_bs == list(proposal.batch_buckets)
    assert loaded.decode_block == list(proposal.block_buckets)
    # A tighter bucket budget is respected too.
    tight = propose_hpu_buckets(
        steps, step_ms, eager_ms, list(range(1, 65)), [32, 64, 128], 32, 64 * 32, max_buckets=20
    )
    assert tight.buckets <= 20


def test_tune_capture_hpu_from_a_bucket_cost_table(tmp_path: pytest.TempPathFactory) -> None:
    """--device hpu --cost-table: the proposal lands in a file whose batch buckets and block range load back."""
    from backends.hpu.bucketing import resolve_bucket_config
    from engine.cli import main

    table = {
        "hpu_buckets": {
            "points": [[1, 8, 10.1], [64, 512, 16.4], [32, 256, 13.2], [8, 1024, 20.3]],
            "eager_points": [[1, 8, 60], [64, 512, 100], [8, 1024, 120]],
            "warmup_s_per_bucket": 2.0,
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
                "1-4:0.1,33-36:0.6,49-52:0.3",
                "--context",
                "1024",
                "--output",
                output,
            ]
        )
        == 0
    )
    with open(output, encoding="utf-8") as handle:
        text = handle.read()
    written = yaml.safe_load(text)
    assert 36 in written["capture_sizes"] and 52 in written["capture_sizes"]
    assert "Never run on Gaudi hardware" in text and "ENGINE_DECODE_BLOCK_BUCKET_STEP=" in text
    with open(os.path.join(REPO_ROOT, "configs", "hpu.yaml"), encoding="utf-8") as handle:
        device = yaml.safe_load(handle)
    merged = {**device, "capture_sizes": written["capture_sizes"], "hpu": {**device["hpu"], **written["hpu"]}}
    loaded = resolve_bucket_config(merged, env={})
    assert loaded.decode_bs == written["capture_sizes"] and loaded.strategy == written["hpu"]["bucketing"]
    r = written["hpu"]["decode_block_bucket"]
    assert loaded.decode_block[0] == r["min"] and loaded.decode_block[-1] == r["max"]


PROMPT_POINTS = [[1, 128, 12.0], [1, 1024, 30.0], [1, 4096, 110.0], [4, 512, 45.0]]


def prompt_case(prompts_per_step: int = 1):
    """A synthetic prefill cost, a skewed prompt-length distribution (90% at 500-530 tokens) and the current
    configs/hpu.yaml prompt buckets (one row, 128/128/4096, at most 4096 tokens) priced on it."""
    from backends.hpu.bucketing import BucketRange, linear_buckets, prompt_buckets
    from engine.tuning.prompt import PromptCost, evaluate_pairs, load_prompt_lengths, prompt_steps

    cost = PromptCost.fit(PROMPT_POINTS)
    lengths = load_prompt_lengths("500-530:0.9,100-1000:0.1", 4095)
    steps = prompt_steps(lengths, prompts_per_step)
    bs, seq = BucketRange(1, 1, 1), BucketRange(128, 128, 4096)
    current = evaluate_pairs(bs, seq, prompt_buckets(linear_buckets(bs), linear_buckets(seq), 4096), steps, cost, 3.0)
    return cost, lengths, steps, current


def test_hpu_prompt_buckets_pad_less_than_the_defaults_within_the_budget() -> None:
    from engine.tuning.prompt import propose_prompt_buckets

    cost, lengths, steps, current = prompt_case()
    assert current.buckets == 32 and current.padded_tokens > 60  # 500-530 pads to 512 or 640
    proposal = propose_prompt_buckets(
        lengths,
        steps,
        cost,
        current,
        "linear",
        [32, 64, 128, 256],
        1,
        4096,
        warmup_s_per_bucket=3.0,
        max_buckets=current.buckets,
    )
    chosen = proposal.chosen
    assert chosen.buckets <= current.buckets
    assert chosen.padded_tokens < current.padded_tokens / 2, chosen
    assert chosen.expected_ms <= current.expected_ms
    assert chosen.seq_range.max >= 1000  # every prompt of the distribution has a bucket
    # The least expected time among all priced candidates within the budget: none cheaper was passed over.
    within = [e for e in proposal.candidates if e.covers and e.buckets <= current.buckets]
    assert chosen.expected_ms == min(e.expected_ms for e in within)
    # Tighter budgets, in buckets and in warm-up seconds, are honoured and cost time.
    tight = propose_prompt_buckets(
        lengths, steps, cost, current, "linear", [32, 64, 128, 256], 1, 4096, warmup_s_per_bucket=3.0, max_buckets=6
    )
    assert tight.chosen.buckets <= 6 and tight.chosen.expected_ms > chosen.expected_ms
    by_time = propose_prompt_buckets(
        lengths,
        steps,
        cost,
        current,
        "linear",
        [32, 64, 128, 256],
        1,
        4096,
        warmup_s_per_bucket=3.0,
        warmup_budget_s=12.0,
    )
    assert by_time.chosen.warmup_s <= 12.0
    with pytest.raises(ValueError, match="no prompt bucket range"):
        propose_prompt_buckets(lengths, steps, cost, current, "linear", [32], 1, 4096, max_buckets=2)


def test_hpu_prompt_buckets_batch_rows_when_a_step_brings_several_prompts() -> None:
    """With four prompts a step and a pass costing 10 ms before its first token, rows > 1 pay off; the
    priced passes are the prefill runner's own grouping (backends/hpu/prefill.group_prompts)."""
    from backends.hpu.bucketing import make_buckets, prompt_buckets
    from backends.hpu.prefill import group_prompts
    from engine.tuning.prompt import propose_prompt_buckets

    cost, lengths, steps, current = prompt_case(prompts_per_step=4)
    proposal = propose_prompt_buckets(
        lengths, steps, cost, current, "linear", [32, 64, 128], 4, 4096, warmup_s_per_bucket=3.0, max_buckets=64
    )
    chosen = proposal.chosen
    assert chosen.bs_range.max > 1 and chosen.expected_ms < current.expected_ms
    pairs = prompt_buckets(make_buckets(chosen.bs_range, "linear"), make_buckets(chosen.seq_range, "linear"), 4096)
    assert list(chosen.pairs) == pairs and all(bs * seq <= 4096 for bs, seq in pairs)
    ms = sum(p * sum(cost(*bucket) for _, bucket in group_prompts(list(step), pairs)) for p, step in steps)
    assert chosen.expected_ms == pytest.approx(ms / 4)


def test_tune_capture_hpu_writes_prompt_buckets_that_load_back(tmp_path: pytest.TempPathFactory) -> None:
    """The written hpu: section, laid over configs/hpu.yaml, gives BucketConfig.prompt_pairs() == the proposal."""
    from backends.hpu.bucketing import resolve_bucket_config
    from engine.cli import main

    table = {
        "hpu_buckets": {
            "points": [[1, 8, 10.1], [64, 512, 16.4], [32, 256, 13.2], [8, 1024, 20.3]],
            "eager_points": [[1, 8, 60], [64, 512, 100], [8, 1024, 120]],
            "warmup_s_per_bucket": 2.0,
            "prompt_points": PROMPT_POINTS,
            "warmup_s_per_prompt_bucket": 3.0,
        }
    }
    path, output, lengths = str(tmp_path / "hpu.json"), str(tmp_path / "hpu.yaml"), str(tmp_path / "lengths.json")
    with open(path, "w", encoding="utf-8") as handle:
        json.dump(table, handle)
    with open(lengths, "w", encoding="utf-8") as handle:
        json.dump([300] * 6 + [310] * 3 + [700], handle)  # observed prompt lengths
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
                lengths,
                "--output",
                output,
            ]
        )
        == 0
    )
    with open(output, encoding="utf-8") as handle:
        text = handle.read()
    with open(output[: -len(".yaml")] + ".json", encoding="utf-8") as handle:
        report = json.load(handle)["prompt"]
    written = yaml.safe_load(text)["hpu"]
    assert "Never run on Gaudi hardware" in text and "ENGINE_PROMPT_SEQ_BUCKET_STEP=" in text
    assert written["prompt_seq_bucket"] == report["chosen"]["prompt_seq_bucket"]
    assert report["chosen"]["padded_tokens"] < report["current"]["padded_tokens"]
    with open(os.path.join(REPO_ROOT, "configs", "hpu.yaml"), encoding="utf-8") as handle:
        device = yaml.safe_load(handle)
    loaded = resolve_bucket_config({**device, "hpu": {**device["hpu"], **written}}, env={})
    pairs = [tuple(p) for p in report["chosen"]["pairs"]]
    assert loaded.prompt_pairs() == pairs and loaded.prompt_pairs(device["max_model_len"] - 1) == pairs
    assert max(seq for _, seq in pairs) >= 700 and min(seq for _, seq in pairs) <= 310


def test_tune_capture_hpu_rejects_too_few_prompt_points(
    tmp_path: pytest.TempPathFactory, capsys: pytest.CaptureFixture[str]
) -> None:
    from engine.cli import main
    from engine.tuning.prompt import PromptCost

    with pytest.raises(ValueError, match="at least three prompt_points"):
        PromptCost.fit([[1, 128, 12.0], [1, 1024, 30.0]])
    table = {
        "hpu_buckets": {
            "points": [[1, 8, 10.1], [64, 512, 16.4], [32, 256, 13.2]],
            "eager_points": [[1, 8, 60], [64, 512, 100], [8, 1024, 120]],
            "prompt_points": [[1, 128, 12.0], [1, 1024, 30.0]],
        }
    }
    path, output = str(tmp_path / "hpu.json"), str(tmp_path / "hpu.yaml")
    with open(path, "w", encoding="utf-8") as handle:
        json.dump(table, handle)
    assert main(["tune-capture", "--device", "hpu", "--cost-table", path, "--output", output]) == 2
    assert "at least three prompt_points" in capsys.readouterr().err and not os.path.exists(output)


def test_prompt_length_distributions(tmp_path: pytest.TempPathFactory) -> None:
    from engine.tuning.prompt import load_prompt_lengths

    default = load_prompt_lengths(None, 4095)
    assert min(default.weights) == 256 and max(default.weights) == 768 and default.mean == pytest.approx(512)
    weighted = str(tmp_path / "w.json")
    with open(weighted, "w", encoding="utf-8") as handle:
        json.dump({"100": 3, "5000": 1}, handle)  # length -> weight; 5000 is past the longest bucketed prompt
    found = load_prompt_lengths(weighted, 4095)
    assert found.weights == {100: 0.75, 4095: 0.25}


# ---- distributions -------------------------------------------------------------------------------------


def test_distribution_files_and_specs(tmp_path: pytest.TempPathFactory) -> None:
    as_map = tmp_path / "d.json"
    as_map.write_text(json.dumps({"1": 30, "4": 10}))
    pairs = tmp_path / "pairs.json"
    pairs.write_text(json.dumps([[1, 30], [4, 10]]))
    observed = tmp_path / "observed.json"
    observed.write_text(json.dumps([1, 1, 1, 4]))
    table = tmp_path / "d.csv"
    table.write_text("batch_size,count\n1,30\n4,10\n")
    for path in (as_map, pairs, table):
        d = load_distribution_file(str(path))
        assert d.weights == {1: 0.75, 4: 0.25} and d.observations == 40
    assert load_distribution_file(str(observed)).weights == {1: 0.75, 4: 0.25}
    spec = parse_spec("1-4:0.4,10:0.6")
    assert spec.weights == pytest.approx({1: 0.1, 2: 0.1, 3: 0.1, 4: 0.1, 10: 0.6})
    harmonic = sum(1 / s for s in range(1, 9))
    assert load_distribution(None, None, 8).weights == pytest.approx({s: 1 / s / harmonic for s in range(1, 9)})
    folded = load_distribution("2:1,20:1", None, 16)  # above max_num_seqs: counted at it
    assert folded.weights == {2: 0.5, 16: 0.5}
    with pytest.raises(ValueError):
        parse_spec("0:1")
    with pytest.raises(ValueError):
        SizeDistribution.from_counts({3: 0}, "empty")


def _metrics_text(sizes: list[int], tokens: list[int], prompts: Sequence[int] = ()) -> str:
    from engine.server.metrics import ServerMetrics

    counts = StepSizeCounts()
    for n in sizes:
        counts.decode_batch.observe(n)
    for n in tokens:
        counts.step_tokens.observe(n)
    for n in prompts:
        counts.record_prompt(n)
    stats = EngineStats(
        *([0] * 13),
        decode_batch_sizes=counts.decode_batch.snapshot(),
        extend_step_tokens=counts.step_tokens.snapshot(),
        prompt_tokens=counts.prompt_tokens.snapshot(),
    )
    return ServerMetrics(lambda: stats, "m").render().decode()


def test_prometheus_histogram_round_trip() -> None:
    sizes = [1] * 5 + [3] * 2 + [32] * 3 + [37, 37] + [130] + [2000]
    text = _metrics_text(sizes, [300, 5])
    assert 'engine:decode_batch_size_bucket{le="3.0",model_name="m"} 7.0' in text
    assert "engine:extend_step_tokens_count" in text
    d = from_prometheus_text(text)
    # Exact where each size has its own bucket (to 32); above, a bucket's steps spread evenly over its sizes:
    # (36, 38] over 37 and 38, (128, 136] over eight; 2000 is past the last bound (1024): placed where the
    # sum puts it.
    n = len(sizes)
    assert d.weights[1] == pytest.approx(5 / n) and d.weights[3] == pytest.approx(2 / n)
    assert d.weights[32] == pytest.approx(3 / n)
    assert [d.weights[s] for s in (37, 38)] == pytest.approx([1 / n] * 2)
    assert [d.weights[s] for s in range(129, 137)] == pytest.approx([1 / 8 / n] * 8)
    beyond = [s for s in d.weights if s > 1024]  # the sum's leftover is off by the spreading above (a few rows)
    assert len(beyond) == 1 and abs(beyond[0] - 2000) <= 8 and d.weights[beyond[0]] == pytest.approx(1 / n)
    assert d.observations == n
    assert DECODE_BATCH_BOUNDS[:32] == tuple(range(1, 33))


def test_prompt_lengths_come_from_the_metrics_histogram(metrics_server: tuple[str, list[str]]) -> None:
    """The HPU prompt tuner reads engine:request_prompt_tokens from the same scrape as the batch sizes: 32-token
    buckets to 1,024 spread evenly over their lengths; a file or spec given explicitly wins."""
    from engine.tuning.prompt import load_prompt_lengths

    url, seen = metrics_server
    lengths = load_prompt_lengths(None, 4096, url, api_key="k3y")
    # 300, 310 (bucket (288, 320]) and 700 (bucket (672, 704]): each bucket's count over its 32 lengths.
    assert set(lengths.weights) == set(range(289, 321)) | set(range(673, 705))
    assert sum(lengths.weights[n] for n in range(289, 321)) == pytest.approx(2 / 3)
    assert seen == ["Bearer k3y"]
    assert load_prompt_lengths("100:1", 4096, url).weights == {100: 1.0}
    assert len(seen) == 1  # the spec was used, no scrape


@pytest.fixture
def metrics_server() -> Iterator[tuple[str, list[str]]]:
    """A stand-in /metrics endpoint that records the Authorization header of each request."""
    text = _metrics_text([2, 2, 5], [], prompts=[300, 310, 700])
    seen: list[str] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            seen.append(self.headers.get("Authorization", ""))
            body = text.encode() if self.path == "/metrics" else b""
            self.send_response(200 if body else 404)
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}", seen
    server.shutdown()


def test_metrics_url_is_read_with_the_api_key(metrics_server: tuple[str, list[str]]) -> None:
    url, seen = metrics_server
    d = load_distribution(None, url, 64, api_key="k3y")
    assert d.weights == pytest.approx({2: 2 / 3, 5: 1 / 3})
    assert seen == ["Bearer k3y"]
    assert "engine:decode_batch_size" in fetch_metrics(url + "/metrics")


# ---- the engine: step-size counts, /metrics, and the tuned file ------------------------------------------


def test_engine_counts_step_sizes_and_serves_them_on_metrics(smol_engine: Engine) -> None:
    from fastapi.testclient import TestClient

    from engine.server.app import build_app

    before = smol_engine.stats()
    prompts = ["The capital of France is", "Here is a list of three fruits:", "Once upon a time"]
    smol_engine.generate(prompts, SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True))
    after = smol_engine.stats()
    decode = after.decode_batch_sizes.count - before.decode_batch_sizes.count
    assert decode == 4  # 5 tokens each: one from the (single) prefill step, then 4 decode steps of 3 rows
    assert after.decode_batch_sizes.counts[2] - before.decode_batch_sizes.counts[2] == 4  # the bucket le=3
    assert after.extend_step_tokens.count - before.extend_step_tokens.count == 1
    prompt_tokens = sum(len(smol_engine.tokenizer.encode(p)) for p in prompts)
    assert after.extend_step_tokens.total - before.extend_step_tokens.total == prompt_tokens
    # One prompt-length observation per request, of its whole prompt.
    assert after.prompt_tokens.count - before.prompt_tokens.count == 3
    assert after.prompt_tokens.total - before.prompt_tokens.total == prompt_tokens
    with TestClient(build_app(smol_engine)) as client:
        text = client.get("/metrics").text
    d = from_prometheus_text(text)
    assert d.weights.get(3, 0) > 0 and "engine:extend_step_tokens_bucket" in text
    assert 'engine:request_prompt_tokens_bucket{le="32.0",model_name=' in text


def test_workload_replay_through_engine_steps_counts_padding_and_eager_steps(smol_engine: Engine) -> None:
    from collections import Counter

    from engine.tuning.measure import make_runner
    from engine.tuning.workload import replay_workload, sample_steps

    runners = {}
    for name, sizes in (("both", [1, 2]), ("two", [2]), ("one", [1])):
        runners[name] = make_runner(smol_engine, sizes)
        runners[name].capture()
    dist = parse_spec("1:0.5,2:0.5")
    drawn = sample_steps(dist, 20, seed=5, max_sizes=8)
    ones, twos = drawn[1], drawn[2]
    assert ones + twos == 20 and ones and twos
    results = {r.name: r for r in replay_workload(smol_engine, runners, dist, 20, iters=2, context=16, seed=5)}
    assert smol_engine.runner.graph_runner is None  # the engine's own (none: graphs off) is back
    assert (results["both"].padding_rows, results["both"].eager_steps) == (0.0, 0)
    assert results["two"].padding_rows == pytest.approx(ones / 20) and results["two"].eager_steps == 0
    assert results["two"].padded_fraction == pytest.approx(ones / (2 * 20))
    assert (results["one"].padding_rows, results["one"].eager_steps) == (0.0, twos)
    for r in results.values():
        assert set(r.step_ms) == {1, 2} and all(ms > 0 for ms in r.step_ms.values())
        weighted = (ones * r.step_ms[1] + twos * r.step_ms[2]) / 20
        assert r.mean_step_ms == pytest.approx(weighted)
    assert sample_steps(dist, 20, seed=5, max_sizes=8) == drawn and isinstance(drawn, Counter)


def test_write_into_a_device_yaml_changes_only_the_tuned_block(tmp_path: pytest.TempPathFactory) -> None:
    path = str(tmp_path / "cpu.yaml")
    shutil.copy(os.path.join(REPO_ROOT, "configs", "cpu.yaml"), path)
    with open(path, encoding="utf-8") as handle:
        original = yaml.safe_load(handle)
    write_tuned_yaml(path, decode_values([1, 3, 6]), ["first run"], {"device": "cpu"})
    write_tuned_yaml(path, decode_values([1, 2, 5, 9]), ["second run", "a longer header line " * 10], {"device": "cpu"})
    with open(path, encoding="utf-8") as handle:
        text = handle.read()
    loaded = yaml.safe_load(text)
    assert loaded["capture_sizes"] == [1, 2, 5, 9] and loaded["max_capture_size"] == 9
    assert {k: v for k, v in loaded.items() if k not in ("capture_sizes", "max_capture_size")} == {
        k: v for k, v in original.items() if k not in ("capture_sizes", "max_capture_size")
    }
    assert text.count(BEGIN) == 1 and text.count(END) == 1 and "first run" not in text and "tuned_for" not in text


def test_tune_capture_end_to_end_writes_sizes_the_engine_captures(tmp_path: pytest.TempPathFactory) -> None:
    from engine.cli import main

    output, table = str(tmp_path / "tuned.yaml"), str(tmp_path / "tuned.json")
    args = [
        "tune-capture",
        "--device",
        "cpu",
        "--max-num-seqs",
        "3",
        "--context",
        "16",
        "--iters",
        "3",
        "--candidates",
        "1,2",
        "--distribution",
        "1:0.6,2:0.3,3:0.1",
        "--no-verify",
        "--memory-budget-mib",
        "inf",
        "--capture-time-budget-s",
        "inf",
        "--output",
        output,
    ]
    assert main(args) == 0
    with open(output, encoding="utf-8") as handle:
        text = handle.read()
    written = yaml.safe_load(text)
    sizes = written["capture_sizes"]
    # Which of 1 and 2 pays depends on this box's timings (a replay of 1 row is not always faster than of 2
    # here); what must hold: a non-empty subset of the candidates, the best one for the figures measured.
    assert sizes and set(sizes) <= {1, 2} and written["max_capture_size"] == max(sizes)
    assert written["tuned_for"]["device"] == "cpu"
    for words in (
        "Measured at candidate sizes [1, 2]",
        "Distribution: spec 1:0.6,2:0.3,3:0.1",
        "torch ",
        "Expected decode step, default [1, 2, 3]",
    ):
        assert words in text, words
    with open(table, encoding="utf-8") as handle:
        report = json.load(handle)
    measured = report["measurements"]["sizes"]
    assert [m["size"] for m in measured] == [1, 2]
    assert all(m["replay_ms"] > 0 and m["eager_ms"] > 0 and m["capture_s"] > 0 for m in measured)
    assert set(report["measurements"]["eager_points"]) == {"1", "2", "3"}
    from engine.tuning.command import cost_model
    from engine.tuning.measure import MeasureReport

    model = cost_model(MeasureReport.from_dict(report["measurements"]))
    dist = parse_spec("1:0.6,2:0.3,3:0.1")
    best = min((evaluate(s, dist, model) for s in ([1], [2], [1, 2])), key=lambda e: e.expected_ms)
    assert report["tuned"]["expected_ms"] == pytest.approx(best.expected_ms)

    # The engine loads the file and captures exactly those sizes.
    engine = track(
        Engine(device="cpu", capture_config=output, max_num_seqs=3, kv_cache_tokens=512, page_size=16, dtype="float32")
    )
    runner = engine.runner.graph_runner
    assert runner is not None and runner.capture_sizes == sizes and runner.max_batch_size == max(sizes)
    assert engine.stats().decode_batch_sizes.count == 0  # the warm-up request's steps are not counted
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    engine.generate(["The capital of France is", "Hello"], params)
    two_rows = 3 if max(sizes) >= 2 else 0  # three decode steps of 2 rows: a graph only if one holds 2
    assert engine.runner.graph_steps == two_rows
    engine.generate(["The capital of France is", "Hello", "One two three"], params)
    assert engine.runner.graph_steps == two_rows  # rows of 3: no graph holds them, they ran eagerly
    counts = engine.stats().decode_batch_sizes
    assert counts.count == 6 and counts.counts[1] == 3 and counts.counts[2] == 3  # buckets le=2 and le=3


def test_tune_capture_from_a_cost_table(tmp_path: pytest.TempPathFactory) -> None:
    """--cost-table: no measuring; the selection of a fixed table, within the default sizes' budgets."""
    from engine.cli import main

    model = linear_model(list(range(1, 17)))
    sizes = [
        {
            "size": c.size,
            "replay_ms": c.replay_ms,
            "eager_ms": model.eager_ms(c.size),
            "capture_s": c.capture_s,
            "first_capture_s": c.capture_s,
            "memory_mib": c.memory_mib,
            "memory_source": "rss",
        }
        for c in model.costs
    ]
    table = {
        "model": {"num_layers": 30},
        "measurements": {
            "sizes": sizes,
            "eager_points": {"1": 20.0, "16": 23.0},
            "fixed_capture_s": 0.0,
            "fixed_memory_mib": 0.0,
            "logits_mib_per_row": 0.0,
            "capture_kind": "compile",
            "context": 64,
            "iters": 5,
        },
    }
    path, output = str(tmp_path / "table.json"), str(tmp_path / "out.yaml")
    with open(path, "w", encoding="utf-8") as handle:
        json.dump(table, handle)
    assert (
        main(
            [
                "tune-capture",
                "--device",
                "cpu",
                "--cost-table",
                path,
                "--distribution",
                "3:0.5,11-12:0.5",
                "--output",
                output,
            ]
        )
        == 0
    )
    with open(output, encoding="utf-8") as handle:
        written = yaml.safe_load(handle)
    # Defaults [1, 2, 4, 8, 16] pad 3 to 4 and 11-12 to 16; within their memory and capture time every step gets
    # a graph of its own size.
    assert written["capture_sizes"] == [3, 11, 12]
