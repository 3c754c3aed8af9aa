"""Huawei Ascend (NPU) backend. Untested on Ascend hardware; see docs/npu.md.

Importing this package never imports torch_npu: it is loaded lazily inside
NpuPlatform / NpuDecodeGraphRunner methods.
"""

from backends.npu.platform import NpuPlatform

__all__ = ["NpuPlatform"]
