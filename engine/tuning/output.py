"""What `engine tune-capture` leaves behind: the YAML the engine loads, its header comment, the JSON of
everything measured, and the table printed at the end.

The YAML keeps the shape of configs/<device>.yaml: `capture_sizes` and `max_capture_size` (read by
EngineConfig.resolve, as the device file's own), under a comment block saying what was measured, when,
on what, and the expected cost against the default sizes. Written into an existing device file, only
that block and those two keys change (between the begin/end markers), so every other key and comment
stays; a new file also gets `tuned_for` (model, device, dtype, page size), which `--capture-config`
checks against the engine it configures.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Sequence
from typing import Any

import yaml

from engine.tuning.select import Evaluation

BEGIN = "# --- tune-capture begin (engine tune-capture rewrites this block) ---"
END = "# --- tune-capture end ---"
EXTEND_BEGIN = "# --- tune-capture extend begin (engine tune-capture --extend rewrites this block) ---"
EXTEND_END = "# --- tune-capture extend end ---"


def describe(evaluation: Evaluation, unit: str = "rows", uncaptured: str = "eager") -> str:
    """One line of an evaluation; unit: what a step pads (decode rows, extend tokens), uncaptured: what a
    step past the largest graph runs as."""
    eager = f", {100 * evaluation.eager_fraction:.1f}% of steps {uncaptured}" if evaluation.eager_fraction else ""
    estimated = f"; interpolated costs for {list(evaluation.interpolated)}" if evaluation.interpolated else ""
    return (
        f"{evaluation.expected_ms:.3f} ms/step (padding {evaluation.padding_ms:.3f} ms, {evaluation.padding_rows:.2f} "
        f"{unit}/step = {100 * evaluation.padded_fraction:.1f}% of replayed {unit}{eager}); "
        f"{evaluation.graphs} graphs, ~{evaluation.memory_mib:.0f} MiB, "
        f"~{evaluation.capture_s:.1f} s capture{estimated}"
    )


def header_lines(info: dict[str, Any]) -> list[str]:
    """The comment block: what, when, on what, and the resulting expected cost vs the defaults."""
    tuned: Evaluation = info["tuned"]
    default: Evaluation = info["default"]
    gain = 100 * (default.expected_ms - tuned.expected_ms) / default.expected_ms if default.expected_ms else 0.0
    lines = [
        f"Decode capture sizes tuned by `engine tune-capture` on {info['date']} for {info['model']} "
        f"({info['dtype']}, page size {info['page_size']}) on {info['device']}: {info['machine']}.",
        f"Measured at candidate sizes {info['candidates']}: eager step, graph replay "
        f"(median of {info['iters']} back-to-back steps at {info['context']}-token contexts), "
        f"capture seconds and graph memory ({info['memory_source']}); "
        f"{info['cache']}.",
        f"Distribution: {info['distribution']}.",
        f"Budgets: {info['budget']}.",
        f"Expected decode step, tuned {list(tuned.sizes)}: {describe(tuned)}.",
        f"Expected decode step, default {list(default.sizes)}: {describe(default)}.",
        f"Tuned vs default: {gain:+.1f}% expected step time saved, padding {default.padding_rows:.2f} -> "
        f"{tuned.padding_rows:.2f} rows/step.",
    ]
    for line in info.get("extra", []):
        lines.append(line)
    lines.append(f"Reproduce: {info['command']}")
    return lines


def _comment(lines: Sequence[str], width: int = 118) -> list[str]:
    """Each line as YAML comments, wrapped at `width`."""
    out = []
    for line in lines:
        words, current = line.split(), "#"
        for word in words:
            if len(current) + 1 + len(word) > width and current != "#":
                out.append(current)
                current = "#  "
            current += " " + word
        out.append(current)
    return out


def _markers(kind: str) -> tuple[str, str]:
    return (BEGIN, END) if kind == "decode" else (EXTEND_BEGIN, EXTEND_END)


def tuned_block(
    values: dict[str, Any], header: Sequence[str], extra: dict[str, Any] | None = None, kind: str = "decode"
) -> list[str]:
    begin, end = _markers(kind)
    block = [begin, *_comment(header)]
    block += (
        yaml.safe_dump({**values, **(extra or {})}, sort_keys=False, default_flow_style=None).rstrip("\n").splitlines()
    )
    return [*block, end]


def decode_values(sizes: Sequence[int]) -> dict[str, Any]:
    """The keys a decode tuning writes: the sizes and the largest (EngineConfig.resolve reads both)."""
    return {"capture_sizes": sorted(int(s) for s in sizes), "max_capture_size": int(max(sizes))}


def write_tuned_yaml(
    path: str,
    values: dict[str, Any],
    header: Sequence[str],
    tuned_for: dict[str, Any],
    extra: dict[str, Any] | None = None,
    kind: str = "decode",
) -> str:
    """Write the tuned keys (`values`) to `path`: in place into an existing YAML (only this kind's block and
    those keys change, so a decode and an extend tuning live side by side), or as a new file. Returns the
    text written; raises if the result would not load back with those values."""
    begin, end = _markers(kind)
    if os.path.exists(path):
        with open(path, encoding="utf-8") as handle:
            old = handle.read().splitlines()
        in_block = False
        kept: list[str] = []
        insert_at = None
        for line in old:
            if line.strip() == begin:
                in_block, insert_at = True, len(kept) if insert_at is None else insert_at
                continue
            if in_block:
                in_block = line.strip() != end
                continue
            if re.match(rf"^({'|'.join(values)}):", line):
                insert_at = len(kept) if insert_at is None else insert_at
                continue
            kept.append(line)
        at = len(kept) if insert_at is None else insert_at
        lines = kept[:at] + tuned_block(values, header, extra, kind) + kept[at:]
    else:
        lines = tuned_block(values, header, {"tuned_for": tuned_for, **(extra or {})}, kind)
    text = "\n".join(lines) + "\n"
    loaded = yaml.safe_load(text) or {}
    if any(loaded.get(key) != value for key, value in values.items()):
        raise ValueError(f"{path}: the tuned file would not load back as {values}")
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", encoding="utf-8") as handle:
        handle.write(text)
    return text


def write_json(path: str, report: dict[str, Any]) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", encoding="utf-8") as handle:
        json.dump(report, handle, indent=2, default=str)


def print_tables(
    measured: Sequence[dict[str, Any]],
    probability: dict[int, float],
    tuned: Evaluation,
    default: Evaluation,
    others: Sequence[tuple[str, Evaluation]] = (),
    size_label: str = "size",
    uncaptured: str = "eager",
    default_label: str = "default",
    unit: str = "rows",
) -> None:
    """Per candidate: its figures, the share of steps it would serve, and whether tuned/default capture it.
    The labels say what a size is, what a step past the largest graph runs as, what the baseline set is
    called and what padding counts (decode sizes by default)."""
    eager_label = f"{uncaptured} ms"
    served: dict[int, float] = {}
    for batch, p in probability.items():
        size = next((s for s in tuned.sizes if s >= batch), None)
        if size is not None:
            served[size] = served.get(size, 0.0) + p
    head = (
        f"{size_label:>6} {eager_label:>13} {'replay ms':>10} {'speedup':>8} {'capture s':>10} {'memory MiB':>11} "
        f"{'p(<=size)':>11} {'served':>7} {'tuned':>6} {default_label:>8}"
    )
    print(head + "\n" + "-" * len(head))
    cumulative = 0.0
    sizes = sorted(m["size"] for m in measured)
    for row in sorted(measured, key=lambda m: m["size"]):
        size = row["size"]
        previous = sizes[sizes.index(size) - 1] if sizes.index(size) else 0
        cumulative += sum(p for b, p in probability.items() if previous < b <= size)
        speedup = row["eager_ms"] / row["replay_ms"] if row["replay_ms"] else float("nan")
        print(
            f"{size:>6} {row['eager_ms']:>13.3f} {row['replay_ms']:>10.3f} {speedup:>8.2f} {row['capture_s']:>10.2f} "
            f"{row['memory_mib']:>11.1f} {cumulative:>11.3f} {100 * served.get(size, 0.0):>6.1f}% "
            f"{'x' if size in tuned.sizes else '':>6} {'x' if size in default.sizes else '':>8}"
        )
    print()
    rows = [("tuned", tuned), (default_label, default), *others]
    head = (
        f"{'set':<10} {'ms/step':>9} {'padding ms':>11} {'pad ' + unit:>10} {'pad %':>7} "
        f"{uncaptured[:6] + ' %':>8} {'graphs':>7} {'MiB':>8} {'capture s':>10}  sizes"
    )
    print(head + "\n" + "-" * len(head))
    for name, e in rows:
        note = " (interpolated: " + ",".join(map(str, e.interpolated)) + ")" if e.interpolated else ""
        print(
            f"{name:<10} {e.expected_ms:>9.3f} {e.padding_ms:>11.3f} {e.padding_rows:>10.2f} "
            f"{100 * e.padded_fraction:>6.1f}% {100 * e.eager_fraction:>7.1f}% {e.graphs:>7} {e.memory_mib:>8.1f} "
            f"{e.capture_s:>10.2f}  "
            f"{list(e.sizes)}{note}"
        )
