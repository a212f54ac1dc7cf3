"""Structured output through `dsv4 serve` with the official openai client: 20 JSON schemas with 20
prompts validate even from dsv4-tiny (greedy and sampled), json_object, SGLang's `regex` and
vLLM's `guided_choice`, streaming equal to non-streaming, and clean 400s for bad specs."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import jsonschema
import openai
import pytest

from .conftest import ServerProcess

MODEL = "dsv4-tiny"


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0,
                       timeout=60.0) as c:
        yield c


def _schemas() -> list[dict[str, Any]]:
    """20 schemas: bounded integers and numbers, enums, booleans, short strings, small arrays,
    nested objects, optional fields."""
    leaves: list[dict[str, Any]] = [
        {"type": "integer", "minimum": 0, "maximum": 99},
        {"type": "boolean"},
        {"enum": ["add", "sub", "mul"]},
        {"type": "string", "maxLength": 6},
        {"type": "array", "maxItems": 3, "items": {"type": "integer", "minimum": 0,
                                                   "maximum": 9}},
        {"type": "number", "minimum": -5, "maximum": 5},
        {"type": "object", "properties": {"a": {"type": "integer", "minimum": 1, "maximum": 3}},
         "required": ["a"]},
    ]
    out = []
    for i in range(20):
        keys = [f"k{i}_{j}" for j in range(1 + i % 3)]
        props = {k: leaves[(i + j) % len(leaves)] for j, k in enumerate(keys)}
        out.append({"type": "object", "properties": props, "required": keys[: 1 + i % 2]})
    return out


def _chat(client: openai.OpenAI, prompt: str, **kw: Any) -> Any:
    return client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": prompt}], max_tokens=64, **kw)


def test_twenty_schemas_validate(client: openai.OpenAI) -> None:
    """The 20 requests are in flight together (the server batches them, each under its own
    grammar); every one validates against its schema."""
    def ask(i: int, schema: dict[str, Any]) -> Any:
        fmt = {"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": schema,
                                                      "strict": True}}
        return _chat(client, f"What is {i}+{20 - i}?", response_format=fmt,
                     temperature=0.0 if i % 2 else 1.0, seed=i)

    schemas = _schemas()
    with ThreadPoolExecutor(len(schemas)) as pool:
        outs = list(pool.map(ask, range(len(schemas)), schemas))
    for out, schema in zip(outs, schemas, strict=True):
        text = out.choices[0].message.content
        jsonschema.validate(json.loads(text), schema)
        assert out.choices[0].finish_reason == "stop", text


def test_json_object_regex_and_choice(client: openai.OpenAI) -> None:
    out = _chat(client, "What is 2+2?", response_format={"type": "json_object"}, temperature=0)
    assert isinstance(json.loads(out.choices[0].message.content), dict)
    pattern = r"[0-9]{1,2} (apples|pears)"
    done = client.completions.create(model=MODEL, prompt="12+7=", max_tokens=16,
                                     temperature=1.0, seed=3, extra_body={"regex": pattern})
    assert re.fullmatch(pattern, done.choices[0].text), done.choices[0].text
    out = _chat(client, "Is 3 > 2?", extra_body={"guided_choice": ["yes", "no"]}, temperature=0)
    assert out.choices[0].message.content in ("yes", "no")


def test_streaming_reassembles_to_the_non_streaming_result(client: openai.OpenAI) -> None:
    schema = _schemas()[4]
    fmt = {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}
    whole = _chat(client, "What is 9+9?", response_format=fmt, temperature=0)
    chunks = _chat(client, "What is 9+9?", response_format=fmt, temperature=0, stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    jsonschema.validate(json.loads(text), schema)


@pytest.mark.parametrize(("kw", "param", "message"), [
    ({"response_format": {"type": "xml"}}, "response_format", "response_format.type='xml'"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format", "schema is missing"),
    ({"extra_body": {"regex": "("}}, None, "does not compile as regex"),
    ({"extra_body": {"regex": "a", "guided_choice": ["b"]}}, "guided_choice", "are exclusive"),
    ({"extra_body": {"guided_choice": []}}, "guided_choice", "non-empty list"),
])
def test_bad_structured_requests_are_400(client: openai.OpenAI, kw: dict[str, Any],
                                         param: str | None, message: str) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        _chat(client, "hi", **kw)
    body = err.value.body
    assert isinstance(body, dict) and message in body["message"], body
    assert body["type"] == "invalid_request_error"
    if param is not None:
        assert body["param"] == param
