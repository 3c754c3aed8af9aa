"""Intel Gaudi (HPU) backend. Untested on Gaudi hardware; see docs/hpu.md.

Importing this package never imports habana_frameworks: the bridge is loaded
lazily inside HpuPlatform / HpuDecodeRunner methods.
"""

from backends.hpu.platform import HpuPlatform

__all__ = ["HpuPlatform"]
