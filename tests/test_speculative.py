"""Speculative decoding (n-gram drafts, verify steps as decode rows): settings, the proposer, exactness.

Greedy output must be the output without speculation, token for token; sampled output must follow the
target model's distribution (a chi-square test against HF's probabilities, which a wrong acceptance rule
fails); rejected drafts' pages go back to the pool and the KV invariant holds after every step.
"""

from __future__ import annotations

import json
import math
import random
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from engine.engine import Engine
from engine.kv_cache import PageAllocator
from engine.kv_manager import KVCacheManager
from engine.penalties import PenaltyState
from engine.request import Request
from engine.sampler import _apply_penalties, sample
from engine.sampling_params import SamplingParams
from engine.speculative.acceptance import SpecDecodeStats, accepted_length
from engine.speculative.config import SpeculativeConfig, sglang_speculative_config
from engine.speculative.ngram import NgramProposer
from tests.conftest import release_cached, track

NGRAM = json.dumps({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2})

# Prompts whose answers copy from the prompt (where n-grams pay) and others (where they rarely do).
PROMPTS = [
    "Repeat this list exactly, once: apples, oranges, bananas, grapes, pears, plums, cherries, lemons.",
    "Write the numbers from 1 to 25 separated by commas.",
    "Copy this sentence word for word: the quick brown fox jumps over the lazy dog near the river bank.",
    "def add(a, b):\n    return a + b\n\nRewrite the function above with type hints.",
    "What is the capital of France?",
    "Name three colours.",
    "Spell the word 'banana' letter by letter, separated by dashes.",
    "Translate 'good morning' into French.",
    "List the days of the week.",
    "Repeat after me: red green blue, red green blue, red green blue.",
    "Give me a haiku about the sea.",
    "What is 12 times 12?",
    "Write a Python list of the first ten square numbers.",
    "Summarise in one sentence: cats sleep a lot and like warm places.",
    "Count down from 15 to 1.",
    "Say hello in five languages.",
    "Copy exactly: {'name': 'Ada', 'age': 36, 'city': 'London'}",
    "What colour is the sky on a clear day?",
    "Write the alphabet in capital letters separated by spaces.",
    "Explain what a prime number is in one sentence.",
]


# ---- settings --------------------------------------------------------------------------------
def test_speculative_config_takes_vllms_keys_and_refuses_the_rest() -> None:
    config = SpeculativeConfig.parse(NGRAM)
    assert config is not None and config.num_speculative_tokens == 4 and config.lookup_range == (2, 4)
    assert SpeculativeConfig.parse(None) is None and SpeculativeConfig.parse("") is None
    assert SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 3}').lookup_range == (5, 5)  # type: ignore[union-attr]
    assert SpeculativeConfig.parse(
        '{"method": "[ngram]", "num_speculative_tokens": 2, "prompt_lookup_max": 3}'
    ).lookup_range == (3, 3)  # type: ignore[union-attr]
    bad = {
        '{"method": "eagle3", "num_speculative_tokens": 3, "draft": "x"}': "unsupported keys draft",
        '{"method": "ngram", "num_speculative_tokens": 3, "model": "x"}': "goes with methods draft_model and eagle3",
        '{"method": "draft_model", "num_speculative_tokens": 3}': "goes with methods draft_model and eagle3",
        '{"method": "eagle", "num_speculative_tokens": 3}': "'eagle' is not supported yet",
        '{"method": "eagle3", "num_speculative_tokens": 3}': "goes with methods draft_model and eagle3",
        '{"method": "medusa2", "num_speculative_tokens": 3}': "must be one of ngram",
        '{"method": "ngram"}': "needs 'num_speculative_tokens'",
        '{"method": "ngram", "num_speculative_tokens": 0}': "1..16",
        '{"method": "ngram", "num_speculative_tokens": 2.5}': "must be an integer",
        '{"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": 1}': "must be >= 2",
        '{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2}': "1 <= ",
        "[1, 2]": "JSON object",
        "{nope": "not valid JSON",
    }
    for text, message in bad.items():
        with pytest.raises(ValueError, match=message.replace("(", r"\(").replace("[", r"\[")):
            SpeculativeConfig.parse(text)


def test_sglang_flags_are_the_same_config() -> None:
    assert sglang_speculative_config(None, None, None, None, None) is None
    assert sglang_speculative_config("NGRAM", 4, None, None, None) == {"method": "ngram", "num_speculative_tokens": 4}
    assert sglang_speculative_config("ngram", None, 5, None, 1) == {"method": "ngram", "num_speculative_tokens": 4}
    assert sglang_speculative_config("STANDALONE", 3, 4, "/m/draft", None) == {
        "method": "draft_model",
        "num_speculative_tokens": 3,
        "model": "/m/draft",
    }
    bad = {
        ("EAGLE", 3, None, "/m/head", None): "EAGLE is not supported yet; algorithms: NGRAM, STANDALONE, EAGLE3",
        ("MEDUSA", 3, None, None, None): "must be one of NGRAM, STANDALONE",
        ("EAGLE3", 3, None, None, None): "--speculative-draft-model-path goes with",
        ("NGRAM", None, None, None, None): "needs --speculative-num-steps or --speculative-num-draft-tokens",
        ("NGRAM", 3, 8, None, None): "a chain of 3 drafts verifies 4 tokens",
        ("NGRAM", 3, None, None, 4): "tree drafts are not supported",
        ("STANDALONE", 3, None, None, None): "--speculative-draft-model-path goes with",
        ("NGRAM", 3, None, "/m/draft", None): "--speculative-draft-model-path goes with",
        (None, 3, None, None, None): "go with --speculative-algorithm",
    }
    for args, message in bad.items():
        with pytest.raises(ValueError, match=message):
            sglang_speculative_config(*args)


def test_ngram_proposer_copies_what_followed_the_latest_match_of_the_longest_suffix() -> None:
    proposer = NgramProposer(num_tokens=3, min_n=1, max_n=3)
    # Suffix [7, 8] occurs twice; the most recent occurrence (followed by 5, 6) wins.
    assert proposer.propose([7, 8, 1, 2, 7, 8, 5, 6, 9, 7, 8]) == [5, 6, 9]
    # A longer match beats a more recent shorter one: [3, 7, 8] only at the start.
    assert proposer.propose([3, 7, 8, 4, 4, 4, 7, 8, 9, 3, 7, 8]) == [4, 4, 4]
    assert proposer.propose([1, 2, 3, 4]) == []  # nothing recurs
    assert proposer.propose([1, 2, 1, 2], limit=1) == [1]  # a limit (max_tokens, the context) cuts drafts
    assert proposer.propose([5, 5], limit=0) == []
    assert NgramProposer(4, 2, 2).propose([1, 2, 3, 1, 2]) == [3, 1, 2]  # drafts stop at the context's end


def test_ngram_proposer_matches_a_plain_search_on_random_contexts() -> None:
    """The vectorised search against the definition, on 3,000 small contexts over a 4-token alphabet."""

    def plain(tokens: list[int], k: int, low: int, high: int) -> list[int]:
        for n in range(min(high, len(tokens) - 1), low - 1, -1):
            for start in range(len(tokens) - 1 - n, -1, -1):  # latest occurrence first, the suffix excluded
                if tokens[start : start + n] == tokens[len(tokens) - n :]:
                    return tokens[start + n : start + n + k]
        return []

    rng = random.Random(7)
    for _ in range(3000):
        tokens = [rng.randrange(4) for _ in range(rng.randint(1, 40))]
        low = rng.randint(1, 3)
        high, k = rng.randint(low, 5), rng.randint(1, 5)
        assert NgramProposer(k, low, high).propose(tokens) == plain(tokens, k, low, high), (tokens, low, high, k)


def test_acceptance_keeps_the_matching_prefix_and_counts_like_vllm() -> None:
    assert accepted_length([4, 5, 6], [4, 5, 9, 1]) == 2
    assert accepted_length([4, 5, 6], [1, 5, 6, 1]) == 0
    assert accepted_length([4, 5], [4, 5, 7]) == 2
    stats = SpecDecodeStats()
    stats.record(3, 2)
    stats.record(3, 0)
    stats.record(0, 0)  # a request without drafts is not a draft
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (2, 6, 2)
    assert stats.accepted_per_position == [1, 1, 0]
    assert stats.mean_acceptance_length == 2.0 and stats.acceptance_rate == pytest.approx(1 / 3)


def test_which_requests_draft() -> None:
    """Penalized and biased requests draft (their logit edits see the drafts before each row); a batch at
    disable_by_batch_size drafts nothing."""
    from engine.speculative.speculator import Speculator

    config = '{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 1, "prompt_lookup_max": 1, '
    speculator = Speculator(SpeculativeConfig.parse(config + '"disable_by_batch_size": 4}'))  # type: ignore[arg-type]
    plain = Request("a", [1, 2, 1], SamplingParams())
    penalized = Request("b", [1, 2, 1], SamplingParams(presence_penalty=0.5))
    biased = Request("c", [1, 2, 1], SamplingParams(logit_bias={5: 1.0}))
    assert speculator.draft([plain, penalized, biased], [5, 5, 5]) == [[2, 1], [2, 1], [2, 1]]
    assert speculator.draft([plain], [1]) == [[2]]  # the room left (max_tokens, the context) caps them
    assert speculator.draft([plain] * 4, [5] * 4) == [[]] * 4


def test_trim_gives_back_the_pages_only_rejected_drafts_used() -> None:
    kv = KVCacheManager(PageAllocator(9), page_size=4, enable_prefix_cache=True)
    request = Request("r", list(range(10)), SamplingParams(max_tokens=8))
    assert kv.allocate(request, 10 + 1 + 4)  # the fed token and four drafts: 15 tokens, 4 pages
    request.batch_row_pages = 4  # the decode row holds all four
    assert len(kv.allocator.pages_of("r")) == 4
    kv.trim(request, 11)  # one draft kept, plus the target's token: 11 tokens need 3 pages
    assert len(kv.allocator.pages_of("r")) == 3 and request.batch_row_pages == 3
    assert kv.allocator.num_free == 8 - 3
    assert not kv.allocate(request, 40, evict=False)  # drafts never take more than the free pages
    kv.release(request)
    kv.check_invariant()


# ---- the engine --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def spec_engine(engine_cache: Any) -> Iterator[Engine]:
    engine = engine_cache(None, speculative_config=NGRAM, debug_kv_invariant=True)
    yield engine
    release_cached(engine)


def test_greedy_text_is_identical_with_ngram_speculation(smol_engine: Engine, spec_engine: Engine) -> None:
    params = SamplingParams(max_tokens=40, temperature=0.0)
    reference = smol_engine.generate(PROMPTS, params, chat=True)
    spec_engine.speculator.stats.__init__()  # type: ignore[union-attr,misc]
    outputs = spec_engine.generate(PROMPTS, params, chat=True)
    for want, got in zip(reference, outputs):
        assert got.token_ids == want.token_ids, (want.prompt, want.text, got.text)
        assert got.text == want.text and got.finish_reason == want.finish_reason
    stats = spec_engine.speculator.stats  # type: ignore[union-attr]
    print(
        f"20 prompts: {stats.num_drafts} drafts, {stats.num_draft_tokens} draft tokens, "
        f"{stats.num_accepted_tokens} accepted, mean acceptance length {stats.mean_acceptance_length:.2f}"
    )
    # The copying prompts give real acceptance: well over one token per verify step.
    assert stats.num_accepted_tokens > 0 and stats.mean_acceptance_length > 1.5


def test_one_request_alone_streams_every_kept_token_once(smol_engine: Engine, spec_engine: Engine) -> None:
    prompt = PROMPTS[1]
    params = SamplingParams(max_tokens=60, temperature=0.0, logprobs=2)
    want = smol_engine.generate(prompt, params, chat=True)[0]
    deltas = list(spec_engine.stream(prompt, params, chat=True))
    got = deltas[-1]
    assert got.token_ids == want.token_ids
    assert [t for d in deltas for t in d.new_token_ids] == got.token_ids  # several tokens per output, none twice
    assert "".join(d.new_text for d in deltas) == got.text == want.text
    assert len(deltas) < len(got.token_ids)  # some steps kept several tokens
    # Logprobs of kept drafts are the target's, as without speculation.
    assert got.logprobs is not None and want.logprobs is not None and len(got.logprobs) == len(want.logprobs)
    for a, b in zip(got.logprobs, want.logprobs):
        assert a.token_id == b.token_id and a.logprob == pytest.approx(b.logprob, abs=1e-3)
    assert [e for d in deltas for e in d.new_logprobs or []] == got.logprobs


def test_stops_max_tokens_and_penalties_hold_inside_kept_drafts(smol_engine: Engine, spec_engine: Engine) -> None:
    prompt = PROMPTS[1]
    cases = [
        SamplingParams(max_tokens=7, temperature=0.0),  # max_tokens cuts the drafts
        SamplingParams(max_tokens=60, temperature=0.0, stop=["10,"]),  # a stop string inside kept tokens
        # Penalties: each verify row penalized as after the drafts before it, only kept tokens recorded.
        SamplingParams(max_tokens=30, temperature=0.0, repetition_penalty=1.3),
        SamplingParams(max_tokens=40, temperature=0.0, frequency_penalty=0.4, presence_penalty=0.3),
        SamplingParams(max_tokens=40, temperature=0.0, repetition_penalty=1.1, frequency_penalty=0.2),
        SamplingParams(max_tokens=30, temperature=0.0, min_tokens=20),  # EOS blocked in each row before the 20th
    ]
    for params in cases:
        want = smol_engine.generate(prompt, params, chat=True)[0]
        got = spec_engine.generate(prompt, params, chat=True)[0]
        assert (got.token_ids, got.text, got.finish_reason) == (want.token_ids, want.text, want.finish_reason), params


def test_a_verify_rows_penalties_count_the_drafts_before_it() -> None:
    """Row j of a verify step is penalized as if its request had taken drafts[:j]: its logits equal those of the
    request with the drafts appended to its output, penalized from scratch (repetition over prompt + output,
    frequency and presence over the output); and the step records nothing (the engine records the kept tokens)."""
    vocab, prompt, output, drafts = 12, [1, 2, 3], [4, 5, 4], [6, 4, 6]
    params = SamplingParams(temperature=0.0, repetition_penalty=1.5, frequency_penalty=0.3, presence_penalty=0.2)
    request = Request("a", prompt, params)
    request.output_token_ids = list(output)
    request.batch_row = 0
    torch.manual_seed(0)
    logits = torch.randn(1 + len(drafts), vocab)
    state = PenaltyState(2, vocab, torch.device("cpu"))
    rows = torch.zeros(1 + len(drafts), dtype=torch.int64)
    row_drafts = [(j, drafts) for j in range(1 + len(drafts))]
    got, _ = _apply_penalties(logits.clone(), [request] * len(row_drafts), state, rows, row_drafts)
    for j in range(1 + len(drafts)):
        alone = Request("b", prompt, params)
        alone.output_token_ids = output + drafts[:j]
        alone.batch_row = 1
        reference = PenaltyState(2, vocab, torch.device("cpu"))
        want, _ = _apply_penalties(logits[j : j + 1].clone(), [alone], reference, torch.ones(1, dtype=torch.int64))
        assert not torch.equal(want[0], logits[j]) and torch.allclose(got[j], want[0]), j
    sample(logits.clone(), [request] * len(row_drafts), state, rows, row_drafts)
    assert state.counts is not None and int(state.counts[0].sum()) == len(output)  # nothing recorded


def test_penalized_requests_record_only_their_kept_tokens(spec_engine: Engine) -> None:
    """After each step of a penalized request with n-gram drafts, its row's counts are its output's histogram."""
    params = SamplingParams(max_tokens=40, temperature=0.0, repetition_penalty=1.1, frequency_penalty=0.2)
    spec_engine.kv_manager.reset_prefix_cache()
    spec_engine.speculator.stats.__init__()  # type: ignore[union-attr,misc]
    request_id = spec_engine.add_request(PROMPTS[1], params, chat=True)
    request = spec_engine._requests[request_id]
    checked = 0
    while spec_engine.has_unfinished():
        spec_engine.step()
        state = spec_engine.decode_state.penalties
        if request.finished or request.batch_row is None or state is None or state.counts is None:
            continue
        histogram = torch.bincount(torch.tensor(request.output_token_ids), minlength=state.counts.shape[1])
        assert torch.equal(state.counts[request.batch_row].long(), histogram)
        checked += 1
    stats = spec_engine.speculator.stats  # type: ignore[union-attr]
    assert checked > 5 and stats.num_accepted_tokens > 0 and stats.num_draft_tokens > stats.num_accepted_tokens


COPY_JSON = (
    'Copy this JSON exactly: {"name": "Ada Lovelace", "city": "London", "languages": ["English", "French", '
    '"Italian"], "numbers": [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]}'
)
COPY_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "city": {"type": "string"},
        "languages": {"type": "array", "items": {"type": "string"}},
        "numbers": {"type": "array", "items": {"type": "integer"}},
    },
    "required": ["name", "city", "languages", "numbers"],
}


def test_grammar_requests_verify_drafts_and_keep_their_greedy_text(smol_engine: Engine, spec_engine: Engine) -> None:
    """A JSON schema and a JSON object request with n-gram drafts: the grammar masks each verify row after the
    drafts before it, so greedy output is the output without speculation, and drafts were kept."""
    from engine.structured import GrammarSpec

    cases = [
        SamplingParams(max_tokens=90, temperature=0.0, grammar=GrammarSpec.json_schema(COPY_SCHEMA)),
        SamplingParams(max_tokens=90, temperature=0.0, grammar=GrammarSpec("json_object"), min_tokens=40),
    ]
    for params in cases:
        want = smol_engine.generate(COPY_JSON, params, chat=True)[0]
        spec_engine.speculator.stats.__init__()  # type: ignore[union-attr,misc]
        got = spec_engine.generate(COPY_JSON, params, chat=True)[0]
        assert (got.token_ids, got.text, got.finish_reason) == (want.token_ids, want.text, want.finish_reason)
        json.loads(got.text)
        stats = spec_engine.speculator.stats  # type: ignore[union-attr]
        assert stats.num_accepted_tokens > 10, stats.num_accepted_tokens  # the copy was drafted, and kept


def test_grammar_masks_of_draft_rows_are_those_after_the_drafts(smol_engine: Engine) -> None:
    """Each verify row's mask equals a fresh matcher's after the drafts before the row; the request's matcher
    ends where it was; grammar_drafts keeps the prefix the grammar allows."""
    from engine.structured.mask import apply_grammar_masks, grammar_drafts
    from engine.structured.spec import import_xgrammar

    xgr = import_xgrammar()
    tokenizer = smol_engine.tokenizer
    vocab = int(smol_engine.model_config.vocab_size)
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab)
    compiled = xgr.GrammarCompiler(info).compile_json_schema(json.dumps(COPY_SCHEMA))
    text = '{"name": "Ada", "city": "Lon'
    prefix = tokenizer.encode(text, add_special_tokens=False)
    drafts = tokenizer.encode('don", "languages": [', add_special_tokens=False)
    wrong = tokenizer.encode("} oops", add_special_tokens=False)
    request = Request("r", [1], SamplingParams())
    request.grammar = xgr.GrammarMatcher(compiled)
    for token in prefix:
        assert request.grammar.accept_token(token)
    assert grammar_drafts(request.grammar, drafts + wrong) == drafts  # cut at the first refused token
    newline = tokenizer.encode("\n", add_special_tokens=False)
    assert grammar_drafts(request.grammar, newline + drafts) == []  # inside a string: no raw newline
    logits = torch.zeros(len(drafts) + 1, vocab)
    apply_grammar_masks(logits, [request] * len(logits), [(j, drafts) for j in range(len(logits))])
    for j in range(len(logits)):
        fresh = xgr.GrammarMatcher(compiled)
        for token in prefix + drafts[:j]:
            assert fresh.accept_token(token)
        bitmask = torch.zeros(1, (vocab + 31) // 32, dtype=torch.int32)
        fresh.fill_next_token_bitmask(bitmask)
        allowed = ~forbidden(bitmask, vocab)[0]
        assert torch.equal(logits[j] == 0, allowed), j
    assert logits[0].isinf().sum() != logits[len(drafts)].isinf().sum()  # the rows do differ
    after = torch.zeros(1, vocab)
    apply_grammar_masks(after, [request])
    assert torch.equal(after[0], logits[0])  # rolled back: the next position is the first row's


def forbidden(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    from engine.structured.mask import forbidden_tokens

    return forbidden_tokens(bitmask, vocab)


def test_seeded_sampling_with_speculation_is_reproducible(spec_engine: Engine) -> None:
    params = [SamplingParams(max_tokens=30, temperature=0.8, top_p=0.9, seed=s) for s in (1, 2, 1)]
    first = spec_engine.generate([PROMPTS[2]] * 3, params, chat=True)
    again = spec_engine.generate([PROMPTS[2]] * 3, params, chat=True)
    assert [o.token_ids for o in first] == [o.token_ids for o in again]
    assert first[0].token_ids == first[2].token_ids  # the same seed in one batch


def test_retraction_and_abort_under_memory_pressure_free_every_page(tiny_checkpoints: dict[str, str]) -> None:
    """Tiny llama, 7 pages of 16 tokens for 12 requests of up to 40 + 40 tokens whose prompts repeat
    themselves (so n-grams draft): verify steps retract each other and still give the roomy engine's tokens."""
    rng = random.Random(4)
    prompts = []
    for _ in range(12):
        motif = [rng.randrange(3, 300) for _ in range(rng.randint(3, 8))]
        prompts.append((motif * 6)[: rng.randint(10, 40)])
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    options: dict[str, Any] = dict(device="cpu", dtype="float32", disable_graphs=True, page_size=16)
    roomy = track(Engine(model=tiny_checkpoints["llama"], **options))
    tight = track(
        Engine(
            model=tiny_checkpoints["llama"],
            **options,
            kv_cache_tokens=112,
            speculative_config=NGRAM,
            debug_kv_invariant=True,
        )
    )
    expected = [o.token_ids for o in roomy.generate(prompts, params)]
    assert [o.token_ids for o in tight.generate(prompts, params)] == expected
    assert tight.scheduler.num_retractions > 0
    stats = tight.speculator.stats  # type: ignore[union-attr]
    assert stats.num_accepted_tokens > 0, "the repeating prompts should have accepted drafts"
    # An abort between two verify steps frees its pages and decode row.
    request_id = tight.add_request(prompts[0], SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True))
    for _ in range(4):
        tight.step()
    tight.abort(request_id)
    while tight.has_unfinished():
        tight.step()
    assert tight.kv_pages_in_use() == 0 and tight.step_builder.rows_in_use == 0
    roomy.shutdown()
    tight.shutdown()


def test_speculation_with_tensor_parallelism_is_refused() -> None:
    from engine.config import EngineConfig

    with pytest.raises(Exception, match="tensor-parallel-size 2 > 1 is not supported yet"):
        track(Engine(EngineConfig(device="cpu", speculative_config=NGRAM, tensor_parallel_size=2)))


# ---- sampling follows the target distribution --------------------------------------------------
def _chi_square_bound(df: int, z: float = 3.09) -> float:
    """The chi-square quantile at p = 0.999 (z = 3.09), by Wilson and Hilferty's cube approximation."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def _chi_square(counts: Counter[int], probs: dict[int, float], n: int) -> tuple[float, int]:
    """Pearson's statistic over the cells expected at least 5 times (the rest lumped into one cell)."""
    big = {t: p for t, p in probs.items() if p * n >= 5}
    observed = [counts.get(t, 0) for t in big]
    expected = [p * n for p in big.values()]
    rest_observed = n - sum(observed)
    rest_expected = n - sum(expected)
    if rest_expected >= 5:
        observed.append(rest_observed)
        expected.append(rest_expected)
    statistic = sum((o - e) ** 2 / e for o, e in zip(observed, expected))
    return statistic, len(observed) - 1


def _target_probs(hf: Any, prefix: list[int], temperature: float, top_k: int) -> dict[int, float]:
    with torch.no_grad():
        logits = hf(torch.tensor([prefix])).logits[0, -1].double() / temperature
    values, ids = logits.topk(top_k)
    return dict(zip(ids.tolist(), values.softmax(-1).tolist()))


def test_sampling_with_speculation_follows_the_target_distribution(
    tiny_llama: str, hf_tiny: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """2,000 draws of three tokens (top-k 6, temperature 1.3) whose second token is verified against a draft
    the target often takes and often refuses: the second and third tokens' frequencies against HF's exact
    marginals. The proposer is replaced by one that drafts the target's most likely second token, since the
    acceptance rule is under test, not the n-grams. Always keeping the drafts, a wrong rule, fails."""
    hf = hf_tiny("llama")
    temperature, top_k = 1.3, 6
    prompt = [17, 29, 41, 53]
    first = _target_probs(hf, prompt, temperature, top_k)
    after_first = {t: _target_probs(hf, [*prompt, t], temperature, top_k) for t in first}
    second: Counter[int] = Counter()
    third: Counter[int] = Counter()
    for t1, p1 in first.items():
        for t2, p2 in after_first[t1].items():
            second[t2] += p1 * p2
            for t3, p3 in _target_probs(hf, [*prompt, t1, t2], temperature, top_k).items():
                third[t3] += p1 * p2 * p3
    # The draft for the second token: the target's most likely one after the first token drawn.
    best_after = {t1: max(probs, key=lambda t: probs[t]) for t1, probs in after_first.items()}
    acceptance = sum(p1 * after_first[t1][best_after[t1]] for t1, p1 in first.items())
    print(f"expected acceptance {acceptance:.2f}")
    spec = json.dumps({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 1, "prompt_lookup_min": 1})
    engine = track(
        Engine(
            model=tiny_llama,
            device="cpu",
            dtype="float32",
            max_num_seqs=64,
            disable_graphs=True,
            speculative_config=spec,
            seed=1234,
        )
    )
    assert engine.speculator is not None
    monkeypatch.setattr(
        engine.speculator.proposer,
        "propose",
        lambda tokens, limit=None: [best_after[tokens[-1]]] if len(tokens) == len(prompt) + 1 else [],
    )
    n = 2000
    params = SamplingParams(max_tokens=3, temperature=temperature, top_k=top_k, ignore_eos=True)

    def draw() -> list[list[int]]:
        return [o.token_ids for o in engine.generate([list(prompt)] * n, params)]

    stats = engine.speculator.stats
    tokens = draw()
    assert stats.num_drafts == n
    assert abs(stats.num_accepted_tokens / n - acceptance) < 0.05  # both outcomes often: 0.2 < acceptance < 0.9
    assert 0.2 < acceptance < 0.9
    for position, probs in ((1, second), (2, third)):
        counts = Counter(t[position] for t in tokens)
        statistic, df = _chi_square(counts, probs, n)
        print(
            f"token {position + 1}: chi-square {statistic:.1f} on {df} degrees of freedom "
            f"(bound {_chi_square_bound(df):.1f})"
        )
        assert statistic < _chi_square_bound(df)

    def keep_every_draft(drafts: list[int], sampled: list[int]) -> list[int]:
        return drafts + sampled[len(drafts) : len(drafts) + 1]

    monkeypatch.setattr(engine.speculator, "accept", keep_every_draft)
    statistic, df = _chi_square(Counter(t[1] for t in draw()), second, n)
    print(f"wrong rule: chi-square {statistic:.1f} on {df} degrees of freedom")
    assert statistic > _chi_square_bound(df)
    engine.shutdown()


# ---- the server --------------------------------------------------------------------------------
def test_server_streams_speculative_tokens_and_counts_them_in_metrics(smol_engine: Engine) -> None:
    """`engine serve --speculative-config`: a streamed greedy chat completion gives the engine's text without
    speculation, and /metrics carries vLLM's speculative-decoding counters."""
    import httpx

    from tests.server_helpers import start_server

    prompt = PROMPTS[1]
    want = smol_engine.generate(prompt, SamplingParams(max_tokens=48, temperature=0.0), chat=True)[0]
    server = start_server("--speculative-config", NGRAM, log_name="server-speculative")
    try:
        body = {
            "messages": [{"role": "user", "content": prompt}],
            "max_tokens": 48,
            "temperature": 0,
            "stream": True,
        }
        text = ""
        with httpx.stream("POST", f"{server.base_url}/v1/chat/completions", json=body, timeout=120) as response:
            assert response.status_code == 200
            for line in response.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    for choice in json.loads(line[6:])["choices"]:
                        text += choice["delta"].get("content") or ""
        assert text == want.text
        metrics = server.wait_idle(timeout=20)
        assert metrics["vllm:spec_decode_num_drafts_total"] > 0
        assert (
            0
            < metrics["vllm:spec_decode_num_accepted_tokens_total"]
            <= metrics["vllm:spec_decode_num_draft_tokens_total"]
        )
        assert "speculative decoding: ngram, 4 tokens, n-grams 2-4" in server.log()
    finally:
        server.stop()


# ---- a draft model -------------------------------------------------------------------------------
def _draft_config(model: str, k: int = 4) -> str:
    return json.dumps({"method": "draft_model", "model": model, "num_speculative_tokens": k})


def test_a_draft_model_gives_the_targets_greedy_text(engine_cache: Any, smol_engine: Engine) -> None:
    """The embedded SmolLM2 drafting for itself (an engine of its own: its KV pool, its prefix cache as the
    rollback): nearly every draft is accepted, and the text is the target's without speculation."""
    from engine.loader.resolve import default_model_path

    engine = engine_cache(None, speculative_config=_draft_config(default_model_path()), debug_kv_invariant=True)
    assert engine.draft_engine is not None
    params = SamplingParams(max_tokens=40, temperature=0.0)
    prompts = PROMPTS[:6]
    want = smol_engine.generate(prompts, params, chat=True)
    engine.speculator.stats.__init__()  # type: ignore[union-attr,misc]
    got = engine.generate(prompts, params, chat=True)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    stats = engine.speculator.stats  # type: ignore[union-attr]
    print(f"self-drafting: mean acceptance length {stats.mean_acceptance_length:.2f} of 5")
    assert stats.mean_acceptance_length > 3.5
    draft = engine.draft_engine
    assert not draft.has_unfinished() and draft.kv_pages_in_use() == 0  # every draft request ended
    assert draft.stats().prefix_cache_hit_tokens > 0  # the accepted context came from its cache
    release_cached(engine)


def test_a_random_draft_model_is_refused_nothing_and_changes_nothing(
    tmp_path: Any, engine_cache: Any, smol_engine: Engine
) -> None:
    """A tiny random model with SmolLM2's vocabulary: its drafts are almost all rejected, the text is the same;
    one with another vocabulary is refused at start, by name."""
    from tests.conftest import build_tiny_checkpoint

    random_draft = build_tiny_checkpoint("llama", str(tmp_path / "draft"), vocab_size=49152)
    engine = engine_cache(None, speculative_config=_draft_config(random_draft, k=3), debug_kv_invariant=True)
    params = SamplingParams(max_tokens=24, temperature=0.0)
    want = smol_engine.generate(PROMPTS[:3], params, chat=True)
    got = engine.generate(PROMPTS[:3], params, chat=True)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    stats = engine.speculator.stats  # type: ignore[union-attr]
    assert stats.num_drafts > 0 and stats.acceptance_rate < 0.5
    release_cached(engine)
    other_vocabulary = build_tiny_checkpoint("llama", str(tmp_path / "other"))
    with pytest.raises(Exception, match="draft model's vocabulary \\(384 tokens\\) is not the target's \\(49152\\)"):
        Engine(device="cpu", dtype="float32", disable_graphs=True, speculative_config=_draft_config(other_vocabulary))
