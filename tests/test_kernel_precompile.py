"""Compiling the engine's Triton kernels ahead (backends/cuda/triton_build.py compile_only, BackgroundCompiles;
TritonAttentionBackend.precompile_kernels; gemv.precompile_gemv; lora.precompile_lora): the launchers' own
argument logic, run in compile-only mode, reaches every variant the decode graphs and extend steps launch, and
runs no kernel. Under Triton's interpreter (these CPU tests) a compile-only launch is recorded instead of
compiled."""

from __future__ import annotations

import pathlib
from collections import Counter

import pytest
import torch
from torch import nn

from backends.cuda.triton_build import BackgroundCompiles, KernelHandle, compile_only, load_kernel
from engine.layers.attention import Attention, AttentionMetadata


class _Recorder:
    """Stands in for a JIT function: records launches and compile-only launches (warmups)."""

    def __init__(self) -> None:
        self.launched: list[tuple] = []
        self.warmed: list[tuple] = []

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launched.append((grid, args, kwargs))

    def warmup(self, *args, grid, **kwargs):
        self.warmed.append((grid, args, kwargs))


def test_kernel_handle_launches_or_only_compiles() -> None:
    recorder = _Recorder()
    kernel = KernelHandle(recorder)
    kernel[(4,)](1, 2, BLOCK=16)
    with compile_only():
        kernel[(8,)](3, BLOCK=32)
    kernel[(2,)](5)
    assert recorder.launched == [((4,), (1, 2), {"BLOCK": 16}), ((2,), (5,), {})]
    assert recorder.warmed == [((8,), (3,), {"BLOCK": 32})]


def test_background_compiles_stay_off_under_the_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # what the CPU tests run under; set here so a GPU runner checks it too
    background = BackgroundCompiles()
    assert not background.active  # TRITON_INTERPRET=1: nothing to compile
    background.finish()
    background.finish()  # idempotent


class _TwoKinds(nn.Module):
    """Two decoder layers: global attention, then a sliding window (Gemma-like), in float32."""

    def __init__(self) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(16, 8)
        self.layers = nn.ModuleList(
            [
                nn.ModuleDict({"attn": Attention(8, 2, 64)}),
                nn.ModuleDict({"attn": Attention(8, 2, 64, sliding_window=16)}),
            ]
        )

    def decoder_layers(self) -> list[nn.Module]:
        return list(self.layers)


def _decode_meta(bs: int, pages: int) -> AttentionMetadata:
    return AttentionMetadata(
        is_decode=True,
        slot_indices=torch.zeros(bs, dtype=torch.int64),
        page_table=torch.zeros(bs, pages, dtype=torch.int32),
        seq_lens=torch.ones(bs, dtype=torch.int32),
        page_size=16,
    )


def test_attention_precompile_reaches_every_variant_and_runs_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    from backends.cuda.triton_attention import TritonAttentionBackend

    warmed: Counter = Counter()
    for module, name in (
        ("backends.cuda.kernels.paged_decode", "paged_decode_kernel"),
        ("backends.cuda.kernels.paged_decode", "combine_splits_kernel"),
        ("backends.cuda.kernels.ragged_attention", "ragged_paged_attention_kernel"),
    ):
        handle = load_kernel(module, name)

        def record(*args, grid, _name=name, **kwargs):
            warmed[(_name, kwargs.get("SPLIT"), kwargs.get("STORE_NEW"), kwargs.get("WINDOWED"))] += 1

        monkeypatch.setattr(handle.fn, "warmup", record)
    model = _TwoKinds()
    caches = [(torch.full((64, 2, 64), float("nan")), torch.full((64, 2, 64), float("nan"))) for _ in range(2)]
    # Batch 64 fills the (interpreter's) grid in one pass; batch 1 splits the context.
    launches = TritonAttentionBackend().precompile_kernels(model, caches, [_decode_meta(64, 4), _decode_meta(1, 4)])
    assert launches == 6  # two layer kinds x (two decode sizes + the ragged kernel)
    assert warmed == Counter(
        {
            ("paged_decode_kernel", False, True, None): 2,  # one pass, the new k/v stored by the kernel
            ("paged_decode_kernel", True, True, None): 2,  # split-K
            ("combine_splits_kernel", None, None, None): 2,
            ("ragged_paged_attention_kernel", None, None, False): 1,
            ("ragged_paged_attention_kernel", None, None, True): 1,  # the sliding-window layer's variant
        }
    )
    for k_cache, v_cache in caches:  # compile-only: no kernel wrote a cache
        assert torch.isnan(k_cache).all() and torch.isnan(v_cache).all()


def test_gemv_precompile_once_per_shape(monkeypatch: pytest.MonkeyPatch) -> None:
    from backends.cuda.gemv import GEMV, precompile_gemv
    from engine.layers.linear import Linear

    shapes: list[tuple] = []
    handle = load_kernel("backends.cuda.kernels.gemv", "gemv_kernel")

    def record(x, weight, *args, grid, **kwargs):
        shapes.append((tuple(weight.shape), kwargs["HAS_BIAS"], kwargs["BLOCK_N"], kwargs["BLOCK_K"]))

    monkeypatch.setattr(handle.fn, "warmup", record)
    layers = nn.ModuleList(
        [Linear(64, 96, bias=False), Linear(64, 96, bias=False), Linear(96, 64, bias=True), Linear(64, 32, bias=False)]
    )
    for layer in layers[:3]:
        layer.method = GEMV  # the fourth stays dense: not precompiled
    assert precompile_gemv(layers) == 2
    assert sorted(shapes) == [((64, 96), True, 16, 512), ((96, 64), False, 16, 512)]


def test_compile_workers_build_each_kernels_launcher_before_handing_it_over(monkeypatch: pytest.MonkeyPatch) -> None:
    """The executor Triton's AsyncCompileMode gets (BackgroundCompiles) runs each compile and then builds that
    kernel's C launcher in the same worker thread, before the future resolves: the first launch, on the main
    thread, then only loads it. A launcher that fails to build leaves the compiled kernel usable."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    from backends.cuda import triton_build

    built: list[tuple[str, str]] = []
    monkeypatch.setattr(
        triton_build, "build_launcher", lambda kernel: built.append((kernel, threading.current_thread().name))
    )
    with ThreadPoolExecutor(2, thread_name_prefix="compile-test") as pool:
        executor = triton_build._LauncherBuildingExecutor(pool)
        futures = [executor.submit(lambda name=name: name) for name in ("decode", "ragged")]
        assert [future.result() for future in futures] == ["decode", "ragged"]
    assert sorted(kernel for kernel, _ in built) == ["decode", "ragged"]
    assert all(thread.startswith("compile-test") for _, thread in built)
    monkeypatch.undo()
    triton_build.build_launcher(object())  # no driver on this machine (or no such kernel): logged, not raised


def test_runtime_warm_up_starts_nothing_under_the_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    from backends.cuda import triton_build

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(triton_build, "_runtime_warm_up", None)
    triton_build.start_runtime_warm_up()
    assert triton_build._runtime_warm_up is None
    triton_build.wait_for_runtime_warm_up()  # nothing to wait for


def test_import_ahead_imports_what_it_can_and_logs_the_rest(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    import sys

    from backends.cuda import triton_build

    monkeypatch.delitem(sys.modules, "colorsys", raising=False)
    seconds = triton_build.import_ahead(("engine_no_such_module", "colorsys"))
    assert "colorsys" in sys.modules and seconds >= 0
    assert "engine_no_such_module not imported ahead (ModuleNotFoundError" in caplog.text


def test_the_compiler_modules_imported_ahead_exist_in_this_torch() -> None:
    """A torch that renamed one would only log a warning at start-up; here it fails."""
    import importlib.util

    from backends.cuda.platform import COMPILER_MODULES

    assert [name for name in COMPILER_MODULES if importlib.util.find_spec(name) is None] == []


def test_the_engine_starts_compile_workers_before_it_sets_up_the_device_and_loads_the_model(
    monkeypatch: pytest.MonkeyPatch, tiny_llama: str
) -> None:
    """Inductor's worker pool takes seconds to come up (~8 s on the H200's host): the engine starts it first,
    before the seed, the model source and the weights, and joins the warm-up thread only after the load."""
    import engine.engine as engine_module
    from backends import platform_class
    from engine.engine import Engine

    order: list[str] = []
    platform = platform_class("cpu")
    monkeypatch.setattr(platform, "start_compile_workers", lambda self: order.append("start workers"))
    monkeypatch.setattr(platform, "wait_for_compile_workers", lambda self: order.append("wait for workers"))
    monkeypatch.setattr(platform, "set_seed", lambda self, seed: order.append("seed"))
    load_model = engine_module.load_model
    monkeypatch.setattr(
        engine_module, "load_model", lambda *args, **kwargs: order.append("load") or load_model(*args, **kwargs)
    )
    engine = Engine(model=tiny_llama, device="cpu", compile_extend=True, capture_sizes="1", warmup=False)
    assert order == ["start workers", "seed", "load", "wait for workers"]
    engine.shutdown()

    order.clear()
    engine = Engine(model=tiny_llama, device="cpu", disable_graphs=True, warmup=False)
    assert order == ["seed", "load"]  # nothing compiles: nothing started or waited for
    engine.shutdown()


def test_the_cuda_platform_starts_inductors_pool_and_sees_it_come_up(tmp_path: pathlib.Path) -> None:
    """start_compile_workers launches inductor's real worker pool (two workers, in a fresh process, since this
    one runs with one compile thread), inductor_pool_ready() reads torch's own readiness (False while it starts,
    then True: a torch that renamed what it reads would give None and fail here), and the engine's log at the
    first compile says so."""
    import os
    import subprocess
    import sys

    repo_root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    script = tmp_path / "pool.py"
    script.write_text(
        "import logging, sys, time\n"
        "logging.basicConfig(level=logging.INFO, stream=sys.stdout, format='%(message)s')\n"
        "from backends.cuda.platform import CudaPlatform, inductor_pool_ready\n"
        "assert inductor_pool_ready() is None, 'a pool before any was started'\n"
        "CudaPlatform().start_compile_workers()\n"
        "states = [inductor_pool_ready()]\n"
        "deadline = time.monotonic() + 120\n"
        "while not states[-1] and time.monotonic() < deadline:\n"
        "    time.sleep(0.05)\n"
        "    states.append(inductor_pool_ready())\n"
        "CudaPlatform().wait_for_compile_workers()\n"
        "print('states', states[0], states[-1])\n"
    )
    env = {**os.environ, "TORCHINDUCTOR_COMPILE_THREADS": "2", "PYTHONPATH": repo_root}
    result = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "states False True" in result.stdout, result.stdout + result.stderr[-3000:]
    assert "inductor compile workers starting in the background" in result.stdout
    assert "inductor compile workers ready" in result.stdout


def _variant(kernel: str, args: tuple, kwargs: dict) -> tuple:
    """What selects a compiled Triton variant: the constexprs and warps, and for each integer argument whether
    it is 1, a multiple of 16 or neither (Triton's specialization; tensors here are all 16-byte aligned)."""
    ints = tuple("1" if a == 1 else "16" if a % 16 == 0 else "n" for a in args if isinstance(a, int))
    return kernel, ints, tuple(sorted(kwargs.items()))


def test_lora_precompile_reaches_every_variant_a_step_launches(monkeypatch: pytest.MonkeyPatch) -> None:
    """precompile_lora compiles, for a projection with A folded into its weight (the expand alone) and one
    without (shrink and expand), the variant every row count from a decode step of one row to a prefill of
    thousands launches; nothing runs."""
    from backends.cuda import lora as cuda_lora
    from engine.layers.linear import Linear
    from engine.lora.layers import add_lora_slots
    from engine.lora.rows import LoRARows

    variants: set[tuple] = set()
    for name in ("lora_shrink_kernel", "lora_expand_kernel"):
        handle = load_kernel(cuda_lora.KERNELS, name)

        def record(*args, grid, name=name, **kwargs):
            variants.add(_variant(name, args, kwargs))

        monkeypatch.setattr(handle.fn, "warmup", record)
    rows = LoRARows(4096, 2, torch.device("cpu"), grouped=True)
    folded, plain = Linear(64, 512).to(torch.bfloat16), Linear(64, 96).to(torch.bfloat16)
    for layer in (folded, plain):
        add_lora_slots(layer, rows, 16, torch.bfloat16, cuda_lora.TRITON_LORA)
    assert folded.method.folded and not plain.method.folded  # type: ignore[attr-defined]
    model = nn.ModuleList([folded, plain, Linear(64, 32)])  # the last has no LoRA: nothing to compile
    assert cuda_lora.precompile_lora(model) == 2 * 2 * len(cuda_lora.ROW_CLASSES)
    precompiled, variants = set(variants), set()
    with compile_only():  # what steps of these sizes launch: each variant they select was compiled ahead
        for count in (1, 3, 8, 15, 16, 17, 24, 31, 48, 64, 100, 256, 257, 300, 512, 1000, 2048, 4096):
            both = torch.empty(count, 512 + 2 * 16, dtype=torch.bfloat16)
            cuda_lora.lora_expand(
                both[:, :512],
                both[:, 512:],
                folded.lora_b,
                rows.sorted_rows,
                rows.group_starts,  # type: ignore[arg-type]
            )
            out, x = torch.empty(count, 96, dtype=torch.bfloat16), torch.empty(count, 64, dtype=torch.bfloat16)
            cuda_lora.lora_sgmv(
                out,
                x,
                plain.lora_a,
                plain.lora_b,
                rows.sorted_rows,
                rows.group_starts,  # type: ignore[arg-type]
            )
    assert variants and variants <= precompiled, sorted(variants - precompiled)
