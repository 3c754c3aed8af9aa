"""GPU checks: the Triton paged decode kernel, and decode (and extend) steps replayed from device graphs.

Each holds on an NVIDIA GPU (CUDA graphs) and on an AMD one, where a ROCm build of torch captures HIP
graphs through the same torch.cuda.CUDAGraph and Triton compiles the same kernels: marked cuda and rocm,
they run wherever either is present (tests/conftest.py) and skip elsewhere. Tensors live on torch's "cuda"
device either way; the engine's device flag names the platform.
"""

from __future__ import annotations

import pytest
import torch

from engine.layers.torch_attention import paged_decode_attention

pytestmark = [pytest.mark.cuda, pytest.mark.rocm]
# The engine's platform: HIP devices are torch "cuda" devices, but the engine's cuda platform refuses a ROCm build.
ENGINE_DEVICE = "rocm" if torch.version.hip is not None else "cuda"


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_decode_matches_torch_reference(page_size: int, dtype: torch.dtype) -> None:
    from backends.cuda.triton_attention import paged_decode_attention_triton

    torch.manual_seed(0)
    batch, heads, kv_heads, dim = 5, 8, 2, 64
    seq_lens = torch.tensor([1, 17, 64, 100, 333], dtype=torch.int32)
    num_pages = 1 + sum((int(s) + page_size - 1) // page_size for s in seq_lens)
    k_cache = torch.randn(num_pages * page_size, kv_heads, dim, dtype=dtype, device="cuda")
    v_cache = torch.randn_like(k_cache)
    pages = torch.randperm(num_pages - 1) + 1  # scattered pages, never page 0
    width = max((int(s) + page_size - 1) // page_size for s in seq_lens)
    page_table = torch.zeros(batch, width, dtype=torch.int32)
    cursor = 0
    for row, length in enumerate(seq_lens.tolist()):
        need = (length + page_size - 1) // page_size
        page_table[row, :need] = pages[cursor : cursor + need].to(torch.int32)
        cursor += need
    page_table, seq_lens = page_table.cuda(), seq_lens.cuda()
    q = torch.randn(batch, heads, dim, dtype=dtype, device="cuda")
    k_new = torch.randn(batch, kv_heads, dim, dtype=dtype, device="cuda")
    # Slot of each row's last token, so the reference's own store rewrites it identically.
    last = seq_lens.long() - 1
    slots = page_table.gather(1, (last // page_size).unsqueeze(1)).squeeze(1).long() * page_size + last % page_size
    k_cache.index_copy_(0, slots, k_new)
    v_cache.index_copy_(0, slots, k_new)
    got = paged_decode_attention_triton(q, k_cache, v_cache, page_table, seq_lens, page_size, dim**-0.5)
    want = paged_decode_attention(
        q.float(),
        k_new.float(),
        k_new.float(),
        k_cache.float(),
        v_cache.float(),
        slots,
        page_table,
        seq_lens,
        page_size,
        dim**-0.5,
    )
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)


@pytest.mark.parametrize("compile_decode", [False, True])
def test_cuda_graph_decode_matches_eager(tmp_path, compile_decode: bool) -> None:
    from engine.engine import Engine
    from engine.sampling_params import SamplingParams

    _tiny_llama(tmp_path)
    prompts = [[1, 5, 9], [7] * 40, list(range(3, 90)), [2, 4, 8, 16, 32, 64, 128]]
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    tokens = {}
    for page_size in (1, 16):
        for graphs in (True, False):
            engine = Engine(
                model=str(tmp_path),
                device=ENGINE_DEVICE,
                dtype="float32",
                page_size=page_size,
                capture_sizes="1,2,8",
                disable_graphs=not graphs,
                kv_cache_tokens=4096,
                compile_decode=compile_decode,
            )
            tokens[(page_size, graphs)] = [o.token_ids for o in engine.generate(prompts, params)]
            # Batch 1 alone (the four prompts finish together, so the batch above never shrinks to 1).
            tokens[(page_size, graphs, "alone")] = engine.generate([prompts[2]], params)[0].token_ids
            if graphs:
                assert engine.runner.graph_steps > 0
            engine.check_kv_invariant()
            assert engine.kv_pages_in_use() == 0
        assert tokens[(page_size, True)] == tokens[(page_size, False)]
        assert tokens[(page_size, True, "alone")] == tokens[(page_size, False, "alone")]


def test_prefix_cache_chunking_and_retraction_on_cuda_graphs(tmp_path) -> None:
    """CUDA graphs replaying over pages the prefix cache recycles: same tokens as a plain eager run."""
    import random

    from engine.engine import Engine
    from engine.sampling_params import SamplingParams

    _tiny_llama(tmp_path, max_positions=4096)
    rng = random.Random(0)
    prefixes = [[rng.randrange(3, 512) for _ in range(n)] for n in (200, 90)]
    prompts = [prefixes[i % 2] + [rng.randrange(3, 512) for _ in range(rng.randint(1, 30))] for i in range(24)]
    prompts.append([rng.randrange(3, 512) for _ in range(1500)])  # chunked at 256
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    common = dict(
        model=str(tmp_path),
        device=ENGINE_DEVICE,
        dtype="float32",
        page_size=16,
        max_num_seqs=8,
        debug_kv_invariant=True,
    )
    reference = Engine(
        **common, disable_graphs=True, enable_prefix_caching=False, chunked_prefill_size=0, kv_cache_tokens=32768
    )
    expected = [o.token_ids for o in reference.generate(prompts, params)]
    # Tight pool: 2048 tokens for eight sequences of up to ~1500 + the cache, so pages are evicted and retracted.
    engine = Engine(**common, capture_sizes="1,2,4,8", chunked_prefill_size=256, kv_cache_tokens=2048)
    got = [o.token_ids for o in engine.generate(prompts, params)]
    assert got == expected
    stats = engine.stats()
    assert engine.runner.graph_steps > 0 and stats.prefix_cache_hit_tokens > 0 and stats.evicted_pages > 0
    assert engine.kv_pages_in_use() == 0


def _tiny_llama(folder, max_positions: int = 1024) -> str:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=512,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=3,
        num_attention_heads=8,
        num_key_value_heads=2,
        max_position_embeddings=max_positions,
        initializer_range=0.2,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(folder)
    return str(folder)


def _mixed_params() -> list:
    from engine.sampling_params import SamplingParams

    return [
        SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True),
        SamplingParams(
            max_tokens=25, temperature=0.8, top_p=0.9, top_k=50, repetition_penalty=1.1, seed=3, ignore_eos=True
        ),
        SamplingParams(
            max_tokens=20, temperature=0.7, min_p=0.05, presence_penalty=0.5, logprobs=2, seed=4, ignore_eos=True
        ),
        SamplingParams(max_tokens=28, temperature=0.0, stop_token_ids=[7], ignore_eos=True),
    ]


def test_overlap_gives_the_tokens_of_the_synchronous_run_on_cuda_graphs(tmp_path) -> None:
    from engine.engine import Engine

    model = _tiny_llama(tmp_path)
    prompts = [[1, 5, 9], [7] * 40, list(range(3, 90)), [2, 4, 8, 16, 32, 64, 128]]
    results = []
    for overlap in (False, True):
        engine = Engine(
            model=model,
            device=ENGINE_DEVICE,
            dtype="float32",
            page_size=16,
            capture_sizes="1,2,4",
            kv_cache_tokens=4096,
            overlap_schedule=overlap,
            debug_kv_invariant=True,
        )
        outputs = engine.generate(prompts, _mixed_params())
        results.append(
            [(o.token_ids, o.finish_reason, [(e.token_id, e.logprob) for e in o.logprobs or []]) for o in outputs]
        )
        assert engine.runner.graph_steps > 0 and engine.kv_pages_in_use() == 0
    assert results[0] == results[1]


def test_overlapped_decode_launch_never_waits_for_the_device(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Launching a decode step (inputs, graph replay, sampling with penalties, seeds and logprobs) makes no
    host-device synchronization: torch's sync debug mode raises on any."""
    from engine.engine import Engine

    engine = Engine(
        model=_tiny_llama(tmp_path),
        device=ENGINE_DEVICE,
        dtype="float32",
        page_size=16,
        capture_sizes="1,2,4",
        kv_cache_tokens=4096,
        overlap_schedule=True,
    )
    real_launch = engine._launch
    checked = {"decode": 0}

    def launch_without_syncs(step):
        if step is None or not step.is_decode:
            return real_launch(step)
        torch.cuda.set_sync_debug_mode("error")
        try:
            launched = real_launch(step)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert not launched.failed, launched.failed
        checked["decode"] += 1
        return launched

    monkeypatch.setattr(engine, "_launch", launch_without_syncs)
    engine.generate([[1, 5, 9], [7] * 40, list(range(3, 90)), [2, 4, 8]], _mixed_params())
    assert checked["decode"] > 15


def test_extend_graphs_give_the_tokens_of_compiled_and_eager_extend_steps(tmp_path) -> None:
    """Prefill, chunk and mixed steps replayed from CUDA graphs per token bucket (padding request,
    empty requests), with staggered arrivals and a cached prefix: the tokens of compiled and of
    eager extend steps, float32."""
    import random

    from helpers import run_staggered

    from engine.engine import Engine
    from engine.sampling_params import SamplingParams

    model = _tiny_llama(tmp_path, max_positions=4096)
    rng = random.Random(5)
    prefix = [rng.randrange(3, 512) for _ in range(70)]
    prompts = [
        (prefix if i % 3 == 0 else []) + [rng.randrange(3, 512) for _ in range(rng.randint(1, 300))] for i in range(20)
    ]
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    results = {}
    for mode, options in {
        "graphs": dict(extend_capture_tokens="16,64,256,1024", compile_extend=True),
        "eager_graphs": dict(
            extend_capture_tokens="16,64,256,1024", compile_extend=False
        ),  # the eager forward captured
        "compiled": dict(extend_capture_tokens="", compile_extend=True),
        "eager": dict(extend_capture_tokens="", compile_extend=False),
    }.items():
        engine = Engine(
            model=model,
            device=ENGINE_DEVICE,
            dtype="float32",
            page_size=16,
            capture_sizes="1,2,4,8",
            max_num_seqs=8,
            kv_cache_tokens=8192,
            chunked_prefill_size=200,
            mixed_steps=True,
            debug_kv_invariant=True,
            **options,
        )
        results[mode] = run_staggered(engine, prompts, params, [3 * i for i in range(len(prompts))]).token_ids
        if mode.endswith("graphs"):
            assert engine.runner.extend_graphs is not None and engine.runner.extend_graphs.replays > 0
        assert engine.kv_pages_in_use() == 0
    assert results["graphs"] == results["eager_graphs"] == results["compiled"] == results["eager"]


def test_strict_mode_never_recompiles_over_a_long_mixed_workload_on_cuda_graphs(tmp_path) -> None:
    """The CUDA defaults (decode graphs of the compiled step, whose layer graph the compiled extend step
    shares; extend-graph buckets; overlap; mixed steps) in strict mode: over ~500 steps of staggered
    arrivals (every batch size, prompt length and chunk split, steps inside and above the buckets),
    dynamo compiles nothing after warm-up, and strict mode would raise if it did."""
    import random

    from helpers import run_staggered

    from engine.engine import Engine
    from engine.sampling_params import SamplingParams
    from graphs.compiled_step import compile_count

    engine = Engine(
        model=_tiny_llama(tmp_path, max_positions=4096),
        device=ENGINE_DEVICE,
        page_size=16,
        capture_sizes="1,2,4,8",
        max_num_seqs=8,
        kv_cache_tokens=16384,
        chunked_prefill_size=1024,
        strict_graphs=True,
    )
    assert engine.config.extend_capture_tokens and engine.config.compile_extend and engine.config.mixed_steps
    rng = random.Random(7)
    arrivals = sorted(rng.randrange(0, 530) for _ in range(80))
    prompts = [[rng.randrange(3, 512) for _ in range(rng.randint(1, 1500))] for _ in arrivals]
    params = [SamplingParams(max_tokens=rng.randint(2, 40), temperature=0.0, ignore_eos=True) for _ in prompts]
    compiled_before = compile_count()
    run = run_staggered(engine, prompts, params, arrivals, max_steps=700)
    assert len(run.recorder.steps) >= 480  # 510 on the CPU with the same workload
    assert compile_count() == compiled_before
    extend_tokens = [
        tokens for (is_decode, _), tokens in zip(run.recorder.steps, run.recorder.num_tokens) if not is_decode
    ]
    largest_bucket = max(engine.runner.extend_graphs.graphs)
    assert min(extend_tokens) <= largest_bucket < max(extend_tokens)  # steps inside the buckets and above them
    assert engine.runner.extend_graphs.replays > 0 and engine.runner.extend_step.compiles_after_first == 0
    assert engine.kv_pages_in_use() == 0


def test_decode_steps_above_the_graphs_run_the_compiled_layers_on_cuda(tmp_path) -> None:
    """max_num_seqs above the largest capture size (a tuned config's sizes, or --max-num-seqs past them): the larger
    decode steps run the layer graph the decode capture compiled, without a graph; strict mode, overlap and
    mixed steps on; the tokens of eager steps (float32)."""
    import random

    from helpers import run_staggered

    from engine.engine import Engine
    from engine.sampling_params import SamplingParams
    from graphs.compiled_step import compile_count

    model = _tiny_llama(tmp_path)
    rng = random.Random(11)
    prompts = [[rng.randrange(3, 512) for _ in range(rng.randint(2, 200))] for _ in range(24)]
    params = [SamplingParams(max_tokens=rng.randint(8, 30), temperature=0.0, ignore_eos=True) for _ in prompts]
    arrivals = [i // 3 for i in range(len(prompts))]
    results = {}
    for mode in ("graphs", "eager"):
        engine = Engine(
            model=model,
            device=ENGINE_DEVICE,
            dtype="float32",
            page_size=16,
            capture_sizes="1,2,4",
            max_num_seqs=16,
            kv_cache_tokens=8192,
            chunked_prefill_size=256,
            debug_kv_invariant=True,
            strict_graphs=mode == "graphs",
            disable_graphs=mode == "eager",
        )
        compiled_before = compile_count()
        run = run_staggered(engine, prompts, params, arrivals)
        results[mode] = run.token_ids
        assert engine.kv_pages_in_use() == 0
        if mode == "graphs":
            assert compile_count() == compiled_before
            assert max(run.decode_sizes) > 4
            runner = engine.runner
            assert runner.eager_steps == 0 and runner.extend_step.compiles_after_first == 0
            assert runner.graph_steps == sum(1 for size in run.decode_sizes if size <= 4)
    assert results["graphs"] == results["eager"]


def test_moe_model_replays_cuda_graphs_with_the_fused_experts(tmp_path) -> None:
    """Mixtral (tiny, random) on CUDA: the fused Triton experts inside captured decode graphs and compiled
    extend steps give the tokens of eager steps, and of the torch experts op."""
    from conftest import build_tiny_checkpoint

    from backends.cuda.moe_method import TRITON_FUSED_MOE
    from engine.engine import Engine
    from engine.layers.moe import TORCH_EXPERTS, SparseMoE
    from engine.sampling_params import SamplingParams

    model = build_tiny_checkpoint("mixtral", str(tmp_path / "mixtral"))
    prompts = [[1, 5, 9], [7] * 40, list(range(3, 90)), [2, 4, 8, 16, 32, 64, 128]]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    tokens = {}
    for mode in ("graphs", "eager", "torch_experts"):
        engine = Engine(
            model=model,
            device=ENGINE_DEVICE,
            dtype="float32",
            page_size=16,
            capture_sizes="1,2,4",
            kv_cache_tokens=4096,
            disable_graphs=mode != "graphs",
            debug_kv_invariant=True,
        )
        moe_layers = [m for m in engine.model.modules() if isinstance(m, SparseMoE)]
        assert moe_layers and all(m.method is TRITON_FUSED_MOE for m in moe_layers)
        if mode == "torch_experts":
            for layer in moe_layers:
                layer.method = TORCH_EXPERTS
        tokens[mode] = [o.token_ids for o in engine.generate(prompts, params)]
        if mode == "graphs":
            assert engine.runner.graph_steps > 0
        assert engine.kv_pages_in_use() == 0
    assert tokens["graphs"] == tokens["eager"] == tokens["torch_experts"]


def test_gemma2_soft_capped_attention_on_cuda_graphs(tmp_path) -> None:
    """Gemma 2 (tiny, random): the Triton kernels' soft-capped scores and per-layer windows inside decode
    graphs and compiled extend steps, against eager steps and against transformers, float32 greedy."""
    from conftest import build_tiny_checkpoint
    from transformers import AutoModelForCausalLM

    from engine.engine import Engine
    from engine.sampling_params import SamplingParams

    model = build_tiny_checkpoint("gemma2", str(tmp_path / "gemma2"))
    prompts = [[1, 5, 9], [7] * 40, list(range(3, 90)), [2, 4, 8, 16, 32, 64, 128]]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        want = [
            hf.generate(torch.tensor([p]), max_new_tokens=24, do_sample=False, eos_token_id=None, pad_token_id=0)[
                0, len(p) :
            ].tolist()
            for p in prompts
        ]
    for graphs in (True, False):
        engine = Engine(
            model=model,
            device=ENGINE_DEVICE,
            dtype="float32",
            page_size=16,
            capture_sizes="1,2,4",
            kv_cache_tokens=4096,
            disable_graphs=not graphs,
            debug_kv_invariant=True,
        )
        assert [o.token_ids for o in engine.generate(prompts, params)] == want
        assert engine.kv_pages_in_use() == 0


def test_one_row_gemv_in_bf16_decode_graphs(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A bf16 engine whose batch-1 decode graphs run the Triton GEMV (backends/cuda/gemv.py) is as close
    to the float32 engine as the same bf16 engine on cuBLAS: the sampled token's log-probability at each
    step (until a bf16 run first picks another token than float32) deviates from float32's by at most
    twice cuBLAS's largest deviation plus 0.02. bf16 rounds the logits themselves (0.4% of a logit of
    this random model's size is ~0.1 nats), so only a comparison against cuBLAS's own error is fair."""
    from backends.cuda.gemv import GEMV
    from engine.engine import Engine
    from engine.sampling_params import SamplingParams

    on_rocm = torch.version.hip is not None  # ROCm keeps its BLAS (the GEMV was measured on the H200 only)
    _tiny_llama(tmp_path)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=1)
    runs = {}
    from backends.cuda.platform import CudaPlatform

    for name, dtype, gemv in (("float32", "float32", False), ("gemv", "bfloat16", True), ("cublas", "bfloat16", False)):
        monkeypatch.setattr(CudaPlatform, "one_row_gemv", gemv and not on_rocm)  # the platform's own choice
        engine = Engine(
            model=str(tmp_path), device=ENGINE_DEVICE, dtype=dtype, capture_sizes="1,2", kv_cache_tokens=4096
        )
        assert any(getattr(m, "method", None) is GEMV for m in engine.model.modules()) == (
            name == "gemv" and not on_rocm
        )
        runs[name] = engine.generate([[1, 5, 9, 33]], params)[0].logprobs
        assert engine.runner.graph_steps > 0
        del engine
    deviations: dict[str, list[float]] = {"gemv": [], "cublas": []}
    for name, steps in deviations.items():
        for got, want in zip(runs[name], runs["float32"]):
            if got.token_id != want.token_id:
                break
            steps.append(abs(got.logprob - want.logprob))
    assert len(deviations["gemv"]) >= 4 and len(deviations["cublas"]) >= 4
    assert max(deviations["gemv"]) <= 2 * max(deviations["cublas"]) + 0.02, deviations


def test_batch1_graph_is_captured_over_two_rows_without_a_compile_of_its_own(
    tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The compiled decode step's batch-1 graph reads two static rows, the second padding
    (graphs/cuda_graph_runner.py): building the engine (sizes 1, 2 and 8, then the warm-up request's extend
    step) compiles one graph, the layer's, which decode and extend share (graphs/opaque_attention.py; the
    head runs eagerly), one fewer than with batch 1 compiled on its own (dynamo's size 1), and batch-1
    tokens (float32) are those of the size-1 compile and of eager steps, after batches of more rows left their
    own values in the padding row's buffers."""
    from engine.engine import Engine
    from engine.sampling_params import SamplingParams
    from graphs import cuda_graph_runner
    from graphs.compiled_step import compile_count

    _tiny_llama(tmp_path)
    prompts = [list(range(3, 60)), [9, 8, 7], [5] * 20]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    compiles, tokens = {}, {}
    for variant in ("1", "0", "eager"):
        two_rows = variant != "0"
        monkeypatch.setattr(cuda_graph_runner, "batch1_in_two_rows", lambda model, two_rows=two_rows: two_rows)
        before = compile_count()
        engine = Engine(
            model=str(tmp_path),
            device=ENGINE_DEVICE,
            dtype="float32",
            capture_sizes="1,2,8",
            kv_cache_tokens=4096,
            compile_decode=True,
            disable_graphs=variant == "eager",
        )
        compiles[variant] = compile_count() - before
        if variant != "eager":
            assert engine.runner.graph_runner.graph_rows(1) == (2 if variant == "1" else 1)
        engine.generate(prompts, params)  # batches of three fill rows 1 and 2 of the static buffers
        tokens[variant] = [engine.generate([prompt], params)[0].token_ids for prompt in prompts]
        assert engine.kv_pages_in_use() == 0
        del engine
    assert compiles["1"] == 1 and compiles["0"] == 2, compiles
    assert tokens["1"] == tokens["0"] == tokens["eager"]


def test_eagle3_drafts_left_on_the_device_verify_as_drafts_read_back_on_cuda_graphs(tmp_path) -> None:
    """Speculative decoding with an EAGLE-3 head (dummy weights of the target's shape) on CUDA graphs: the draft
    loop replays its captured graphs, and with overlap scheduling on its drafts stay on the device for the verify
    step. Every verify step then checks the same drafts and samples the same tokens at every row as with the
    drafts read back first, and the text is that of decoding without speculation."""
    import json

    from engine.engine import Engine
    from engine.sampling_params import SamplingParams

    model = _tiny_llama(tmp_path)
    prompts = [[1, 5, 9], [7] * 40, list(range(3, 90)), [2, 4, 8, 16, 32, 64, 128]]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    common = dict(
        model=model, device=ENGINE_DEVICE, dtype="float32", page_size=16, capture_sizes="1,2,4,8,16,32",
        kv_cache_tokens=4096, debug_kv_invariant=True,
    )  # fmt: skip
    plain = Engine(**common)
    want = [o.token_ids for o in plain.generate(prompts, params)]
    plain.shutdown()
    spec = json.dumps({"method": "eagle3", "model": "dummy", "num_speculative_tokens": 3})
    verdicts = []
    for on_device in (False, True):
        engine = Engine(**common, speculative_config=spec, overlap_schedule=on_device)
        speculator = engine.speculator
        assert speculator is not None and speculator.eagle is not None
        assert speculator.drafts_on_device == on_device
        seen: list[tuple[list[int], list[int]]] = []
        accept = speculator.accept

        def recorded(drafts: list[int], sampled: list[int], accept=accept, seen=seen) -> list[int]:
            seen.append((list(drafts), list(sampled)))
            return accept(drafts, sampled)

        speculator.accept = recorded  # type: ignore[method-assign]
        got = [o.token_ids for o in engine.generate(prompts, params)]
        verdicts.append(seen)
        assert {key[0] for key in speculator.eagle.loop.replays} == {"catch-up", "chain"}  # the loop's graphs ran
        assert engine.runner.graph_steps > 0 and engine.kv_pages_in_use() == 0
        engine.shutdown()
        assert got == want
    host, device = verdicts
    assert len(host) > 20 and all(t >= 0 for drafts, _ in device for t in drafts)
    assert device == host
