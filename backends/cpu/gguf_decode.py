"""The CPU's decode runner for Llama-family models with GGUF weights: the whole step in one native call.

At batch 1 the compiled torch step of SmolLM2 (Q4_1) spent ~2/3 of its 21 ms outside the matmuls:
121 op calls through Python and ctypes, dynamo's guard checks, the layer graphs' small kernels,
attention's setup. NativeDecodeRunner hands the step to kernels/gguf_decode.c instead (embedding,
every layer, final norm and LM head in one OpenMP region) over the same weights (the tiles of
backends/cpu/gguf_linear.py), the same paged KV cache, and the same static decode buffers and
capture hooks as the compiled runner, behind the engine's decode contract (graphs/step_runner.py
`run_decode`). CpuDecodeRunner is what the CPU platform hands the engine: this runner where
`native_step_unsupported` finds nothing in the way, the compiled graphs otherwise.
"""

from __future__ import annotations

import ctypes
import logging
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from backends.cpu.gguf_linear import (
    PATH_NAMES,
    GGMatrix,
    GGUFLinearMethod,
    QuantizedEmbedding,
    _library,
    code_paths,
    gguf_tiles,
)
from graphs.capture_loop import CaptureReport, capture_loop
from graphs.step_runner import DecodeGraphRunner

if TYPE_CHECKING:
    from engine.step_message import DecodeMessage
    from graphs.model_runner import DecodeBatchState

logger = logging.getLogger(__name__)

_P, _I32 = ctypes.c_void_p, ctypes.c_int32


class GGLinear(ctypes.Structure):
    _fields_ = [("parts", ctypes.POINTER(GGMatrix)), ("bias", _P), ("nparts", _I32), ("rows", _I32)]


class GGLayer(ctypes.Structure):
    _fields_ = [
        ("qkv", GGLinear),
        ("o", GGLinear),
        ("gate_up", GGLinear),
        ("down", GGLinear),
        ("attn_norm", _P),
        ("ffn_norm", _P),
        ("q_norm", _P),
        ("k_norm", _P),
        ("k_cache", _P),
        ("v_cache", _P),
        ("cos", _P),
        ("sin", _P),
        ("window", _I32),
        ("reserved", _I32),
    ]


class GGModel(ctypes.Structure):
    _fields_ = [
        ("layers", ctypes.POINTER(GGLayer)),
        ("head", GGLinear),
        ("embed", ctypes.POINTER(GGMatrix)),
        ("embed_dense", _P),
        ("final_norm", _P),
        *(
            (name, _I32)
            for name in (
                "n_layers",
                "hidden",
                "heads",
                "kv_heads",
                "head_dim",
                "inter",
                "vocab",
                "max_positions",
                "page_size",
                "levels",
                "isa_f32",
                "isa_i8",
            )
        ),
        ("eps", ctypes.c_float),
        ("scale", ctypes.c_float),
    ]


@torch.no_grad()
def native_step_unsupported(model: torch.nn.Module, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> str | None:
    """Why kernels/gguf_decode.c cannot run this model's decode step here (None: it can)."""
    from engine.distributed.state import tp_world_size
    from engine.layers.mlp import GatedMLP
    from engine.layers.norm import RMSNorm
    from engine.models.decoder import DecoderLayer

    if _library() is None:
        return "the native GGUF kernels are not built here"
    if tp_world_size() > 1:
        return "tensor parallelism (the step holds no collectives)"
    if model.aux_tap is not None:
        return "an EAGLE-3 head reads inner layers' hidden states, which the native step keeps none of"
    if not model.config.family.traits.native_cpu_step:  # the family's file says whether the kernels implement it
        return f"{model.config.model_type}: its family's block is not the one kernels/gguf_decode.c implements"
    if any(k.dtype != torch.float32 or not k.is_contiguous() or not v.is_contiguous() for k, v in kv_caches):
        return "the KV cache is not float32"
    if type(model.model.norm) is not RMSNorm:
        return "its final norm is not RMSNorm"
    for layer in model.decoder_layers():
        attn = layer.self_attn
        if type(layer) is not DecoderLayer or not isinstance(layer.mlp, GatedMLP) or layer.mlp.act is not F.silu:
            return "a layer is not a plain SiLU-gated decoder layer"
        if type(layer.input_layernorm) is not RMSNorm or type(layer.post_attention_layernorm) is not RMSNorm:
            return "a layer's norms are not RMSNorm"
        if attn.attn.softcap or (attn.qk_norm and type(attn.q_norm) is not RMSNorm):
            return "a layer soft-caps its scores or has norms of another kind"
        linears = (attn.qkv_proj, attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)
        if any(lin.method.name == "lora" for lin in linears):
            return "LoRA adapters (the native step has no adapter matmuls)"
        if not all(isinstance(lin.method, GGUFLinearMethod) for lin in linears):
            return "a layer has linears outside GGUF blocks"
        if any(lin.bias is not None for lin in linears[1:]):
            return "a layer has a bias other than q/k/v's"
    methods = {
        lin.method.levels
        for layer in model.decoder_layers()
        for lin in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)
    }
    if len(methods) != 1:
        return "its layers mix activation kinds"
    return None


class NativeDecodeRunner(DecodeGraphRunner):
    """Decode steps of 1 to max(capture_sizes) rows through kernels/gguf_decode.c: nothing to compile
    or capture, and no padding (a step of n rows computes n rows)."""

    def __init__(
        self,
        model: Any,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        capture_sizes: list[int],
        max_pages_per_seq: int,
        page_size: int,
        device: torch.device,
        slot_dtype: torch.dtype = torch.int64,
        strict: bool = False,
    ) -> None:
        if slot_dtype != torch.int64:
            raise ValueError("the native decode step reads int64 slots")
        super().__init__(model, kv_caches, capture_sizes, max_pages_per_seq, page_size, device, slot_dtype)
        self.compiles_after_warmup = 0  # nothing compiles: the compiled runner's counter, for the same checks
        self.threads = torch.get_num_threads()
        self._keep: list[Any] = []  # every tensor and ctypes array the C structs point into
        self.activations = model.decoder_layers()[0].self_attn.qkv_proj.method.activations
        self.model_struct = self._describe(model, kv_caches, page_size)
        self.torch_head = None if self.model_struct.head.nparts else model.lm_head
        self.out_width = model.config.vocab_size if self.torch_head is None else model.config.hidden_size
        self._step = _library().gguf_decode_step
        self._step.restype = ctypes.c_int
        self._step.argtypes = [_P, ctypes.c_int, _P, _P, _P, _P, ctypes.c_int, _P, _P, _P, ctypes.c_int64, ctypes.c_int]
        scratch_fn = _library().gguf_decode_scratch
        scratch_fn.restype, scratch_fn.argtypes = ctypes.c_int64, [_P, ctypes.c_int, ctypes.c_int, ctypes.c_int]
        size = scratch_fn(
            ctypes.byref(self.model_struct), self.max_batch_size, max_pages_per_seq * page_size, self.threads
        )
        self.scratch = torch.empty(size, dtype=torch.uint8)

    def _linear(self, layer: Any) -> GGLinear:
        parts = gguf_tiles(layer)
        matrices = (GGMatrix * len(parts))(
            *(GGMatrix(t.data_ptr(), f.code, rows, layer.in_features, 0) for f, rows, t in parts)
        )
        self._keep.extend([matrices, *(t for _, _, t in parts)])
        bias = self._f32(layer.bias) if layer.bias is not None else None
        return GGLinear(matrices, bias, len(parts), layer.out_features)

    def _f32(self, tensor: torch.Tensor) -> int:
        """A float32 copy where the model holds another dtype (a bf16 model: its norms, bias, rotary table)."""
        tensor = tensor.detach().to(torch.float32).contiguous()
        self._keep.append(tensor)
        return tensor.data_ptr()

    def _describe(self, model: Any, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], page_size: int) -> GGModel:
        """The model as kernels/gguf_decode.c's gg_model: pointers into its tiles, norms, tables and caches."""
        config = model.config
        layers = model.decoder_layers()
        structs = (GGLayer * len(layers))()
        positions = min(layer.self_attn.rotary.cos_cache.shape[0] for layer in layers)  # the tables' rows
        for i, (layer, (k_cache, v_cache)) in enumerate(zip(layers, kv_caches)):
            attn, mlp = layer.self_attn, layer.mlp
            rotary = attn.rotary
            structs[i] = GGLayer(
                self._linear(attn.qkv_proj),
                self._linear(attn.o_proj),
                self._linear(mlp.gate_up_proj),
                self._linear(mlp.down_proj),
                self._f32(layer.input_layernorm.weight),
                self._f32(layer.post_attention_layernorm.weight),
                self._f32(attn.q_norm.weight) if attn.qk_norm else None,
                self._f32(attn.k_norm.weight) if attn.qk_norm else None,
                k_cache.data_ptr(),
                v_cache.data_ptr(),
                self._f32(rotary.cos_cache),
                self._f32(rotary.sin_cache),
                int(attn.attn.sliding_window or 0),
                0,
            )
        self._keep.append(structs)
        embed = model.model.embed_tokens
        embed_matrix = None
        if isinstance(embed, QuantizedEmbedding):
            embed_matrix = ctypes.pointer(
                GGMatrix(embed.gguf_tiles.data_ptr(), embed.fmt.code, embed.vocab, embed.dim, 0)
            )
            self._keep.extend([embed_matrix, embed.gguf_tiles])
        head = self._linear(model.lm_head) if isinstance(model.lm_head.method, GGUFLinearMethod) else GGLinear()
        attn0 = layers[0].self_attn
        if len({float(layer.self_attn.attn.scale) for layer in layers}) != 1:
            raise ValueError("layers with different attention scales")
        paths = code_paths()
        return GGModel(
            structs,
            head,
            embed_matrix,
            None if embed_matrix is not None else self._f32(embed.weight),
            self._f32(model.model.norm.weight),
            len(layers),
            config.hidden_size,
            attn0.num_heads,
            attn0.num_kv_heads,
            attn0.head_dim,
            layers[0].mlp.intermediate_size,
            config.vocab_size,
            positions,
            page_size,
            layers[0].self_attn.qkv_proj.method.levels,
            paths.float32,
            paths.int8,
            float(model.model.norm.eps),
            float(attn0.attn.scale),
        )

    def capture(self, sizes: list[int] | None = None) -> None:
        """Nothing to compile: one step of the largest size (of `sizes` when given) over the dummy rows (slot 0,
        page 0) pages the weights and the scratch in before the first request."""
        self.report = CaptureReport("native GGUF decode step (no graphs: one warm step)")
        paths = code_paths()
        kernels = PATH_NAMES[paths.float32 if self.activations == "float32" else paths.int8]
        for size in capture_loop(
            self.report,
            [max(sizes) if sizes else self.max_batch_size],
            extra=lambda: f"{self.activations} activations, {kernels} kernels",
        ):
            self._capture_size(size)

    def _capture_size(self, bs: int) -> None:
        self.hooks.prepare_for_capture(self.buffers, bs)
        self._replay(bs)

    def run_decode(self, message: DecodeMessage, state: DecodeBatchState) -> tuple[torch.Tensor, torch.Tensor]:
        """The contract of graphs/step_runner.py, without padding: the hooks fill the first n rows only."""
        n = message.batch_size
        rows = self.hooks.prepare_for_replay(self.buffers, message, state, n)
        return self._replay(n), rows

    def _replay(self, bs: int) -> torch.Tensor:
        buffers = self.buffers
        self.hooks.before_replay(buffers, bs, None)
        out = torch.empty(bs, self.out_width, dtype=torch.float32)
        status = self._step(
            ctypes.byref(self.model_struct),
            bs,
            buffers.input_ids.data_ptr(),
            buffers.positions.data_ptr(),
            buffers.slot_indices.data_ptr(),
            buffers.page_table.data_ptr(),
            buffers.page_table.shape[1],
            buffers.seq_lens.data_ptr(),
            out.data_ptr(),
            self.scratch.data_ptr(),
            self.scratch.nbytes,
            self.threads,
        )
        if status != 0:
            raise ValueError(
                f"native GGUF decode step refused its inputs (batch {bs}): a token, position or slot out of range"
            )
        if self.torch_head is not None:  # a head outside GGUF blocks: in the model's dtype, as compute_logits runs it
            return self.torch_head(out.to(self.torch_head.weight.dtype)).float()
        return out


class CpuDecodeRunner:
    """The CPU platform's decode runner: NativeDecodeRunner for a Llama-family model in GGUF blocks
    (ENGINE_CPU_NATIVE_KERNELS=0 or anything native_step_unsupported names: the compiled graphs)."""

    def __new__(cls, model: Any, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], *args: Any, **kwargs: Any) -> Any:
        from graphs.compiled_runner import CompiledDecodeRunner

        why = native_step_unsupported(model, kv_caches)
        if why is None:
            logger.info("decode steps: one native call per step (kernels/gguf_decode.c)")
            return NativeDecodeRunner(model, kv_caches, *args, **kwargs)
        if any(isinstance(getattr(m, "method", None), GGUFLinearMethod) for m in model.modules()):
            logger.info("decode steps: compiled graphs (the native GGUF step does not apply: %s)", why)
        return CompiledDecodeRunner(model, kv_caches, *args, **kwargs)
