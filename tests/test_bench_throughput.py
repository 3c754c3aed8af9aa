"""engine bench throughput: the step-class table the offline figures are read from."""

from __future__ import annotations

import pytest

from engine.bench_throughput import step_classes


def test_steps_grouped_by_kind_and_next_power_of_two() -> None:
    steps = [
        ("decode", 1, 0, 4.0),
        ("decode", 3, 0, 5.0),
        ("decode", 4, 0, 7.0),
        ("decode", 5, 0, 8.0),
        ("mixed", 500, 984, 50.0),
        ("mixed", 508, 1000, 54.0),
        ("prefill", 0, 8192, 200.0),
    ]
    table = step_classes(steps, flops_per_token=1e9)
    by_key = {(row["kind"], row["tokens_up_to"]): row for row in table}
    assert list(by_key) == [("decode", 1), ("decode", 4), ("decode", 8), ("mixed", 2048), ("prefill", 8192)]
    assert by_key[("decode", 4)]["steps"] == 2 and by_key[("decode", 4)]["mean_decode_rows"] == 3.5
    assert by_key[("decode", 4)]["mean_ms"] == 6.0
    mixed = by_key[("mixed", 2048)]
    assert (mixed["steps"], mixed["mean_decode_rows"], mixed["mean_prefill_tokens"]) == (2, 504, 992)
    assert mixed["total_s"] == pytest.approx(0.104)
    # 2,992 tokens x 1 GFLOP in 104 ms
    assert mixed["matmul_tflops"] == pytest.approx(2992 * 1e9 / 0.104 / 1e12)
