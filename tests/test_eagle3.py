"""EAGLE-3 draft heads (engine/speculative/eagle3*.py): a tiny random head for the embedded SmolLM2, saved in the
public layout (config.json + model.safetensors with d2t/t2d and a draft vocabulary smaller than the target's),
loaded and run.

A random head's drafts are nearly all rejected, which is what exactness needs: greedy text identical to decoding
without it, eager and through the compiled decode graphs. The fuzz forces accepts and rejects at random (drafts
replaced by the target's own continuation, corrupted at chosen places): the text stays the target's, the KV
invariant holds after every step, the head's cache follows the request exactly (caught up to the last computed
position, no draft K/V left behind), and the head's own drafts for a context do not depend on the accept/reject
history that led there, which a stale cache entry after a rollback would change. The head's store is shared by
all requests (in the target pool's slots): a batch drafts what each request drafts alone, and a freed request's
K/V are never read by the next owner of its slots.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from engine.engine import Engine
from engine.errors import ModelLoadError
from engine.request import Request
from engine.sampling_params import SamplingParams
from engine.speculative.aux_hidden import AuxHiddenTap, default_aux_layers
from engine.speculative.config import SpeculativeConfig, sglang_speculative_config
from engine.speculative.eagle3 import Eagle3Proposer
from engine.speculative.eagle3_checkpoint import DUMMY, TargetShape, dummy_config, load_eagle3_head
from engine.speculative.eagle3_head import Eagle3Config
from engine.speculative.eagle3_kv import HeadKVStore, SlotTable, bucket, grouped_attention, stamps_of
from tests.conftest import release_cached
from tests.eagle3_files import build_eagle3_head

PROMPTS = [
    "What is the capital of France?",
    "Write the numbers from 1 to 25 separated by commas.",
    "Name three colours.",
    "Copy this sentence word for word: the quick brown fox jumps over the lazy dog.",
    "List the days of the week.",
    "Give me a haiku about the sea.",
]
SMOL_SHAPE = TargetShape(576, 49152, 30, 9, 3, 1536, 2048)


def _eagle(path: str, k: int = 3) -> str:
    return json.dumps({"method": "eagle3", "model": path, "num_speculative_tokens": k})


@pytest.fixture(scope="module")
def head_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    return build_eagle3_head(str(tmp_path_factory.mktemp("eagle3") / "head"), draft_vocab_size=2048)


@pytest.fixture(scope="module")
def eagle_engine(engine_cache: Any, head_path: str) -> Iterator[Engine]:
    engine = engine_cache(None, speculative_config=_eagle(head_path), debug_kv_invariant=True)
    yield engine
    release_cached(engine)


# ---- settings and the checkpoint ---------------------------------------------------------------
def test_vllm_and_sglang_spellings_give_the_same_config() -> None:
    config = SpeculativeConfig.parse(_eagle("/m/head", 4))
    assert config is not None and (config.method, config.model, config.num_speculative_tokens) == (
        "eagle3",
        "/m/head",
        4,
    )
    assert sglang_speculative_config("EAGLE3", 4, 5, "/m/head", 1) == {
        "method": "eagle3",
        "num_speculative_tokens": 4,
        "model": "/m/head",
    }
    with pytest.raises(ValueError, match="--speculative-eagle-topk 4: tree drafts are not supported"):
        sglang_speculative_config("EAGLE3", 3, None, "/m/head", 4)
    with pytest.raises(ValueError, match="'eagle' is not supported yet"):
        SpeculativeConfig.parse('{"method": "eagle", "model": "/m/head", "num_speculative_tokens": 3}')
    # The engine's SGLang flags become the same JSON at resolve time.
    from backends import get_platform
    from engine.config import EngineConfig

    flags: dict[str, Any] = dict(
        device="cpu",
        speculative_algorithm="EAGLE3",
        speculative_draft_model_path="/m/head",
        speculative_num_steps=3,
    )
    resolved = EngineConfig(**flags).resolve(get_platform("cpu"))
    assert json.loads(resolved.speculative_config or "") == {
        "method": "eagle3",
        "num_speculative_tokens": 3,
        "model": "/m/head",
    }
    with pytest.raises(ValueError, match="--speculative-eagle-topk 2: tree drafts are not supported"):
        EngineConfig(**flags, speculative_eagle_topk=2).resolve(get_platform("cpu"))


def test_the_public_layout_loads_with_its_vocabulary_map(head_path: str, tmp_path: Any) -> None:
    head = load_eagle3_head(head_path, SMOL_SHAPE, torch.float32, torch.device("cpu"))
    config = head.config
    assert (config.draft_vocab_size, config.vocab_size, head.embed_tokens) == (2048, 49152, None)
    # d2t maps every draft id to a distinct target id that t2d marks.
    ids = head.to_target_ids(torch.arange(2048))
    assert len(set(ids.tolist())) == 2048 and bool(head.t2d[ids].all()) and int(head.t2d.sum()) == 2048
    probs = head.target_probs(torch.randn(2, 576))
    assert probs.shape == (2, 49152) and torch.allclose(probs.sum(-1), torch.ones(2))
    assert not bool((probs[:, ~head.t2d] > 0).any())
    # Default aux layers (vLLM's and SGLang's): the streams entering 2, L // 2, L - 3; explicit ids are outputs.
    assert config.target_layers(30) == default_aux_layers(30) == [2, 15, 27]
    explicit = build_eagle3_head(str(tmp_path / "ids"), layer_ids=[1, 14, 26], own_embedding=True, prefix="layers.0.")
    head = load_eagle3_head(explicit, SMOL_SHAPE, torch.float32, torch.device("cpu"))
    assert head.config.target_layers(30) == [2, 15, 27] and head.embed_tokens is not None
    # t2d left out (vLLM never reads it): rebuilt from d2t.
    without = load_eagle3_head(
        build_eagle3_head(str(tmp_path / "no-t2d"), drop=("t2d",)), SMOL_SHAPE, torch.float32, torch.device("cpu")
    )
    assert torch.equal(without.t2d, load_eagle3_head(head_path, SMOL_SHAPE, torch.float32, torch.device("cpu")).t2d)


def test_a_bad_checkpoint_is_refused_by_name(tmp_path: Any, head_path: str) -> None:
    cpu = torch.device("cpu")
    cases = {
        "wide": (
            {"config_overrides": {"hidden_size": 640}},
            "does not fit the target model: hidden_size 640, the target's is 576",
        ),
        "missing": (
            {"drop": ("midlayer.mlp.down_proj.weight",)},
            "missing tensor\\(s\\) midlayer.mlp.down_proj.weight",
        ),
        "no-map": ({"drop": ("d2t",)}, "missing tensor\\(s\\) d2t"),
        "vocab": ({"config_overrides": {"vocab_size": 32000}}, "vocab_size 32000, the target's is 49152"),
        "layers": ({"layer_ids": [1, 14, 30]}, "layer 30 is not among the target's 30 layers"),
        "shape": (
            {"config_overrides": {"intermediate_size": 512}},
            r"midlayer.mlp.gate_proj.weight has shape \(256, 576\), the config gives \(512, 576\)",
        ),
    }
    for name, (options, message) in cases.items():
        folder = str(tmp_path / name)
        if name == "shape":  # weights of one size, a config of another
            build_eagle3_head(folder)
            with open(f"{folder}/config.json", encoding="utf-8") as handle:
                values = json.load(handle)
            values.update(options["config_overrides"])
            with open(f"{folder}/config.json", "w", encoding="utf-8") as handle:
                json.dump(values, handle)
        else:
            build_eagle3_head(folder, **options)
        with pytest.raises(ModelLoadError, match=message):
            load_eagle3_head(folder, SMOL_SHAPE, torch.float32, cpu)
    with pytest.raises(ModelLoadError, match=r"no config\.json there"):
        load_eagle3_head(str(tmp_path / "nowhere"), SMOL_SHAPE, torch.float32, cpu)
    # Through the engine: refused at start, the message naming the problem.
    with pytest.raises(ModelLoadError, match="hidden_size 640"):
        Engine(
            device="cpu",
            dtype="float32",
            disable_graphs=True,
            cpu_prefill_weights="gguf",  # no bf16 prefill copy: the head is refused before it would matter
            speculative_config=_eagle(str(tmp_path / "wide")),
        )


def test_dummy_heads_take_the_targets_shape() -> None:
    """`"model": "dummy"`: a head shaped like the public Llama-3-8B one, for benchmarks with dummy weights."""
    llama8b = TargetShape(4096, 128256, 32, 32, 8, 14336, 8192)
    config = Eagle3Config.from_json(dummy_config(llama8b))
    assert (config.hidden_size, config.num_key_value_heads, config.intermediate_size) == (4096, 8, 14336)
    assert (config.draft_vocab_size, config.target_layers(32)) == (32000, [2, 16, 29])
    head = load_eagle3_head(DUMMY, SMOL_SHAPE, torch.float32, torch.device("cpu"))
    ids = head.to_target_ids(torch.arange(head.config.draft_vocab_size))
    assert int(ids.max()) < 49152 and len(set(ids.tolist())) == head.config.draft_vocab_size


def test_the_tap_records_the_streams_entering_the_chosen_layers() -> None:
    tap = AuxHiddenTap([2, 5, 5], hidden_size=4, max_tokens=2, dtype=torch.float32, device=torch.device("cpu"))
    for layer in range(7):
        tap.record(layer, torch.full((3, 4), float(layer)))  # three tokens: more than planned, the buffer grows
    assert tap.rows(3).tolist() == [[2.0] * 4 + [5.0] * 8] * 3


# ---- the engine ------------------------------------------------------------------------------------
def test_the_head_store_keeps_one_writer_per_slot_and_reads_only_its_own() -> None:
    """Stamps (writer, position): a read sees only what that request wrote at that position; two writes to one
    slot in a call keep the later one whole (keys, values and stamp together); the store grows past its first
    size when the pool's is not given, and refuses a slot past the pool's when it is."""
    store = HeadKVStore(kv_heads=2, head_dim=4, dtype=torch.float32, device=torch.device("cpu"))
    keys = torch.arange(3 * 2 * 4, dtype=torch.float32).view(3, 2, 4)
    store.write(torch.tensor([5, 9, 5]), stamps_of(torch.tensor([1, 1, 2]), torch.tensor([0, 1, 7])), keys, -keys)
    got_keys, got_values, valid = store.gather(
        torch.tensor([[5, 9, -1], [5, 9, 5]]), stamps_of(torch.tensor([[1], [2]]), torch.tensor([0, 1, 7]))
    )
    assert valid.tolist() == [[False, True, False], [False, False, True]]  # slot 5: writer 2's, for position 7
    assert torch.equal(got_keys[1, 2], keys[2]) and torch.equal(got_values[0, 1], -keys[1])
    store.ensure(10_000)
    assert (
        store.trash > 10_000 and store.gather(torch.tensor([9]), stamps_of(torch.tensor(1), torch.tensor(1)))[2].item()
    )
    fixed = HeadKVStore(2, 4, torch.float32, torch.device("cpu"), num_slots=64)
    with pytest.raises(ValueError, match="slot 64 is past the head's store of 64 slots"):
        fixed.ensure(64)
    table = SlotTable(torch.device("cpu"))
    rows = [table.assign() for _ in range(20)]  # past its first rows: it grows
    assert sorted(rows) == list(range(20)) and table.slots.shape[0] >= 20
    table.ensure_width(100)
    assert table.slots.shape[1] == bucket(100) == 128


def test_batched_attention_is_each_requests_own_attention() -> None:
    """grouped_attention over a padded batch with a mask equals each row's SDPA over its allowed keys alone."""
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(3, 2, 6, 8, generator=generator)  # 6 heads over 2 kv heads
    keys, values = torch.randn(2, 3, 5, 2, 8, generator=generator).unbind(0)
    mask = torch.rand(3, 2, 5, generator=generator) > 0.4
    mask[..., 0] = True
    out = grouped_attention(q, keys, values, mask)
    for b in range(3):
        for j in range(2):
            allowed = mask[b, j]
            k = keys[b, allowed].repeat_interleave(3, dim=1).transpose(0, 1)  # [heads, n, head_dim]
            v = values[b, allowed].repeat_interleave(3, dim=1).transpose(0, 1)
            want = torch.nn.functional.scaled_dot_product_attention(q[b, j].unsqueeze(1), k, v).squeeze(1)
            assert torch.allclose(out[b, j], want, atol=1e-5)


def test_greedy_text_is_identical_with_an_eagle3_head(smol_engine: Engine, eagle_engine: Engine) -> None:
    params = SamplingParams(max_tokens=24, temperature=0.0)
    want = smol_engine.generate(PROMPTS, params, chat=True)
    got = eagle_engine.generate(PROMPTS, params, chat=True)
    for a, b in zip(want, got):
        assert (b.token_ids, b.text, b.finish_reason) == (a.token_ids, a.text, a.finish_reason), a.prompt
    stats = eagle_engine.speculator.stats  # type: ignore[union-attr]
    assert stats.num_drafts > 0 and stats.num_draft_tokens > stats.num_drafts
    assert eagle_engine.speculator.eagle.states == {}  # type: ignore[union-attr]  # every request's cache freed
    # Sampled requests run too (drafts are single tokens: the acceptance rule is exact for them); seeds repeat.
    sampled = [SamplingParams(max_tokens=16, temperature=0.8, seed=s) for s in (1, 2)]
    first = eagle_engine.generate(PROMPTS[:2], sampled, chat=True)
    assert [o.token_ids for o in first] == [o.token_ids for o in eagle_engine.generate(PROMPTS[:2], sampled, chat=True)]


def test_greedy_text_is_identical_through_the_compiled_decode_graphs(
    smol_engine: Engine, engine_cache: Any, head_path: str
) -> None:
    """The default CPU mode: verify steps replay the compiled decode graphs (the native GGUF step keeps no inner
    states, so the head's engine takes the compiled runner); one size, strict: nothing compiles after capture."""
    engine = engine_cache(
        None,
        speculative_config=_eagle(head_path),
        disable_graphs=False,
        capture_sizes="8",
        strict_graphs=True,
        debug_kv_invariant=True,
    )
    assert "CompiledDecodeRunner" in engine.runner.describe()
    params = SamplingParams(max_tokens=16, temperature=0.0)
    want = smol_engine.generate(PROMPTS[:2], params, chat=True)
    got = engine.generate(PROMPTS[:2], params, chat=True)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert engine.runner.graph_steps > 0 and engine.speculator.stats.num_drafts > 0  # type: ignore[union-attr]
    release_cached(engine)


def test_drafts_left_on_the_device_verify_as_drafts_read_back(
    smol_engine: Engine, eagle_engine: Engine, engine_cache: Any, head_path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where steps read their input tokens on the device (overlap scheduling's platforms) the head's drafts stay
    there: the verify step is built from pending draft tokens and reads the drafts from the loop's buffer. Every
    verify step then checks the same drafts and samples the same token at every row (a wrongly fed draft changes
    the rows after it) as with the drafts read back before the step, and the text is the target's."""
    on_device = engine_cache(None, speculative_config=_eagle(head_path), debug_kv_invariant=True, overlap_schedule=True)
    speculator = on_device.speculator
    assert speculator is not None and speculator.drafts_on_device and on_device.decode_state.device_drafts is not None
    assert not on_device.overlap  # verify steps still wait for their verdict before the next step
    loop = speculator.eagle.loop  # type: ignore[union-attr]
    reads = []
    read_drafts = loop.read_drafts
    monkeypatch.setattr(loop, "read_drafts", lambda: reads.append(1) or read_drafts())
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (9, 15, 12)]
    prompts = ["The quick brown fox", "Once upon a time", "My favourite colour is"]
    verdicts: list[list[tuple[list[int], list[int]]]] = []
    for engine in (eagle_engine, on_device):
        seen: list[tuple[list[int], list[int]]] = []
        verdicts.append(seen)
        accept = engine.speculator.accept  # type: ignore[union-attr]

        def recorded(drafts: list[int], sampled: list[int], accept: Any = accept, seen: Any = seen) -> list[int]:
            seen.append((list(drafts), list(sampled)))
            return accept(drafts, sampled)  # type: ignore[no-any-return]

        monkeypatch.setattr(engine.speculator, "accept", recorded)
        engine.kv_manager.reset_prefix_cache()
        got = [o.token_ids for o in engine.generate(prompts, params)]
        assert got == [o.token_ids for o in smol_engine.generate(prompts, params)]
    host, device = verdicts
    assert reads and len(host) > 20 and all(t >= 0 for drafts, _ in device for t in drafts)
    assert device == host
    release_cached(on_device)


def _drafts_from_scratch(eagle: Eagle3Proposer, tokens: list[int], features: torch.Tensor, k: int) -> list[int]:
    """The head's chain for a context computed without any cache: every position again, full causal attention
    (positions 0..len(tokens) - 2 with their features, then each draft appended with the head's own output)."""
    head = eagle.head
    n = len(tokens) - 1

    def attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        groups = q.shape[1] // keys.shape[1]
        keys, values = (t.repeat_interleave(groups, dim=1).transpose(0, 1) for t in (keys, values))
        out = torch.nn.functional.scaled_dot_product_attention(q.transpose(0, 1), keys, values, is_causal=True)
        return out.transpose(0, 1)

    embeds = eagle.embed(torch.tensor(tokens[1:]))
    feature = head.fuse(features[:n])
    drafts: list[int] = []
    with torch.no_grad():
        for _ in range(k):
            normed, hidden = head.layer(embeds, feature, torch.arange(feature.shape[0]), attend)
            token = head.to_target_ids(head.draft_logits(normed[-1:]).argmax(-1))
            drafts.append(int(token))
            embeds = torch.cat([embeds, eagle.embed(token)])
            feature = torch.cat([feature, hidden[-1:]])
    return drafts


class _Checked:
    """The proposer's observe and propose wrapped: after every propose each request's head cache is caught up
    to its last computed position with no chain K/V left past it (dense: and every position before it is its own,
    no prefix-cache hit), and (at `rate` of the calls) its drafts are those of the head run from scratch on the
    same features. force(request, drafts): the drafts handed to the
    engine instead (a fuzz of accepts and rejects); None: the head's own."""

    def __init__(self, eagle: Eagle3Proposer, rate: float, force: Any = None, dense: bool = True) -> None:
        self.eagle, self.rate, self.force, self.dense = eagle, rate, force, dense
        self.observe, self.propose = eagle.observe, eagle.propose
        self.features: dict[str, dict[int, torch.Tensor]] = {}  # every request's latest features by position
        self.head_drafts: dict[tuple[int, ...], list[int]] = {}  # context -> the head's own drafts, every run
        self.mismatches: list[tuple[int, ...]] = []
        self.checked = 0
        self.max_batch = 0  # the most requests drafting in one propose
        self.rng = random.Random(0)

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setattr(self.eagle, "observe", self.observed)
        monkeypatch.setattr(self.eagle, "propose", self.proposed)

    def observed(self, step: Any, message: Any) -> None:
        self.observe(step, message)
        for request in step.requests:
            pending = self.eagle.states[request.request_id].pending[-1]
            for offset, row in enumerate(pending.rows):
                self.features.setdefault(request.request_id, {})[pending.first + offset] = row

    def proposed(self, requests: list[Request], limits: list[int], on_device: bool = False) -> list[list[int]]:
        assert not on_device  # the drafts are checked by value
        drafts = self.propose(requests, limits)
        self.max_batch = max(self.max_batch, sum(1 for d in drafts if d))
        for request, proposed in zip(requests, drafts):
            state = self.eagle.states[request.request_id]
            assert state.length == request.num_tokens - 1
            # No K/V stored past the last computed position (a chain's stay in the draft loop's scratch), and
            # without prefix-cache hits every position before it is the request's own.
            assert not bool((self.eagle.table.slots[state.row, state.length :] >= 0).any())
            if self.dense:
                assert bool(self.eagle.valid_positions(request).all())
            context = tuple(request.all_token_ids)
            if not proposed:
                continue
            if context in self.head_drafts and self.head_drafts[context] != proposed:
                self.mismatches.append(context)
            self.head_drafts[context] = proposed
            if self.rng.random() < self.rate:
                rows = self.features[request.request_id]
                stacked = torch.stack([rows[p] for p in range(request.num_tokens - 1)])
                assert proposed == _drafts_from_scratch(self.eagle, request.all_token_ids, stacked, len(proposed))
                self.checked += 1
        if self.force is None:
            return drafts
        return [self.force(request, proposed) if proposed else [] for request, proposed in zip(requests, drafts)]


def test_fuzzed_accepts_and_rejects_keep_the_text_the_kv_and_the_heads_cache(
    smol_engine: Engine, eagle_engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    params = SamplingParams(max_tokens=28, temperature=0.0)
    prompts = PROMPTS[:3]
    want = {o.prompt: o.token_ids for o in smol_engine.generate(prompts, params, chat=True)}
    eagle = eagle_engine.speculator.eagle  # type: ignore[union-attr]
    assert isinstance(eagle, Eagle3Proposer)
    rng = random.Random(1)

    def force(request: Request, proposed: list[int]) -> list[int]:
        """The target's own continuation, wrong from a random place on: every acceptance length happens."""
        assert request.prompt is not None
        truth = want[request.prompt][len(request.output_token_ids) :][: len(proposed)]
        cut = rng.randint(0, len(truth))
        return truth[:cut] + [(t + 1) % 49152 for t in truth[cut:]]

    checked = _Checked(eagle, rate=0.3, force=force)
    checked.install(monkeypatch)
    eagle_engine.speculator.stats.__init__()  # type: ignore[union-attr,misc]
    for _ in range(3):  # three histories of accepts and rejects over the same contexts
        for prompt in prompts:
            # No prefix-cache hits: the head sees every position (a hit leaves gaps the reference does not model).
            eagle_engine.kv_manager.reset_prefix_cache()
            got = eagle_engine.generate(prompt, params, chat=True)[0]
            assert got.token_ids == want[prompt]
    stats = eagle_engine.speculator.stats  # type: ignore[union-attr]
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    assert min(stats.accepted_per_position) > 0  # every draft position was accepted sometimes
    assert not checked.mismatches, f"{len(checked.mismatches)} contexts drafted differently after other histories"
    assert checked.checked > 5 and eagle.states == {}


def test_a_batch_drafts_what_each_request_drafts_alone(
    smol_engine: Engine, eagle_engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The head's attention is batched over the step's requests: four requests drafting together draft, at
    every context, the tokens each drafts when it runs alone (and those of the head run from scratch)."""
    eagle = eagle_engine.speculator.eagle  # type: ignore[union-attr]
    assert isinstance(eagle, Eagle3Proposer)
    checked = _Checked(eagle, rate=1.0)
    checked.install(monkeypatch)
    prompts = ["The quick brown fox", "Once upon a time", "In the beginning", "My favourite colour is"]
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (8, 14, 11, 10)]
    want = [o.token_ids for o in smol_engine.generate(prompts, params)]
    for prompt, p in zip(prompts, params):
        eagle_engine.kv_manager.reset_prefix_cache()  # no prefix-cache hits: the head sees every position
        eagle_engine.generate([prompt], [p])
    alone, checked.head_drafts = checked.head_drafts, {}
    assert checked.max_batch == 1
    eagle_engine.kv_manager.reset_prefix_cache()
    assert [o.token_ids for o in eagle_engine.generate(prompts, params)] == want
    together = checked.head_drafts
    common = alone.keys() & together.keys()
    assert checked.max_batch == 4 and len(common) > 20
    assert {c: together[c] for c in common} == {c: alone[c] for c in common}
    assert not checked.mismatches and eagle.states == {}


class _ReplayingGraphs:
    """engine.platform.DeviceGraphs on the CPU: a capture runs the function (its warm-up) and a replay runs
    it again, reading the persistent buffers as they are then. A function that kept a value of the call it
    was captured in (a tensor made on the host, a Python int) would replay that value, as a device graph
    does, and draft wrongly for later steps."""

    def __init__(self) -> None:
        self.captured: list[Any] = []
        self.replays = 0

    def capture(self, fn: Any) -> Any:
        fn()
        self.captured.append(fn)

        def replay() -> None:
            self.replays += 1
            fn()

        return replay


def test_the_draft_loop_replays_its_captured_shapes_and_drafts_what_the_head_drafts(
    smol_engine: Engine, eagle_engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Between verify steps the catch-up and the chain run in fixed shapes (batch padded to a power of two,
    context to its bucket) captured once per shape: replayed for four requests of different lengths, every
    draft is still the head's from scratch and the text the target's."""
    eagle = eagle_engine.speculator.eagle  # type: ignore[union-attr]
    assert isinstance(eagle, Eagle3Proposer)
    graphs = _ReplayingGraphs()
    monkeypatch.setattr(eagle.loop, "graphs", graphs)
    monkeypatch.setattr(eagle.loop, "replays", {})
    decode_shaped = []
    decode_catch_up = eagle._decode_catch_up

    def counted(requests: list[Request]) -> Any:
        rows = decode_catch_up(requests)
        decode_shaped.append(rows is not None)
        return rows

    monkeypatch.setattr(eagle, "_decode_catch_up", counted)
    checked = _Checked(eagle, rate=1.0)
    checked.install(monkeypatch)
    prompts = ["The quick brown fox", "Once upon a time", "In the beginning", "My favourite colour is"]
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (9, 15, 12, 20)]
    want = [o.token_ids for o in smol_engine.generate(prompts, params)]
    eagle_engine.kv_manager.reset_prefix_cache()
    assert [o.token_ids for o in eagle_engine.generate(prompts, params)] == want
    kinds = {key[0] for key in eagle.loop.replays}
    batches = {key[1] for key in eagle.loop.replays}
    assert kinds == {"catch-up", "chain"} and {1, 2, 4} <= batches
    assert graphs.replays > 2 * len(graphs.captured) and sum(decode_shaped) > 2 * decode_shaped.count(False)
    # Each shape captured once: the slot table was sized at start, so no growth dropped the graphs.
    assert len(graphs.captured) == len(eagle.loop.replays)
    assert checked.checked > 10 and not checked.mismatches and eagle.states == {}


def test_a_freed_requests_head_kv_is_never_read_by_the_next_owner_of_its_slots(
    smol_engine: Engine, eagle_engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A request aborted mid-decode leaves its head K/V at its slots; they are made garbage, and the next request
    takes the same pages (the pool hands freed pages out first). Its drafts must be the head's from scratch at
    every step: it rewrites a slot before it reads it, and nothing of the aborted request is read."""
    eagle = eagle_engine.speculator.eagle  # type: ignore[union-attr]
    assert isinstance(eagle, Eagle3Proposer)
    eagle_engine.kv_manager.reset_prefix_cache()
    first = eagle_engine.add_request(
        "Once upon a time, in a land far away, there lived a",
        SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True),
    )
    for _ in range(8):
        eagle_engine.step()
    state = next(iter(eagle.states.values()))
    row = eagle.table.slots[state.row]
    used = row[row >= 0]
    assert used.numel() > 10
    eagle_engine.abort(first)
    while eagle_engine.has_unfinished():
        eagle_engine.step()
    assert eagle.states == {} and bool((eagle.table.slots == -1).all())
    eagle_engine.kv_manager.reset_prefix_cache()  # its cached pages too go back to the free list
    garbage = torch.randn(used.numel(), *eagle.store.keys.shape[1:]) * 1e3
    eagle.store.keys[used], eagle.store.values[used] = garbage, -garbage
    checked = _Checked(eagle, rate=1.0)
    checked.install(monkeypatch)
    seen: list[torch.Tensor] = []
    observe = checked.observed

    def observed(step: Any, message: Any) -> None:
        observe(step, message)
        for s in eagle.states.values():
            seen.append(eagle.table.slots[s.row].clone())

    monkeypatch.setattr(eagle, "observe", observed)
    prompt = "In the beginning was the word, and the word"
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    want = smol_engine.generate([prompt], params)[0].token_ids
    assert eagle_engine.generate([prompt], params)[0].token_ids == want
    reused = set(used.tolist()) & {slot for slots in seen for slot in slots.tolist() if slot >= 0}
    assert len(reused) > 10 and checked.checked > 3 and eagle.states == {}


def test_steps_without_drafts_leave_features_for_the_next_draft(
    smol_engine: Engine, eagle_engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """disable_by_batch_size 2: while two or three requests run nobody drafts (nor runs the head), so their
    features pile up over several steps; once one is left its head catches up on all of them at once."""
    import dataclasses

    speculator = eagle_engine.speculator
    assert speculator is not None and speculator.eagle is not None
    monkeypatch.setattr(speculator, "config", dataclasses.replace(speculator.config, disable_by_batch_size=2))
    checked = _Checked(speculator.eagle, rate=1.0)
    checked.install(monkeypatch)
    prompts = ["The quick brown fox", "Once upon a time", "In the beginning"]  # no shared prefix: no cache hits
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (6, 10, 20)]
    eagle_engine.kv_manager.reset_prefix_cache()
    want = [o.token_ids for o in smol_engine.generate(prompts, params)]
    assert [o.token_ids for o in eagle_engine.generate(prompts, params)] == want
    assert checked.checked > 0 and speculator.eagle.states == {}


def test_the_tap_holds_the_streams_entering_the_heads_layers(eagle_engine: Engine) -> None:
    """What the head is given is what the target's layers 2, 15 and 27 received, for every token of a step."""
    eagle = eagle_engine.speculator.eagle  # type: ignore[union-attr]
    assert eagle is not None and eagle.tap.layers == [2, 15, 27]
    layers = eagle_engine.model.decoder_layers()
    seen: dict[int, torch.Tensor] = {}
    hooks = [
        layers[i].register_forward_pre_hook(lambda _m, args, i=i: seen.__setitem__(i, args[1].clone()))
        for i in (2, 15, 27)
    ]
    try:
        eagle_engine.kv_manager.reset_prefix_cache()
        eagle_engine.generate(PROMPTS[0], SamplingParams(max_tokens=1), chat=True)  # one prefill step
    finally:
        for hook in hooks:
            hook.remove()
    tokens = seen[2].shape[0]
    assert tokens > 10 and torch.equal(eagle.tap.rows(tokens), torch.cat([seen[2], seen[15], seen[27]], dim=-1))


def test_retraction_and_abort_under_memory_pressure_with_a_head(tiny_checkpoints: dict[str, str]) -> None:
    """Tiny llama with a dummy head of its shape (`"model": "dummy"`), 7 pages of 16 tokens for 12 requests:
    verify steps retract each other (the head's cache of a retracted request goes, its redo is observed anew)
    and the tokens are the roomy engine's; an abort between verify steps frees everything."""
    rng = random.Random(4)
    prompts = [[rng.randrange(3, 300) for _ in range(rng.randint(10, 40))] for _ in range(12)]
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    options: dict[str, Any] = dict(device="cpu", dtype="float32", disable_graphs=True, page_size=16)
    roomy = Engine(model=tiny_checkpoints["llama"], **options)
    tight = Engine(
        model=tiny_checkpoints["llama"],
        **options,
        kv_cache_tokens=112,
        speculative_config=_eagle(DUMMY, k=2),
        debug_kv_invariant=True,
    )
    try:
        expected = [o.token_ids for o in roomy.generate(prompts, params)]
        assert [o.token_ids for o in tight.generate(prompts, params)] == expected
        assert tight.scheduler.num_retractions > 0 and tight.speculator.stats.num_drafts > 0  # type: ignore[union-attr]
        request_id = tight.add_request(prompts[0], SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True))
        for _ in range(4):
            tight.step()
        tight.abort(request_id)
        while tight.has_unfinished():
            tight.step()
        assert tight.kv_pages_in_use() == 0 and tight.speculator.eagle.states == {}  # type: ignore[union-attr]
    finally:
        roomy.shutdown()
        tight.shutdown()
