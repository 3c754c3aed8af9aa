"""Gaudi strict mode, lazy mark_steps, fp32 softmax and regional compilation, on CPU with a fake bridge.

The fake `habana_frameworks.torch` keeps one process-wide graph-compilation counter, as the bridge's
metric_global does, and lazy-mode semantics: work queued without a mark_step compiles at the next
mark_step, wherever that is. Prefill and sampler compiles must not trip strict mode; a compile
inside the decode step must.
"""

from __future__ import annotations

import random
import sys
import types
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
from conftest import reset_dynamo
from helpers import hpu_device_config, load_tiny_llama
from torch.utils._python_dispatch import TorchDispatchMode

from backends.hpu.attention import (
    HpuAttentionBackend,
    HpuFlatMetadata,
    flat_paged_attention,
    fp32_softmax_for,
)
from backends.hpu.bucketing import decode_buckets
from backends.hpu.graph_runner import HpuDecodeRunner, RecompileAfterWarmupError, _bridge_metric_factory
from backends.hpu.platform import HpuEngineRunner, HpuPlatform, configure_fp32_softmax
from engine.layers.attention import AttentionMetadata
from engine.layers.torch_attention import TorchAttentionBackend


class FakeBridge:
    """habana_frameworks.torch as far as the runner uses it: core.mark_step, hpu.wrap_in_hpu_graph, metrics."""

    def __init__(self) -> None:
        self.total = 0  # graph compilations in the whole process (metric_global's TotalNumber)
        self.pending = 0  # lazily queued graphs that compile at the next mark_step
        self.events: list[str] = []

    def queue(self) -> None:
        """Lazy mode: ops recorded now compile (as one graph) at the next mark_step."""
        self.pending = 1

    def compile_now(self) -> None:
        """An eager compile (a sampler op, an eager-mode recipe)."""
        self.total += 1

    def mark_step(self) -> None:
        self.events.append("mark_step")
        self.total += self.pending
        self.pending = 0

    def stats(self, count: int) -> list[tuple[str, int]]:
        return [("TotalNumber", count), ("TotalTime", 7 * count), ("AvgTime", 7)]

    @contextmanager
    def metric_localcontext(self, name: str) -> Iterator[Any]:
        assert name == "graph_compilation"
        start = self.total
        metric = types.SimpleNamespace(stats=lambda: self.stats(0))
        yield metric
        counted = self.total - start
        metric.stats = lambda: self.stats(counted)  # frozen at exit, as the bridge's local metric

    def metric_global(self, name: str) -> Any:
        return types.SimpleNamespace(stats=lambda: self.stats(self.total))

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        root = types.ModuleType("habana_frameworks")
        htorch = types.ModuleType("habana_frameworks.torch")
        hpu = types.ModuleType("habana_frameworks.torch.hpu")
        metrics = types.ModuleType("habana_frameworks.torch.hpu.metrics")
        metrics.metric_localcontext = self.metric_localcontext  # type: ignore[attr-defined]
        metrics.metric_global = self.metric_global  # type: ignore[attr-defined]
        hpu.metrics = metrics  # type: ignore[attr-defined]
        hpu.wrap_in_hpu_graph = lambda module, disable_tensor_cache=True: module  # type: ignore[attr-defined]
        htorch.hpu = hpu  # type: ignore[attr-defined]
        htorch.core = types.SimpleNamespace(mark_step=self.mark_step)  # type: ignore[attr-defined]
        root.torch = htorch  # type: ignore[attr-defined]
        for name, module in [
            ("habana_frameworks", root),
            ("habana_frameworks.torch", htorch),
            ("habana_frameworks.torch.hpu", hpu),
            ("habana_frameworks.torch.hpu.metrics", metrics),
        ]:
            monkeypatch.setitem(sys.modules, name, module)


def _batch(n: int) -> dict[str, torch.Tensor]:
    return dict(
        input_ids=torch.arange(1, n + 1),
        positions=torch.full((n,), 4),
        slot_indices=torch.arange(n) + 8,
        page_table=torch.ones(n, 2, dtype=torch.int32),
        seq_lens=torch.full((n,), 5, dtype=torch.int32),
    )


@pytest.mark.parametrize("mode", ["lazy", "eager"])
def test_strict_counts_only_the_decode_region(monkeypatch: pytest.MonkeyPatch, mode: str) -> None:
    bridge = FakeBridge()
    bridge.install(monkeypatch)
    seen: set[tuple[int, ...]] = set()
    state = {"compile_inside": False}

    def step(input_ids, positions, slot_indices, page_table, seq_lens, **block):
        bridge.events.append("step")
        key = (input_ids.shape[0], block["block_list"].shape[0])
        if key not in seen or state["compile_inside"]:  # a new shape: the bridge compiles a graph for it
            seen.add(key)
            bridge.queue() if mode == "lazy" else bridge.compile_now()
        return input_ids.float().unsqueeze(1)

    runner = HpuDecodeRunner(
        step,
        buckets=decode_buckets([1, 2], [2, 4], 4),
        page_size=4,
        max_blocks_per_seq=4,
        device="cpu",
        mode=mode,
        strict=True,
        with_block_metadata=True,
        show_progress=False,
        compile_metric=_bridge_metric_factory(),
    )
    runner.warmup()
    assert runner.bridge_compiles == len(seen) == len(runner.buckets)  # warm-up's compiles were all counted

    for _ in range(3):
        # A prefill and the sampler compile outside the decode step: eagerly, and (lazy) queued without a
        # mark_step, so they would compile at the decode step's own mark_step if it did not flush first.
        before = bridge.total
        bridge.compile_now()
        if mode == "lazy":
            bridge.queue()
        bridge.events.clear()
        out = runner.run(**_batch(2))  # must not raise: none of that compiled inside the decode region
        assert out.tolist() == [[1.0], [2.0]]
        assert bridge.total > before  # ...though the process-wide counter (metric_global) moved
        if mode == "lazy":
            assert bridge.events == ["mark_step", "step", "mark_step"]  # flushed before the region, then after

    state["compile_inside"] = True  # the step now compiles each time: inside the region
    with pytest.raises(RecompileAfterWarmupError, match=r"compiled 1 graph\(s\) inside the decode step"):
        runner.run(**_batch(1))


def test_strict_default_is_the_same_in_every_mode(monkeypatch: pytest.MonkeyPatch) -> None:
    bridge = FakeBridge()
    bridge.install(monkeypatch)

    class Model:
        attention_backend = None  # the runner's own hooks (an engine model has its backend's)

        def __call__(self, input_ids, positions, kv_caches, meta):
            return input_ids.float().unsqueeze(1)

        def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
            return hidden

    kv = [(torch.zeros(64, 1, 2), torch.zeros(64, 1, 2))]
    for mode in ("compile", "lazy", "eager"):
        runner = HpuEngineRunner(
            Model(), kv, [1, 2], 4, 4, torch.device("cpu"), mode=mode, compile_backend="eager", show_progress=False
        )
        assert runner.inner.strict, mode  # hpu.strict: true in configs/hpu.yaml
        assert not HpuEngineRunner(
            Model(),
            kv,
            [1, 2],
            4,
            4,
            torch.device("cpu"),
            mode=mode,
            compile_backend="eager",
            show_progress=False,
            device_config=hpu_device_config(strict=False),
        ).inner.strict


def test_each_platform_supplies_its_decode_runner_options(monkeypatch: pytest.MonkeyPatch) -> None:
    """Platform.decode_runner_options (what Engine.graph_runner_options returns: _graph_runner and the tuner build
    runners with it): HPU passes strict= only with --strict-graphs (the runner's own default then holds in every
    graph mode, compile mode included, where it used to be overridden with False); CPU's compiled runner always
    takes it; CUDA gets its kernel precompiler over the engine's model and caches, and the compiled extend step's
    layer graph; HPU and NPU the engine's device config (their hpu: / npu: sections)."""
    from backends.cpu.platform import CpuPlatform
    from backends.cuda.platform import CudaPlatform
    from backends.npu.platform import NpuPlatform
    from engine.config import EngineConfig
    from engine.engine import Engine

    model = torch.nn.Identity()  # the engine hands its model to the platform's hooks as the nn.Module it is
    caches = [(torch.zeros(4, 1, 2), torch.zeros(4, 1, 2))]

    def options(platform: Any, strict_graphs: bool, **config: Any) -> dict[str, Any]:
        return platform.decode_runner_options(EngineConfig(strict_graphs=strict_graphs, **config), model, caches, None)

    for mode in ("compile", "lazy", "eager"):
        hpu = options(HpuPlatform(graph_mode=mode), strict_graphs=False)
        assert "strict" not in hpu and hpu["mode"] == mode and "hpu" in hpu["device_config"], mode
        assert options(HpuPlatform(graph_mode=mode), strict_graphs=True)["strict"] is True, mode
    assert options(CpuPlatform(), strict_graphs=False) == {"strict": False}
    assert options(CpuPlatform(), strict_graphs=True) == {"strict": True}
    npu = options(NpuPlatform(), strict_graphs=True)
    assert npu == {"device_config": {}} and "strict" not in npu  # the engine's device config (unresolved here)
    cuda = CudaPlatform()
    monkeypatch.setattr(cuda, "kernel_precompiler", lambda model, caches: ("precompiler", model, caches))
    assert options(cuda, strict_graphs=False) == {
        "compile_step": False,
        "precompile": ("precompiler", model, caches),
        "layer_fn": None,
    }
    # A compiled extend step's layer graph is shared with the CUDA decode graphs (graphs/opaque_attention.py).
    engine = types.SimpleNamespace(
        config=EngineConfig(compile_decode=True),
        platform=cuda,
        model=model,
        kv_pool=types.SimpleNamespace(caches=caches),
    )
    extend_step = types.SimpleNamespace(layer_fn="the extend step's compiled layer")
    got = Engine.graph_runner_options(engine, extend_step)  # type: ignore[arg-type]
    assert got["layer_fn"] == extend_step.layer_fn and got["compile_step"] is True


def test_lazy_prefill_ends_with_a_mark_step(monkeypatch: pytest.MonkeyPatch) -> None:
    bridge = FakeBridge()
    bridge.install(monkeypatch)
    backend = HpuAttentionBackend(store_kv=lambda *args: None, mark_steps=True)
    extend = AttentionMetadata(
        is_decode=False,
        slot_indices=torch.zeros(3),
        page_table=torch.zeros(1, 1),
        seq_lens=torch.tensor([3]),
        page_size=4,
        query_start_loc=[0, 3],
        seq_lens_cpu=[3],
    )
    with backend.step_context(extend):
        bridge.events.append("prefill")
    assert bridge.events == ["prefill", "mark_step"]
    with HpuAttentionBackend(store_kv=lambda *args: None).step_context(extend):  # compile/eager mode: no mark_step
        bridge.events.append("prefill")
    assert bridge.events == ["prefill", "mark_step", "prefill"]


# ---- attention math: bf16 unless the model needs an fp32 softmax ---------------------------------


class DtypeTrace(TorchDispatchMode):
    """The dtypes of every floating-point tensor an op returns."""

    def __init__(self) -> None:
        super().__init__()
        self.dtypes: set[torch.dtype] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.is_floating_point():
                self.dtypes.add(t.dtype)
        return out


def test_bf16_math_unless_fp32_softmax() -> None:
    torch.manual_seed(3)
    page_size, heads, kv_heads, dim = 16, 4, 2, 32
    k_cache, v_cache = torch.randn(12 * page_size, kv_heads, dim), torch.randn(12 * page_size, kv_heads, dim)
    table = torch.tensor([[3, 5, 7], [2, 0, 0], [9, 4, 0]], dtype=torch.int32)
    lens = torch.tensor([40, 9, 17], dtype=torch.int32)
    q = torch.randn(3, heads, dim)
    exact = flat_paged_attention(
        q, k_cache, v_cache, HpuFlatMetadata.from_page_table(table, lens, page_size, torch.float32), page_size, 0.2
    )
    flat = HpuFlatMetadata.from_page_table(table, lens, page_size, torch.bfloat16)
    qb, kb, vb = q.bfloat16(), k_cache.bfloat16(), v_cache.bfloat16()
    results = {}
    for fp32 in (False, True):
        with DtypeTrace() as trace:
            results[fp32] = flat_paged_attention(qb, kb, vb, flat, page_size, 0.2, fp32_softmax=fp32)
        assert results[fp32].dtype == torch.bfloat16
        assert (torch.float32 in trace.dtypes) == fp32  # bf16 math keeps every intermediate in bf16
        torch.testing.assert_close(results[fp32].float(), exact, atol=4e-2, rtol=4e-2)
    assert (results[True].float() - exact).abs().mean() <= (results[False].float() - exact).abs().mean()


def test_fp32_softmax_by_model_type(monkeypatch: pytest.MonkeyPatch) -> None:
    assert fp32_softmax_for("qwen2") and fp32_softmax_for("qwen2_moe") and not fp32_softmax_for("llama")
    assert fp32_softmax_for("llama", "true") and not fp32_softmax_for("qwen2", False)
    with pytest.raises(ValueError):
        fp32_softmax_for("llama", "sometimes")
    for model_type, expected in (("qwen2", True), ("llama", False)):
        backend = HpuPlatform().attention_backend()
        model = types.SimpleNamespace(
            config=types.SimpleNamespace(model_type=model_type), attention_backend=backend, modules=lambda: iter([])
        )
        assert configure_fp32_softmax(model) is expected and backend.fp32_softmax is expected  # auto
        assert configure_fp32_softmax(model, "true") and backend.fp32_softmax
        assert not configure_fp32_softmax(model, False) and not backend.fp32_softmax


# ---- regional compilation: one decoder layer's graph serves every layer ------------------------


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Any]:
    return load_tiny_llama(str(tmp_path_factory.mktemp("tiny_hpu_regional")), num_hidden_layers=3)


def test_regional_compilation_compiles_one_layer_per_bucket(
    tiny_llama: tuple[Any, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    from engine.kv_cache import KVPool

    model, mc = tiny_llama
    page_size, num_pages, max_pages = 8, 24, 4
    nodes: dict[bool, int] = {}
    for regional in (True, False):
        compiled_nodes = [0]

        def counting(gm: torch.fx.GraphModule, example_inputs: list[Any], counter: list[int] = compiled_nodes) -> Any:
            counter[0] += len(gm.graph.nodes)  # this iteration's counter, bound when the backend is made
            return gm.forward

        reset_dynamo()
        pool = KVPool(
            mc.num_hidden_layers,
            num_pages,
            page_size,
            mc.num_key_value_heads,
            mc.head_dim,
            torch.float32,
            torch.device("cpu"),
        )
        model.set_attention_backend(HpuPlatform().attention_backend())
        runner = HpuEngineRunner(
            model,
            pool.caches,
            [2],
            max_pages,
            page_size,
            torch.device("cpu"),
            mode="compile",
            compile_backend=counting,
            regional_compilation=regional,
            strict=True,
            show_progress=False,
            device_config=hpu_device_config(decode_block_bucket=(4, 4, 8)),
        )
        assert runner.regional_compilation is regional and runner.inner.precompiled is regional
        runner.capture()
        nodes[regional] = compiled_nodes[0]
        for k, v in pool.caches:
            k.normal_()
            v.normal_()
        rng = random.Random(4)
        for _ in range(3):  # strict: a compile after warm-up would raise
            lens = torch.tensor([rng.randint(2, 20), rng.randint(2, 12)], dtype=torch.int32)
            table = torch.tensor([[1, 2, 3], [4, 5, 0]], dtype=torch.int32)
            positions = lens.long() - 1
            slots = (
                table.long().gather(1, (positions // page_size).unsqueeze(1)).squeeze(1) * page_size
                + positions % page_size
            )
            ids = torch.tensor([rng.randrange(256), rng.randrange(256)])
            meta = AttentionMetadata(True, slots, table, lens, page_size)
            ref_caches = [(k.clone(), v.clone()) for k, v in pool.caches]
            with torch.no_grad():
                model.set_attention_backend(TorchAttentionBackend())
                ref = model.compute_logits(model(ids, positions, ref_caches, meta))
                model.set_attention_backend(HpuPlatform().attention_backend())
                got = runner.run_batch(ids, positions, meta)
            torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)
    # Per bucket, the regional graphs hold one layer (and the head); the whole step holds all three layers.
    assert 0 < nodes[True] < nodes[False] * 0.75, nodes
