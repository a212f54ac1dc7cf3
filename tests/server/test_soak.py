"""Bounded soak: 128 streaming requests (completions and chat, mixed prompt lengths) at 64
concurrent streams through the official async `openai` client, on loopback. Zero errors, every
request ends with its full token count, and afterwards the engine is idle with every pool free."""

from __future__ import annotations

import asyncio
import random

import httpx
import openai
import pytest

from .conftest import ServerProcess, assert_pools_free

NUM_REQUESTS = 128     # twice the concurrency: streams end and start throughout
CONCURRENCY = 64
MAX_TOKENS = 8
TIMEOUT_S = 240.0
MODEL = "dsv4-tiny"


async def _one(client: openai.AsyncOpenAI, i: int, sem: asyncio.Semaphore) -> int:
    rng = random.Random(i)
    vocab = ["alpha", "beta", "gamma", "delta", "x = 1", "def f():"]
    words = " ".join(rng.choice(vocab) for _ in range(rng.randint(1, 40)))
    opts = {"max_tokens": MAX_TOKENS, "stream": True, "stream_options": {"include_usage": True},
            "temperature": rng.choice([0.0, 0.8]), "extra_body": {"ignore_eos": True}}
    async with sem:
        if i % 2:
            stream = await client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": words}], **opts)  # type: ignore[call-overload]
        else:
            stream = await client.completions.create(model=MODEL, prompt=words, **opts)  # type: ignore[call-overload]
        usage = None
        async for chunk in stream:
            usage = chunk.usage or usage
    assert usage is not None
    return int(usage.completion_tokens)


async def _soak(url: str) -> list[int]:
    sem = asyncio.Semaphore(CONCURRENCY)
    limits = httpx.Limits(max_connections=CONCURRENCY, max_keepalive_connections=CONCURRENCY)
    async with httpx.AsyncClient(limits=limits, timeout=120.0) as http, openai.AsyncOpenAI(
            base_url=f"{url}/v1", api_key="unused", max_retries=0, http_client=http) as client:
        return await asyncio.gather(*(_one(client, i, sem) for i in range(NUM_REQUESTS)))


@pytest.mark.slow
def test_soak_128_requests_at_64_concurrent_streams(server: ServerProcess) -> None:
    before = server.engine_stats()
    tokens = asyncio.run(asyncio.wait_for(_soak(server.url), TIMEOUT_S))
    assert tokens == [MAX_TOKENS] * NUM_REQUESTS
    after = server.wait_idle()
    assert after["num_finished"] - before["num_finished"] == NUM_REQUESTS
    assert after["num_aborted"] == before["num_aborted"]
    assert_pools_free(after, server.initial)
