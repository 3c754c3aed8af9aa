"""Structured output on the real engine (SmolLM2, CPU): every completion matches its grammar.

The model is small and the prompts ask for the shape, but nothing here relies on the model
behaving: the grammar's mask decides which tokens may come, so each output must parse, and the
mask itself is held to xgrammar's own application of it.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

import pytest
import torch

from engine.engine import Engine
from engine.errors import RequestFailedError
from engine.request import Request
from engine.sampling_params import SamplingParams
from engine.structured import GrammarSpec
from engine.structured.compiler import GrammarCompiler, new_matcher
from engine.structured.mask import apply_grammar_masks

xgr = pytest.importorskip("xgrammar")

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "pets": {"type": "array", "items": {"enum": ["cat", "dog"]}, "maxItems": 2},
    },
    "required": ["name", "age", "pets"],
    "additionalProperties": False,
}


def _person(text: str) -> dict[str, Any]:
    value = json.loads(text)
    assert list(value) == ["name", "age", "pets"], value  # the schema's order
    assert isinstance(value["name"], str) and len(value["name"]) <= 12
    assert isinstance(value["age"], int) and 0 <= value["age"] <= 120
    assert set(value["pets"]) <= {"cat", "dog"} and len(value["pets"]) <= 2
    return value


# Engines: the default step loop, and overlap scheduling with mixed prefill+decode steps.
ENGINES = {"sync": {}, "overlap+mixed": {"overlap_schedule": True, "mixed_steps": True, "debug_kv_invariant": True}}


@pytest.fixture(params=list(ENGINES))
def engine(request: pytest.FixtureRequest, engine_cache: Callable[..., Engine]) -> Engine:
    return engine_cache(None, **ENGINES[request.param])


def test_json_schema_outputs_parse_and_follow_the_schema(engine: Engine) -> None:
    prompts = ["Describe a person as JSON.", "Who lives next door? Answer in JSON.", "JSON for a pet owner:"]
    params = [
        SamplingParams(max_tokens=96, temperature=0.0, grammar=GrammarSpec.json_schema(PERSON)),
        SamplingParams(max_tokens=96, temperature=1.0, seed=7, grammar=GrammarSpec.json_schema(PERSON)),
        SamplingParams(max_tokens=96, temperature=0.9, top_p=0.9, logprobs=2, grammar=GrammarSpec.json_schema(PERSON)),
    ]
    outputs = engine.generate(prompts, params, chat=True)
    for output in outputs:
        assert output.finish_reason == "stop", output.text
        _person(output.text)
    assert len(outputs[2].logprobs or []) == len(outputs[2].token_ids)
    assert engine.kv_pages_in_use() == 0


def test_seeded_structured_sampling_is_reproducible_and_a_batch_does_not_change_it(engine: Engine) -> None:
    spec = GrammarSpec.json_schema(PERSON)
    seeded = SamplingParams(max_tokens=96, temperature=1.0, seed=123, grammar=spec)
    alone = engine.generate(["A person:"], seeded, chat=True)[0]
    crowd = engine.generate(
        ["A person:", "Another one:", "JSON please"],
        [seeded, SamplingParams(max_tokens=40, temperature=0.7), SamplingParams(max_tokens=30, temperature=0.0)],
        chat=True,
    )[0]
    assert alone.token_ids == crowd.token_ids
    _person(alone.text)


@pytest.mark.parametrize(
    "spec,check",
    [
        (GrammarSpec("json_object"), lambda text: isinstance(json.loads(text), dict)),
        (GrammarSpec("regex", r"\d{3}-\d{4}"), lambda text: re.fullmatch(r"\d{3}-\d{4}", text) is not None),
        (
            GrammarSpec.choice(["Paris", "London", 'a "quoted" \\ choice\n']),
            lambda text: text in ("Paris", "London", 'a "quoted" \\ choice\n'),
        ),
        (
            GrammarSpec("ebnf", 'root ::= "yes" | "no" | "maybe, " [0-9]+ "%"'),
            lambda text: re.fullmatch(r"yes|no|maybe, \d+%", text) is not None,
        ),
    ],
    ids=["json_object", "regex", "choice", "ebnf"],
)
def test_every_kind_of_grammar_constrains_the_text(
    smol_engine: Engine, spec: GrammarSpec, check: Callable[[str], bool]
) -> None:
    outputs = smol_engine.generate(
        ["The capital of France is", "Write something:"],
        [
            SamplingParams(max_tokens=48, temperature=0.0, grammar=spec),
            SamplingParams(max_tokens=48, temperature=1.2, seed=3, grammar=spec),
        ],
        chat=True,
    )
    compiled = (
        GrammarCompiler(smol_engine.tokenizer, smol_engine.model_config.vocab_size, sorted(smol_engine.eos_token_ids))
        .submit(spec)
        .result()
    )
    for output in outputs:
        matcher = new_matcher(compiled)
        assert all(matcher.accept_token(t) for t in output.token_ids), output.text  # every token, even when cut off
        if output.finish_reason == "stop":
            assert matcher.is_terminated() and check(output.text), output.text
        else:  # the tiny model can nest JSON objects until max_tokens; the text is still a valid prefix
            assert spec.kind == "json_object" and output.finish_reason == "length", output
    assert any(o.finish_reason == "stop" for o in outputs)
    assert smol_engine.kv_pages_in_use() == 0


def test_a_grammar_that_allows_one_text_forces_it_then_stops(smol_engine: Engine) -> None:
    output = smol_engine.generate(
        ["Say anything"],
        SamplingParams(max_tokens=20, temperature=1.0, seed=0, grammar=GrammarSpec.choice(["forced output"])),
    )[0]
    assert output.text == "forced output" and output.finish_reason == "stop"
    assert output.token_ids[-1] in smol_engine.eos_token_ids  # the grammar's end is its stop token


def test_max_tokens_and_stop_strings_still_end_a_constrained_request(smol_engine: Engine) -> None:
    spec = GrammarSpec("regex", r"(abc,){50}")
    short, stopped = smol_engine.generate(
        ["Repeat: abc,abc,", "Repeat: abc,abc,"],
        [
            SamplingParams(max_tokens=5, temperature=0.0, grammar=spec),
            SamplingParams(max_tokens=40, temperature=0.0, grammar=spec, stop=["c,a"]),
        ],
    )
    assert short.finish_reason == "length" and len(short.token_ids) == 5 and "abc,abc,abc,".startswith(short.text)
    assert stopped.finish_reason == "stop" and stopped.text == "ab"
    assert smol_engine.kv_pages_in_use() == 0


def test_prefix_cached_prompts_give_the_same_constrained_text(smol_engine: Engine) -> None:
    params = SamplingParams(max_tokens=96, temperature=0.0, grammar=GrammarSpec.json_schema(PERSON))
    first = smol_engine.generate(["A person, as JSON:"], params, chat=True)[0]
    again = smol_engine.generate(["A person, as JSON:"], params, chat=True)[0]
    assert first.token_ids == again.token_ids
    _person(first.text)


def test_a_grammar_that_fails_to_compile_fails_its_request_alone(smol_engine: Engine) -> None:
    """Past the server's parse (the Python API does not parse first): the compile's error is the request's."""
    good = smol_engine.add_request("Hello", SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    bad = smol_engine.add_request("Hello", SamplingParams(max_tokens=4, grammar=GrammarSpec("regex", "(unclosed")))
    finals = {}
    while smol_engine.has_unfinished():
        for output in smol_engine.step():
            if output.finished:
                finals[output.request_id] = output
    assert finals[bad].finish_reason == "error" and "invalid regex" in (finals[bad].error or "")
    assert "parenthesis" in (finals[bad].error or "")
    assert finals[good].finish_reason == "length" and len(finals[good].token_ids) == 4
    with pytest.raises(RequestFailedError, match=r"invalid json schema: .*nonsense"):
        smol_engine.generate(["Hi"], SamplingParams(grammar=GrammarSpec("json_schema", '{"type": "nonsense"}')))
    assert smol_engine.kv_pages_in_use() == 0 and not smol_engine.has_unfinished()


def test_a_request_aborted_while_its_grammar_compiles_leaves_nothing(smol_engine: Engine) -> None:
    schema = {"type": "object", "properties": {f"field_{i}": {"type": "string"} for i in range(40)}}
    request_id = smol_engine.add_request("Hi", SamplingParams(grammar=GrammarSpec.json_schema(schema)))
    smol_engine.abort(request_id)
    assert not smol_engine.has_unfinished() and smol_engine.step() == []
    assert smol_engine.kv_pages_in_use() == 0


def test_the_mask_is_what_xgrammar_applies_with_the_json_guard_and_leaves_other_rows_alone(smol_engine: Engine) -> None:
    tokenizer, vocab = smol_engine.tokenizer, smol_engine.model_config.vocab_size
    compiler = GrammarCompiler(tokenizer, vocab, sorted(smol_engine.eos_token_ids))
    compiled = compiler.submit(GrammarSpec.json_schema(PERSON)).result()
    requests = [Request(f"r{i}", [1], SamplingParams()) for i in range(4)]
    for i in (0, 2):
        requests[i].grammar = new_matcher(compiled)
        requests[i].grammar_guard = compiled.json_guard
    for token in tokenizer.encode('{"name": "Al', add_special_tokens=False):
        assert requests[2].grammar.accept_token(token)  # row 2 is inside a string, row 0 at the start
    logits = torch.randn(4, vocab, generator=torch.Generator().manual_seed(0))
    expected = logits.clone()
    bitmask = xgr.allocate_token_bitmask(4, vocab)
    for i in (0, 2):
        requests[i].grammar.fill_next_token_bitmask(bitmask, i)
        bitmask[i] &= compiled.json_guard  # raw control characters are never JSON (compiler.py, _safe_tokens)
    xgr.apply_token_bitmask_inplace(expected, bitmask, indices=[0, 2])
    ours = logits.clone()
    apply_grammar_masks(ours, requests)
    assert torch.equal(ours, expected)
    assert torch.equal(ours[1], logits[1]) and torch.equal(ours[3], logits[3])
    assert 0 < int(torch.isfinite(ours[0]).sum()) < 10 < int(torch.isfinite(ours[2]).sum()) < vocab
    compiler.close()


def test_overlap_scheduling_gives_the_constrained_tokens_of_the_synchronous_loop(
    engine_cache: Callable[..., Engine],
) -> None:
    """With overlap, each grammar takes its last token between the next forward and its sampling; a mask
    one token stale would show up here as different tokens (or invalid JSON)."""
    prompts = ["Describe a person as JSON.", "Tell me a story.", "JSON for a pet owner:"]
    params = [
        SamplingParams(max_tokens=96, temperature=0.0, grammar=GrammarSpec.json_schema(PERSON)),
        SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=96, temperature=0.0, grammar=GrammarSpec("json_object")),
    ]
    tokens = {}
    for name, options in ENGINES.items():
        tokens[name] = [o.token_ids for o in engine_cache(None, **options).generate(prompts, params, chat=True)]
    assert tokens["sync"] == tokens["overlap+mixed"]


# A schema with nested objects, arrays, enums, required fields and bounded numbers; strings and
# arrays bounded so that a random model's output ends.
NESTED = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 1, "maximum": 999},
        "score": {"type": "number", "minimum": -1, "maximum": 1},
        "kind": {"enum": ["a", "b", "c"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "minItems": 1, "maxItems": 3},
        "owner": {
            "type": "object",
            "properties": {"name": {"type": "string", "maxLength": 8}, "admin": {"type": "boolean"}},
            "required": ["name", "admin"],
            "additionalProperties": False,
        },
    },
    "required": ["id", "score", "kind", "tags", "owner"],
    "additionalProperties": False,
}


def _nested(value: Any) -> None:
    assert list(value) == ["id", "score", "kind", "tags", "owner"]
    assert isinstance(value["id"], int) and not isinstance(value["id"], bool) and 1 <= value["id"] <= 999
    assert isinstance(value["score"], (int, float)) and -1 <= value["score"] <= 1
    assert value["kind"] in ("a", "b", "c")
    assert 1 <= len(value["tags"]) <= 3 and all(isinstance(t, str) and len(t) <= 6 for t in value["tags"])
    owner = value["owner"]
    assert list(owner) == ["name", "admin"] and isinstance(owner["name"], str) and len(owner["name"]) <= 8
    assert isinstance(owner["admin"], bool)


@pytest.fixture(scope="module")
def random_model_with_a_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A tiny random Llama over SmolLM2's real vocabulary and tokenizer: output with no preference."""
    import shutil

    from transformers import LlamaConfig, LlamaForCausalLM

    from engine.loader.resolve import resolve_model_source

    folder = tmp_path_factory.mktemp("random_llama_with_tokenizer")
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=49152,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=True,
    )
    LlamaForCausalLM(config).save_pretrained(folder)
    tokenizer_dir = resolve_model_source(None).tokenizer_dir
    assert tokenizer_dir is not None
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(f"{tokenizer_dir}/{name}", folder / name)
    return str(folder)


# Seeds: three full batches of the shared engine's 8 sequences (a mask applied to the wrong row or token shows
# in most samples, not in one of many).
SMOL_SEEDS = range(24)


def test_smollm2_at_temperature_1_over_24_seeds_always_gives_valid_json(smol_engine: Engine) -> None:
    spec = GrammarSpec.json_schema(NESTED, any_whitespace=False)
    outputs = smol_engine.generate(
        ["Describe a record as JSON."] * len(SMOL_SEEDS),
        [SamplingParams(max_tokens=160, temperature=1.0, seed=s, grammar=spec) for s in SMOL_SEEDS],
        chat=True,
    )
    for output in outputs:
        assert output.finish_reason == "stop", output.text
        _nested(json.loads(output.text))
    assert len({o.text for o in outputs}) > len(SMOL_SEEDS) // 2
    assert smol_engine.kv_pages_in_use() == 0


def test_a_random_model_at_temperature_1_over_32_seeds_always_gives_valid_json(
    engine_cache: Callable[..., Engine], random_model_with_a_tokenizer: str
) -> None:
    engine = engine_cache(random_model_with_a_tokenizer, max_num_seqs=16)
    seeds = range(32)  # two full batches of 16
    spec = GrammarSpec.json_schema(NESTED, any_whitespace=False)
    constrained = engine.generate(
        ["Some JSON:"] * len(seeds),
        [SamplingParams(max_tokens=160, temperature=1.0, seed=s, grammar=spec) for s in seeds],
    )
    for output in constrained:
        assert output.finish_reason == "stop", output.text
        _nested(json.loads(output.text))
    assert len({o.text for o in constrained}) > 25  # random, not one answer
    free = engine.generate(
        ["Some JSON:"] * len(seeds), [SamplingParams(max_tokens=60, temperature=1.0, seed=s) for s in seeds]
    )
    parsed = 0
    for output in free:
        try:
            json.loads(output.text)
            parsed += 1
        except json.JSONDecodeError:
            pass
    assert parsed == 0  # without the grammar the same model's text is not JSON: the test can fail
    assert engine.kv_pages_in_use() == 0


def test_raw_control_characters_never_enter_json_even_where_xgrammar_allows_them(smol_engine: Engine) -> None:
    """xgrammar 0.2.9 lets a length-bounded string take raw control characters; the JSON guard does not."""
    vocab = smol_engine.model_config.vocab_size
    compiler = GrammarCompiler(smol_engine.tokenizer, vocab, sorted(smol_engine.eos_token_ids))
    compiled = compiler.submit(GrammarSpec.json_schema({"type": "string", "maxLength": 6})).result()
    request = Request("r", [1], SamplingParams())
    request.grammar, request.grammar_guard = new_matcher(compiled), compiled.json_guard
    assert request.grammar.accept_token(smol_engine.tokenizer.convert_tokens_to_ids('"'))
    controls = [
        t for t in range(vocab) if any(ord(c) < 32 and c not in "\t\n\r" for c in smol_engine.tokenizer.decode([t]))
    ]
    assert controls
    bare = xgr.allocate_token_bitmask(1, vocab)
    request.grammar.fill_next_token_bitmask(bare, 0)
    unguarded = torch.zeros(1, vocab)
    xgr.apply_token_bitmask_inplace(unguarded, bare)
    assert torch.isfinite(unguarded[0, controls]).any()  # the upstream bug this guards against
    logits = torch.zeros(1, vocab)
    apply_grammar_masks(logits, [request])
    assert not torch.isfinite(logits[0, controls]).any()
    compiler.close()
