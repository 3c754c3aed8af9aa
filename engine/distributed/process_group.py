"""Joining and leaving the tensor-parallel process group (torch.distributed), with a timeout.

Rank 0 creates the rendezvous store on a free port before it spawns the
workers (no port is guessed, so two engines on one machine never collide) and
hands them its address; every rank then joins two groups: the platform's
backend for tensor collectives and a gloo group for host messages. Each
collective waits at most `timeout_s` for the other ranks, so a rank that hangs
ends in an error rather than a hang.
"""

from __future__ import annotations

import logging
import os
from datetime import timedelta
from typing import Any

import torch

from engine.distributed.state import TensorParallelState, reset_tp_state, set_tp_state, tp_state

logger = logging.getLogger(__name__)

STORE_HOST = "127.0.0.1"  # the engine spawns its ranks on this host (multi-node: torchrun's env://, later)


def create_store(world_size: int, timeout_s: float) -> Any:
    """Rank 0's rendezvous store on a port the OS picks (`store.port` for the workers)."""
    import torch.distributed as dist

    return dist.TCPStore(
        STORE_HOST, 0, world_size, is_master=True, timeout=timedelta(seconds=timeout_s), wait_for_workers=False
    )


def init_tensor_parallel(
    rank: int,
    world_size: int,
    backend: str,
    timeout_s: float,
    store: Any = None,
    store_port: int | None = None,
    device: torch.device | None = None,
) -> TensorParallelState:
    """Join the group as `rank` (rank 0 passes its store, the workers its port) and make it this
    process's tensor-parallel state. A first all-reduce on each group proves every rank is there and
    sets up the communicators before anything is captured."""
    import torch.distributed as dist

    if backend == "nccl":
        # NVLink SHARP (multicast) stays off: the 2xH200 machine this targets does not allow it.
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    timeout = timedelta(seconds=timeout_s)
    if store is None:
        if store_port is None:
            raise ValueError("a worker rank needs the rendezvous store's port")
        store = dist.TCPStore(STORE_HOST, store_port, world_size, is_master=False, timeout=timeout)
    options: dict[str, Any] = {}
    if device is not None and device.type != "cpu":
        if device.index is None:  # rank 0 passes the platform's device: the current one
            device = torch.device(device.type, getattr(torch, device.type).current_device())
        options["device_id"] = device  # NCCL/HCCL communicators bound to this rank's device from the start
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout, **options)
    control = dist.new_group(backend="gloo", timeout=timeout)  # a second group even when the first is gloo
    state = TensorParallelState(rank, world_size, dist.group.WORLD, control, timeout_s)
    set_tp_state(state)
    probe = torch.ones(1, device=device if device is not None else torch.device("cpu"))
    dist.all_reduce(probe, group=state.device_group)
    control_probe = torch.ones(1)
    dist.all_reduce(control_probe, group=control)
    if int(probe.item()) != world_size or int(control_probe.item()) != world_size:
        raise RuntimeError(f"tensor-parallel rank {rank}: the first all-reduce gave {probe.item()}, not {world_size}")
    logger.info(
        "tensor-parallel rank %d of %d joined (%s + gloo, %.0f s collective timeout)",
        rank,
        world_size,
        backend,
        timeout_s,
    )
    return state


def destroy_tensor_parallel() -> None:
    """Leave the group (a no-op when this process is in none)."""
    import torch.distributed as dist

    if tp_state().enabled and dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:
            logger.debug("destroy_process_group failed", exc_info=True)
    reset_tp_state()
