"""The batched LoRA matmul: CUDA's grouped Triton kernels (the split-K shrink and the expand),
which add into out in place, and the CPU's torch paths against a per-row reference, with ranks padded inside the
slot stacks, rows of mixed slots, base rows (-1) and a graph's padding rows after the step's, through the token
-> slot buffers the model runner fills (engine/lora/rows.py); and the op inside an inductor graph.

Without a GPU the Triton kernels run in Triton's CPU interpreter (compiled on a GPU).
"""

from __future__ import annotations

import re
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path

import pytest
import torch
from helpers import greedy
from test_lora_tp import ALL_MODULES, make_adapter
from triton_interpreter import interpreter_mode

from engine.engine import Engine
from engine.lora.matmul import DENSE_LORA, GATHER_LORA, TokenSlots
from engine.lora.rows import LoRARows

ON_GPU = torch.cuda.is_available()
DEVICE = "cuda" if ON_GPU else "cpu"


def _kernels_mode() -> AbstractContextManager[None]:
    """Compiled on a GPU; in Triton's interpreter on the CPU."""
    return nullcontext() if ON_GPU else interpreter_mode()


def _stacks(
    slots: int, parts: list[int], max_rank: int, ranks: list[int], in_features: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """lora_a [S, P*R, in], lora_b [S, P*R, out] laid out as engine/lora/layers.py writes them: slot s's
    part p in rows p*R ... p*R + ranks[s] (the rest of the R rows zero: rank padding), B's non-zero columns
    only part p's output rows. parts: each part's output rows."""
    generator = torch.Generator().manual_seed(seed)
    width, out_features = len(parts) * max_rank, sum(parts)
    lora_a = torch.zeros(slots, width, in_features)
    lora_b = torch.zeros(slots, width, out_features)
    for s in range(slots):
        column = 0
        for p, rows in enumerate(parts):
            r = ranks[s]
            lora_a[s, p * max_rank : p * max_rank + r] = torch.randn(r, in_features, generator=generator)
            lora_b[s, p * max_rank : p * max_rank + r, column : column + rows] = torch.randn(
                r, rows, generator=generator
            )
            column += rows
    return lora_a, lora_b


def _reference(
    out: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, slots: torch.Tensor
) -> torch.Tensor:
    """Row by row, in float64: out_t + (A[s_t] @ x_t) @ B[s_t], out_t where s_t is -1."""
    result = out.double().clone()
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            result[t] += (lora_a[slot].double() @ x[t].double()) @ lora_b[slot].double()
    return result


def _rows(step_slots: list[int], num_slots: int, padded_rows: int, grouped: bool) -> TokenSlots:
    """The buffers as a step of these slots leaves them (after a longer step, whose rows must be reset), viewed
    for a graph of padded_rows rows."""
    rows = LoRARows(max(64, padded_rows + 8), num_slots, torch.device(DEVICE), grouped=grouped)
    rows.fill([0, 1] * 20)  # a longer step before: its rows past this one's must not leak into it
    rows.fill(step_slots)
    return TokenSlots(rows.slots[:padded_rows], rows.sorted_rows, rows.group_starts)


# (slots, parts' output rows, max rank, each slot's rank, input columns): q/k/v-like parts with rank padding
# and an input wider than one split (a partial last split); one part over several output blocks (o/down);
# widths that are no power of two (K = 36 in a block of 64, 88 outputs) with an unloaded (all-zero) slot.
SHAPES = [
    (3, [48, 16, 16], 8, [8, 3, 5], 300),
    (2, [300], 16, [16, 4], 96),
    (3, [40, 24, 24], 12, [12, 0, 7], 200),
]
STEP = [0, -1, 2, 1, 2, -1, 0, 0, -1]  # mixed slots, base rows between them, a slot used by several rows
PADDED = 12  # the graph's rows: three padding rows after the step's nine


def _case(shape: tuple[int, list[int], int, list[int], int], seed: int) -> tuple[torch.Tensor, ...]:
    num_slots, parts, max_rank, ranks, in_features = shape
    lora_a, lora_b = _stacks(num_slots, parts, max_rank, ranks, in_features, seed=seed)
    generator = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(PADDED, in_features, generator=generator)
    out = torch.randn(PADDED, sum(parts), generator=generator)
    return out, x, lora_a, lora_b


# bf16 on a GPU only: Triton 3.6's interpreter multiplies bf16 tl.dot operands as raw bits (a 16x16 dot of
# bf16 randn is off by ~1e10 there), so the CPU runs the same kernels in float32, as the other kernels' tests do.
DTYPES = [torch.float32, torch.bfloat16] if ON_GPU else [torch.float32]
# A signalling NaN in out's rows of no slot: any arithmetic on it (even + 0) quiets it, so these rows keep their
# bits only if no kernel computed on them. Their x rows are NaN too: read into a slot's row, they would poison it.
SIGNALLING_NAN = {torch.float32: (0x7FA00001, torch.int32), torch.bfloat16: (0x7F81, torch.int16)}


@pytest.fixture(params=["many-splits", "one-split"])
def kernel_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The shrink's input split as the step's size chooses it (many splits: their partial sums added by the
    expand), or whole in one split per row block."""
    import backends.cuda.lora as cuda_lora

    if request.param == "one-split":
        monkeypatch.setattr(cuda_lora, "SPLIT_PROGRAMS", 1)
    return str(request.param)


def _apply_triton(
    out: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, rows: TokenSlots
) -> torch.Tensor:
    """TRITON_LORA.apply on the device; out is written in place and returned (checked here)."""
    with _kernels_mode():
        from backends.cuda.lora import TRITON_LORA

        out, x, lora_a, lora_b = (t.to(DEVICE) for t in (out, x, lora_a, lora_b))
        got = TRITON_LORA.apply(out, x, lora_a, lora_b, rows)
    assert got is out
    return got.cpu()


def _check(
    got: torch.Tensor, before: torch.Tensor, want: torch.Tensor, slots: torch.Tensor, dtype: torch.dtype
) -> None:
    """The rows of a slot match the float64 reference (made from the same rounded inputs); every other row
    keeps its bits."""
    assert got.dtype == dtype
    live = slots >= 0
    scale = want[live].abs().max().item()
    tolerance = (1e-5, 1e-4 * scale) if dtype == torch.float32 else (0.01, 0.01 * scale)
    torch.testing.assert_close(got[live].double(), want[live], rtol=tolerance[0], atol=tolerance[1])
    bits = SIGNALLING_NAN[dtype][1]
    assert torch.equal(got[~live].view(bits), before[~live].view(bits))


def _nan_rows_of_no_slot(out: torch.Tensor, x: torch.Tensor, slots: torch.Tensor) -> None:
    value, bits = SIGNALLING_NAN[out.dtype]
    base = slots < 0
    out[base] = torch.tensor(value, dtype=bits).view(out.dtype)
    x[base] = float("nan")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=["qkv-like", "one-part", "odd-widths"])
def test_triton_kernels_match_the_row_by_row_reference(
    shape: tuple[int, list[int], int, list[int], int], dtype: torch.dtype, kernel_path: str
) -> None:
    num_slots, parts, max_rank, ranks, in_features = shape
    step = [s % num_slots if s >= 0 else -1 for s in STEP]
    lora_a, lora_b = _stacks(num_slots, parts, max_rank, ranks, in_features, seed=1)
    generator = torch.Generator().manual_seed(2)
    x = torch.randn(PADDED, in_features, generator=generator)
    out = torch.randn(PADDED, sum(parts), generator=generator)
    out, x, lora_a, lora_b = (t.to(dtype) for t in (out, x, lora_a, lora_b))
    rows = _rows(step, num_slots, PADDED, grouped=True)
    slots = rows.slots.cpu()
    assert int((slots < 0).sum()) == 6  # three base rows and three padding rows
    _nan_rows_of_no_slot(out, x, slots)
    want = _reference(out, x, lora_a, lora_b, slots)
    got = _apply_triton(out.clone(), x, lora_a, lora_b, rows)
    _check(got, out, want, slots, dtype)
    changed = [not torch.allclose(got[t], out[t]) for t in range(len(step)) if step[t] >= 0]
    unloaded = [t for t in range(len(step)) if step[t] >= 0 and ranks[step[t]] == 0]
    assert changed == [ranks[s] > 0 for s in step if s >= 0]  # the adapters change their rows, zeros do not
    assert all(torch.equal(got[t], out[t]) for t in unloaded)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows", [1, 40, 300], ids=["one-row", "two-row-blocks", "long-split"])
def test_triton_kernels_at_decode_and_prefill_sizes(rows: int, dtype: torch.dtype, kernel_path: str) -> None:
    """Through the op the compiled graphs hold (engine::lora_sgmv), float32 sums: one row (a decode step), rows
    over several row blocks of one slot, and the long input splits of a prefill (300 rows)."""
    num_slots = 2
    lora_a, lora_b = _stacks(num_slots, [64, 64], 16, [16, 7], 2300, seed=3)
    generator = torch.Generator().manual_seed(4)
    step = [[1, -1, 0, 1][i % 4] if rows > 1 else 1 for i in range(rows)]
    x = torch.randn(rows, 2300, generator=generator)
    out = torch.randn(rows, 128, generator=generator)
    out, x, lora_a, lora_b = (t.to(dtype) for t in (out, x, lora_a, lora_b))
    token_slots = _rows(step, num_slots, rows, grouped=True)
    slots = token_slots.slots.cpu()
    _nan_rows_of_no_slot(out, x, slots)
    want = _reference(out, x, lora_a, lora_b, slots)
    got = _apply_triton(out.clone(), x, lora_a, lora_b, token_slots)
    _check(got, out, want, slots, dtype)


def test_an_empty_slot_stack_and_a_step_of_base_rows_leave_out_as_it_is(kernel_path: str) -> None:
    out = torch.randn(5, 24)
    x = torch.randn(5, 40)
    slots = LoRARows(16, 0, torch.device(DEVICE), grouped=True)  # no slots at all
    slots.fill([-1, -1, -1])
    rows = TokenSlots(slots.slots[:5], slots.sorted_rows, slots.group_starts)
    got = _apply_triton(out.clone(), x, torch.zeros(0, 8, 40), torch.zeros(0, 8, 24), rows)
    assert torch.equal(got, out)
    lora_a, lora_b = _stacks(2, [24], 8, [8, 8], 40, seed=6)
    rows = _rows([-1, -1, -1], 2, 5, grouped=True)  # slots loaded, none used
    _nan_rows_of_no_slot(out, x, rows.slots.cpu())
    got = _apply_triton(out.clone(), x, lora_a, lora_b, rows)
    assert torch.equal(got.view(torch.int32), out.view(torch.int32))


def test_the_input_splits_spread_a_decode_step_and_stay_few_for_a_prefill() -> None:
    """Llama-3-8B's down projection (14,336 inputs), 8 slots of rank 16: one row is split into 256-column
    pieces (56 programs), a prefill of 8,192 rows into few long ones (its row blocks fill the GPU)."""
    from backends.cuda.lora import MIN_SPLIT_IN, split_tiles

    assert split_tiles(1, 8, 16, 14336).split_in == MIN_SPLIT_IN
    prefill = split_tiles(8192, 8, 16, 14336)
    assert -(-14336 // prefill.split_in) <= 4
    assert all(split_tiles(rows, 8, 48, 4096).split_in % 64 == 0 for rows in (1, 7, 64, 300, 8192))


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
def test_inductor_runs_the_op_in_place_on_the_base_output(dynamic: bool) -> None:
    """A compiled projection (base matmul, then the op), as the decode runner's layer graphs hold it: inductor
    hands the op the matmul's own buffer and returns that buffer, with no copy of out anywhere in its code."""
    from torch._inductor.utils import run_and_get_code

    from graphs.compiled_step import private_copy

    lora_a, lora_b = _stacks(3, [48, 16, 16], 8, [8, 3, 5], 300, seed=8)
    generator = torch.Generator().manual_seed(9)
    weight = torch.randn(80, 300, generator=generator)
    x = torch.randn(PADDED, 300, generator=generator)
    rows = _rows([s % 3 if s >= 0 else -1 for s in STEP], 3, PADDED, grouped=True)
    with _kernels_mode():
        from backends.cuda.lora import TRITON_LORA

        def projection(
            x: torch.Tensor, weight: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, slots: TokenSlots
        ) -> torch.Tensor:
            return TRITON_LORA.apply(x @ weight.t(), x, lora_a, lora_b, slots)

        compiled = torch.compile(private_copy(projection), fullgraph=True, dynamic=dynamic)
        args = [t.to(DEVICE) for t in (x, weight, lora_a, lora_b)]
        got, codes = run_and_get_code(compiled, *args, rows)
    want = _reference(x @ weight.t(), x, lora_a, lora_b, rows.slots.cpu())
    torch.testing.assert_close(got.cpu().double(), want, rtol=1e-5, atol=1e-3)
    # Where out's old values are still read after the op, inductor copies out into a new buffer first (a
    # "clone" kernel) and hands the op that copy (reinterpret_tensor(buf...)): none of that here.
    code = "\n".join(codes)
    call = re.search(r"torch\.ops\.engine\.lora_sgmv\.default\((\w+),", code)
    assert call is not None, code
    buffer = call.group(1)
    assert re.search(rf"mm\(.*out={buffer}\)", code), code  # the matmul's own output buffer
    assert re.search(rf"return \({buffer}, \)", code), code  # is the result, as the op left it
    assert not re.search(r"clone|copy_", code), code


def _folded_case(seed: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A folded projection's matmul output (base columns, then every slot's low-rank columns) for SHAPES[0], as
    one tensor; and x, lora_a, lora_b."""
    out, x, lora_a, lora_b = (t.to(dtype) for t in _case(SHAPES[0], seed=seed))
    num_slots, width, in_features = lora_a.shape
    low_rank = (x @ lora_a.reshape(num_slots * width, in_features).t()).to(dtype)
    return torch.cat([out, low_rank], dim=1), x, lora_a, lora_b


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_the_expand_kernel_adds_into_a_folded_matmuls_base_columns(dtype: torch.dtype) -> None:
    """A folded into the base weight: the expand alone reads each row's slot's columns of the low-rank part and
    adds into the base part, both column slices of one tensor; the low-rank columns and the other rows keep
    their bits."""
    both, x, lora_a, lora_b = _folded_case(seed=11, dtype=dtype)
    out_features = lora_b.shape[2]
    rows = _rows([s % 3 if s >= 0 else -1 for s in STEP], 3, PADDED, grouped=True)
    slots = rows.slots.cpu()
    value, bits = SIGNALLING_NAN[dtype]
    both[slots < 0, :out_features] = torch.tensor(value, dtype=bits).view(dtype)
    want = _reference(both[:, :out_features], x, lora_a, lora_b, slots)
    with _kernels_mode():
        from backends.cuda.lora import TRITON_LORA

        on_device = both.to(DEVICE)
        got = TRITON_LORA.expand(
            on_device[:, :out_features], on_device[:, out_features:], lora_b.to(DEVICE), rows
        ).cpu()
    _check(got, both[:, :out_features], want, slots, dtype)
    assert torch.equal(on_device.cpu()[:, out_features:].view(bits), both[:, out_features:].view(bits))
    assert torch.equal(on_device.cpu()[:, :out_features].view(bits), got.view(bits))  # written where it lies


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
def test_inductor_runs_the_expand_in_place_on_the_folded_matmuls_output(dynamic: bool) -> None:
    """A compiled folded projection (one matmul over the base weight with A's rows appended, then the expand on
    its column slices): the expand runs on the matmul's own buffer, with no copy of it anywhere in the code."""
    from torch._inductor.utils import run_and_get_code

    from graphs.compiled_step import private_copy

    _, x, lora_a, lora_b = _folded_case(seed=13, dtype=torch.float32)
    num_slots, width, in_features = lora_a.shape
    out_features = lora_b.shape[2]
    weight = torch.randn(out_features, in_features, generator=torch.Generator().manual_seed(14))
    folded = torch.cat([weight, lora_a.reshape(num_slots * width, in_features)])
    rows = _rows([s % 3 if s >= 0 else -1 for s in STEP], 3, PADDED, grouped=True)
    with _kernels_mode():
        from backends.cuda.lora import TRITON_LORA

        def projection(x: torch.Tensor, folded: torch.Tensor, lora_b: torch.Tensor, slots: TokenSlots) -> torch.Tensor:
            both = x @ folded.t()
            return TRITON_LORA.expand(both[:, :out_features], both[:, out_features:], lora_b, slots)

        compiled = torch.compile(private_copy(projection), fullgraph=True, dynamic=dynamic)
        args = [t.to(DEVICE) for t in (x, folded, lora_b)]
        got, codes = run_and_get_code(compiled, *args, rows)
    want = _reference(x @ weight.t(), x, lora_a, lora_b, rows.slots.cpu())
    torch.testing.assert_close(got.cpu().double(), want, rtol=1e-5, atol=1e-3)
    code = "\n".join(codes)
    call = re.search(r"torch\.ops\.engine\.lora_expand\.default\(reinterpret_tensor\((\w+),", code)
    assert call is not None, code
    buffer = call.group(1)
    assert re.search(rf"mm\(.*out={buffer}\)", code), code  # the matmul's own output buffer
    assert not re.search(r"clone|copy_", code), code


@pytest.mark.parametrize("kernels", [DENSE_LORA, GATHER_LORA], ids=lambda k: k.name)
def test_the_torch_paths_expand_a_folded_matmuls_columns(kernels: object) -> None:
    both, x, lora_a, lora_b = _folded_case(seed=12, dtype=torch.float32)
    out_features = lora_b.shape[2]
    rows = TokenSlots(*(t.cpu() for t in _rows(STEP, SHAPES[0][0], PADDED, grouped=False)))
    got = kernels.expand(both[:, :out_features], both[:, out_features:], lora_b, rows)  # type: ignore[attr-defined]
    want = _reference(both[:, :out_features], x, lora_a, lora_b, rows.slots)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("kernels", [DENSE_LORA, GATHER_LORA], ids=lambda k: k.name)
def test_the_torch_paths_match_the_row_by_row_reference(kernels: object) -> None:
    out, x, lora_a, lora_b = _case(SHAPES[0], seed=5)
    rows = TokenSlots(*(t.cpu() for t in _rows(STEP, SHAPES[0][0], PADDED, grouped=False)))  # the torch paths: CPU
    got = kernels.apply(out, x, lora_a, lora_b, rows)  # type: ignore[attr-defined]
    want = _reference(out, x, lora_a, lora_b, rows.slots)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-4)
    assert torch.equal(got[rows.slots < 0], out[rows.slots < 0])


def test_the_rows_grouped_by_slot_as_the_kernels_read_them() -> None:
    rows = LoRARows(10, 3, torch.device("cpu"), grouped=True)
    rows.fill([2, -1, 0, 2, 0, -1, 1, 1])
    rows.fill([2, -1, 0, 2, -1])  # shorter: the previous step's last rows back to -1 and to themselves
    assert rows.slots.tolist() == [2, -1, 0, 2, -1, -1, -1, -1, -1, -1]
    assert rows.sorted_rows.tolist() == [2, 0, 3, 1, 4, 5, 6, 7, 8, 9]  # slot 0, (none of 1), slot 2, the rest
    assert rows.group_starts.tolist() == [0, 1, 1, 3, 10]


@pytest.mark.parametrize("mode", ["eager", "graphs", "graphs-folded"])
def test_an_engine_on_the_triton_kernels_gives_the_dense_paths_tokens(
    mode: str, tiny_llama: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The whole model with every projection's LoRA matmul on the Triton kernels (on the CPU the platform is made
    to offer them, as CUDA's does, and they run in the interpreter) against the dense torch path: one batch of
    base rows and two adapters, eager and replaying the decode graph of 8 rows (on the CPU the op inside a strict
    fullgraph compile), its padding rows base rows. "folded": the Triton run with A folded into every base weight
    (the expand kernel alone), against the dense path unfolded."""
    import engine.lora.layers as lora_layers
    from backends.cpu.packed_linear import PACKING_ENV

    if ON_GPU:
        from backends.cuda.platform import CudaPlatform as platform_class
    else:
        from backends.cpu.platform import CpuPlatform as platform_class  # type: ignore[assignment]

    folders = {
        "all": make_adapter(tiny_llama, str(tmp_path / "all"), 3, 8, ALL_MODULES),
        "qv": make_adapter(tiny_llama, str(tmp_path / "qv"), 4, 4, ["q_proj", "v_proj"]),
    }
    graphs = {"disable_graphs": True} if mode == "eager" else {"capture_sizes": "8", "strict_graphs": True}
    prompts = [[5, 17, 99, 23, 8, 41], [200, 3, 77, 77, 12], [9, 8, 7, 6, 5, 4, 3, 150]]
    names = [None, "all", "qv", "all", None, "qv", "qv"]
    params = [greedy(8, lora_name=name) for name in names]
    batch = [prompts[i % len(prompts)] for i in range(len(names))]

    def run() -> tuple[list[list[int]], str]:
        engine = Engine(
            model=tiny_llama,
            device=DEVICE,
            dtype="float32",
            page_size=16,
            kv_cache_tokens=1024,
            max_num_seqs=8,
            lora_modules=",".join(f"{name}={path}" for name, path in folders.items()),
            max_lora_rank=8,
            **graphs,
        )
        try:
            assert engine.lora is not None
            folded = {layer.method.folded for layer in engine.lora.projections.values()}  # type: ignore[attr-defined]
            assert folded == {lora_layers.FOLD_MAX_FRACTION == 0}
            tokens = [o.token_ids for o in engine.generate(batch, params)]
            if mode == "graphs":
                assert engine.runner.graph_steps > 0, engine.runner.describe()
            return tokens, engine.lora.kernels.name
        finally:
            engine.shutdown()

    monkeypatch.setattr(platform_class, "lora_kernels", lambda self: None)
    dense, dense_name = run()
    with _kernels_mode():
        from backends.cuda.lora import TRITON_LORA

        monkeypatch.setattr(platform_class, "lora_kernels", lambda self: TRITON_LORA)
        if mode.endswith("folded"):
            monkeypatch.setenv(PACKING_ENV, "0")  # the CPU's plain weights (CUDA's are never packed)
            monkeypatch.setattr(lora_layers, "FOLD_MAX_FRACTION", 0)  # the tiny model's projections are narrow
        triton, triton_name = run()
    assert (dense_name, triton_name) == ("dense", "triton_sgmv")
    assert triton == dense
    assert dense[1] != dense[0] and dense[2] != dense[0]  # the adapters change the tokens
