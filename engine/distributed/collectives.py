"""The collectives of a tensor-parallel model step, as opaque torch ops, and the host-side ones.

`engine::tp_all_reduce` (sum over ranks: after a row-parallel linear, the
vocab-parallel embedding, the MoE experts) and `engine::tp_all_gather`
(concatenated along the last dimension: the LM head's vocabulary shards) are
registered through engine/layers/ops.py like attention: a compiled CPU step
calls them from inside its graph and a CUDA graph captures the NCCL kernel
they launch, where a bare `dist.all_reduce` call would break dynamo's graph.
Their fake implementations give the shapes for tracing. They are functional
(a new tensor out, the input untouched), which is what lets inductor keep them
in a graph without reasoning about mutation; the copy this costs is one
activation-sized tensor, small next to the matmul before it.

They are only ever called at world size > 1: the layers that call them are
built only then (engine/layers/linear.py, engine/layers/vocab_parallel.py).
"""

from __future__ import annotations

import torch

from engine.distributed.state import tp_state
from engine.layers.ops import define_op


def _all_reduce(x: torch.Tensor) -> torch.Tensor:
    import torch.distributed as dist

    out = x.clone(memory_format=torch.contiguous_format)
    dist.all_reduce(out, group=tp_state().device_group)
    return out


def _all_reduce_fake(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _all_gather(x: torch.Tensor) -> torch.Tensor:
    import torch.distributed as dist

    state = tp_state()
    x = x.contiguous()
    # The list form: the same call on torch 2.11 to 2.13 and on gloo and NCCL alike.
    parts = [torch.empty_like(x) for _ in range(state.world_size)]
    dist.all_gather(parts, x, group=state.device_group)
    return torch.cat(parts, dim=-1)


def _all_gather_fake(x: torch.Tensor) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], x.shape[-1] * tp_state().world_size))


define_op("tp_all_reduce", "(Tensor x) -> Tensor", _all_reduce, _all_reduce_fake)
define_op("tp_all_gather", "(Tensor x) -> Tensor", _all_gather, _all_gather_fake)


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """The sum of x over the tensor-parallel ranks (every rank gets it)."""
    total: torch.Tensor = torch.ops.engine.tp_all_reduce(x)
    return total


def all_gather_last_dim(x: torch.Tensor) -> torch.Tensor:
    """Every rank's x side by side along the last dimension, in rank order."""
    gathered: torch.Tensor = torch.ops.engine.tp_all_gather(x)
    return gathered


def min_over_ranks(value: int) -> int:
    """The smallest of every rank's value (the KV pool is sized from the rank with least free memory)."""
    import torch.distributed as dist

    tensor = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(tensor, op=dist.ReduceOp.MIN, group=tp_state().control_group)
    return int(tensor.item())


TOKENS_OK = 0
TOKENS_FAILED = 1  # rank 0's sampling raised: the others keep their last tokens; the step is re-run in parts


def broadcast_sampled(tokens: torch.Tensor | None, count: int, device: torch.device) -> torch.Tensor:
    """Rank 0's sampled token ids to every rank over the device group: [count] tokens, then a status
    word (TOKENS_OK, or TOKENS_FAILED when rank 0 passes None because its sampling raised). Rank 0
    passes its tokens, the others None. Nothing here waits for the device: the status is made by a
    fill on the device, and the receivers apply it there (`received_tokens`)."""
    import torch.distributed as dist

    state = tp_state()
    if state.is_driver:
        status = torch.full((1,), TOKENS_OK if tokens is not None else TOKENS_FAILED, dtype=torch.int64, device=device)
        body = tokens.to(torch.int64) if tokens is not None else torch.zeros(count, dtype=torch.int64, device=device)
        message = torch.cat([body, status])
    else:
        message = torch.empty(count + 1, dtype=torch.int64, device=device)
    dist.broadcast(message, src=0, group=state.device_group)
    return message


def received_tokens(message: torch.Tensor, previous: torch.Tensor) -> torch.Tensor:
    """The tokens of a broadcast_sampled message, or `previous` (the rows' last tokens) where rank 0's
    sampling failed, chosen on the device."""
    count = message.shape[0] - 1
    return torch.where(message[count:] == TOKENS_OK, message[:count], previous)
