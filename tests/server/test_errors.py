"""Error cases over raw HTTP against a real `dsv4 serve` with an API key and small admission
limits: 401, 400 (invalid values, wrong types, malformed JSON, prompt too long), 404, 413, 503 — all
in OpenAI's error shape, each 400 naming the offending field."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack
from typing import Any

import httpx
import pytest

from .conftest import ServerProcess, assert_pools_free, running_server

KEY = "sk-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
MAX_BYTES = 65536
MAX_RUNNING, MAX_WAITING = 2, 2


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    with running_server(tmp_path_factory.mktemp("errors"), "--api-key", KEY,
                        "--max-request-bytes", str(MAX_BYTES),
                        "--max-running-requests", str(MAX_RUNNING),
                        "--max-waiting-requests", str(MAX_WAITING), "--shutdown-timeout", "2",
                        **AUTH) as srv:
        yield srv


@pytest.fixture(scope="module")
def http(server: ServerProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=60.0) as c:
        yield c


def error_of(r: httpx.Response, status: int) -> dict[str, Any]:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"], err
    return dict(err)


def test_api_key_is_required_on_v1_only(server: ServerProcess) -> None:
    body = {"prompt": "hi", "max_tokens": 1}
    missing = httpx.post(f"{server.url}/v1/completions", json=body)
    assert error_of(missing, 401)["type"] == "invalid_request_error"
    wrong = httpx.post(f"{server.url}/v1/completions", json=body,
                       headers={"Authorization": "Bearer nope"})
    error_of(wrong, 401)
    error_of(httpx.get(f"{server.url}/v1/models"), 401)
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert httpx.post(f"{server.url}/v1/completions", json=body, headers=AUTH).status_code == 200
    assert "Authorization: Bearer" in server.log() and KEY not in server.log(), "the key is logged"


def test_a_body_that_is_not_an_object_gets_a_clean_400(server: ServerProcess) -> None:
    err = error_of(httpx.post(f"{server.url}/v1/completions", json=[1, 2], headers=AUTH), 400)
    assert not err["message"].startswith("None") and err["param"] is None, err


@pytest.mark.parametrize(("field", "value"), [
    ("temperature", -1.0), ("top_p", 0.0), ("top_p", 1.5), ("top_k", 0), ("min_p", 2.0),
    ("max_tokens", 0), ("n", 0), ("logprobs", 21), ("seed", -1), ("frequency_penalty", 3.0),
    ("presence_penalty", -2.5), ("repetition_penalty", 0.0), ("stop", [""]),
])
def test_invalid_values_are_400_naming_the_field(http: httpx.Client, field: str,
                                                 value: object) -> None:
    err = error_of(http.post("/v1/completions",
                             json={"prompt": "hi", "max_tokens": 2, field: value}), 400)
    assert err["param"] == field and field in err["message"], err


@pytest.mark.parametrize(("body", "field"), [
    ({"prompt": "hi", "max_tokens": "ten"}, "max_tokens"),
    ({"prompt": "hi", "temperature": "hot"}, "temperature"),
    ({"prompt": "hi", "stream": "yes"}, "stream"),
    ({"prompt": "hi", "n": 1.5}, "n"),
    ({"prompt": 5}, "prompt"),
    ({"max_tokens": 2}, "prompt"),
])
def test_wrong_types_are_400_naming_the_field(http: httpx.Client, body: dict[str, Any],
                                              field: str) -> None:
    err = error_of(http.post("/v1/completions", json=body), 400)
    assert err["param"] == field, err


@pytest.mark.parametrize(("body", "field"), [
    ({"messages": "hello"}, "messages"),
    ({"messages": []}, "messages"),
    ({"messages": [{"content": "hi"}]}, "messages"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, "top_logprobs"),
    ({"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]}, "tools"),
])
def test_bad_chat_requests_are_400(http: httpx.Client, body: dict[str, Any], field: str) -> None:
    err = error_of(http.post("/v1/chat/completions", json=body), 400)
    assert err["param"].startswith(field), err


def test_malformed_json_is_400(http: httpx.Client) -> None:
    r = http.post("/v1/completions", content=b'{"prompt": "hi", "max_tokens": ',
                  headers={"Content-Type": "application/json"})
    assert error_of(r, 400)["code"] == "invalid_json"


def test_prompt_longer_than_the_context_is_400(http: httpx.Client) -> None:
    err = error_of(http.post("/v1/completions", json={"prompt": [5] * 5000, "max_tokens": 1}), 400)
    assert err["param"] == "prompt" and "context length" in err["message"], err
    err = error_of(http.post("/v1/completions", json={"prompt": [5, 10**6], "max_tokens": 1}), 400)
    assert err["param"] == "prompt_token_ids", err


def test_unknown_model_and_route_are_404(http: httpx.Client) -> None:
    err = error_of(http.post("/v1/completions", json={"model": "gpt-4", "prompt": "hi"}), 404)
    assert err["param"] == "model" and err["code"] == "model_not_found"
    chat = {"model": "x", "messages": [{"role": "user", "content": "a"}]}
    error_of(http.post("/v1/chat/completions", json=chat), 404)
    error_of(http.get("/v1/nothing"), 404)


def test_oversized_body_is_413(http: httpx.Client) -> None:
    error_of(http.post("/v1/completions", json={"prompt": "x" * (MAX_BYTES + 10)}), 413)
    small = http.post("/v1/completions", json={"prompt": "x" * 100, "max_tokens": 1})
    assert small.status_code == 200, small.text


def test_full_waiting_queue_is_503(http: httpx.Client, server: ServerProcess) -> None:
    body = {"prompt": "hello", "max_tokens": 2000, "ignore_eos": True, "stream": True}
    with ExitStack() as streams:
        for _ in range(MAX_RUNNING + MAX_WAITING):   # each returns once the engine has queued it
            r = streams.enter_context(http.stream("POST", "/v1/completions", json=body))
            assert r.status_code == 200
        err = error_of(http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1}), 503)
        assert err["code"] == "queue_full"
    metrics = http.get("/metrics").text
    assert 'dsv4_requests_rejected_total{status="503"} 1' in metrics


def test_pools_are_free_after_the_module(server: ServerProcess) -> None:
    assert_pools_free(server.wait_idle(**AUTH), server.initial)
