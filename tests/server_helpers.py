"""A real `engine serve` process on a free loopback port, shared by the server test modules.

One process serves every test file that needs it (starting one costs a model load and a
few torch.compile graphs), so it is cached here at module level and stopped at exit;
the shutdown test takes it over last and stops it with SIGTERM.
"""

from __future__ import annotations

import atexit
import os
import re
import socket
import subprocess
import sys
import time
from dataclasses import dataclass

import httpx
from conftest import REPO_ROOT

MODEL = "SmolLM2-135M-Instruct"
# float32 so the greedy output can be compared token for token with the shared smol_engine
# (float32, eager); graphs for batch sizes 1-8 and max 8 sequences, so 64 requests queue.
# A short header timeout so the slowloris test need not wait long.
SERVER_ARGS = [
    "--dtype",
    "float32",
    "--capture-sizes",
    "1,2,4,8",
    "--max-num-seqs",
    "8",
    "--kv-cache-tokens",
    "8192",
    "--torch-threads",
    "1",
    "--header-timeout",
    "3",
    # No bf16 prefill copy (~200 MiB an engine): the suite's servers run at once beside its workers.
    "--cpu-prefill-weights",
    "gguf",
    # Parsers on: they change nothing for SmolLM2 (it never thinks), and the tool tests need one.
    "--tool-call-parser",
    "hermes",
    "--reasoning-parser",
    "qwen3",
]
START_TIMEOUT_S = 420


@dataclass
class ServerProcess:
    process: subprocess.Popen
    port: int
    log_path: str

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def metrics(self) -> dict[str, float]:
        """engine:* and vllm:* samples of /metrics, labels stripped (one model, so names are unique enough)."""
        text = httpx.get(f"{self.base_url}/metrics", timeout=10).text
        values = {}
        for line in text.splitlines():
            match = re.match(r"^((?:engine|vllm):[a-z_]+)(\{[^}]*\})? ([0-9.eE+-]+)$", line)
            if match and 'finished_reason="' not in (match.group(2) or ""):
                values[match.group(1)] = float(match.group(3))
            elif match:
                reason = re.search(r'finished_reason="(\w+)"', match.group(2)).group(1)
                values[f"{match.group(1)}:{reason}"] = float(match.group(3))
        return values

    def wait_idle(self, timeout: float = 20.0) -> dict[str, float]:
        """Poll /metrics until nothing runs or waits and no KV page is held; return the last sample."""
        deadline = time.monotonic() + timeout
        while True:
            values = self.metrics()
            if (
                values["engine:num_requests_running"] == 0
                and values["engine:num_requests_waiting"] == 0
                and values["engine:kv_pages_used"] == 0
            ):
                return values
            if time.monotonic() > deadline:
                raise AssertionError(f"server not idle after {timeout} s: {values}")
            time.sleep(0.1)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(*extra: str, log_name: str = "server", own_group: bool = False) -> ServerProcess:
    """own_group: the server leads a process group of its own (a test may signal the whole group)."""
    port = free_port()
    log_path = os.path.join(REPO_ROOT, ".pytest_cache", f"{log_name}-{port}.log")
    os.makedirs(os.path.dirname(log_path), exist_ok=True)
    # The child writes to its own copy of the descriptor: the parent's closes once it has started.
    with open(log_path, "w") as log:
        process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "engine.cli",
                "--log-level",
                "DEBUG",
                "serve",
                "--port",
                str(port),
                *SERVER_ARGS,
                *extra,
            ],
            cwd=REPO_ROOT,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=own_group,
        )
    server = ServerProcess(process, port, log_path)
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        if process.poll() is not None:
            raise RuntimeError(f"server exited with {process.returncode}:\n{server.log()[-3000:]}")
        try:
            if httpx.get(f"{server.base_url}/health", timeout=2).status_code == 200:
                return server
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            server.stop()
            raise RuntimeError(f"server did not start in {START_TIMEOUT_S} s:\n{server.log()[-3000:]}")
        time.sleep(0.5)


_SHARED: dict[str, ServerProcess] = {}


def shared_server(engine_process: bool = False) -> ServerProcess:
    """The session's server, started on first use (again if a test stopped it). engine_process: the
    one whose engine runs in a process of its own (on the CPU the default is a thread)."""
    key = "process" if engine_process else "main"
    server = _SHARED.get(key)
    if server is None or server.process.poll() is not None:
        extra = ("--engine-process",) if engine_process else ()
        server = _SHARED[key] = start_server(*extra, log_name=f"server-{key}")
    return server


def take_shared_server() -> ServerProcess:
    """The shared server for a test that will stop it; later users get a fresh one."""
    server = shared_server()
    del _SHARED["main"]
    return server


@atexit.register
def _stop_all() -> None:
    for server in _SHARED.values():
        server.stop()
