"""What this CPU can run: one place that every CPU-specific path (and its tests) asks.

Machines differ from one session to the next (one has AVX512-BF16, the next
no AVX512 at all), so nothing may assume an instruction set. Flags come from
torch's own CPU probe (cpuinfo, the same library oneDNN's dispatch trusts),
with /proc/cpuinfo as a fallback. `ENGINE_CPU_HIDE_FEATURES` (comma-separated
flag names, or `all`) makes this module report those features as absent, so
the fallback paths can be exercised on a CPU that has the fast ones.
"""

from __future__ import annotations

import os
import platform
from dataclasses import dataclass
from functools import cache

import torch

HIDE_ENV = "ENGINE_CPU_HIDE_FEATURES"

# The x86 features the CPU paths care about, in torch's spelling (torch._C._cpu._get_cpu_capability).
KNOWN_FLAGS = (
    "avx2",
    "fma3",
    "f16c",
    "avx512_f",
    "avx512_bw",
    "avx512_vl",
    "avx512_dq",
    "avx512_vnni",
    "avx512_bf16",
    "avx_ne_convert",
    "amx_tile",
    "amx_bf16",
)
# /proc/cpuinfo spells some of them differently.
_PROC_NAMES = {
    "fma": "fma3",
    "avx512f": "avx512_f",
    "avx512bw": "avx512_bw",
    "avx512vl": "avx512_vl",
    "avx512dq": "avx512_dq",
    "avx512vnni": "avx512_vnni",
    "avx_vnni": "avx_vnni",
}


@dataclass(frozen=True)
class CpuFeatures:
    arch: str
    flags: frozenset[str]
    hidden: frozenset[str]

    def has(self, *names: str) -> bool:
        return all(name in self.flags for name in names)

    @property
    def avx512(self) -> bool:
        return self.has("avx512_f", "avx512_bw", "avx512_vl", "avx512_dq")

    @property
    def native_bf16(self) -> bool:
        """bf16 dot products in hardware (AVX512-BF16 or AMX), not emulated through float32."""
        return self.has("avx512_bf16") or self.has("amx_bf16")

    @property
    def isa(self) -> str:
        """The widest vector ISA, as a name for logs."""
        if self.arch not in ("x86_64", "AMD64", "i686"):
            return self.arch
        if self.has("amx_bf16"):
            return "AMX-BF16"
        if self.avx512 and self.has("avx512_bf16"):
            return "AVX512-BF16"
        if self.avx512:
            return "AVX512"
        if self.has("avx2"):
            return "AVX2"
        return "SSE"

    def describe(self) -> str:
        relevant = sorted(self.hidden & set(KNOWN_FLAGS))
        hidden = f" (hidden by {HIDE_ENV}: {','.join(relevant)})" if relevant else ""
        return f"{self.isa}{hidden}"


def _torch_flags() -> set[str]:
    try:
        capability = torch._C._cpu._get_cpu_capability()
    except (AttributeError, RuntimeError):
        return set()
    return {name for name, value in capability.items() if value is True}


def _proc_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as handle:
            for line in handle:
                if line.startswith(("flags", "Features")):
                    words = line.split(":", 1)[1].split()
                    return {_PROC_NAMES.get(word, word) for word in words}
    except OSError:
        pass
    return set()


def _hidden_flags(available: set[str]) -> frozenset[str]:
    raw = os.environ.get(HIDE_ENV, "").strip().lower()
    if not raw:
        return frozenset()
    if raw == "all":
        return frozenset(available)
    return frozenset(name.strip() for name in raw.split(",") if name.strip())


@cache
def cpu_features() -> CpuFeatures:
    """This CPU's flags (cached: the CPU does not change under a running process)."""
    flags = _torch_flags() or _proc_flags()
    hidden = _hidden_flags(flags)
    return CpuFeatures(platform.machine(), frozenset(flags - hidden), hidden & frozenset(flags))


def onednn_bf16_supported() -> bool:
    """oneDNN's bf16 linear (and its weight reorder) runs here.

    torch's reorder refuses without "avx_ne_convert or avx512bw, avx512vl and
    avx512dq"; torch's own check (_is_mkldnn_bf16_supported) is asked too.
    """
    features = cpu_features()
    if not torch.backends.mkldnn.is_available() or not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return False
    return features.has("avx_ne_convert") or features.has("avx512_bw", "avx512_vl", "avx512_dq")


def onednn_linear_supported(dtype: torch.dtype) -> bool:
    """oneDNN-packed linears for this dtype: float32 wherever oneDNN exists, bf16 as above."""
    if not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.bfloat16:
        return onednn_bf16_supported()
    return dtype == torch.float32


def native_gemv_bf16_supported() -> bool:
    """kernels/gemv_bf16.c is written with AVX512-BF16 intrinsics (vdpbf16ps)."""
    return cpu_features().avx512 and cpu_features().has("avx512_bf16")
