"""Where a py-spy recording spent its samples, per process and thread: the functions most often on the
stack (inclusive) and at its top (self), from `py-spy record --format raw --threads [--subprocesses]`.

    PYTHONPATH=. python benchmarks/py_spy_summary.py server_stacks.txt --top 25 --output-json summary.json

Prints a table per thread and writes JSON. A sample counts once per function however deep its recursion.
"""

from __future__ import annotations

import argparse
import collections
import json
import re
from typing import Any

_PROCESS = re.compile(r'process (\d+):"([^"]*)";')  # a command line may hold ';' itself (python -c)
_THREAD = re.compile(r"^thread \((\d+)\)(?:: (.*))?$")


def _place(stack: str) -> tuple[str, str, list[str]]:
    """(process, thread, code frames) of one stack: the innermost process and thread frames name them."""
    processes = _PROCESS.findall(stack)
    process = "?"
    if processes:
        pid, command = processes[-1]
        process = f"{pid} {command[-70:] or '(the recorded command)'}"
    frames = _PROCESS.sub("", stack).split(";")
    thread, start = "?", 0
    for index, frame in enumerate(frames):
        if match := _THREAD.match(frame):
            thread = match.group(2) or match.group(1)
            start = index + 1
    return process, thread, frames[start:]


def summarize(path: str, top: int) -> dict[str, Any]:
    inclusive: dict[tuple[str, str], collections.Counter[str]] = collections.defaultdict(collections.Counter)
    leaves: dict[tuple[str, str], collections.Counter[str]] = collections.defaultdict(collections.Counter)
    totals: collections.Counter[tuple[str, str]] = collections.Counter()
    with open(path, encoding="utf-8") as handle:
        for line in handle:
            stack, _, count = line.rstrip("\n").rpartition(" ")
            if not stack:
                continue
            process, thread, frames = _place(stack)
            key, samples = (process, thread), int(count)
            totals[key] += samples
            for name in {frame.split(" (")[0] for frame in frames}:
                inclusive[key][name] += samples
            if frames:
                leaves[key][frames[-1]] += samples
    return {
        "samples": sum(totals.values()),
        "threads": [
            {
                "process": process,
                "thread": thread,
                "samples": samples,
                "inclusive": inclusive[process, thread].most_common(top),
                "self": leaves[process, thread].most_common(top),
            }
            for (process, thread), samples in totals.most_common()
        ],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("recording", help="py-spy's raw output (collapsed stacks)")
    parser.add_argument("--top", type=int, default=20)
    parser.add_argument("--min-share", type=float, default=0.01, help="leave out threads under this share")
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args()
    summary = summarize(args.recording, args.top)
    total = summary["samples"]
    summary["threads"] = [t for t in summary["threads"] if t["samples"] >= args.min_share * total]
    for thread in summary["threads"]:
        share = thread["samples"] / total
        print(f"\n{thread['process']} / {thread['thread']}: {thread['samples']} samples ({share:.1%})")
        print(f"  {'on the stack':>12}  {'share':>6}  function")
        for name, samples in thread["inclusive"]:
            print(f"  {samples:>12}  {samples / thread['samples']:>6.1%}  {name}")
        print(f"  {'at the top':>12}  {'share':>6}  frame")
        for name, samples in thread["self"][:10]:
            print(f"  {samples:>12}  {samples / thread['samples']:>6.1%}  {name}")
    if args.output_json:
        with open(args.output_json, "w", encoding="utf-8") as handle:
            json.dump(summary, handle, indent=1)


if __name__ == "__main__":
    main()
