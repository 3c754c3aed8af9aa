"""benchmarks/py_spy_summary.py on a recording of a server and its engine process, whose command line
holds a ';' (python -c "...; spawn_main(...)"), as py-spy writes them with --subprocesses --threads."""

from __future__ import annotations

from pathlib import Path

from benchmarks.py_spy_summary import summarize

SERVER = 'process 10:"python -m engine.cli serve"'
ENGINE = 'process 11:"python -c from multiprocessing.spawn import spawn_main; spawn_main(pipe_handle=21)"'
RECORDING = f"""{SERVER};thread (10): MainThread;run (asyncio/runners.py:1);select (selectors.py:2) 30
{SERVER};thread (10): MainThread;run (asyncio/runners.py:1);write (asyncio/selector_events.py:3) 10
{SERVER};{ENGINE};thread (11): MainThread;step (engine/engine.py:4);step (engine/engine.py:4);sync (s.py:5) 50
{SERVER};{ENGINE};thread (11): MainThread;step (engine/engine.py:4);launch (engine/engine.py:6) 10
{SERVER};thread (12): engine-events;read (engine/server/engine_process.py:7) 5
"""


def test_samples_are_counted_per_process_and_thread(tmp_path: Path) -> None:
    path = tmp_path / "stacks.txt"
    path.write_text(RECORDING)
    summary = summarize(str(path), top=5)
    assert summary["samples"] == 105
    by_place = {(t["process"].split()[0], t["thread"]): t for t in summary["threads"]}
    assert {place: t["samples"] for place, t in by_place.items()} == {
        ("11", "MainThread"): 60,
        ("10", "MainThread"): 40,
        ("10", "engine-events"): 5,
    }
    engine = by_place["11", "MainThread"]
    # A recursive frame counts once per sample; the top of the stack is the frame with its line.
    assert dict(engine["inclusive"])["step"] == 60
    assert engine["self"][0] == ("sync (s.py:5)", 50)
    assert "spawn_main(pipe_handle=21)" in engine["process"]
