"""`echo` + `logprobs` on /v1/completions scores the prompt: its token log-probs equal the offline
engine's `prompt_logprobs` (fp32), `max_tokens: 0` returns the prompt alone, and streaming carries
the prompt's log-probs in the first chunk."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import openai
import pytest

from dsv4 import LLM, SamplingParams

from .conftest import ServerProcess

PROMPT = "What is 12+7? Answer: 19"
MODEL = "dsv4-tiny"


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused")


@pytest.fixture(scope="module")
def offline(model_path: Path) -> tuple[list[int], list[float | None]]:
    llm = LLM(model_path, dtype="float32", device="cpu", page_size=128, max_total_tokens=4096)
    out = llm.generate(PROMPT, SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1),
                       use_tqdm=False)[0]
    assert out.prompt_logprobs is not None
    return out.prompt_token_ids, out.prompt_logprobs


def test_echo_max_tokens_0_scores_the_prompt(client: openai.OpenAI,
                                             offline: tuple[list[int], list[float | None]]) -> None:
    ids, want = offline
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=0, echo=True,
                                    logprobs=1, temperature=0)
    choice = out.choices[0]
    assert choice.text == PROMPT and out.usage is not None and out.usage.completion_tokens == 0
    lp = choice.logprobs
    assert lp is not None and len(lp.tokens) == len(ids) == len(lp.token_logprobs)
    assert lp.token_logprobs[0] is None and lp.top_logprobs is not None
    assert lp.top_logprobs[0] is None
    assert all(abs(a - b) <= 1e-5 for a, b in zip(lp.token_logprobs[1:], want[1:], strict=True))
    assert all(len(t) == 1 for t in lp.top_logprobs[1:])
    assert lp.text_offset[:2] == [0, len(lp.tokens[0])]


def test_echo_with_tokens_lists_prompt_then_completion(client: openai.OpenAI,
                                                       offline: tuple[list[int],
                                                                      list[float | None]]) -> None:
    ids, _ = offline
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, echo=True,
                                    logprobs=0, temperature=0)
    lp = out.choices[0].logprobs
    assert lp is not None and len(lp.tokens) == len(ids) + 3
    assert out.choices[0].text.startswith(PROMPT)
    assert "".join(lp.tokens[len(ids):]) == out.choices[0].text[len(PROMPT):]


def test_streamed_echo_carries_the_prompt_logprobs(server: ServerProcess,
                                                   offline: tuple[list[int],
                                                                  list[float | None]]) -> None:
    ids, want = offline
    body = {"prompt": PROMPT, "max_tokens": 2, "echo": True, "logprobs": 1, "stream": True,
            "temperature": 0}
    with httpx.Client(base_url=server.url, timeout=30.0) as http:
        first = None
        with http.stream("POST", "/v1/completions", json=body) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    first = first or line
    assert first is not None
    lp = json.loads(first.removeprefix("data: "))["choices"][0]["logprobs"]
    assert lp["token_logprobs"][0] is None and len(lp["tokens"]) >= len(ids)
    assert abs(lp["token_logprobs"][1] - want[1]) <= 1e-5  # type: ignore[operator]


def test_max_tokens_0_needs_echo(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError, match="max_tokens=0 is invalid without echo"):
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=0)
