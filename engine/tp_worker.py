"""A worker rank (> 0): builds the same engine as rank 0 on its shard, then runs the steps rank 0 sends.

It never schedules, tokenizes or samples: each step arrives as a WireStep
(engine/distributed/wire.py), the model runner runs the same forward (graph
replay included) with the same collectives as rank 0, and the tokens rank 0
sampled arrive by broadcast into this rank's decode rows (`last_tokens`), so
the next step's pending input tokens are the same on every rank.

It reports to rank 0 over its own pipe: "started" (imports done), "ready"
(engine built), "failed" (with its traceback, just before it exits 1).
It leaves on STOP, when rank 0's pipe closes (rank 0 is gone), or when its
parent process is no longer its parent.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import signal
import sys
import threading
import time
import traceback
from multiprocessing.connection import Connection
from typing import Any

import torch

from engine.distributed.launcher import TERM_GRACE_S

logger = logging.getLogger(__name__)


def worker_main(
    rank: int,
    world_size: int,
    store_port: int,
    config: Any,
    commands: Connection,
    reports: Connection,
    threads: int,
    parent_pid: int,
    log_level: int,
) -> None:
    """The spawned process's entry point (torch.multiprocessing, spawn); threads and log_level: rank 0's."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole process group: rank 0 stops us
    signal.signal(signal.SIGTERM, _leave_soon)
    logging.basicConfig(
        level=log_level, format=f"%(asctime)s %(levelname)s rank{rank} %(name)s: %(message)s", stream=sys.stderr
    )
    _exit_with_parent(parent_pid)
    torch.set_num_threads(threads)
    # tqdm's default lock is a multiprocessing semaphore; a worker that is killed leaves it behind (and a
    # warning at exit). Its bars need only a thread lock here.
    from tqdm import tqdm

    tqdm.set_lock(threading.RLock())
    code = 0
    try:
        reports.send(("started", os.getpid()))
        code = _serve(rank, world_size, store_port, config, commands, reports)
    except BaseException:
        text = traceback.format_exc()
        logger.error("tensor-parallel rank %d failed:\n%s", rank, text)
        with contextlib.suppress(OSError):
            reports.send(("failed", text))
        code = 1
    finally:
        from engine.distributed.process_group import destroy_tensor_parallel

        destroy_tensor_parallel()
    sys.exit(code)


def _serve(rank: int, world_size: int, store_port: int, config: Any, commands: Connection, reports: Connection) -> int:
    from backends import get_platform
    from engine.distributed.channel import Command, StepReceiver
    from engine.distributed.consistency import report_state
    from engine.distributed.process_group import init_tensor_parallel
    from engine.engine import Engine

    platform = get_platform(config.device)
    device = platform.device
    if device.type != "cpu":
        # Rank r on accelerator r: the platform's device ("cuda", "npu", ...) is the current one from here on.
        platform.set_device(rank)
        device = torch.device(device.type, rank)
    init_tensor_parallel(
        rank, world_size, platform.dist_backend, float(config.dist_timeout_s), store_port=store_port, device=device
    )
    engine = Engine(dataclasses.replace(config, warmup=False))  # rank 0 runs the warm-up request through us
    reports.send(("ready", None))
    receiver = StepReceiver(commands)
    while True:
        try:
            command, payload = receiver.receive()
        except EOFError:
            logger.error("tensor-parallel rank %d: rank 0 is gone; leaving", rank)
            return 1
        if command is Command.STEP:
            run_step(engine, payload)
        elif command is Command.LORA:
            assert engine.lora is not None  # rank 0 sends changes only with LoRA on, as every rank has it
            engine.lora.apply_change(payload)  # rank 0's slot change, before the step that needs it
        elif command is Command.CHECK:
            report_state(engine)
        elif command is Command.STOP:
            reports.send(("stopped", None))
            return 0


def run_step(engine: Any, wire: Any) -> None:
    """One step as rank 0 runs it, without the sampling: the forward, then rank 0's tokens into the rows."""
    from engine.distributed.collectives import broadcast_sampled, received_tokens
    from engine.distributed.wire import decode_step
    from engine.transfer import to_device

    runner, state = engine.runner, engine.decode_state
    step, message = decode_step(wire, engine.step_builder.host_page_table, runner.device)
    runner.received_lora_slots = wire.lora_slots  # the step has no requests to read them from
    with torch.no_grad():
        logits, rows = runner.forward(step, message)
        if not wire.samples or logits is None:
            return
        if rows is None or step.is_mixed:
            rows = to_device(message.sample_rows, torch.int64, runner.device)
        tokens = broadcast_sampled(None, int(rows.shape[0]), runner.device)
        state.record_sampled(rows, received_tokens(tokens, state.last_tokens.index_select(0, rows)))


def _leave_soon(signum: int, frame: object) -> None:
    """SIGTERM: sent to every process at once (systemd stops a service's whole cgroup, `kill -- -pgid`),
    rank 0 then stops this rank with its STOP message; if that does not come within TERM_GRACE_S (rank 0 is
    stuck, or the signal was for this rank alone), leave anyway."""
    timer = threading.Timer(TERM_GRACE_S, os._exit, (128 + signum,))
    timer.daemon = True
    timer.start()


def _exit_with_parent(parent_pid: int) -> None:
    """Leave when rank 0's process is gone (killed without a chance to stop us), even mid-compile."""

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=watch, name="engine-tp-parent-watch", daemon=True).start()
