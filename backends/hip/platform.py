"""ROCm platform: the CUDA-graph path on a HIP build of torch, with its own capture sizes.

Not yet run on AMD hardware. On ROCm, torch exposes HIP devices through the
torch.cuda namespace and `torch.version.hip` is set; graphs are HIP graphs.
"""

from __future__ import annotations

import torch

from backends.cuda.platform import CudaPlatform


class HipPlatform(CudaPlatform):
    name = "rocm"  # configs/rocm.yaml
    device_type = "cuda"  # HIP devices are torch "cuda" devices
    replica_share = None  # data-parallel replicas never ran on a ROCm machine: refused, not guessed
    visible_devices_env = "HIP_VISIBLE_DEVICES"
    dist_backend = "nccl"  # RCCL behind torch's nccl backend name
    one_row_gemv = False  # measured against cuBLAS on the H200 only; rocBLAS stays until measured on AMD

    def is_available(self) -> bool:
        return torch.version.hip is not None and torch.cuda.is_available()

    def unavailable_reason(self) -> str:
        if torch.version.hip is None:
            return f"device 'rocm' is not available: this torch build ({torch.__version__}) is not a ROCm build"
        return "device 'rocm' is not available: no AMD GPU visible"

    def fp8_linear_method(self):
        """None: MI300 computes in e4m3fnuz, not the e4m3fn of FP8 checkpoints, and the CUDA FP8 method has
        never run on ROCm; FP8 weights are dequantized once at load."""
        return None
