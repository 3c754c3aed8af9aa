"""Per-parameter weight loading: each parameter knows how to take its checkpoint tensor(s).

As in vLLM and nano-vllm, a parameter carries a `weight_loader(param, tensor,
shard)` that copies one checkpoint tensor into it: the whole parameter
(`shard` None), or one part of a fused parameter (q, k or v of `qkv_proj`;
gate or up of `gate_up_proj`; one expert's projection of a stacked expert
weight). A model's loader then only maps checkpoint names to (parameter, shard).

With tensor parallelism a parameter holds only its rank's slice, and its
loader narrows the checkpoint tensor to that slice (`column_parallel_loader`,
`row_parallel_loader`, the vocabulary's and the experts' own). Those loaders
take the checkpoint tensor unread (`LazyTensor`: a safetensors slice) and read
only their rows or columns, so no rank ever holds a whole weight it does not
keep; every other loader gets the tensor read in full, as before.

Each parameter also declares the parts it is filled from (`fill_keys`), so
a checkpoint that leaves one out is caught: `FillTracker` names the
parameter and the part nobody filled, and a checkpoint tensor with no home
is refused with both names.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import nn

from engine.errors import ModelLoadError

if TYPE_CHECKING:
    from engine.distributed.sharding import Shard, VocabShard

# (param, checkpoint tensor, shard or None) -> the fill keys it filled
WeightLoader = Callable[[nn.Parameter, torch.Tensor, Any], list[Hashable]]
WHOLE: tuple[Hashable, ...] = ("",)  # the one fill key of a parameter that is not fused


def copy_checked(dest: torch.Tensor, tensor: torch.Tensor, what: str) -> None:
    """dest <- tensor, or a ModelLoadError naming `what` and both shapes."""
    if tuple(dest.shape) != tuple(tensor.shape):
        raise ModelLoadError(
            f"shape mismatch for {what}: checkpoint {tuple(tensor.shape)} vs model {tuple(dest.shape)}"
        )
    if (dest.dtype == torch.float8_e4m3fn) != (tensor.dtype == torch.float8_e4m3fn):
        # An FP8 weight must come as FP8 (its scale beside it), and a dense one must not: a silent
        # cast would drop the scale.
        raise ModelLoadError(f"dtype mismatch for {what}: checkpoint {tensor.dtype} vs model {dest.dtype}")
    dest.copy_(tensor)


def default_weight_loader(param: nn.Parameter, tensor: torch.Tensor, shard: Any = None) -> list[Hashable]:
    """The whole parameter from one tensor of its shape."""
    if shard is not None:
        raise ModelLoadError(f"parameter of shape {tuple(param.shape)} is not fused, but was given shard {shard!r}")
    copy_checked(param.data, tensor, f"a parameter of shape {tuple(param.shape)}")
    return list(fill_keys(param))


def row_shard_loader(shard_rows: dict[Hashable, tuple[int, int]]) -> WeightLoader:
    """A parameter fused along its rows from parts (shard -> [start, end) rows); shard None: all at once
    (a checkpoint that stores the fused tensor, as Phi-3 does)."""

    def load(param: nn.Parameter, tensor: torch.Tensor, shard: Any = None) -> list[Hashable]:
        if shard is None:
            copy_checked(param.data, tensor, f"fused parameter of shape {tuple(param.shape)}")
            return list(shard_rows)
        if shard not in shard_rows:
            raise ModelLoadError(f"fused parameter has parts {list(shard_rows)}, not {shard!r}")
        start, end = shard_rows[shard]
        copy_checked(param.data[start:end], tensor, f"part {shard!r} (rows {start}-{end}) of a fused parameter")
        return [shard]

    return load


def scale_loader(shard_rows: dict[Hashable, tuple[int, int]], out_features: int, block: int) -> WeightLoader:
    """An FP8 weight's scale, filled per part of a fused Linear (shard_rows; empty for a plain one).
    The parameter holds one scale per output row ([out]), or one per block x block tile ([out / block,
    in / block]). A checkpoint's per-tensor scale (a scalar) covers its part's rows; a per-channel
    scale ([rows] or [rows, 1]) is copied; a block scale takes its part's block rows, which must
    then start and end on a block edge."""

    def load(param: nn.Parameter, tensor: torch.Tensor, shard: Any = None) -> list[Hashable]:
        if shard is None:
            start, end, keys = 0, out_features, list(shard_rows) or list(WHOLE)
        elif shard in shard_rows:
            (start, end), keys = shard_rows[shard], [shard]
        else:
            raise ModelLoadError(f"fused parameter has parts {list(shard_rows)}, not {shard!r}")
        what = f"the scale of rows {start}-{end}"
        if param.dim() == 2:  # block scales
            if start % block or (end % block and end != out_features):
                raise ModelLoadError(f"{what} do not start and end on {block}-row blocks, as block-wise FP8 needs")
            copy_checked(param.data[start // block : -(-end // block)], tensor.float(), what)
        elif tensor.numel() == 1:
            param.data[start:end] = tensor.float().reshape(())
        else:
            copy_checked(param.data[start:end], tensor.float().reshape(-1), what)
        return keys

    return load


class LazyTensor(Protocol):
    """A checkpoint tensor not read yet (engine/loader/weights.py: a safetensors slice)."""

    shape: tuple[int, ...]

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        """Only these rows (dim 0) or columns (dim 1), read from the file."""

    def read(self) -> torch.Tensor:
        """The whole tensor."""


# What a checkpoint's weight iterators yield: a tensor, or (tensor parallelism) one not read yet.
CheckpointTensor = torch.Tensor | LazyTensor
# A WeightLoader for a parameter set to read lazily (set_weight_loader's reads_lazily): the tensor may come unread.
LazyWeightLoader = Callable[[nn.Parameter, CheckpointTensor, Any], list[Hashable]]


def column_parallel_loader(
    part_rows: dict[Hashable, tuple[int, int]], shards: dict[Hashable, Shard]
) -> LazyWeightLoader:
    """A column-parallel weight or bias (output rows split): part -> its rows here and this rank's piece of
    the checkpoint's part (a plain Linear: the one part ""). A checkpoint storing the parts fused (Phi-3,
    shard None) is cut into them first, in order."""

    def load(param: nn.Parameter, tensor: CheckpointTensor, shard: Any = None) -> list[Hashable]:
        if shard is None and list(part_rows) != [""]:
            offset = 0
            for key, (start, end) in part_rows.items():
                piece = shards[key]
                copy_checked(
                    param.data[start:end],
                    tensor.narrow(0, offset + piece.start, piece.size),
                    f"rank's rows of part {key!r} of a fused parameter",
                )
                offset += piece.total
            if offset != tensor.shape[0]:
                raise ModelLoadError(
                    f"fused checkpoint tensor has {tensor.shape[0]} rows; its parts add up to {offset}"
                )
            return list(part_rows)
        key = "" if shard is None else shard
        if key not in part_rows:
            raise ModelLoadError(f"fused parameter has parts {list(part_rows)}, not {shard!r}")
        (start, end), piece = part_rows[key], shards[key]
        if tensor.shape[0] != piece.total:
            raise ModelLoadError(
                f"shape mismatch for part {key!r}: checkpoint has {tensor.shape[0]} rows, the model "
                f"{piece.total} (split {piece.count} ways)"
            )
        copy_checked(
            param.data[start:end],
            tensor.narrow(0, piece.start, piece.size),
            f"rows {piece.start}-{piece.start + piece.size} of part {key!r}",
        )
        return [key]

    return load


def row_parallel_loader(piece: Shard) -> LazyWeightLoader:
    """A row-parallel weight (input columns split): this rank's columns of the checkpoint's [out, in]."""

    def load(param: nn.Parameter, tensor: CheckpointTensor, shard: Any = None) -> list[Hashable]:
        if shard is not None:
            raise ModelLoadError(f"row-parallel parameter is not fused, but was given shard {shard!r}")
        if len(tensor.shape) != 2 or tensor.shape[1] != piece.total:
            raise ModelLoadError(
                f"shape mismatch: checkpoint {tuple(tensor.shape)}, the model [{param.shape[0]}, "
                f"{piece.total}] split {piece.count} ways along its columns"
            )
        copy_checked(
            param.data, tensor.narrow(1, piece.start, piece.size), f"columns {piece.start}-{piece.start + piece.size}"
        )
        return list(WHOLE)

    return load


def first_rank_bias_loader(rank: int) -> LazyWeightLoader:
    """A row-parallel layer's bias: every rank adds its bias before the sum over ranks, so only rank 0
    holds it (the others hold zeros) and the sum adds it once."""

    def load(param: nn.Parameter, tensor: CheckpointTensor, shard: Any = None) -> list[Hashable]:
        full = tensor if isinstance(tensor, torch.Tensor) else tensor.read()
        if rank == 0:
            copy_checked(param.data, full, f"a bias of shape {tuple(param.shape)}")
        else:
            copy_checked(param.data, torch.zeros_like(full), f"a bias of shape {tuple(param.shape)}")
        return list(WHOLE)

    return load


def vocab_parallel_loader(piece: VocabShard) -> LazyWeightLoader:
    """An embedding or LM head split by vocabulary: this rank's rows; the padding rows past the real
    vocabulary (the last rank's) are zero."""

    def load(param: nn.Parameter, tensor: CheckpointTensor, shard: Any = None) -> list[Hashable]:
        if shard is not None:
            raise ModelLoadError(f"vocabulary-parallel parameter is not fused, but was given shard {shard!r}")
        if tensor.shape[0] < piece.end:
            raise ModelLoadError(
                f"shape mismatch: checkpoint has {tensor.shape[0]} vocabulary rows, the model {piece.end} or more"
            )
        copy_checked(
            param.data[: piece.size],
            tensor.narrow(0, piece.start, piece.size),
            f"vocabulary rows {piece.start}-{piece.end}",
        )
        param.data[piece.size :].zero_()
        return list(WHOLE)

    return load


def set_weight_loader(
    param: torch.Tensor, loader: WeightLoader, keys: Iterable[Hashable] = WHOLE, reads_lazily: bool = False
) -> None:
    """param: a parameter (nn.Linear's stubs declare its weight a Tensor). reads_lazily: the loader is a
    LazyWeightLoader, which takes a LazyTensor and reads only its slice (tensor-parallel loaders)."""
    # Plain attributes on the parameter object, which torch's stubs do not declare.
    param.weight_loader = loader  # type: ignore[attr-defined]
    param.fill_keys = tuple(keys)  # type: ignore[attr-defined]
    param.reads_lazily = reads_lazily  # type: ignore[attr-defined]


def attach_weight_loaders(model: nn.Module) -> None:
    """Give every parameter its loader. Loaders live on parameter objects, and moving a model off the
    meta device (`to_empty`) makes new ones: modules keep what they need to attach them again."""
    for module in model.modules():
        attach = getattr(module, "attach_weight_loaders", None)
        if attach is not None:
            attach()


def weight_loader(param: nn.Parameter) -> WeightLoader:
    return getattr(param, "weight_loader", default_weight_loader)


def lazy_weight_loader(param: nn.Parameter) -> LazyWeightLoader:
    """The loader of a parameter set to read lazily (set_weight_loader's reads_lazily)."""
    loader: LazyWeightLoader = getattr(param, "weight_loader")  # noqa: B009 (torch's stubs do not declare it)
    return loader


def fill_keys(param: nn.Parameter) -> tuple[Hashable, ...]:
    return getattr(param, "fill_keys", WHOLE)


class FillTracker:
    """Which parts of which parameters a checkpoint has filled; `check()` names what it left out."""

    def __init__(self, params: dict[str, nn.Parameter], skip: Iterable[str] = ()) -> None:
        skipped = set(skip)
        self.expected = {name: set(fill_keys(p)) for name, p in params.items() if name not in skipped}
        self.filled: dict[str, set[Hashable]] = {name: set() for name in self.expected}

    def record(self, name: str, keys: Iterable[Hashable]) -> None:
        self.filled.setdefault(name, set()).update(keys)

    def check(self) -> None:
        missing = [
            (name, sorted(map(str, keys - self.filled[name])))
            for name, keys in self.expected.items()
            if keys - self.filled[name]
        ]
        if not missing:
            return
        examples = ", ".join(
            name if parts == [""] else f"{name} (parts {', '.join(parts[:4])})" for name, parts in missing[:3]
        )
        raise ModelLoadError(
            f"checkpoint is missing tensors for {len(missing)} parameters (left unfilled), e.g. {examples}"
        )


def load_checkpoint(
    params: dict[str, nn.Parameter],
    weights: Iterable[tuple[str, CheckpointTensor]],
    route: Callable[[str], tuple[str, Any] | None],
    skip: Iterable[str] = (),
) -> None:
    """Every checkpoint tensor through its parameter's weight_loader; route(name) -> (parameter name,
    shard), or None for a tensor the model has no use for by design (rotary inv_freq, a tied head)."""
    tracker = FillTracker(params, skip)
    for name, tensor in weights:
        target = route(name)
        if target is None:
            continue
        param_name, shard = target
        param = params.get(param_name)
        if param is None:
            raise ModelLoadError(f"checkpoint tensor {name!r} has no home: the model has no parameter {param_name!r}")
        if not isinstance(tensor, torch.Tensor) and not getattr(param, "reads_lazily", False):
            tensor = tensor.read()
        try:
            if isinstance(tensor, torch.Tensor):
                keys = weight_loader(param)(param, tensor, shard)
            else:  # still unread: the parameter reads lazily
                keys = lazy_weight_loader(param)(param, tensor, shard)
        except ModelLoadError as exc:
            raise ModelLoadError(f"checkpoint tensor {name!r} -> {param_name}: {exc}") from exc
        tracker.record(param_name, keys)
    tracker.check()
