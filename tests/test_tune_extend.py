"""`engine tune-capture --extend`: token-count buckets of extend/mixed-step graphs.

On the CPU (no CUDA graphs here) the selection runs from a cost table in the tuner's own JSON form and its
file is loaded by an engine config; on a GPU the tuner measures a tiny model and an engine built with its
file captures exactly the buckets it chose.
"""

from __future__ import annotations

import itertools
import json

import pytest
import yaml

from engine.config import EngineConfig
from engine.tuning.distribution import TOKENS_HISTOGRAM, SizeDistribution, load_distribution, parse_spec
from engine.tuning.extend import MIN_BUCKET, extend_candidates
from engine.tuning.output import BEGIN, EXTEND_BEGIN, decode_values, write_tuned_yaml
from engine.tuning.select import CostModel, evaluate

BUCKETS = [16, 64, 256, 1024, 4096, 8192]


def unbucketed_ms(tokens: int) -> float:
    """A compiled step: ~8 ms of launches at any size (host-bound), then 0.02 ms a token."""
    return max(8.0, 1.0 + 0.02 * tokens)


def cost_table() -> dict:
    """Graphs save the launches (replay 1 ms + 0.02 ms a token) and cost memory and capture time."""
    sizes = [
        {
            "size": b,
            "replay_ms": 1.0 + 0.02 * b,
            "eager_ms": unbucketed_ms(b),
            "capture_s": 0.3,
            "first_capture_s": 0.3,
            "memory_mib": 10.0 + b / 64,
            "memory_source": "device",
        }
        for b in BUCKETS
    ]
    return {
        "kind": "extend",
        "compile_extend": True,
        "measurements": {
            "sizes": sizes,
            "eager_points": {str(b): unbucketed_ms(b) for b in BUCKETS},
            "fixed_capture_s": 0.0,
            "fixed_memory_mib": 0.0,
            "logits_mib_per_row": 0.0,
            "capture_kind": "cuda_graph",
            "context": 512,
            "iters": 5,
        },
    }


def test_candidates_are_powers_of_two_and_the_distribution_s_quantiles_up_to_the_largest_step() -> None:
    distribution = parse_spec("40-45:0.5,3000-3010:0.5")
    candidates = extend_candidates([100], distribution, 8704)
    assert candidates[0] == MIN_BUCKET and candidates[-1] == 8704
    assert {16, 32, 64, 128, 4096, 8192, 100} <= set(candidates)
    assert 48 in candidates and 3008 in candidates and 3024 in candidates  # quantiles, rounded up to 16
    assert all(c <= 8704 for c in candidates)


def test_token_distribution_comes_from_the_extend_step_histogram(monkeypatch: pytest.MonkeyPatch) -> None:
    text = "\n".join(
        [
            "# TYPE engine:extend_step_tokens histogram",
            'engine:extend_step_tokens_bucket{le="8.0"} 0.0',
            'engine:extend_step_tokens_bucket{le="16.0"} 6.0',
            'engine:extend_step_tokens_bucket{le="24.0"} 6.0',
            'engine:extend_step_tokens_bucket{le="+Inf"} 6.0',
            "engine:extend_step_tokens_sum 60.0",
            "engine:extend_step_tokens_count 6.0",
            "",
        ]
    )
    import engine.tuning.distribution as module

    fetched: list[str] = []
    # The scrape itself is tested against a live server in test_tune_capture.py; here, which histogram is read.
    monkeypatch.setattr(module, "fetch_metrics", lambda url, key=None: fetched.append(url) or text)
    found = load_distribution(None, "http://server", 8192, histogram=TOKENS_HISTOGRAM)
    assert fetched == ["http://server"] and set(found.weights) == set(range(9, 17))


def _exhaustive_best(distribution: SizeDistribution, model: CostModel) -> tuple[int, ...]:
    subsets = (s for n in range(len(BUCKETS) + 1) for s in itertools.combinations(BUCKETS, n))
    return min(subsets, key=lambda s: evaluate(list(s), distribution, model).expected_ms)


def test_tune_capture_extend_from_a_cost_table_writes_buckets_the_engine_config_loads(tmp_path) -> None:
    from backends import platform_class
    from engine.cli import main
    from engine.tuning.command import cost_model
    from engine.tuning.measure import MeasureReport

    table_path, output = str(tmp_path / "table.json"), str(tmp_path / "cuda.yaml")
    with open(table_path, "w", encoding="utf-8") as handle:
        json.dump(cost_table(), handle)
    # A file that already carries a decode tuning: the extend block goes beside it.
    write_tuned_yaml(output, decode_values([1, 2, 8]), ["a decode tuning"], {"device": "cuda"})
    spec = "5-60:0.6,200-250:0.1,5000-8000:0.3"
    assert (
        main(
            [
                "tune-capture",
                "--extend",
                "--device",
                "cuda",
                "--cost-table",
                table_path,
                "--distribution",
                spec,
                "--memory-budget-mib",
                "inf",
                "--capture-time-budget-s",
                "inf",
                "--output",
                output,
            ]
        )
        == 0
    )
    with open(output, encoding="utf-8") as handle:
        text = handle.read()
    written = yaml.safe_load(text)
    assert text.count(BEGIN) == 1 and text.count(EXTEND_BEGIN) == 1 and written["capture_sizes"] == [1, 2, 8]
    model = cost_model(MeasureReport.from_dict(cost_table()["measurements"]))
    best = _exhaustive_best(parse_spec(spec), model)
    assert written["extend_capture_tokens"] == list(best) and written["compile_extend"] is True
    # Small steps are host-bound (8 ms unbucketed, 1.3-2.2 ms replayed): they get buckets; 5,000-8,000-token
    # steps padded to 8,192 would cost more than they save.
    assert 64 in best and 8192 not in best
    with open(str(tmp_path / "cuda.json"), encoding="utf-8") as handle:
        report = json.load(handle)
    assert report["tuned"]["expected_ms"] < report["unbucketed"]["expected_ms"]

    resolved = EngineConfig(device="cuda", capture_config=output).resolve(platform_class("cuda")())
    assert resolved.extend_capture_tokens == list(best) and resolved.compile_extend is True
    assert resolved.capture_sizes == [1, 2, 8]
    explicit = EngineConfig(device="cuda", capture_config=output, extend_capture_tokens="").resolve(
        platform_class("cuda")()
    )
    assert explicit.extend_capture_tokens == ""  # a flag on the command line still wins over the file


def test_memory_budget_limits_the_extend_buckets(tmp_path) -> None:
    from engine.cli import main

    table_path, output = str(tmp_path / "table.json"), str(tmp_path / "out.yaml")
    with open(table_path, "w", encoding="utf-8") as handle:
        json.dump(cost_table(), handle)
    assert (
        main(
            [
                "tune-capture",
                "--extend",
                "--device",
                "cuda",
                "--cost-table",
                table_path,
                "--distribution",
                "5-60:0.5,900-1000:0.5",
                "--memory-budget-mib",
                "12",
                "--output",
                output,
            ]
        )
        == 0
    )
    with open(output, encoding="utf-8") as handle:
        written = yaml.safe_load(handle)
    # 1,024's pool alone is 26 MiB: only the small buckets fit 12 MiB.
    assert written["extend_capture_tokens"] and max(written["extend_capture_tokens"]) <= 64


@pytest.mark.cuda
def test_tune_capture_extend_measures_and_the_engine_captures_exactly_its_buckets(tmp_path) -> None:
    from test_cuda import ENGINE_DEVICE, _tiny_llama

    from engine.cli import main
    from engine.engine import Engine
    from engine.sampling_params import SamplingParams

    model = _tiny_llama(tmp_path / "model")
    output = str(tmp_path / "extend.yaml")
    common = [
        "--model",
        model,
        "--device",
        ENGINE_DEVICE,
        "--dtype",
        "float32",
        "--max-num-seqs",
        "8",
        "--max-model-len",
        "1024",
        "--chunked-prefill-size",
        "256",
    ]
    assert (
        main(
            [
                "tune-capture",
                "--extend",
                *common,
                "--candidates",
                "16,64,256",
                "--distribution",
                "1-70:1",
                "--prompt-len",
                "40",
                "--iters",
                "5",
                "--memory-budget-mib",
                "inf",
                "--capture-time-budget-s",
                "inf",
                "--output",
                output,
            ]
        )
        == 0
    )
    with open(output, encoding="utf-8") as handle:
        written = yaml.safe_load(handle)
    with open(str(tmp_path / "extend.json"), encoding="utf-8") as handle:
        report = json.load(handle)
    measured = report["measurements"]["sizes"]
    assert [m["size"] for m in measured] == [16, 64, 256]
    assert all(m["replay_ms"] > 0 and m["eager_ms"] > 0 and m["capture_s"] > 0 for m in measured)
    engine = Engine(
        model=model,
        device=ENGINE_DEVICE,
        dtype="float32",
        max_num_seqs=8,
        max_model_len=1024,
        chunked_prefill_size=256,
        capture_config=output,
    )
    runner = engine.runner.extend_graphs
    if written["extend_capture_tokens"]:
        assert runner is not None and sorted(runner.graphs) == written["extend_capture_tokens"]
        engine.generate([[5] * 30], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
        assert runner.replays > 0
    else:
        assert runner is None
    assert engine.kv_pages_in_use() == 0
