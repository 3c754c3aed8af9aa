"""Platform backends, one folder each; `get_platform(name)` picks one."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from engine.platform import DeviceUnavailableError, Platform

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

# device flag -> (module, class). rocm lives in backends/hip.
_PLATFORMS: dict[str, tuple[str, str]] = {
    "cpu": ("backends.cpu.platform", "CpuPlatform"),
    "cuda": ("backends.cuda.platform", "CudaPlatform"),
    "rocm": ("backends.hip.platform", "HipPlatform"),
    "hpu": ("backends.hpu.platform", "HpuPlatform"),
    "npu": ("backends.npu.platform", "NpuPlatform"),
    "xla": ("backends.xla.platform", "XlaPlatform"),
}
DEVICE_NAMES = (*tuple(_PLATFORMS), "auto")
# A device YAML's own section -> (module, the dataclass that declares its keys); light modules, so that the
# command line can make their flags on any machine.
_SECTIONS: dict[str, tuple[str, str]] = {
    "hpu": ("backends.hpu.settings", "HpuSettings"),
}
# Preference of `--device auto`: the first available wins.
_AUTO_ORDER = ("cuda", "rocm", "hpu", "npu", "cpu")


def platform_class(name: str) -> type[Platform]:
    if name not in _PLATFORMS:
        raise DeviceUnavailableError(f"unknown device {name!r}; choose one of {', '.join(DEVICE_NAMES)}")
    module_name, class_name = _PLATFORMS[name]
    return getattr(importlib.import_module(module_name), class_name)


def get_platform(name: str = "auto") -> Platform:
    """The Platform for a device flag; raises DeviceUnavailableError when absent."""
    if name == "auto":
        for candidate in _AUTO_ORDER:
            platform = platform_class(candidate)()
            if platform.is_available():
                return platform
    platform = platform_class(name)()
    platform.check_available()
    return platform


def device_sections() -> dict[str, type[DataclassInstance]]:
    """Each device section's settings dataclass (the command line makes --<section>-<key> flags from it)."""
    return {name: getattr(importlib.import_module(module), cls) for name, (module, cls) in _SECTIONS.items()}
