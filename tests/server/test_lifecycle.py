"""Process lifecycle of `dsv4 serve`: readiness, SIGTERM (drain, then abort, exit 0), and engine
failures (killed engine, engine that cannot load the model, bad model path) that must end in a
non-zero exit, never a hang. Each test that needs a server starts its own."""

from __future__ import annotations

import json
import os
import shutil
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from .conftest import ServerProcess, refused_serve

EXIT_TIMEOUT_S = 30.0


def _events(r: httpx.Response) -> Iterator[dict[str, object]]:
    for line in r.iter_lines():
        if line.startswith("data: {"):
            yield json.loads(line.removeprefix("data: "))


def test_sigterm_finishes_short_requests_aborts_long_ones_and_exits_0(tmp_path: Path) -> None:
    srv = ServerProcess(tmp_path, "--shutdown-timeout", "5")
    seen = srv.wait_healthy()
    assert 503 in seen, f"/health should answer 503 while the engine loads; saw {seen}"
    short = {"prompt": "a", "max_tokens": 40, "ignore_eos": True, "stream": True}
    long = {"prompt": "b", "max_tokens": 2000, "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=srv.url, timeout=60.0) as http, \
            http.stream("POST", "/v1/completions", json=short) as a, \
            http.stream("POST", "/v1/completions", json=long) as b:
        events_a, events_b = _events(a), _events(b)
        next(events_a), next(events_b)
        srv.proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        # the listener stays open during the drain: new requests get 503 with Retry-After
        assert srv.health() == 503, "a draining server answers /health with 503"
        refused = http.post("/v1/completions", json={"prompt": "c", "max_tokens": 2})
        assert refused.status_code == 503 and refused.headers["Retry-After"] == "10"
        assert refused.json()["error"]["code"] == "shutting_down"
        finish_a = [e["choices"][0]["finish_reason"] for e in events_a]   # type: ignore[index]
        assert finish_a[-1] == "length", \
            "an in-flight request should finish within the shutdown timeout"
        started = time.monotonic()
        finish_b = [e["choices"][0]["finish_reason"] for e in events_b]   # type: ignore[index]
        assert finish_b[-1] == "abort" and len(finish_b) < 2000, \
            "the long one is aborted at the timeout"
        assert time.monotonic() - started < 20
    assert srv.stop(timeout=EXIT_TIMEOUT_S) == 0, srv.log()


def test_killed_engine_makes_the_server_unhealthy_and_exit_nonzero(tmp_path: Path) -> None:
    srv = ServerProcess(tmp_path)
    srv.wait_healthy()
    engine_pid = int(httpx.get(f"{srv.url}/health").json()["engine_pid"])
    body = {"prompt": "c", "max_tokens": 2000, "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=srv.url, timeout=60.0) as http, \
            http.stream("POST", "/v1/completions", json=body) as r:
        events = _events(r)
        next(events)
        os.kill(engine_pid, signal.SIGKILL)
        last = list(events)[-1]
    assert "error" in last and "engine" in str(last["error"]), last
    assert srv.health() in (None, 503)
    assert srv.proc.wait(timeout=EXIT_TIMEOUT_S) != 0, srv.log()


def test_engine_that_cannot_load_the_model_exits_nonzero(tmp_path: Path, model_path: Path) -> None:
    broken = tmp_path / "broken"
    broken.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):   # no weights
        shutil.copy(model_path / name, broken / name)
    srv = ServerProcess(tmp_path, "--model", str(broken))
    assert srv.proc.wait(timeout=120) != 0
    assert "engine process failed" in srv.log()


def test_bad_model_path_exits_nonzero_with_a_message(tmp_path: Path,
                                                     caplog: pytest.LogCaptureFixture) -> None:
    """Refused before any process starts (`dsv4 serve`'s entry point run in this process)."""
    code, log = refused_serve(caplog, "--model", str(tmp_path / "missing"))
    assert code != 0 and "--model" in log, (code, log)
