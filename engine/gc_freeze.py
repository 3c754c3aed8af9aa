"""Start-up's objects out of the cyclic garbage collector's way.

A built engine holds hundreds of thousands of long-lived Python objects: modules, parameters' wrappers,
dynamo's guards and inductor's compiled code (373k for SmolLM2 with the compiled CPU decode). Python's
oldest-generation collection scans all of them: 200-230 ms a time on a 2-core EPYC. It runs whenever
enough objects have survived since the last one, so in a long run it lands on a random step: the H200's
offline run showed single steps 215-350 ms over their class's median at random places. Frozen (as
vLLM's engine core does after start-up), those objects are never scanned again; objects made while
serving are collected as before. Frozen objects that later become cyclic garbage are not reclaimed,
which is why this happens once, after start-up, and why Engine.shutdown() unfreezes them.
"""

from __future__ import annotations

import gc
import logging
import time

logger = logging.getLogger(__name__)


def freeze_start_up_objects() -> int:
    """Collect start-up's garbage, then freeze what survives; returns the number of objects frozen."""
    start = time.perf_counter()
    gc.collect()
    collect_ms = (time.perf_counter() - start) * 1e3
    gc.freeze()
    frozen = gc.get_freeze_count()
    logger.info(
        "gc: %d start-up objects frozen (a full collection over them took %.0f ms; it no longer scans them)",
        frozen,
        collect_ms,
    )
    return frozen


def unfreeze_gc() -> None:
    """Back into the oldest generation (Engine.shutdown): what the engine held can be collected again."""
    gc.unfreeze()
    logger.info("gc: start-up objects unfrozen")
