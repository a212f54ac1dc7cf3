"""`dsv4 serve` with the embedded dsv4-tiny on loopback (CPU, fp32), for the client benchmarks.

    with local_server() as port: ...   # healthy on http://127.0.0.1:{port}; stopped on exit
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def local_server(timeout_s: float = 300.0) -> Iterator[int]:
    """The port of a healthy `dsv4 serve` subprocess, terminated on exit."""
    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "dsv4", "serve", "--port", str(port),
                               "--device", "cpu", "--dtype", "float32"])
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"dsv4 serve did not become healthy on port {port}")
            time.sleep(1)
        yield port
    finally:
        server.terminate()
        server.wait(timeout=60)
