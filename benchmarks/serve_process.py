"""`engine serve` of a checkout on a free loopback port, for the attack benchmarks (hostile_grammars.py,
hostile_floods.py): a module they import, not a script."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import httpx


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
        deadline = time.monotonic() + 600
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(f"the server exited with {self.process.returncode}; see {log_path}")
            try:
                if httpx.get(f"{self.base}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the server did not start; see {log_path}")
            time.sleep(0.5)

    def stop(self) -> None:
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(15)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
