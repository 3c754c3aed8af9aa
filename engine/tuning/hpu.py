"""`engine tune-capture --device hpu --cost-table FILE`: propose Gaudi (batch, blocks) decode buckets and
(rows, tokens per row) prompt buckets. NEVER RUN ON GAUDI.

Nothing here measures: the HPU runner warms its buckets as a whole (backends/hpu/graph_runner.py has no
per-bucket capture or replay hook), so the step times come from a cost table measured on a Gaudi,

    {"hpu_buckets": {"points": [[bs, blocks, ms], ...], "eager_points": [[bs, blocks, ms], ...],
                     "warmup_s_per_bucket": 1.5}}

(at least three points each), priced for every other bucket by a fitted plane (engine/tuning/buckets.py).
With "prompt_points": [[rows, tokens_per_row, ms], ...] (at least three) and "warmup_s_per_prompt_bucket"
in the same table, the prompt_bs / prompt_seq ranges are proposed too (engine/tuning/prompt.py) for the
prompt lengths of --prompt-lengths; a table without prompt_points leaves the prompt buckets as they are.
The written file carries capture_sizes (the batch buckets; HpuEngineRunner takes them) and an `hpu:`
section with the block range; the HPU runner reads configs/hpu.yaml itself, so the range reaches it
through --output configs/hpu.yaml or the ENGINE_DECODE_BLOCK_BUCKET_* variables the header lists.
"""

from __future__ import annotations

import argparse
import json
import math
import os
from datetime import UTC, datetime
from typing import TYPE_CHECKING

from backends.hpu.bucketing import BucketRange, HpuBucketConfig, make_buckets, read_bucket_range, resolve_bucket_config
from engine.capture_sizes import parse_sizes
from engine.tuning.buckets import PlaneCost, evaluate_hpu, propose_hpu_buckets, step_distribution
from engine.tuning.distribution import SizeDistribution
from engine.tuning.output import decode_values, write_json, write_tuned_yaml
from engine.tuning.prompt import (
    PromptCost,
    PromptEvaluation,
    PromptProposal,
    describe_lengths,
    evaluate_pairs,
    load_prompt_lengths,
    prompt_steps,
    prompt_table,
    propose_prompt_buckets,
)
from engine.tuning.prompt_ctx import (
    CtxCost,
    CtxEvaluation,
    CtxProposal,
    ctx_steps,
    ctx_table,
    evaluate_ctx,
    load_prefix_lengths,
    propose_ctx_buckets,
)
from engine.tuning.select import candidate_sizes

if TYPE_CHECKING:
    from engine.config import EngineConfig


def tune_hpu(args: argparse.Namespace, config: EngineConfig, distribution: SizeDistribution) -> int:
    if not args.cost_table:
        raise ValueError(
            "--device hpu selects from measured figures: pass --cost-table (docs/tuning.md gives the form)"
        )
    with open(args.cost_table, encoding="utf-8") as handle:
        table = json.load(handle)["hpu_buckets"]
    # Checked before any work: a table with prompt points too few to fit is one error, not a half-written file.
    prompt_ms = PromptCost.fit(table["prompt_points"]) if "prompt_points" in table else None
    ctx_ms = CtxCost.fit(table["ctx_points"], int(config.page_size)) if "ctx_points" in table else None
    step_ms = PlaneCost.fit([tuple(p) for p in table["points"]])
    eager_ms = PlaneCost.fit([tuple(p) for p in table["eager_points"]])
    warmup = float(table.get("warmup_s_per_bucket", 0.0))
    page_size = int(config.page_size)
    settings = {
        **config.device_config,
        "capture_sizes": config.capture_sizes,
        "page_size": page_size,
        "max_model_len": config.max_model_len,
        "max_num_seqs": config.max_num_seqs,
    }
    current = resolve_bucket_config(settings)
    max_blocks_per_seq = math.ceil(int(config.max_model_len) / page_size)
    max_blocks_total = int(config.max_num_seqs) * max_blocks_per_seq
    steps = step_distribution(distribution, args.context, page_size)
    default = evaluate_hpu(
        current.decode_bs, current.decode_block, steps, step_ms, eager_ms, max_blocks_per_seq, max_blocks_total
    )
    max_buckets = args.max_graphs or default[3]
    budget_s = args.capture_time_budget_s if args.capture_time_budget_s is not None else default[3] * warmup or None
    candidates = parse_sizes(args.candidates) or candidate_sizes(
        current.decode_bs, distribution, int(config.max_num_seqs)
    )
    proposal = propose_hpu_buckets(
        steps,
        step_ms,
        eager_ms,
        candidates,
        parse_sizes(args.hpu_block_steps) or [128],
        max_blocks_per_seq,
        max_blocks_total,
        max_buckets,
        warmup,
        None if budget_s is None or math.isinf(budget_s) else budget_s,
    )
    r = proposal.block_range
    date = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
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
        f"The block range reaches the HPU runner through this file (--capture-config), configs/hpu.yaml or "
        f"--hpu-decode-block-bucket {r.min},{r.step},{r.max} --hpu-bucketing {proposal.strategy}; for one debugging "
        f"run, ENGINE_DECODE_BLOCK_BUCKET_MIN={r.min} ENGINE_DECODE_BLOCK_BUCKET_STEP={r.step} "
        f"ENGINE_DECODE_BLOCK_BUCKET_MAX={r.max}.",
    ]
    hpu_keys = dict(proposal.config()["hpu"])  # type: ignore[arg-type]
    prompt = None
    if prompt_ms is not None:
        prompt, prompt_header = _tune_prompt(args, config, settings, current, proposal.strategy, prompt_ms, table)
        header += prompt_header
        hpu_keys.update(prompt.chosen.config())
    else:
        header.append("Prompt buckets not tuned: the cost table has no prompt_points.")
    ctx = None
    if ctx_ms is not None and args.prefix_lengths:
        ctx, ctx_header = _tune_ctx(args, config, current, proposal.strategy, ctx_ms, table, prompt)
        header += ctx_header
        hpu_keys.update(ctx.chosen.config())
        if args.max_prompt_ctx_buckets:
            hpu_keys["max_prompt_ctx_buckets"] = args.max_prompt_ctx_buckets
    else:
        header.append(
            "Prefix (ctx) buckets not tuned: "
            + ("no --prefix-lengths." if ctx_ms is not None else "the cost table has no ctx_points.")
        )
    output = args.output or os.path.join("configs", "tuned", "hpu-buckets.yaml")
    write_tuned_yaml(
        output,
        decode_values(proposal.batch_buckets),
        header,
        {"model": args.model, "device": "hpu", "page_size": page_size, "date": date},
        {"hpu": hpu_keys},
    )
    json_path = args.json or os.path.splitext(output)[0] + ".json"
    write_json(
        json_path,
        {
            "date": date,
            "proposal": proposal.__dict__ | {"block_range": r.__dict__},
            "current": {
                "expected_ms": default[0],
                "padded_rows": default[1],
                "padded_blocks": default[2],
                "buckets": default[3],
            },
            "cost_table": table,
            "prompt": _prompt_json(prompt),
            "prompt_ctx": _ctx_json(ctx),
        },
    )
    print("\n".join(header))
    print(f"\nwrote {output} and {json_path}")
    return 0


def _tune_prompt(
    args: argparse.Namespace,
    config: EngineConfig,
    settings: dict,
    current: HpuBucketConfig,
    strategy: str,
    cost: PromptCost,
    table: dict,
) -> tuple[PromptProposal, list[str]]:
    """The prompt ranges for --prompt-lengths under the prompt budget, printed as a table; and header lines."""
    max_len = _longest_bucketed_prompt(config, current)
    lengths = load_prompt_lengths(args.prompt_lengths, max_len, args.metrics_url, args.api_key)
    steps = prompt_steps(lengths, args.prompts_per_step)
    warmup = float(table.get("warmup_s_per_prompt_bucket", 0.0))
    bs_now, seq_now = _current_prompt_ranges(settings)
    now = evaluate_pairs(bs_now, seq_now, current.prompt_pairs(int(config.max_model_len) - 1), steps, cost, warmup)
    # Default budget: the buckets warmed today, so the proposal never lengthens warm-up.
    max_buckets = args.max_prompt_buckets or now.buckets
    budget_s = args.prompt_warmup_budget_s
    budget_s = None if budget_s is None or math.isinf(budget_s) else budget_s
    max_rows = 1 << max(0, math.ceil(math.log2(args.prompts_per_step)))  # no more rows than a step brings
    proposal = propose_prompt_buckets(
        lengths,
        steps,
        cost,
        now,
        strategy,
        parse_sizes(args.hpu_prompt_seq_steps),
        max_rows,
        current.max_num_batched_tokens,
        warmup,
        max_buckets,
        budget_s,
    )
    print(prompt_table(proposal, max_buckets, budget_s) + "\n")
    c, bs, seq = proposal.chosen, proposal.chosen.bs_range, proposal.chosen.seq_range
    header = [
        f"Prompt buckets from {len(table['prompt_points'])} measured prefill passes (ms = a + b*rows*seq + "
        f"c*rows*seq^2: a={cost.a:.3f}, b={cost.b:.3g}, c={cost.c:.3g}), {warmup:g} s warm-up per bucket. "
        f"Prompt lengths: {describe_lengths(lengths)}; {args.prompts_per_step} prompt(s) per prefill step.",
        f"Proposed: prompt_bs {{min: {bs.min}, step: {bs.step}, max: {bs.max}}} x prompt_seq {{min: {seq.min}, step: "
        f"{seq.step}, max: {seq.max}}} ({strategy}) = {c.buckets} prompt buckets ({c.warmup_s:.1f} s warm-up); "
        f"expected {c.expected_ms:.3f} ms and {c.padded_tokens:.1f} padded tokens per prompt; budget {max_buckets} "
        f"buckets{f', {budget_s:g} s' if budget_s is not None else ''}.",
        f"Current: prompt_bs {bs_now.min}/{bs_now.step}/{bs_now.max} x prompt_seq {seq_now.min}/{seq_now.step}/"
        f"{seq_now.max} = {now.buckets} prompt buckets; expected {now.expected_ms:.3f} ms and "
        f"{now.padded_tokens:.1f} padded tokens per prompt. max_num_batched_tokens stays "
        f"{current.max_num_batched_tokens}.",
        f"The prompt ranges reach the HPU prefill runner through configs/hpu.yaml or ENGINE_PROMPT_BS_BUCKET_MIN="
        f"{bs.min} ENGINE_PROMPT_BS_BUCKET_STEP={bs.step} ENGINE_PROMPT_BS_BUCKET_MAX={bs.max} "
        f"ENGINE_PROMPT_SEQ_BUCKET_MIN={seq.min} ENGINE_PROMPT_SEQ_BUCKET_STEP={seq.step} "
        f"ENGINE_PROMPT_SEQ_BUCKET_MAX={seq.max}.",
    ]
    return proposal, header


def _tune_ctx(
    args: argparse.Namespace,
    config: EngineConfig,
    current: HpuBucketConfig,
    strategy: str,
    cost: CtxCost,
    table: dict,
    prompt: PromptProposal | None,
) -> tuple[CtxProposal, list[str]]:
    """The context range for --prefix-lengths over the prompt buckets in force (the proposed ones when prompt
    buckets were tuned too), printed as a table; and header lines."""
    page, max_model_len = int(config.page_size), int(config.max_model_len)
    new_tokens = load_prompt_lengths(
        args.prompt_lengths, _longest_bucketed_prompt(config, current), args.metrics_url, args.api_key
    )
    prefixes = load_prefix_lengths(args.prefix_lengths, max_model_len - 1)
    steps = ctx_steps(new_tokens, prefixes, page, max_model_len)
    pairs = prompt.chosen.pairs if prompt is not None else current.prompt_pairs(max_model_len - 1)
    bs, seq = sorted({b for b, _ in pairs}), sorted({s for _, s in pairs})
    limit = args.max_prompt_ctx_buckets or current.max_prompt_ctx_buckets
    warmup = float(table.get("warmup_s_per_prompt_bucket", 0.0))

    def evaluate_buckets(label: BucketRange | None, ctx: list[int]) -> CtxEvaluation:
        return evaluate_ctx(
            label, ctx, bs, seq, page, max_model_len, current.max_num_batched_tokens, limit, steps, cost, warmup
        )

    def evaluate(ctx_range: BucketRange) -> CtxEvaluation:
        return evaluate_buckets(ctx_range, make_buckets(ctx_range, strategy))

    # The buckets in force are the engine's own list (config and environment); the range only labels them.
    configured = (config.device_config.get("hpu") or {}).get("prompt_ctx_bucket") or {"min": 1, "step": 4, "max": 0}
    now_range, _ = read_bucket_range("prompt_ctx", configured, os.environ)
    now = evaluate_buckets(now_range if current.prompt_ctx else None, current.prompt_ctx)
    proposal = propose_ctx_buckets(steps, now, evaluate, parse_sizes(args.hpu_ctx_steps))
    print(ctx_table(proposal) + "\n")
    c, r, cur = proposal.chosen, proposal.chosen.ctx_range, proposal.current
    assert r is not None
    now_text = f"{cur.ctx_range.min}/{cur.ctx_range.step}/{cur.ctx_range.max}" if cur.ctx_range else "off"
    header = [
        f"Prefix buckets from {len(table['ctx_points'])} measured prefill passes with a prefix (ms = a + b*rows*seq + "
        f"c*rows*seq^2 + d*rows*seq*ctx_tokens: a={cost.a:.3f}, b={cost.b:.3g}, c={cost.c:.3g}, d={cost.d:.3g}). "
        f"Prefixed steps: new tokens {describe_lengths(new_tokens)}; cached prefixes {describe_lengths(prefixes)}.",
        f"Proposed: prompt_ctx {{min: {r.min}, step: {r.step}, max: {r.max}}} pages ({strategy}) = {c.buckets} prefix "
        f"buckets (at most {limit}); expected {c.expected_ms:.3f} ms and {c.padded_tokens:.1f} padded tokens per "
        f"prefixed step.",
        f"Current: prompt_ctx {now_text} = {cur.buckets} prefix buckets; "
        + (
            f"expected {cur.expected_ms:.3f} ms and {cur.padded_tokens:.1f} padded tokens per prefixed step."
            if cur.covers
            else "some prefixed steps fit no bucket and would run unpadded (a new graph per shape)."
        ),
        f"The range reaches the HPU prefill runner through configs/hpu.yaml or ENGINE_PROMPT_CTX_BUCKET_MIN={r.min} "
        f"ENGINE_PROMPT_CTX_BUCKET_STEP={r.step} ENGINE_PROMPT_CTX_BUCKET_MAX={r.max}.",
    ]
    return proposal, header


def _ctx_json(proposal: CtxProposal | None) -> dict | None:
    if proposal is None:
        return None

    def one(e: CtxEvaluation) -> dict:
        return {
            "prompt_ctx_bucket": e.ctx_range.__dict__ if e.ctx_range else None,
            "buckets": e.buckets,
            "expected_ms": e.expected_ms,
            "padded_tokens": e.padded_tokens,
            "warmup_s": e.warmup_s,
            "covers": e.covers,
        }

    return {
        "chosen": one(proposal.chosen),
        "current": one(proposal.current),
        "candidates": [one(e) for e in proposal.candidates],
    }


def _longest_bucketed_prompt(config: EngineConfig, current: HpuBucketConfig) -> int:
    """Prompt lengths above this are counted at it: no prompt exceeds max_model_len - 1, a longer one is cut
    into chunks of chunked_prefill_size (only the first, which has no prefix, is bucketed), and no bucket
    holds more than max_num_batched_tokens."""
    limits = [int(config.max_model_len) - 1]
    chunk = (
        config.chunked_prefill_size
        if config.chunked_prefill_size is not None
        else config.device_config.get("chunked_prefill_size")
    )
    if chunk is not None and int(chunk) > 0:
        limits.append(int(chunk))
    if current.max_num_batched_tokens is not None:
        limits.append(current.max_num_batched_tokens)
    return min(limits)


def _current_prompt_ranges(settings: dict) -> tuple[BucketRange, BucketRange]:
    """The prompt ranges in force (hpu.prompt_*_bucket under ENGINE_PROMPT_*_BUCKET_*), with
    resolve_bucket_config's fallbacks for a file that has none."""
    hpu = dict(settings.get("hpu") or {})
    page, max_len = int(settings["page_size"]), int(settings["max_model_len"])
    bs, _ = read_bucket_range(
        "prompt_bs", {"min": 1, "step": 1, "max": 1, **(hpu.get("prompt_bs_bucket") or {})}, os.environ
    )
    seq, _ = read_bucket_range(
        "prompt_seq", {"min": page, "step": page, "max": max_len, **(hpu.get("prompt_seq_bucket") or {})}, os.environ
    )
    return bs, seq


def _prompt_json(proposal: PromptProposal | None) -> dict | None:
    if proposal is None:
        return None

    def one(e: PromptEvaluation) -> dict:
        return {
            "prompt_bs_bucket": e.bs_range.__dict__,
            "prompt_seq_bucket": e.seq_range.__dict__,
            "buckets": e.buckets,
            "expected_ms": e.expected_ms,
            "padded_tokens": e.padded_tokens,
            "warmup_s": e.warmup_s,
            "covers": e.covers,
            "pairs": [list(p) for p in e.pairs],
        }

    return {
        "chosen": one(proposal.chosen),
        "current": one(proposal.current),
        "candidates": [one(e) for e in proposal.candidates],
    }
