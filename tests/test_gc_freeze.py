"""freeze_gc: the built engine's objects leave the cyclic GC's scans, and shutdown() gives them back."""

from __future__ import annotations

import argparse
import gc
import weakref

from engine.cli import add_engine_args, engine_config_from_args
from engine.engine import Engine


def test_freeze_then_shutdown_lets_a_deleted_engine_be_collected(tiny_checkpoints: dict[str, str]) -> None:
    assert gc.get_freeze_count() == 0
    engine = Engine(
        model=tiny_checkpoints["llama"],
        device="cpu",
        dtype="float32",
        kv_cache_tokens=512,
        max_num_seqs=2,
        disable_graphs=True,
        freeze_gc=True,
    )
    try:
        assert engine.froze_gc and gc.get_freeze_count() > 1000
        model = weakref.ref(engine.model)
        frozen_after_start = gc.get_freeze_count()
        engine.generate([[1, 2, 3]])  # serving works frozen; what it makes is collected as usual
        assert gc.get_freeze_count() <= frozen_after_start  # objects freed by refcount leave it
    finally:
        engine.shutdown()
    assert gc.get_freeze_count() == 0 and not engine.froze_gc
    engine.shutdown()  # idempotent
    del engine
    gc.collect()
    assert model() is None, "the engine's model outlived the engine (held by frozen cycles?)"


def test_serving_entry_points_freeze_unless_told_not_to() -> None:
    parser = argparse.ArgumentParser()
    add_engine_args(parser)

    def serving(argv):
        return engine_config_from_args(
            parser.parse_args(argv), freeze_gc=parser.parse_args(argv).freeze_gc is not False
        )

    assert serving([]).freeze_gc is True and serving(["--no-freeze-gc"]).freeze_gc is False
    # A library engine: unset, which is off (the environment no longer decides: freeze_gc is the only switch).
    assert engine_config_from_args(parser.parse_args([])).freeze_gc is None
