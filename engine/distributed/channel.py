"""Rank 0's messages to the other ranks: each step's description, consistency checks, stop.

Pickled host objects over one pipe per worker (the pipes the launcher made
when it spawned them), as nano-vllm uses shared memory: local, a few
microseconds a message, no timeout while the engine idles (a gloo broadcast
would time out under a worker that waits longer than the collective timeout
for the next request), and a write to a worker that died fails at once. The
engine only sees `publish` on rank 0 and `receive` on the others, so a
transport between hosts (multi-node, torchrun) can replace it.
"""

from __future__ import annotations

import enum
import pickle
from collections.abc import Sequence
from multiprocessing.connection import Connection
from typing import Any


class Command(enum.IntEnum):
    STEP = 1  # a WireStep: run its forward (and take its sampled tokens)
    CHECK = 2  # join the cross-rank consistency check of the decode state
    STOP = 3  # leave the loop and the group
    LORA = 4  # a LoRA SlotChange (engine/lora/manager.py): hold rank 0's adapter slots


class RankGoneError(RuntimeError):
    """A message could not reach a rank (its pipe is closed: the process is gone)."""

    def __init__(self, rank: int, error: BaseException) -> None:
        super().__init__(f"rank {rank} is unreachable: {type(error).__name__}: {error}")
        self.rank = rank


class StepChannel:
    """Rank 0's end: conns[i] reaches rank i + 1."""

    def __init__(self, conns: Sequence[Connection]) -> None:
        self.conns = list(conns)

    def publish(self, command: Command, payload: Any = None) -> None:
        data = pickle.dumps((int(command), payload), protocol=pickle.HIGHEST_PROTOCOL)
        for rank, conn in enumerate(self.conns, start=1):
            try:
                conn.send_bytes(data)
            except (OSError, EOFError) as exc:  # BrokenPipeError: the worker is gone
                raise RankGoneError(rank, exc) from exc


class StepReceiver:
    """A worker's end."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn

    def receive(self) -> tuple[Command, Any]:
        """The next (command, payload); EOFError once rank 0 is gone."""
        command, payload = pickle.loads(self.conn.recv_bytes())
        return Command(command), payload
