"""/tokenize, /detokenize and /tokenizer_info (server/tokenize.py) against the shipped tokenizer:
the same ids as the server's own prompt building, round trips, vLLM's response shape, 400s naming
the field."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
from tokenizers import Tokenizer

from .conftest import ServerProcess


@pytest.fixture(scope="module")
def http(server: ServerProcess) -> httpx.Client:
    return httpx.Client(base_url=server.url, timeout=30.0)


def test_tokenize_and_detokenize_round_trip(http: httpx.Client, model_path: Path) -> None:
    tok = Tokenizer.from_file(str(model_path / "tokenizer.json"))
    text = "What is 12+7?"
    out = http.post("/tokenize", json={"prompt": text, "return_token_strs": True}).json()
    assert out["tokens"] == tok.encode(text).ids and out["count"] == len(out["tokens"])
    assert out["max_model_len"] == 2048 and len(out["token_strs"]) == out["count"]
    plain = http.post("/tokenize", json={"prompt": text, "add_special_tokens": False}).json()
    assert plain["tokens"] == tok.encode(text, add_special_tokens=False).ids
    assert plain["token_strs"] is None
    back = http.post("/detokenize", json={"tokens": plain["tokens"]}).json()
    assert back == {"prompt": text}


def test_tokenize_chat_equals_the_chat_prompt(http: httpx.Client) -> None:
    """The chat form's ids are the prompt /v1/chat/completions builds: its usage counts them."""
    messages = [{"role": "user", "content": "What is 3+4?"}]
    ids = http.post("/tokenize", json={"messages": messages}).json()["tokens"]
    chat = http.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 1}).json()
    assert chat["usage"]["prompt_tokens"] == len(ids)


def test_tokenizer_info(http: httpx.Client, model_path: Path) -> None:
    info = http.get("/tokenizer_info").json()
    config = json.loads((model_path / "tokenizer_config.json").read_text())
    assert info["eos_token"] == config["eos_token"] and info["chat_template"]
    assert info["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert info["model_max_length"] == 2048


@pytest.mark.parametrize(("route", "body", "param"), [
    ("/tokenize", {}, "prompt"),
    ("/tokenize", {"prompt": "a", "messages": [{"role": "user", "content": "b"}]}, "prompt"),
    ("/detokenize", {"tokens": [1, 10**7]}, "tokens"),
    ("/detokenize", {"tokens": "1 2"}, "tokens"),
])
def test_bad_bodies_are_400s_naming_the_field(http: httpx.Client, route: str,
                                              body: dict[str, object], param: str) -> None:
    r = http.post(route, json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()
