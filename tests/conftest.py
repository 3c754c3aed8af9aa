"""Shared fixtures: tiny random HF checkpoints, the SmolLM2 HF reference, shared engines, KV checks.

Engines are expensive (a GGUF dequantize, and with graphs a torch.compile per
capture size), so the ones several test files use are session-scoped and built
lazily through `engine_cache`. Every test that touches an engine is followed by
a check that the engine is idle and its KV pool balances (see `_kv_guard`).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import ctypes
import functools
import gc
import importlib
import importlib.util
import os
import shutil
import sys
from collections.abc import Callable, Iterator
from typing import Any

# Environment first: OMP_NUM_THREADS only takes effect if set before torch is imported.
os.environ.setdefault("TQDM_DISABLE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# One intra-op thread: the shapes here are tiny, and on a shared 2-core box two OpenMP threads
# that wait on each other made a 135M-parameter decode step 10-20x slower. Inductor compiles in
# this process too (no worker pool to start). Subprocesses (CLI tests) inherit both settings.
TEST_THREADS = int(os.environ.get("ENGINE_TEST_THREADS", "1"))
os.environ.setdefault("OMP_NUM_THREADS", str(TEST_THREADS))
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
# No GPU: the Triton kernels run in Triton's CPU interpreter (tests/triton_interpreter.py). Set before
# anything imports triton, which fixes the mode of triton.language's own helpers at import.
if not (os.path.exists("/proc/driver/nvidia/version") or os.path.exists("/dev/kfd")):
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO_ROOT not in sys.path:
    sys.path.insert(0, REPO_ROOT)

torch.set_num_threads(TEST_THREADS)

# Every test must leave torch's dynamo/inductor config as it found it (tests/torch_config_guard.py).
pytest_plugins = ["torch_config_guard", "pytester"]

from engine.engine import Engine  # noqa: E402
from engine.loader.resolve import default_model_path  # noqa: E402

# ---------------------------------------------------------------------------------------------
# Tiny random checkpoints
# ---------------------------------------------------------------------------------------------

# Shapes shared by every tiny model: GQA (4 query heads over 2 kv heads), head_dim 16.
TINY_COMMON = dict(
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    # A large init makes logits peaked (std ~ 0.2 * sqrt(64) ~ 1.6 per logit), so the greedy
    # argmax is decided by margins far above fp32 noise: no near-ties that flip on rounding.
    initializer_range=0.2,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)

TINY_SPECS: dict[str, dict[str, Any]] = {
    # Llama 3 style: llama3 rope scaling (original context 128 < max positions 512), untied head,
    # saved in several shards so the model.safetensors.index.json path is exercised.
    "llama": dict(
        config_cls="LlamaConfig",
        kwargs=dict(
            vocab_size=384,
            num_hidden_layers=3,
            rms_norm_eps=1e-5,
            tie_word_embeddings=False,
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 10000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 128,
            },
        ),
        shard="120KB",
        seed=11,
    ),
    # Llama with plain rope: tells a llama3-rope problem apart from one in the Llama block itself.
    "llama_plain": dict(
        config_cls="LlamaConfig",
        kwargs=dict(
            vocab_size=384,
            num_hidden_layers=2,
            rms_norm_eps=1e-5,
            tie_word_embeddings=False,
            rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
        ),
        shard=None,
        seed=15,
    ),
    # Qwen2: q/k/v bias, tied embeddings, large rope theta.
    "qwen2": dict(
        config_cls="Qwen2Config",
        kwargs=dict(
            vocab_size=320,
            num_hidden_layers=2,
            rms_norm_eps=1e-6,
            tie_word_embeddings=True,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
            use_sliding_window=False,
        ),
        shard=None,
        seed=12,
    ),
    # Qwen3: per-head q/k RMSNorm, explicit head_dim, untied head.
    "qwen3": dict(
        config_cls="Qwen3Config",
        kwargs=dict(
            vocab_size=448,
            num_hidden_layers=2,
            head_dim=16,
            rms_norm_eps=1e-6,
            tie_word_embeddings=False,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
            use_sliding_window=False,
        ),
        shard=None,
        seed=13,
    ),
    # Phi-3: q/k/v and gate/up fused in the checkpoint itself, untied head.
    "phi3": dict(
        config_cls="Phi3Config",
        kwargs=dict(
            vocab_size=352,
            num_hidden_layers=2,
            rms_norm_eps=1e-5,
            tie_word_embeddings=False,
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=2,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        ),
        shard=None,
        seed=16,
    ),
    # Mixtral: every layer a sparse MoE (4 experts, top 2, renormalised).
    "mixtral": dict(
        config_cls="MixtralConfig",
        kwargs=dict(
            vocab_size=336,
            num_hidden_layers=2,
            rms_norm_eps=1e-5,
            tie_word_embeddings=False,
            num_local_experts=4,
            num_experts_per_tok=2,
            sliding_window=None,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        ),
        shard=None,
        seed=17,
    ),
    # Qwen3-MoE: q/k norms, MoE layers 0 and 2 around a dense layer 1 (mlp_only_layers), top-k renormalised.
    "qwen3_moe": dict(
        config_cls="Qwen3MoeConfig",
        kwargs=dict(
            vocab_size=368,
            num_hidden_layers=3,
            head_dim=16,
            rms_norm_eps=1e-6,
            tie_word_embeddings=False,
            num_experts=6,
            num_experts_per_tok=2,
            moe_intermediate_size=48,
            norm_topk_prob=True,
            mlp_only_layers=[1],
            use_sliding_window=False,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        ),
        shard=None,
        seed=18,
    ),
    # Gemma 2: (1 + w) norms around attention and MLP, scaled embeddings, query_pre_attn_scalar
    # unlike head_dim, soft-capped attention scores and logits (caps low enough to bite at these
    # scales), a 24-token sliding window on alternate layers (the longest prompts decode past it).
    "gemma2": dict(
        config_cls="Gemma2Config",
        kwargs=dict(
            vocab_size=400,
            num_hidden_layers=4,
            head_dim=16,
            query_pre_attn_scalar=24,
            rms_norm_eps=1e-6,
            tie_word_embeddings=True,
            attn_logit_softcapping=3.0,
            final_logit_softcapping=5.0,
            sliding_window=24,
            hidden_activation="gelu_pytorch_tanh",
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        ),
        shard=None,
        seed=19,
    ),
    # Gemma 3 (text): Gemma 2's block with (1 + w) q/k norms, no caps, two rotary bases (sliding 10k,
    # full 1M with linear scaling x2), five sliding layers to one full (here 2:1 over 3 layers).
    "gemma3": dict(
        config_cls="Gemma3TextConfig",
        kwargs=dict(
            vocab_size=416,
            num_hidden_layers=3,
            head_dim=16,
            query_pre_attn_scalar=20,
            rms_norm_eps=1e-6,
            tie_word_embeddings=True,
            sliding_window=24,
            layer_types=["sliding_attention", "sliding_attention", "full_attention"],
            rope_parameters={
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "linear", "rope_theta": 1000000.0, "factor": 2.0},
            },
        ),
        shard=None,
        seed=20,
    ),
    # Qwen2-MoE: q/k/v bias, a shared expert behind a sigmoid gate, top-k not renormalised, layer 1 dense.
    "qwen2_moe": dict(
        config_cls="Qwen2MoeConfig",
        kwargs=dict(
            vocab_size=368,
            num_hidden_layers=3,
            rms_norm_eps=1e-6,
            tie_word_embeddings=False,
            num_experts=6,
            num_experts_per_tok=2,
            moe_intermediate_size=48,
            shared_expert_intermediate_size=96,
            norm_topk_prob=False,
            mlp_only_layers=[1],
            qkv_bias=True,
            use_sliding_window=False,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        ),
        shard=None,
        seed=21,
    ),
    # Mistral: the Llama block under another model_type; no sliding window in effect.
    "mistral": dict(
        config_cls="MistralConfig",
        kwargs=dict(
            vocab_size=384,
            num_hidden_layers=2,
            rms_norm_eps=1e-5,
            tie_word_embeddings=True,
            sliding_window=None,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        ),
        shard="200KB",
        seed=14,
    ),
}


def build_tiny_checkpoint(name: str, folder: str, **overrides: Any) -> str:
    """A random checkpoint of TINY_SPECS[name] saved with save_pretrained (safetensors) into folder."""
    import transformers

    spec = TINY_SPECS[name]
    config_cls = getattr(transformers, spec["config_cls"])
    kwargs = {**TINY_COMMON, **spec["kwargs"], **overrides}
    config = config_cls(**kwargs)
    torch.manual_seed(spec["seed"])
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for param_name, param in model.named_parameters():
            # HF init leaves biases at 0 and norm weights at 1; randomise them so a bias or a
            # norm that is loaded into the wrong place (or not at all) changes the output.
            if param_name.endswith(".bias"):
                param.normal_(0.0, 0.2)
            elif "norm" in param_name:
                param.copy_(1.0 + 0.3 * torch.randn_like(param))
    save_kwargs: dict[str, Any] = {"safe_serialization": True}
    if spec["shard"]:
        save_kwargs["max_shard_size"] = spec["shard"]
    model.save_pretrained(folder, **save_kwargs)
    return folder


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """name -> folder of a saved tiny random checkpoint (no tokenizer: prompts are token ids)."""
    root = tmp_path_factory.mktemp("tiny_models")
    paths = {}
    for name in TINY_SPECS:
        paths[name] = build_tiny_checkpoint(name, str(root / name))
    # The sharded ones really are sharded (otherwise the index path is not under test).
    for name in ("llama", "mistral"):
        assert os.path.isfile(os.path.join(paths[name], "model.safetensors.index.json")), name
    return paths


@pytest.fixture(scope="session")
def tiny_llama(tiny_checkpoints: dict[str, str]) -> str:
    return tiny_checkpoints["llama"]


_HF_TINY: dict[str, Any] = {}


@pytest.fixture(scope="session")
def hf_tiny(tiny_checkpoints: dict[str, str]) -> Callable[[str], Any]:
    """name -> the HF transformers model read back from the saved tiny checkpoint (fp32, eval)."""
    from transformers import AutoModelForCausalLM

    def get(name: str) -> Any:
        if name not in _HF_TINY:
            # Eager: the one HF attention with every feature in every transformers version (5.17's default
            # silently drops Gemma 2's soft-capping, which made the engine look wrong on the H200).
            model = AutoModelForCausalLM.from_pretrained(
                tiny_checkpoints[name], dtype=torch.float32, attn_implementation="eager"
            )
            _HF_TINY[name] = model.eval()
        return _HF_TINY[name]

    return get


# ---------------------------------------------------------------------------------------------
# SmolLM2 (the embedded GGUF) and its HF reference
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def smol_gguf_path() -> str:
    return default_model_path()


@pytest.fixture(scope="session")
def smol_hf(smol_gguf_path: str) -> tuple[Any, Any]:
    """(model, tokenizer) of HF transformers reading the same GGUF file, in float32."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = os.path.split(smol_gguf_path)
    model = AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=name, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    return model, tokenizer


# ---------------------------------------------------------------------------------------------
# Engines
# ---------------------------------------------------------------------------------------------

_ENGINES: dict[tuple, Engine] = {}


def _key(model: str | None, kwargs: dict[str, Any]) -> tuple:
    # The CPU fast-path switches decide what an engine is built with (cpu_fast_paths_off), so they are part of it.
    switches = tuple(os.environ.get(name, "") for name in FAST_PATHS_OFF)
    return (model, tuple(sorted((k, str(v)) for k, v in kwargs.items())), switches)


@pytest.fixture(scope="session")
def engine_cache() -> Callable[..., Engine]:
    """get(model, **options) -> a session-wide Engine, built once per (model, options).

    Defaults: cpu, float32, page 16, 2048 KV tokens, max_num_seqs 8, eager, GGUF block kernels for prefill too,
    and no time budget for
    extend steps (max_extend_step_ms=0): how prompts split into steps must not depend on how fast
    this machine happens to be, since tests count steps. The server tests keep the CPU default.
    """

    def get(model: str | None, **options: Any) -> Engine:
        kwargs = dict(
            device="cpu",
            dtype="float32",
            page_size=16,
            kv_cache_tokens=2048,
            max_num_seqs=8,
            disable_graphs=True,
            max_extend_step_ms=0,
            # The suite's many cached SmolLM2 engines without a bf16 prefill copy each (~200 MiB): the CI machine's
            # memory is shared by its workers. tests/test_cpu_prefill_weights.py and the parity variants run it.
            cpu_prefill_weights="gguf",
        )
        kwargs.update(options)
        key = _key(model, kwargs)
        if key not in _ENGINES:
            _ENGINES[key] = Engine(model=model, **kwargs)
        return _ENGINES[key]

    return get


def return_freed_memory() -> None:
    """Collect the engines a test dropped and hand glibc's freed heap back to the system: a worker's RSS otherwise
    keeps every dropped engine's pages (SmolLM2 engines built and dropped 4 times: 1.27 GB, 0.67 GB after the
    trim), and the suite's workers share the machine's memory (one was killed at 8.2 GB)."""
    gc.collect()
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError):  # another C library (musl): nothing to trim with
            ctypes.CDLL("libc.so.6").malloc_trim(0)


def release_cached(engine: Engine) -> None:
    """Take an engine out of engine_cache and shut it down: for the heavy ones a module uses alone, so that the
    session does not hold them (the suite's workers share the machine's memory)."""
    for key in [key for key, cached in _ENGINES.items() if cached is engine]:
        del _ENGINES[key]
    engine.shutdown()
    return_freed_memory()


def reset_dynamo() -> None:
    """torch._dynamo.reset(), for a test that counts a fresh compile. It throws away every compiled graph in
    the process, the shared engines' too, whose next step would then recompile (an error in strict mode):
    those engines leave the cache, so later tests build them anew, whichever order the files run in. Tests
    call this rather than torch._dynamo.reset()."""
    torch._dynamo.reset()
    for key in [key for key, engine in _ENGINES.items() if not engine.config.disable_graphs]:
        del _ENGINES[key]


@pytest.fixture(scope="session")
def smol_engine(engine_cache: Callable[..., Engine]) -> Engine:
    """SmolLM2 eager, page size 16: the workhorse for text-level tests."""
    return engine_cache(None)


# ---------------------------------------------------------------------------------------------
# The CPU with every fast path switched off
# ---------------------------------------------------------------------------------------------

FAST_PATHS_OFF = {"ENGINE_CPU_NATIVE_KERNELS": "0", "ENGINE_CPU_ONEDNN_PACKING": "0", "ENGINE_CPU_HIDE_FEATURES": "all"}


@pytest.fixture
def cpu_fast_paths_off(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Native kernels, oneDNN packing and every CPU feature switched off, as on the barest x86-64 CPU.

    Engines built inside take the torch fallbacks; the switches and the cached choices are
    restored afterwards, so later engines get this CPU's fast paths again.
    """
    from backends.cpu.platform import forget_cpu_paths

    for name, value in FAST_PATHS_OFF.items():
        monkeypatch.setenv(name, value)
    forget_cpu_paths()
    yield
    monkeypatch.undo()
    forget_cpu_paths()


# ---------------------------------------------------------------------------------------------
# Devices: @pytest.mark.cuda / rocm / hpu / npu, @pytest.mark.absent(device), ENGINE_TEST_DEVICE
# ---------------------------------------------------------------------------------------------

# A test marked with devices runs where one of them is present and skips elsewhere, saying why. A test
# marked absent(device) asserts that device's absence (a platform refusing, a vendor module never imported)
# and skips where the device or its vendor stack is present. ENGINE_TEST_DEVICE names the device a CI runner
# exists for: the session stops at once if that device is absent (a runner that lost its GPU must not pass
# by skipping every GPU test), and tests marked only for other devices skip. docs/testing.md.
DEVICES = ("cuda", "rocm", "hpu", "npu")
TEST_DEVICE_ENV = "ENGINE_TEST_DEVICE"
# The module that brings each vendor device into torch. Once installed it is imported with torch itself
# (torch's device-backend autoload), so a test asserting that nothing imports it cannot pass there.
VENDOR_MODULES = {"hpu": "habana_frameworks", "npu": "torch_npu"}


def vendor_installed(device: str) -> bool:
    """Whether the vendor module of `device` is installed (looked up, not imported)."""
    module = VENDOR_MODULES.get(device)
    return module is not None and importlib.util.find_spec(module) is not None


@functools.cache
def device_missing(device: str) -> str | None:
    """None when this machine can run `device`'s tests, else why it cannot."""
    if device in ("cuda", "rocm"):  # HIP devices are torch "cuda" devices on a ROCm build of torch
        hip = torch.version.hip is not None
        if hip != (device == "rocm"):
            return f"torch {torch.__version__} is {'a ROCm' if hip else 'not a ROCm'} build"
        return None if torch.cuda.is_available() else f"torch {torch.__version__} sees no GPU"
    module = VENDOR_MODULES[device]
    if not vendor_installed(device):
        return f"{module} is not installed"
    try:
        importlib.import_module("habana_frameworks.torch" if device == "hpu" else module)
    except Exception as exc:
        return f"{module} failed to import: {exc}"
    api = getattr(torch, device, None)
    if api is None or not api.is_available() or api.device_count() < 1:
        return f"{module} is installed but torch.{device} sees no device"
    return None


def selected_device() -> str | None:
    """ENGINE_TEST_DEVICE: the device this run is for ("cpu": none), or None to go by what is present."""
    value = os.environ.get(TEST_DEVICE_ENV, "").strip().lower()
    if value and value not in ("cpu", *DEVICES):
        raise pytest.UsageError(f"{TEST_DEVICE_ENV}={value!r}: choose one of cpu, {', '.join(DEVICES)}")
    return value or None


def pytest_configure(config: pytest.Config) -> None:
    device = selected_device()
    if device in DEVICES and (why := device_missing(device)):
        raise pytest.UsageError(f"{TEST_DEVICE_ENV}={device}, but this machine cannot run the {device} tests: {why}")


def pytest_sessionstart(session: pytest.Session) -> None:
    """Build the native CPU kernels once, in the main process, before any xdist worker starts: each library is
    cached by the hash of its sources and this CPU's flags (backends/cpu/native.py), so the workers and the
    servers they start load it instead of each compiling it at once (~25 s of gcc on a cold 2-core machine)."""
    if hasattr(session.config, "workerinput"):
        return
    from backends.cpu import native

    if native.native_kernels_enabled() and shutil.which("gcc"):
        with concurrent.futures.ThreadPoolExecutor() as pool:  # each build waits on gcc processes
            list(pool.map(native.build, native.library_names()))


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """`-n auto` (setup.cfg): one worker per core, at least 2 and at most 4. Many tests wait on a server or a
    subprocess rather than the CPU, so 2 workers pay off even on one core; each worker holds its own engines
    (~1 GiB), so more than 4 costs memory for little."""
    return max(2, min(4, os.cpu_count() or 1))


def device_skip_reason(item: pytest.Item, selected: str | None) -> str | None:
    """Why `item` must not run here given its device markers, or None when it may."""
    wanted = [device for device in DEVICES if item.get_closest_marker(device)]
    if wanted:
        needs = " or ".join(wanted)
        if selected is not None and selected not in wanted:
            return f"needs {needs}; {TEST_DEVICE_ENV}={selected}"
        missing = {device: device_missing(device) for device in wanted}
        if all(missing.values()):
            return f"needs {needs}: " + "; ".join(f"{device}: {why}" for device, why in missing.items())
    for mark in item.iter_markers("absent"):
        if not mark.args or any(device not in DEVICES for device in mark.args):
            raise pytest.UsageError(
                f"{item.nodeid}: absent() takes devices among {', '.join(DEVICES)}, not {mark.args}"
            )
        for device in mark.args:
            if selected == device:
                return f"asserts that {device} is absent; {TEST_DEVICE_ENV}={device}"
            # The vendor stack first: merely looking for the device would import it.
            if vendor_installed(device):
                return f"asserts that {device} is absent; {VENDOR_MODULES[device]} is installed here"
            if device_missing(device) is None:
                return f"asserts that {device} is absent; this machine has one"
    return None


# The files that take longest (measured with --durations, slowest first). xdist hands out whole files in
# collection order (setup.cfg: --dist loadscope --no-loadscope-reorder), so these start first and the run does
# not end with one worker still busy on a long file; other files follow in their usual order. Only the
# order changes.
SLOWEST_FILES = (
    "test_server_hostile.py",
    "test_hf_parity.py",
    "test_server.py",
    "test_tensor_parallel.py",
    "test_structured_output.py",
    "test_fp8.py",
    "test_fp8_accuracy.py",
    "test_engine_process.py",
    "test_errors.py",
    "test_gguf_native_decode.py",
    "test_cli.py",
    "test_gguf_quantized.py",
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    selected = selected_device()
    for item in items:
        if (reason := device_skip_reason(item, selected)) is not None:
            item.add_marker(pytest.mark.skip(reason=reason))
    rank = {name: index for index, name in enumerate(SLOWEST_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the rest keep their order


# ---------------------------------------------------------------------------------------------
# KV invariant after every test that used an engine
# ---------------------------------------------------------------------------------------------

_TOUCHED: list[Engine] = []


def track(engine: Engine) -> Engine:
    """Register an engine built inside a test so that _kv_guard checks it afterwards."""
    _TOUCHED.append(engine)
    return engine


def assert_engine_idle(engine: Engine) -> None:
    """No queued or running work, KV pool balanced, nothing left allocated."""
    assert not engine.has_unfinished(), "engine still has unfinished requests"
    engine.check_kv_invariant()
    assert engine.kv_pages_in_use() == 0, f"{engine.kv_pages_in_use()} KV pages still in use while idle"
    assert engine.step_builder.rows_in_use == 0, f"{engine.step_builder.rows_in_use} decode rows still held while idle"


def _reset(engine: Engine) -> None:
    for request_id in list(engine._requests):
        engine.abort(request_id)
    scheduler = engine.scheduler
    stuck = list(scheduler.running) + list(scheduler.waiting) + ([scheduler.chunked] if scheduler.chunked else [])
    for request in stuck:
        scheduler.finish(request, "abort")


@pytest.fixture(autouse=True)
def _kv_guard(request: pytest.FixtureRequest) -> Iterator[None]:
    """After each test: every engine it used is idle with a balanced KV pool (then reset it anyway)."""
    _TOUCHED.clear()
    yield
    # check_kv_invariant is a walk over a few hundred page ids: cheap enough to run on every engine.
    engines = (
        [v for v in request.node.funcargs.values() if isinstance(v, Engine)] + list(_TOUCHED) + list(_ENGINES.values())
    )
    seen: set[int] = set()
    problems = []
    for engine in engines:
        if id(engine) in seen:
            continue
        seen.add(id(engine))
        try:
            assert_engine_idle(engine)
        except AssertionError as exc:
            problems.append(str(exc))
            _reset(engine)  # keep shared engines usable by later tests
    built_here = bool(_TOUCHED)
    _TOUCHED.clear()
    if built_here:
        return_freed_memory()
    if problems:
        pytest.fail("KV invariant after test: " + "; ".join(problems))
