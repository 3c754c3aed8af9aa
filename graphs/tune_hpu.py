"""`engine tune-capture --device hpu --cost-table FILE`: propose Gaudi (batch, blocks) buckets. NEVER RUN ON GAUDI.

Nothing here measures: the HPU runner warms its buckets as a whole (backends/hpu/graph_runner.py has no
per-bucket capture or replay hook), so the step times come from a cost table measured on a Gaudi,

    {"hpu_buckets": {"points": [[bs, blocks, ms], ...], "eager_points": [[bs, blocks, ms], ...],
                     "warmup_s_per_bucket": 1.5}}

(at least three points each), priced for every other bucket by a fitted plane (graphs/tune_buckets.py).
The written file carries capture_sizes (the batch buckets; HpuEngineRunner takes them) and an `hpu:`
section with the block range; the HPU runner reads configs/hpu.yaml itself, so the range reaches it
through --output configs/hpu.yaml or the ENGINE_DECODE_BLOCK_BUCKET_* variables the header lists.
"""

from __future__ import annotations

import argparse
import json
import math
import os
from datetime import datetime, timezone
from typing import TYPE_CHECKING

from backends.hpu.bucketing import resolve_bucket_config
from graphs.buckets import parse_sizes
from graphs.tune_buckets import PlaneCost, evaluate_hpu, propose_hpu_buckets, step_distribution
from graphs.tune_distribution import SizeDistribution
from graphs.tune_output import write_json, write_tuned_yaml
from graphs.tune_select import candidate_sizes

if TYPE_CHECKING:
    from engine.config import EngineConfig


def tune_hpu(args: argparse.Namespace, config: "EngineConfig", distribution: SizeDistribution) -> int:
    if not args.cost_table:
        raise ValueError("--device hpu selects from measured figures: pass --cost-table (docs/tuning.md gives the form)")
    with open(args.cost_table, encoding="utf-8") as handle:
        table = json.load(handle)["hpu_buckets"]
    step_ms = PlaneCost.fit([tuple(p) for p in table["points"]])
    eager_ms = PlaneCost.fit([tuple(p) for p in table["eager_points"]])
    warmup = float(table.get("warmup_s_per_bucket", 0.0))
    page_size = int(config.page_size)
    settings = {**config.device_config, "capture_sizes": config.capture_sizes, "page_size": page_size,
                "max_model_len": config.max_model_len, "max_num_seqs": config.max_num_seqs}
    current = resolve_bucket_config(settings)
    max_blocks_per_seq = math.ceil(int(config.max_model_len) / page_size)
    max_blocks_total = int(config.max_num_seqs) * max_blocks_per_seq
    steps = step_distribution(distribution, args.context, page_size)
    default = evaluate_hpu(current.decode_bs, current.decode_block, steps, step_ms, eager_ms, max_blocks_per_seq,
                           max_blocks_total)
    max_buckets = args.max_graphs or default[3]
    budget_s = args.capture_time_budget_s if args.capture_time_budget_s is not None else default[3] * warmup or None
    candidates = parse_sizes(args.candidates) or candidate_sizes(current.decode_bs, distribution, int(config.max_num_seqs))
    proposal = propose_hpu_buckets(steps, step_ms, eager_ms, candidates, parse_sizes(args.hpu_block_steps) or [128],
                                   max_blocks_per_seq, max_blocks_total, max_buckets, warmup,
                                   None if budget_s is None or math.isinf(budget_s) else budget_s)
    r = proposal.block_range
    date = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    header = [
        f"HPU decode buckets proposed by `engine tune-capture --device hpu` on {date} from the cost table "
        f"{args.cost_table} (a plane fitted to {len(table['points'])} measured buckets). Never run on Gaudi hardware.",
        f"Distribution: {distribution.summary()}; rows of {args.context} tokens ({page_size}-token pages).",
        f"Proposed: batch buckets {list(proposal.batch_buckets)} x {proposal.strategy} block buckets {{min: {r.min}, "
        f"step: {r.step}, max: {r.max}}} = {proposal.buckets} buckets; expected {proposal.expected_ms:.3f} ms/step, "
        f"padding {proposal.padded_rows:.2f} rows and {proposal.padded_blocks:.1f} blocks per step.",
        f"Current configs/hpu.yaml: batch {list(current.decode_bs)} x {len(current.decode_block)} block buckets = "
        f"{default[3]} buckets; expected {default[0]:.3f} ms/step, padding {default[1]:.2f} rows and {default[2]:.1f} "
        "blocks per step.",
        f"The block range reaches the HPU runner through configs/hpu.yaml or ENGINE_DECODE_BLOCK_BUCKET_MIN={r.min} "
        f"ENGINE_DECODE_BLOCK_BUCKET_STEP={r.step} ENGINE_DECODE_BLOCK_BUCKET_MAX={r.max} ENGINE_HPU_BUCKETING="
        f"{proposal.strategy}.",
    ]
    output = args.output or os.path.join("configs", "tuned", "hpu-buckets.yaml")
    hpu_keys = proposal.config()["hpu"]
    write_tuned_yaml(output, proposal.batch_buckets, header,
                     {"model": args.model, "device": "hpu", "page_size": page_size, "date": date}, {"hpu": hpu_keys})
    json_path = args.json or os.path.splitext(output)[0] + ".json"
    write_json(json_path, {"date": date, "proposal": proposal.__dict__ | {"block_range": r.__dict__},
                           "current": {"expected_ms": default[0], "padded_rows": default[1], "padded_blocks": default[2],
                                       "buckets": default[3]}, "cost_table": table})
    print("\n".join(header))
    print(f"\nwrote {output} and {json_path}")
    return 0
