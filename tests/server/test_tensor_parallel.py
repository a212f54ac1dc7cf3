"""`dsv4 serve --tp-size 2` / `--dp-size 2` on CPU (gloo): the engine process is rank 0 and
spawns rank 1 (`engine/parallel.py`, `engine/data_parallel.py`). Completions equal a one-process
server's (greedy tokens and log-probs), a json_object response too, and a
killed rank takes the server down (non-zero exit, no hang). The one-process outputs are the
session's default server's (one engine thread on a 2-core machine, as `--torch-threads 1`), taken
once for the module; each multi-rank server is a test's own (each is killed or stopped)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest

from .conftest import ServerProcess, free_port, refused_serve

BODY = {"prompt": "def fib(n):", "max_tokens": 12, "temperature": 0, "ignore_eos": True,
        "logprobs": 0}
JSON_BODY = {**BODY, "response_format": {"type": "json_object"}}
PROMPTS = ("def fib(n):", "class Tree:", "import os\n")


def complete(srv: ServerProcess, body: dict) -> httpx.Response:
    return httpx.post(f"{srv.url}/v1/completions", json=body, timeout=120.0)


def rank_pids(engine_pid: int) -> list[int]:
    """The engine process's spawned rank processes (not multiprocessing's resource tracker)."""
    kids = Path(f"/proc/{engine_pid}/task/{engine_pid}/children").read_text().split()
    return [int(k) for k in kids
            if b"resource_tracker" not in Path(f"/proc/{k}/cmdline").read_bytes()]


@pytest.fixture(scope="module")
def one_process(server: ServerProcess) -> dict[str, Any]:
    """A one-process server's choices, the references of every test here: BODY ("plain"), BODY
    as a json_object ("json") and BODY on each of PROMPTS ("prompts"), taken before any
    multi-rank server starts. `server`'s clean stop (exit 0) is `test_lifecycle.py`'s SIGTERM
    test's."""
    return {"plain": complete(server, BODY).json()["choices"][0],
            "json": complete(server, JSON_BODY).json()["choices"][0],
            "prompts": [complete(server, {**BODY, "prompt": p}).json()["choices"][0]
                        for p in PROMPTS]}


@pytest.mark.slow
def test_tp2_server_equals_one_process_and_dies_with_a_rank(tmp_path: Path,
                                                            one_process: dict[str, Any]) -> None:
    want, want_json = one_process["plain"], one_process["json"]
    two = ServerProcess(tmp_path, "--tp-size", "2", "--torch-threads", "1")
    two.wait_healthy()
    got = complete(two, BODY).json()["choices"][0]
    assert got["text"] == want["text"]
    a, b = got["logprobs"]["token_logprobs"], want["logprobs"]["token_logprobs"]
    assert max(abs(x - y) for x, y in zip(a, b, strict=True)) <= 1e-5
    structured = complete(two, JSON_BODY)
    assert structured.status_code == 200, structured.text
    text = structured.json()["choices"][0]["text"]
    assert text == want_json["text"] and isinstance(json.loads(text), dict)
    engine_pid = int(httpx.get(f"{two.url}/health").json()["engine_pid"])
    (rank1,) = rank_pids(engine_pid)
    os.kill(rank1, signal.SIGKILL)
    failed = complete(two, BODY)
    assert failed.status_code >= 500 or "error" in failed.text, failed.text
    assert two.proc.wait(timeout=60.0) != 0, two.log()
    assert "rank(s) died: [('dsv4-rank-1', -9)]" in two.log(), two.log()


@pytest.mark.slow
def test_dp2_server_equals_one_process(tmp_path: Path, one_process: dict[str, Any]) -> None:
    """Data-parallel attention behind the HTTP server: three concurrent-in-flight prompts land on
    both ranks (rank 0 assigns by load), each completion equals the one-process server's."""
    want = one_process["prompts"]
    two = ServerProcess(tmp_path, "--dp-size", "2", "--torch-threads", "1")
    try:
        two.wait_healthy()
        with httpx.Client(timeout=120.0) as http:
            batch = {**BODY, "prompt": list(PROMPTS)}   # one call, 3 requests
            got = http.post(f"{two.url}/v1/completions", json=batch).json()["choices"]
        for g, w in zip(sorted(got, key=lambda c: c["index"]), want, strict=True):
            assert g["text"] == w["text"]
            a, b = g["logprobs"]["token_logprobs"], w["logprobs"]["token_logprobs"]
            assert max(abs(x - y) for x, y in zip(a, b, strict=True)) <= 1e-5
    finally:
        assert two.stop(timeout=30.0) == 0, two.log()


@pytest.mark.slow
def test_two_nodes_equal_one_process_and_a_lost_node_stops_the_server(
        tmp_path: Path, one_process: dict[str, Any]) -> None:
    """`--nnodes 2` on one machine: node 1 (`--node-rank 1`, no HTTP) runs rank 1, node 0 serves
    and runs rank 0, both meet at `--dist-init-addr`. The completion equals a one-process
    server's; a clean stop of node 0 stops node 1 (exit 0); with node 1 killed, node 0's next
    request fails and its server exits non-zero."""
    want = one_process["plain"]
    for kill_node1 in (False, True):
        addr = f"127.0.0.1:{free_port()}"
        nodes = ["--tp-size", "2", "--nnodes", "2", "--dist-init-addr", addr,
                 "--torch-threads", "1"]
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        with open(tmp_path / f"node1-{kill_node1}.log", "wb") as log:
            node1 = subprocess.Popen([sys.executable, "-m", "dsv4", "serve", "--node-rank", "1",
                                      *nodes], stdout=log, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True)
        node0 = ServerProcess(tmp_path, "--node-rank", "0", *nodes)
        try:
            node0.wait_healthy()
            got = complete(node0, BODY).json()["choices"][0]
            assert got["text"] == want["text"]
            a, b = got["logprobs"]["token_logprobs"], want["logprobs"]["token_logprobs"]
            assert max(abs(x - y) for x, y in zip(a, b, strict=True)) <= 1e-5
            if kill_node1:
                os.killpg(node1.pid, signal.SIGKILL)
                node1.wait(timeout=30.0)
                failed = complete(node0, BODY)
                assert failed.status_code >= 500 or "error" in failed.text, failed.text
                assert node0.proc.wait(timeout=60.0) != 0, node0.log()
            else:
                assert node0.stop(timeout=60.0) == 0, node0.log()
                assert node1.wait(timeout=60.0) == 0
        finally:
            if node0.proc.poll() is None:
                node0.proc.kill()
            if node1.poll() is None:
                os.killpg(node1.pid, signal.SIGKILL)


def test_bad_layouts_are_refused_at_startup(tmp_path: Path,
                                            caplog: pytest.LogCaptureFixture) -> None:
    """A real `dsv4 serve` process exits 2 on a refused layout; the other refusals go through
    the same entry point in this process."""
    srv = ServerProcess(tmp_path, "--tp-size", "2", "--ep-size", "3")
    assert srv.proc.wait(timeout=60.0) == 2
    assert "ep_size=3 is invalid" in srv.log()
    for flags, message in ((("--tp-size", "2", "--dp-size", "2"),
                            "tp_size=2 with dp_size=2 is not supported"),
                           (("--tp-size", "2", "--nnodes", "2"),
                            "dist_init_addr=None is invalid with nnodes=2"),
                           (("--tp-size", "2", "--nnodes", "3", "--dist-init-addr", "h:1"),
                            "nnodes=3 is invalid")):
        code, log = refused_serve(caplog, *flags)
        assert code == 2 and message in log, (flags, code, log)
