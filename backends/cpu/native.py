"""Build and load the CPU's native kernels (plain C, compiled once per machine with gcc).

Plain C with OpenMP, not a torch C++ extension: it compiles in a fraction of a
second (no torch headers), so a fresh machine pays nothing noticeable, and it
is called through ctypes, which releases the GIL. Built with -march=native,
so the cache key includes the CPU's feature flags; loaded after torch, its
libgomp resolves to the one torch already holds, so it shares torch's OpenMP
threads (inductor's generated C++ works the same way). When gcc is missing or
the build fails, the caller falls back to torch ops.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import time
from functools import cache
from pathlib import Path

from engine.platform import cache_dir

logger = logging.getLogger(__name__)

KERNEL_DIR = Path(__file__).parent / "kernels"
# -ffast-math: vectorised expf from glibc's libmvec and reassociated dot products; the kernels
# never produce or test for inf/NaN (softmax subtracts the row maximum first). Compile only:
# linking a shared library with -ffast-math pulls in crtfastmath.o, whose constructor turns on
# flush-to-zero for the whole process (torch included) the moment the library loads.
CFLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp", "-fPIC"]
LDFLAGS = ["-shared", "-fopenmp"]
LIBS = ["-lmvec", "-lm"]
DISABLE_ENV = "ENGINE_CPU_NATIVE_KERNELS"  # "0" turns the native kernels off


def _cache_dir() -> Path:
    return Path(cache_dir("native"))


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as handle:
            for line in handle:
                if line.startswith("flags"):
                    return line
    except OSError:
        pass
    return os.uname().machine


# Libraries built from several kernel files (each file one job, sharing kernels/*.h); any other
# name is kernels/<name>.c alone.
LIBRARIES = {
    "gguf": (
        "gguf_repack",
        "gguf_matmul",
        "gguf_matmul_portable",
        "gguf_matmul_avx2",
        "gguf_matmul_avx512",
        "gguf_decode",
    ),
}


def library_names() -> list[str]:
    """Every library kernels/ builds: the groups of LIBRARIES, then each other .c file alone."""
    grouped = {part for parts in LIBRARIES.values() for part in parts}
    return [*LIBRARIES, *sorted(p.stem for p in KERNEL_DIR.glob("*.c") if p.stem not in grouped)]


def _sources(name: str) -> list[Path]:
    return [KERNEL_DIR / f"{part}.c" for part in LIBRARIES.get(name, (name,))]


def build(name: str, compiler: str = "gcc") -> Path:
    """kernels/<name>.c (or the files LIBRARIES lists) -> a cached shared library; raises on a failed build.
    The cache key covers every source and every header of kernels/, so an edited header rebuilds."""
    sources = _sources(name)
    headers = sorted(KERNEL_DIR.glob("*.h"))
    version = subprocess.run([compiler, "-dumpfullversion"], capture_output=True, text=True, check=True).stdout.strip()
    key = hashlib.sha256(
        "\0".join(
            [
                *(p.read_text() for p in sources + headers),
                " ".join(CFLAGS + LDFLAGS + LIBS),
                compiler,
                version,
                _cpu_flags(),
            ]
        ).encode()
    ).hexdigest()[:16]
    target = _cache_dir() / f"{name}-{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
        built = Path(scratch) / target.name
        objects = [Path(scratch) / f"{source.stem}.o" for source in sources]
        compiles = [
            subprocess.Popen(
                [compiler, *CFLAGS, "-c", "-o", str(obj), str(source)],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for source, obj in zip(sources, objects)
        ]
        for source, process in zip(sources, compiles):  # in parallel: a fresh machine waits for the slowest file
            _, stderr = process.communicate()
            if process.returncode != 0:
                raise RuntimeError(f"{compiler} failed on {source.name}: {stderr.strip()[-2000:]}")
        result = subprocess.run(
            [compiler, *LDFLAGS, "-o", str(built), *map(str, objects), *LIBS], capture_output=True, text=True
        )
        if result.returncode != 0:
            raise RuntimeError(f"{compiler} failed to link {name}: {result.stderr.strip()[-2000:]}")
        os.replace(built, target)  # atomic: concurrent engines never load a half-written file
    logger.info("built native CPU kernel %s in %.2f s (%s)", name, time.perf_counter() - start, target)
    return target


def native_kernels_enabled() -> bool:
    """False when the environment switches the native kernels off (torch ops everywhere)."""
    return os.environ.get(DISABLE_ENV, "1") != "0"


@cache
def load(name: str) -> ctypes.CDLL | None:
    """The kernel library, or None (disabled, no compiler, or the build failed: logged once)."""
    if not native_kernels_enabled():
        return None
    if shutil.which("gcc") is None:
        logger.warning("gcc not found: CPU attention falls back to torch ops (slower)")
        return None
    import torch  # noqa: F401 - torch's libgomp must be loaded before the kernel's

    try:
        return ctypes.CDLL(str(build(name)))
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        logger.warning("native CPU kernel %s unavailable, falling back to torch ops: %s", name, exc)
        return None
