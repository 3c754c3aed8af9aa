"""Request grammars judged before admission (issue #48): size and nesting limits, the compile deadline in
killable compiler processes, cancellation when every waiter leaves, and grammars that no text can match.

The limits: accepted at the limit, refused one past it, with a message naming the flag. The deadline: the
same grammar accepted under a generous one and refused under a tight one (its worker killed). The server's
side of each (the attacks with a canary beside them) is in tests/test_server_hostile.py.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from engine.errors import InvalidRequestError
from engine.structured import GrammarLimits, GrammarSpec, validate_grammar
from engine.structured.checker import GrammarChecker, Ticket, tokenizer_info_json
from engine.structured.limits import nesting_depth

xgr = pytest.importorskip("xgrammar")

LIMITS = GrammarLimits(max_chars=2000, max_depth=8)


def nested_arrays(levels: int) -> dict[str, Any]:
    """A schema whose JSON nests `levels` deep ({"type": "string"} is one level)."""
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(levels - 1):
        schema = {"type": "array", "items": schema}
    return schema


def wide_object(properties: int, tag: str = "f") -> dict[str, Any]:
    """Shallow and small to look at, slow to compile: 300 properties ~0.3 s, 2,000 ~28 s on one core."""
    return {
        "type": "object",
        "properties": {f"{tag}_{i}": {"type": ["string", "integer", "null"]} for i in range(properties)},
    }


NESTING: dict[str, Callable[[int], GrammarSpec]] = {
    "json_schema": lambda levels: GrammarSpec.json_schema(nested_arrays(levels)),
    "regex": lambda levels: GrammarSpec("regex", "(" * levels + "a" + ")" * levels),
    "ebnf": lambda levels: GrammarSpec("ebnf", "root ::= " + "(" * levels + '"a"' + ")" * levels),
}


@pytest.mark.parametrize("kind", sorted(NESTING))
def test_nesting_at_the_limit_is_accepted_and_one_level_more_refused_naming_the_limit(kind: str) -> None:
    at_limit, over = NESTING[kind](8), NESTING[kind](9)
    assert nesting_depth(at_limit) == 8 and nesting_depth(over) == 9
    validate_grammar(at_limit, LIMITS)
    with pytest.raises(InvalidRequestError, match=r"nests 9 levels deep; at most 8 \(--grammar-max-depth\)"):
        validate_grammar(over, LIMITS)


@pytest.mark.parametrize(
    "spec",
    [
        GrammarSpec.json_schema({"type": "string", "pattern": "((((((((((a))))))))))", "description": "[[{{[[{{[[{{"}),
        GrammarSpec("regex", r"[(((((((((((]\(\(\(\(\(\(\(\(\(\(x"),
        GrammarSpec("ebnf", 'root ::= "((((((((((" [(((((((((((] # ((((((((((((\n'),
        GrammarSpec.choice(["[[[[[[[[[[", "{{{{{{{{{{{"]),
    ],
    ids=["json strings", "regex class and escapes", "ebnf string, class, comment", "choice"],
)
def test_brackets_inside_strings_classes_escapes_and_comments_do_not_nest(spec: GrammarSpec) -> None:
    assert nesting_depth(spec) <= 1
    validate_grammar(spec, LIMITS)


def _padded(kind: str, chars: int) -> GrammarSpec:
    """A spec of exactly `chars` characters."""
    if kind == "json_schema":
        bare = len(GrammarSpec.json_schema({"type": "string", "description": ""}).text)
        return GrammarSpec.json_schema({"type": "string", "description": "x" * (chars - bare)})
    if kind == "regex":
        return GrammarSpec("regex", "a" * chars)
    return GrammarSpec("ebnf", 'root ::= "' + "a" * (chars - 11) + '"')


@pytest.mark.parametrize("kind", ["json_schema", "regex", "ebnf"])
def test_size_at_the_limit_is_accepted_and_one_character_more_refused_naming_the_limit(kind: str) -> None:
    at_limit, over = _padded(kind, 2000), _padded(kind, 2001)
    assert (len(at_limit.text), len(over.text)) == (2000, 2001)
    validate_grammar(at_limit, LIMITS)
    with pytest.raises(InvalidRequestError, match=r"has 2,001 characters; at most 2,000 \(--grammar-max-chars\)"):
        validate_grammar(over, LIMITS)


def test_json_text_nested_past_pythons_recursion_limit_is_refused_not_a_crash() -> None:
    with pytest.raises(InvalidRequestError, match="nests too deep"):
        GrammarSpec.json_schema("[" * 100_000 + "]" * 100_000)


# ---- the compiler processes ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def info_json() -> str:
    from engine.loader.resolve import resolve_model_source
    from engine.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(resolve_model_source(None).tokenizer_dir)
    return tokenizer_info_json(tokenizer, len(tokenizer))


@pytest.fixture
def checkers(info_json: str) -> Iterator[Callable[..., GrammarChecker]]:
    """GrammarChecker(limits...) over SmolLM2's vocabulary; each closed (its processes killed) after the test."""
    made: list[GrammarChecker] = []

    def make(**limits: Any) -> GrammarChecker:
        made.append(GrammarChecker(lambda: info_json, GrammarLimits(**limits)))
        return made[-1]

    yield make
    for checker in made:
        checker.close()


def _verdict(checker: GrammarChecker, spec: GrammarSpec) -> str | None:
    """None if the grammar is fine, else the 400's message."""
    ticket = checker.check(spec)
    try:
        ticket.future.result(timeout=120)
        return None
    except InvalidRequestError as exc:
        return str(exc)
    finally:
        ticket.release()


def _until(condition: Callable[[], bool], seconds: float, what: str) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


UNSATISFIABLE = {
    "regex [^\\s\\S]": GrammarSpec("regex", r"[^\s\S]"),
    "schema pattern [^\\s\\S]": GrammarSpec.json_schema({"type": "string", "pattern": r"[^\s\S]"}),
    "property pattern": GrammarSpec.json_schema(
        {"type": "object", "properties": {"a": {"type": "string", "pattern": r"[^\s\S]"}}, "required": ["a"]}
    ),
    "ebnf of no character": GrammarSpec("ebnf", r"root ::= [^\0-\U0010FFFF]"),
    "ebnf dead end after a prefix": GrammarSpec("ebnf", 'root ::= "a" [^\\x00-\\U0010ffff]'),
    "regex with a dead branch": GrammarSpec("regex", r"x|y[^\s\S]"),
}
SATISFIABLE = {
    "negated class": GrammarSpec("regex", r"[^a-y]+"),
    "class of every character": GrammarSpec("regex", r"[\s\S]{2}"),
    "starred empty class": GrammarSpec("ebnf", 'root ::= "a" [^\\0-\\U0010ffff]*'),
    "every character but one": GrammarSpec("ebnf", r"root ::= [^\0-\uD7FF\uE000-\U0010FFFE]"),
    "choice": GrammarSpec.choice(["yes", "no"]),
    "json object": GrammarSpec("json_object"),
}


def test_grammars_no_text_can_match_are_refused_and_their_look_alikes_accepted(
    checkers: Callable[..., GrammarChecker],
) -> None:
    checker = checkers(workers=2)
    for name, spec in UNSATISFIABLE.items():
        message = _verdict(checker, spec)
        assert message is not None and "can never be matched" in message, (name, message)
        assert "character class in it matches no character" in message, (name, message)
    for name, spec in SATISFIABLE.items():
        assert _verdict(checker, spec) is None, name
    assert "Regex parsing error" in (_verdict(checker, GrammarSpec("regex", "(unclosed")) or "")


def test_the_same_grammar_is_accepted_under_the_deadline_and_refused_over_it(
    checkers: Callable[..., GrammarChecker],
) -> None:
    spec = GrammarSpec.json_schema(wide_object(300))  # ~0.3 s of CPU to parse and compile
    assert _verdict(checkers(compile_timeout_s=60.0, workers=1), spec) is None
    tight = checkers(compile_timeout_s=0.05, workers=1)
    assert _verdict(tight, spec) == (
        "grammar too complex: the json schema did not compile within 0.05 s (--grammar-compile-timeout)"
    )
    assert tight.counts().timed_out == 1
    assert _verdict(tight, GrammarSpec("regex", "a")) is None  # the killed worker was replaced


def test_started_means_every_compiler_process_is_up(checkers: Callable[..., GrammarChecker]) -> None:
    """What the server waits for before it says it is ready: every slot's first worker process running (the fork
    server's imports done), so none of that start-up shares the CPU with the first requests' steps."""
    checker = checkers(workers=2)
    assert not checker.wait_started(0.0)  # not started yet: nothing to wait for
    checker.start()
    assert checker.wait_started(120.0)
    pool = checker._pool
    assert pool is not None
    assert pool.wait_started(0.0)  # again, at once
    assert pool._first_starts == 2  # each slot started its first worker
    assert _verdict(checker, GrammarSpec("regex", "[a-z]+")) is None


def test_a_check_whose_waiters_all_left_stops_at_once_and_its_worker_is_replaced(
    checkers: Callable[..., GrammarChecker],
) -> None:
    checker = checkers(compile_timeout_s=120.0, workers=1)
    slow = GrammarSpec.json_schema(wide_object(2000, "slow"))  # ~28 s of compile if left to run
    first, second = checker.check(slow), checker.check(slow)  # two requests share one check
    queued = checker.check(GrammarSpec.json_schema(wide_object(2000, "queued")))  # behind it: one worker
    _until(lambda: checker.counts().running == 1, 60, "the slow check never started")
    queued.release()
    assert queued.future.cancelled() and checker.counts().queued == 0  # dropped before it ran
    first.release()
    time.sleep(0.3)
    assert checker.counts().running == 1 and not second.future.done()  # the other request still waits
    second.release()
    _until(lambda: checker.counts().running == 0, 1.0, "a check nobody waits for still runs after 1 s")
    assert second.future.cancelled() and checker.counts().cancelled == 2
    assert _verdict(checker, GrammarSpec("regex", "[a-z]+")) is None  # a fresh worker took over


def test_a_long_check_drops_to_the_lowest_priority_and_a_small_one_beside_it_is_not_held_up(
    checkers: Callable[..., GrammarChecker],
) -> None:
    checker = checkers(compile_timeout_s=120.0, workers=2)
    big = checker.check(GrammarSpec.json_schema(wide_object(2000, "big")))  # ~28 s of compile
    _until(lambda: checker.counts().demoted == 1, 60, "the long check never dropped its priority")
    started = time.monotonic()
    assert _verdict(checker, GrammarSpec.json_schema({"type": "object", "properties": {"a": {}}})) is None
    assert time.monotonic() - started < 10  # the other worker, at its usual priority
    assert not big.future.done()
    big.release()


def test_verdicts_are_cached_by_spec_and_shared(checkers: Callable[..., GrammarChecker]) -> None:
    checker = checkers(workers=1)
    refused = GrammarSpec("regex", r"[^\s\S]")
    assert _verdict(checker, refused) is not None
    again: Ticket = checker.check(refused)
    assert again.future.done() and again.future.exception() is not None  # no second compile
    again.release()
    spec = GrammarSpec.json_schema({"type": "object", "properties": {"n": {"type": "integer"}}})
    a, b = checker.check(spec), checker.check(spec)
    assert a.future is b.future
    a.release()
    b.release()


def test_the_engine_refuses_an_unsatisfiable_grammar_by_name_through_the_python_api(info_json: str) -> None:
    """The engine's own compiler runs the same satisfiability check (a clear error, not a token mismatch)."""
    from engine.loader.resolve import resolve_model_source
    from engine.structured.compiler import GrammarCompiler
    from engine.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(resolve_model_source(None).tokenizer_dir)
    compiler = GrammarCompiler(tokenizer, len(tokenizer), [tokenizer.eos_token_id])
    with pytest.raises(InvalidRequestError, match="the regex can never be matched"):
        compiler.submit(GrammarSpec("regex", r"[^\s\S]")).result(timeout=120)
    assert compiler.submit(GrammarSpec("regex", "[a-z]+")).result(timeout=120).grammar is not None
    compiler.close()


def test_a_queued_engine_compile_that_no_request_waits_for_is_dropped(info_json: str) -> None:
    from engine.loader.resolve import resolve_model_source
    from engine.structured.compiler import COMPILE_THREADS, GrammarCompiler
    from engine.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(resolve_model_source(None).tokenizer_dir)
    compiler = GrammarCompiler(tokenizer, len(tokenizer), [tokenizer.eos_token_id])
    busy = [GrammarSpec.json_schema(wide_object(300, f"busy{i}")) for i in range(COMPILE_THREADS)]
    running = [compiler.submit(spec) for spec in busy]
    late = GrammarSpec.json_schema(json.loads('{"type": "object", "properties": {"late": {"type": "integer"}}}'))
    future = compiler.submit(late)
    compiler.release(late)
    assert future.cancelled()  # queued behind the busy threads: never compiled
    assert compiler.submit(late) is not future  # asked again, it compiles anew
    for f in running:
        f.result(timeout=120)
    compiler.close()
