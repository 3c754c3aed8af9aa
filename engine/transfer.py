"""Host <-> device copies that never make the host wait for the device.

Overlap scheduling prepares step N+1 while the device still runs step N, so
nothing on that path may synchronize. Two things in plain PyTorch do:
`torch.tensor(values, device="cuda")` (a blocking copy: the host waits until
every queued kernel has run) and `.tolist()` / `.item()` of a device tensor.
Here host values go through pinned memory with a non-blocking copy (the
caching host allocator keeps the pinned block alive until its copy has run),
and device results come back through a pinned copy plus an event that is
waited on only when the values are needed.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch


def _pins(device: torch.device) -> bool:
    return device.type == "cuda"  # HIP builds report "cuda" too; pinned memory is a CUDA-runtime feature


def host_tensor(values: Sequence[Any] | torch.Tensor, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A CPU tensor of values, in pinned memory when it is going to a CUDA device."""
    tensor = values if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=dtype)
    return tensor.pin_memory() if _pins(device) else tensor


def to_device(values: Sequence[Any] | torch.Tensor, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """values on `device` without waiting for the device's queued work."""
    tensor = host_tensor(values, dtype, device)
    if device.type == "cpu":
        return tensor
    return tensor.to(device, non_blocking=True)


class HostCopy:
    """Device tensors copied to the host in the background; `get()` waits for that copy alone."""

    def __init__(self, tensors: Sequence[torch.Tensor]) -> None:
        self._event = None
        if tensors and tensors[0].device.type == "cuda":
            self._tensors = [t.to("cpu", non_blocking=True) for t in tensors]  # lands in pinned memory
            self._event = torch.cuda.Event()
            self._event.record()
        else:
            # CPU tensors are final already; other devices copy here (their runners are synchronous).
            self._tensors = [t.cpu() for t in tensors]

    def ready(self) -> bool:
        return self._event is None or self._event.query()

    def get(self) -> list[torch.Tensor]:
        if self._event is not None:
            self._event.synchronize()
            self._event = None
        return self._tensors
