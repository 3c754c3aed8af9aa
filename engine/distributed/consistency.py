"""The KV invariant on every rank: each worker's decode state is rank 0's.

Only rank 0 allocates pages (its KVCacheManager holds the pool invariant,
`free + evictable + protected + in use == total`); every other rank holds its
heads' KV for the same pages and learns them from the step messages. What
must hold there is that each rank's pool has the same pages and page size,
and that its page table (device and host copies, kept from the diffs) and the
last sampled token of every decode row are exactly rank 0's. A rank that
missed a diff or a token would attend over the wrong pages or feed the wrong
token, with no error; this check finds it. Engine.check_kv_invariant runs it
(after every step with --debug-kv-invariant, and after every test).
"""

from __future__ import annotations

import zlib
from typing import Any

import torch


def _crc(tensor: torch.Tensor) -> int:
    return zlib.crc32(tensor.detach().cpu().contiguous().numpy().tobytes())


def state_digest(engine: Any) -> dict[str, int]:
    """This rank's pool shape and checksums of its decode rows."""
    pool, state = engine.kv_pool, engine.decode_state
    return {
        "pages": int(pool.num_pages),
        "page_size": int(pool.page_size),
        "page_table": _crc(state.page_table),
        "host_page_table": _crc(engine.step_builder.host_page_table),
        "last_tokens": _crc(state.last_tokens),
    }


def gather_digests(engine: Any) -> list[dict[str, int]]:
    """Every rank's digest, in rank order (a collective over the control group: every rank calls it)."""
    import torch.distributed as dist

    from engine.distributed.state import tp_state

    state = tp_state()
    digests: list[Any] = [None] * state.world_size
    dist.all_gather_object(digests, state_digest(engine), group=state.control_group)
    return digests


def report_state(engine: Any) -> None:
    """A worker's part of the check (Command.CHECK)."""
    gather_digests(engine)


def check_ranks_agree(digests: list[dict[str, int]]) -> None:
    """Rank 0: every rank's digest is rank 0's, or an AssertionError naming the rank and what differs."""
    reference = digests[0]
    for rank, digest in enumerate(digests[1:], start=1):
        differs = [key for key in reference if digest.get(key) != reference[key]]
        if differs:
            raise AssertionError(
                f"tensor-parallel rank {rank}'s decode state differs from rank 0's in "
                f"{', '.join(differs)} ({digest} vs {reference})"
            )
