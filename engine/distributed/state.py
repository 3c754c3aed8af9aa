"""Which tensor-parallel rank this process is, and the process groups it talks over.

One value per process, set once when the process joins its group (rank 0 in
the engine's own process, ranks > 0 in the workers it spawns) and read by the
layers as they are built (how many heads, which rows of a weight) and by the
collectives as they run. With no group it says rank 0 of 1: every layer is then
built exactly as without tensor parallelism, and no collective is ever called.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class TensorParallelState:
    rank: int
    world_size: int
    # Tensor collectives inside the model (all-reduce, all-gather, the sampled tokens): the
    # platform's backend (NCCL on CUDA, gloo on CPU).
    device_group: Any = None
    # Host-side messages (the step description, start-up and consistency checks): always gloo, and a
    # group of its own, so a message can never be taken for a tensor collective still in flight.
    control_group: Any = None
    timeout_s: float = 0.0  # how long a collective waits for the other ranks before it fails

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def is_driver(self) -> bool:
        """Rank 0: owns the scheduler, the tokenizer and the server; sends each step to the others."""
        return self.rank == 0


SINGLE = TensorParallelState(rank=0, world_size=1)
_state: TensorParallelState = SINGLE


def tp_state() -> TensorParallelState:
    return _state


def tp_rank() -> int:
    return _state.rank


def tp_world_size() -> int:
    return _state.world_size


def set_tp_state(state: TensorParallelState) -> None:
    global _state
    _state = state


def reset_tp_state() -> None:
    """Back to rank 0 of 1 (after the group is torn down)."""
    set_tp_state(SINGLE)


@contextmanager
def building_for(state: TensorParallelState) -> Iterator[None]:
    """Layers built inside read `state` (an engine at world size 1 built in a process whose tensor-parallel
    engine is still running gets whole layers); the process's own state is back afterwards."""
    global _state
    previous, _state = _state, state
    try:
        yield
    finally:
        _state = previous
