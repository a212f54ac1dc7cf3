"""Real `dsv4 serve` processes on 127.0.0.1 for the server tests.

`ServerProcess` starts `python -m dsv4 serve` on a free loopback port (its log goes to a file that
is printed when a test fails), waits — bounded — for GET /health to answer 200, and stops it with
SIGTERM. The `server` fixture is one default-model server shared by the whole session (each test
leaves it idle with every pool free); modules that need other flags start their own.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import httpx
import pytest

from dsv4.assets import default_model_path
from dsv4.cli.main import main
from dsv4.server import launch

START_TIMEOUT_S = 120.0
STOP_TIMEOUT_S = 30.0


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def refused_serve(caplog: pytest.LogCaptureFixture, *flags: str) -> tuple[int, str]:
    """Run `dsv4 serve FLAGS` through the console script's entry point (`cli.main.main`) in this
    process, for flags it must refuse before any server starts: its exit status and the `dsv4`
    log. A server it would start instead fails the test rather than serving."""
    def accepted(*args: object) -> int:
        raise AssertionError(f"the flags were accepted: {flags}")

    logger = logging.getLogger("dsv4")
    logger.addHandler(caplog.handler)           # dsv4's logs do not propagate
    try:
        with mock.patch.object(launch, "serve", accepted):
            code = main(["serve", "--port", str(free_port()), *flags])
    finally:
        logger.removeHandler(caplog.handler)
    return code, caplog.text


class ServerProcess:
    def __init__(self, log_dir: Path, *args: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_dir / f"serve-{self.port}.log"
        self.initial: dict[str, Any] = {}   # engine stats right after start (set by fixtures)
        cmd = [sys.executable, "-m", "dsv4", "serve", "--port", str(self.port), *args]
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)

    def health(self) -> int | None:
        """The /health status, or None when nothing answers."""
        try:
            return httpx.get(f"{self.url}/health", timeout=5.0).status_code
        except httpx.TransportError:
            return None

    def wait_healthy(self, timeout: float = START_TIMEOUT_S) -> list[int | None]:
        """Poll /health until 200; returns every status seen. Fails if the process exits or time
        runs out."""
        seen: list[int | None] = []
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"server exited with {self.proc.returncode}:\n{self.log()}")
            status = self.health()
            seen.append(status)
            if status == 200:
                return seen
            time.sleep(0.1)
        raise AssertionError(f"server not healthy after {timeout} s:\n{self.log()}")

    def engine_stats(self, check_integrity: bool = False, **headers: str) -> dict[str, Any]:
        r = httpx.get(f"{self.url}/v1/engine_stats",
                      params={"check_integrity": str(check_integrity).lower()}, headers=headers,
                      timeout=30.0)
        assert r.status_code == 200, r.text
        return dict(r.json())

    def wait_idle(self, timeout: float = 60.0, **headers: str) -> dict[str, Any]:
        """Engine stats once no request is left anywhere (bounded), after flushing the prefix cache,
        with the integrity check run."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            stats = self.engine_stats(**headers)
            if stats["num_requests"] == 0 and stats["num_inflight"] == 0 and stats["num_jobs"] == 0:
                r = httpx.post(f"{self.url}/flush_cache", headers=headers, timeout=30.0)
                assert r.status_code == 200, r.text
                return self.engine_stats(check_integrity=True, **headers)
            time.sleep(0.1)
        raise AssertionError(f"engine still busy after {timeout} s: {stats}")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = STOP_TIMEOUT_S) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise AssertionError(f"server ignored signal {sig} for {timeout} s:\n"
                                 f"{self.log()}") from None

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-20000:]


@contextlib.contextmanager
def running_server(log_dir: Path, *args: str, **headers: str) -> Iterator[ServerProcess]:
    """A `ServerProcess` with `args`, healthy and its `initial` stats taken (with `headers`);
    stopped on exit."""
    srv = ServerProcess(log_dir, *args)
    try:
        srv.wait_healthy()
        srv.initial = srv.engine_stats(check_integrity=True, **headers)
        yield srv
    finally:
        srv.stop()


def assert_pools_free(stats: dict[str, Any], initial: dict[str, Any]) -> None:
    """No request in the engine, the engine's integrity check passes, and (the prefix cache flushed,
    see `wait_idle`) every pool and the request slots are back to their initial free counts."""
    assert stats["integrity"] == "ok", stats
    assert stats["num_running"] == stats["num_waiting"] == stats["num_requests"] == 0, stats
    assert stats["full_cached"] == stats["swa_cached"] == 0, stats
    assert stats["free_slots"] == initial["free_slots"] == stats["num_slots"], stats
    assert (stats["full_free"], stats["swa_free"]) == (initial["full_free"], initial["swa_free"]), \
        (stats, initial)
    assert (initial["full_free"] == initial["full_usable"]
            and initial["swa_free"] == initial["swa_usable"]), initial


@pytest.fixture(scope="session")
def model_path() -> Path:
    return default_model_path()


@pytest.fixture(scope="session")
def server(tmp_path_factory: pytest.TempPathFactory, model_path: Path) -> Iterator[ServerProcess]:
    """The default server: embedded model, 64 running requests (the soak test's concurrency)."""
    with running_server(tmp_path_factory.mktemp("server"), "--max-running-requests", "64",
                        "--shutdown-timeout", "5") as srv:
        yield srv


@pytest.hookimpl(tryfirst=True, hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    outcome = yield
    report = outcome.get_result()
    if report.failed and "server" in getattr(item, "funcargs", {}):
        report.sections.append(("dsv4 serve log", item.funcargs["server"].log()))
