"""Clients that disconnect mid-stream, or during a non-streaming request: their requests are
aborted in the engine and every KV pool, and every request slot, is back to its initial free
count."""

from __future__ import annotations

import asyncio

import httpx

from .conftest import ServerProcess, assert_pools_free

NUM_CLIENTS = 20
EVENTS_BEFORE_DROP = 3


async def _stream_then_drop(url: str, i: int) -> int:
    """Start a long stream, read a few events, then drop the connection; returns the events read."""
    body = {"prompt": f"client {i}: def f(x):", "max_tokens": 2000, "ignore_eos": True,
            "stream": True, "temperature": 1.0}
    events = 0
    async with (httpx.AsyncClient(base_url=url, timeout=60.0) as http,
                http.stream("POST", "/v1/completions", json=body) as r):
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                events += 1
                if events == EVENTS_BEFORE_DROP:
                    break
    return events   # leaving both context managers closes the connection mid-stream


async def _all(url: str) -> list[int]:
    return await asyncio.wait_for(asyncio.gather(*(_stream_then_drop(url, i)
                                                   for i in range(NUM_CLIENTS))), 120)


def test_disconnected_streams_are_aborted_and_free_their_pages(server: ServerProcess) -> None:
    before = server.engine_stats()
    reads = asyncio.run(_all(server.url))
    assert reads == [EVENTS_BEFORE_DROP] * NUM_CLIENTS
    after = server.wait_idle(timeout=60)
    assert after["num_aborted"] - before["num_aborted"] == NUM_CLIENTS, (before, after)
    assert after["num_finished"] == before["num_finished"], "a dropped request ran to completion"
    assert_pools_free(after, server.initial)


def test_disconnected_non_streaming_request_is_aborted(server: ServerProcess) -> None:
    """A non-streaming request whose client gives up while tokens flow is aborted (not run to
    its 2000 tokens), and its pages come back."""
    before = server.engine_stats()
    body = {"prompt": "def g(x):", "max_tokens": 2000, "ignore_eos": True}
    with httpx.Client(base_url=server.url, timeout=1.5) as http:
        try:
            http.post("/v1/completions", json=body)
            raise AssertionError("the request was meant to outlast the client's timeout")
        except httpx.ReadTimeout:
            pass
    after = server.wait_idle(timeout=60)
    assert after["num_aborted"] - before["num_aborted"] == 1, (before, after)
    assert after["num_finished"] == before["num_finished"], "the request ran to completion"
    assert_pools_free(after, server.initial)
