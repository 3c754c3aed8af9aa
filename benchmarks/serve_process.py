"""`engine serve` of a checkout on a free loopback port, for the attack benchmarks (hostile_grammars.py,
hostile_floods.py) and its readiness wait (serving_vs_offline.py too): a module they import, not a script."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import httpx


def wait_for_health(url: str, process: subprocess.Popen[bytes], timeout: float) -> None:
    """Until `url`/health answers 200; RuntimeError if the process exits first, TimeoutError after timeout."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited with {process.returncode} before it was ready")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"the server was not ready within {timeout:.0f} s")


class Server:
    """`engine serve` of --repo on a free loopback port, its log in a file."""

    def __init__(self, repo: str, extra: list[str], log_path: str) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.base = f"http://127.0.0.1:{self.port}"
        env = {**os.environ, "PYTHONPATH": repo}
        command = [sys.executable, "-m", "engine.cli", "serve", "--port", str(self.port), *extra]
        with open(log_path, "w") as log:
            self.process = subprocess.Popen(command, cwd=repo, env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            wait_for_health(self.base, self.process, 600.0)
        except TimeoutError:
            self.stop()
            raise RuntimeError(f"the server did not start; see {log_path}") from None
        except RuntimeError as exc:
            raise RuntimeError(f"{exc}; see {log_path}") from None

    def stop(self) -> None:
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(15)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
