"""The XLA platform (backends/xla/, torchax on JAX's CPU backend): greedy parity with --device cpu, zero
compiles after warm-up by JAX's own counters, and the device-independent parts (buckets, the attention in
torch ops, the Dimname shim's filter, the install message).

The tests that run XLA skip when torchax or jax is missing, and unless this file runs alone in its process
(`python -m pytest -n 0 tests/test_xla.py`, as .ci/run does): importing torchax renames torch's privateuse1
backend to "jax" and registers a device module, for the rest of the process, after which torch.compile fails
there ("PyTorch is not linked with support for jax devices"), so it must not share a worker with the suite's
compiled-graph tests. The rest run everywhere."""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from conftest import return_freed_memory
from helpers import greedy

from backends.xla import vendor
from backends.xla.attention import XlaAttentionBackend, XlaChunkMetadata
from backends.xla.buckets import bucket_for, split
from engine.engine import Engine
from engine.errors import EngineError
from engine.layers.attention import AttentionMetadata
from engine.layers.torch_attention import TorchAttentionBackend

# Small programs: a short context, two decode and two prefill buckets (each one XLA compile, ~5 s here).
XLA_OPTIONS: dict[str, Any] = dict(
    dtype="float32",
    page_size=16,
    max_model_len=256,
    kv_cache_tokens=1024,
    max_num_seqs=4,
    capture_sizes="1,4",
    extend_capture_tokens="16,64",
    chunked_prefill_size=64,
    max_extend_step_ms=0,
)
PROMPTS = [
    "The capital of France is",
    "Write a haiku about graphs:",
    # Past the largest prefill bucket (64 tokens): two prefill programs, the second over the first one's KV.
    "Once upon a time, in a land far away, there lived a king who had three daughters. " * 3,
]
NEW_TOKENS = 12


# ---- device-independent ----------------------------------------------------------------------
def test_buckets_and_pieces() -> None:
    assert bucket_for([1, 4, 8], 3) == 4
    assert bucket_for([1, 4, 8], 1) == 1
    with pytest.raises(ValueError):
        bucket_for([1, 4], 5)
    assert split(10, 4) == [(0, 4), (4, 8), (8, 10)]
    assert split(3, 4) == [(0, 3)]


def test_shim_only_answers_named_tensor_overloads() -> None:
    for removed in ("dim_Dimname", "dimname", "names_ScalarOpt_dim", "correction_names", "Dimname"):
        assert vendor.is_dimname_overload(removed)
    for kept in ("default", "dim", "Tensor", "out", "int"):
        assert not vendor.is_dimname_overload(kept)


def test_missing_vendor_names_the_install_command(monkeypatch: pytest.MonkeyPatch) -> None:
    from backends import get_platform
    from engine.platform import DeviceUnavailableError

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torchax" else real(name, *a))
    vendor.load.cache_clear()
    try:
        with pytest.raises(DeviceUnavailableError, match=r"pip install torchax==0\.0\.13 'jax\[cpu\]==0\.10\.2'"):
            get_platform("xla")
    finally:
        vendor.load.cache_clear()


def _cache(slots: int = 64, kv_heads: int = 2, dim: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    return torch.randn(slots, kv_heads, dim), torch.randn(slots, kv_heads, dim)


def test_decode_attention_matches_the_torch_backend() -> None:
    """The XLA decode path (every row over its whole page-table row, masked) against the CPU's torch backend
    (exactly the row's pages), on CPU tensors: GQA, rows of different lengths, a page table padded with 0."""
    k_cache, v_cache = _cache()
    q, k, v = torch.randn(3, 4, 8), torch.randn(3, 2, 8), torch.randn(3, 2, 8)
    page_table = torch.tensor([[1, 2, 0, 0], [3, 0, 0, 0], [2, 1, 3, 0]], dtype=torch.int32)
    seq_lens = torch.tensor([7, 2, 12], dtype=torch.int32)
    slots = torch.tensor([1 * 4 + 2, 3 * 4 + 1, 3 * 4 + 3])
    meta = AttentionMetadata(True, slots, page_table, seq_lens, 4)
    for window, softcap in ((0, 0.0), (3, 0.0), (0, 5.0)):
        caches = [(k_cache.clone(), v_cache.clone()) for _ in range(2)]
        ours = XlaAttentionBackend().forward(q, k, v, *caches[0], meta, 0.35, window=window, softcap=softcap)
        theirs = TorchAttentionBackend().forward(q, k, v, *caches[1], meta, 0.35, window=window, softcap=softcap)
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
        assert torch.equal(caches[0][0], caches[1][0]) and torch.equal(caches[0][1], caches[1][1])


def test_chunk_attention_matches_the_torch_backend() -> None:
    """A prefill chunk after a cached prefix, padded with tokens at position 0 / slot 0 (what the runner pads
    with): its real rows equal the torch backend's ragged extend."""
    k_cache, v_cache = _cache()
    prefix, new, pad = 5, 6, 2
    pages = torch.tensor([[2, 3, 1, 0]], dtype=torch.int32)
    positions = torch.arange(prefix, prefix + new)
    slots = torch.tensor([int(pages[0, p // 4]) * 4 + p % 4 for p in positions.tolist()])
    q, k, v = torch.randn(new, 4, 8), torch.randn(new, 2, 8), torch.randn(new, 2, 8)
    ragged = AttentionMetadata(
        False, slots, pages, torch.tensor([prefix + new], dtype=torch.int32), 4, [0, new], [prefix + new]
    )
    padded_positions = torch.cat([positions, torch.zeros(pad, dtype=torch.int64)])
    padded = AttentionMetadata(
        False,
        torch.cat([slots, torch.zeros(pad, dtype=torch.int64)]),
        pages,
        torch.tensor([prefix + new], dtype=torch.int32),
        4,
        platform_metadata=XlaChunkMetadata(padded_positions),
    )
    for window in (0, 4):
        caches = [(k_cache.clone(), v_cache.clone()) for _ in range(2)]
        pad_rows = (torch.zeros(pad, 4, 8), torch.zeros(pad, 2, 8), torch.zeros(pad, 2, 8))
        ours = XlaAttentionBackend().forward(
            torch.cat([q, pad_rows[0]]),
            torch.cat([k, pad_rows[1]]),
            torch.cat([v, pad_rows[2]]),
            *caches[0],
            padded,
            0.35,
            window=window,
        )[:new]
        theirs = TorchAttentionBackend().forward(q, k, v, *caches[1], ragged, 0.35, window=window)
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
        assert torch.equal(caches[0][0][4:], caches[1][0][4:])  # every slot but the reserved page's


class FakePrograms:
    """XlaPrograms' interface on the host: records each call's shapes; logits / hidden rows echo the inputs."""

    def __init__(self, max_pages: int) -> None:
        self.max_pages = max_pages
        self.calls: list[tuple[str, tuple[int, ...]]] = []

    def decode(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        slots: torch.Tensor,
        page_table: torch.Tensor,
        seq_lens: torch.Tensor,
    ) -> torch.Tensor:
        self.calls.append(("decode", tuple(page_table.shape)))
        assert input_ids.shape == positions.shape == slots.shape == seq_lens.shape
        assert bool((seq_lens >= 1).all())  # a padding row still has its one (reserved) key
        return torch.stack([input_ids.float(), positions.float()], dim=1)

    def prefill(
        self, input_ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, page_row: torch.Tensor
    ) -> torch.Tensor:
        self.calls.append(("prefill", (input_ids.shape[0], page_row.shape[0])))
        return torch.stack([input_ids.float(), positions.float()], dim=1)


def test_runners_pad_to_buckets_and_split_past_the_largest() -> None:
    """Decode rows padded to the next batch bucket, a batch past the largest in pieces; each prompt chunk
    padded to the next token bucket, one past the largest in pieces; the real rows come back in order."""
    from backends.xla.runners import XlaDecodeRunner, XlaPrefillRunner
    from engine.step_message import DecodeMessage, ExtendMessage, StepMessage
    from graphs.model_runner import DecodeBatchState
    from graphs.step_runner import StepInputs, StepKind, StepShape

    fake = FakePrograms(max_pages=8)
    decode = XlaDecodeRunner(None, [], [1, 4], 8, 16, torch.device("cpu"), programs_for=lambda *args: fake)  # type: ignore[arg-type]
    state = DecodeBatchState(8, 8, 16, torch.device("cpu"), torch.int64)
    n = 6
    inputs = torch.stack([torch.arange(100, 100 + n), torch.arange(n) + 20, torch.arange(n) + 40, torch.arange(n)])
    message = DecodeMessage(inputs, None, torch.zeros(8, 8, dtype=torch.int32))
    logits, rows = decode.run_decode(message, state)
    assert fake.calls == [("decode", (4, 8)), ("decode", (4, 8))]  # 6 rows: 4, then 2 padded to 4
    assert logits[:, 0].tolist() == list(range(100, 106)) and rows.tolist() == list(range(n))

    fake.calls.clear()
    prefill = XlaPrefillRunner(fake, [16, 64])  # type: ignore[arg-type]
    lens = [10, 70]  # 10 -> one 16-token program; 70 -> 64 + 6 (padded to 16)
    ids = list(range(sum(lens)))
    extend = ExtendMessage(ids, ids, ids, lens, [0, 10, 80], [[1], [2, 3, 4, 5, 6]], [9, 79])
    step = StepInputs(StepShape(StepKind.EXTEND, 2, 80), StepMessage(None, extend, []), state, lambda: None)  # type: ignore[arg-type,return-value]
    assert prefill.can_run(step)
    hidden = prefill.run(step).hidden
    assert fake.calls == [("prefill", (16, 8)), ("prefill", (64, 8)), ("prefill", (16, 8))]
    assert hidden is not None and hidden[:, 0].tolist() == [float(i) for i in ids]


def test_configure_refuses_steps_off_the_programs() -> None:
    from backends.xla.platform import XlaPlatform
    from engine.config import EngineConfig

    for config in (
        EngineConfig(device="xla", mixed_steps=True),
        EngineConfig(device="xla", disable_graphs=True),
        EngineConfig(device="xla", enable_lora=True),
    ):
        with pytest.raises(EngineError):
            XlaPlatform().configure(config)


# ---- on XLA (torchax + jax) ------------------------------------------------------------------
@pytest.fixture(scope="module")
def xla_engine(request: pytest.FixtureRequest) -> Iterator[Engine]:
    others = {item.path.name for item in request.session.items} - {"test_xla.py"}
    if others:
        pytest.skip(
            "runs XLA only alone in its process (torchax changes torch's device registry for the process): "
            "python -m pytest -n 0 tests/test_xla.py"
        )
    pytest.importorskip("jax")
    # Not importorskip("torchax"): a plain import fails on torch 2.13 without the backend's shim (vendor.py).
    if vendor.missing_modules():
        pytest.skip(f"torchax or jax not installed ({vendor.INSTALL_COMMAND})")
    engine = Engine(device="xla", **XLA_OPTIONS)
    yield engine
    engine.shutdown()
    return_freed_memory()


def _texts(engine: Engine) -> list[list[int]]:
    outputs = engine.generate(PROMPTS, greedy(NEW_TOKENS))
    return [list(out.token_ids) for out in outputs]


def test_greedy_matches_cpu(xla_engine: Engine) -> None:
    """`--device xla` and `--device cpu` (float32, the same dequantized GGUF weights) give the same greedy tokens:
    a batch of 3 (a decode batch padded to the bucket of 4) with one prompt past the largest prefill bucket. The
    CPU side runs eagerly: its compiled graphs cannot run in a process that imported torchax (module docstring)."""
    ours = _texts(xla_engine)
    cpu_options = {**XLA_OPTIONS, "extend_capture_tokens": None, "quantization": "none", "disable_graphs": True}
    cpu = Engine(device="cpu", **cpu_options)
    try:
        theirs = _texts(cpu)
    finally:
        cpu.shutdown()
        return_freed_memory()
    assert ours == theirs
    one = xla_engine.generate(["The capital of France is"], greedy(8))[0]
    assert one.text.strip().startswith("Paris"), one.text


def test_no_compiles_after_warm_up(xla_engine: Engine) -> None:
    """JAX's compile log and the programs' jit caches do not move after start-up, whatever the batch size
    (1..4 and past the largest bucket), prompt length (inside, at and past each prefill bucket) or prefix hit."""
    from backends.xla.runners import XlaDecodeRunner

    runner = xla_engine.runner.runner_of(XlaDecodeRunner)
    assert runner is not None
    programs = runner.programs
    caches = programs.cache_sizes()
    assert caches == {"decode": 2, "prefill": 2}
    before = programs.counter.count
    prompts = [("word " * n).strip() for n in (3, 15, 16, 17, 63, 64, 65, 130)]
    xla_engine.generate(prompts[:5], greedy(5))  # 5 requests on a max_num_seqs of 4: batches of 4, then 1
    xla_engine.generate(prompts[5:], greedy(3))
    xla_engine.generate([prompts[-1] + " and more"], greedy(2))  # a prefix-cache hit: a chunk after cached pages
    assert programs.counter.count == before, programs.counter.compiles[before:]
    assert programs.cache_sizes() == caches
    assert xla_engine.runner.eager_steps == 0  # every step ran as an XLA program
