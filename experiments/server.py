"""Start a vLLM server command (a test module's, a benchmark's) and stop it by its process group, whatever happens."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
from pathlib import Path


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def running_server(cmd: list[str], port: int, log_path: Path, env: dict[str, str], timeout: float = 300):
    """Run ``cmd`` (its own session), wait until ``/health`` on ``port`` answers 200, yield the process; then
    SIGTERM its process group (SIGKILL after 30 s). A server that exits or stays unhealthy raises with its log."""
    import requests

    log = open(log_path, "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    deadline = time.time() + timeout
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"vLLM server exited with {proc.returncode}:\n{log_path.read_text()[-3000:]}")
            try:
                if requests.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except requests.RequestException:
                pass
            if time.time() > deadline:
                raise TimeoutError(f"vLLM server not healthy after {timeout:.0f} s:\n{log_path.read_text()[-3000:]}")
            time.sleep(1)
        yield proc
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=30)
        log.close()
