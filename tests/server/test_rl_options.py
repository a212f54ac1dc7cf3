"""The RL options of a real `dsv4 serve --enable-return-routing` on a micro checkpoint:
`return_routed_experts` / `return_indexer_topk` equal an offline engine's captured routing (stop
strings included), the 400s without the flag or with streaming, and `/update_weights_from_disk`
serving the new model's logprobs, refusing corrupt / foreign checkpoints with the served weights
unchanged."""

from __future__ import annotations

import base64
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import torch

from dsv4 import LLM, SamplingParams
from dsv4.checkpoint.presets import micro
from dsv4.checkpoint.writer import write_checkpoint
from dsv4.engine.request import RequestOutput

from .conftest import ServerProcess, assert_pools_free, running_server

KEY = "sk-rl"
AUTH = {"Authorization": f"Bearer {KEY}"}
MODEL = "micro"
PROMPT = torch.randint(3, 512, (21,), generator=torch.Generator().manual_seed(5)).tolist()
ROUTING = {"return_routed_experts": True, "return_indexer_topk": True}
MAX_TOKENS = 7
TOL = 1e-5


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("rl_ckpts")
    out = {name: root / name for name in ("a", "b", "corrupt", "other")}
    write_checkpoint(micro(), out["a"], seed=1)
    write_checkpoint(micro(), out["b"], seed=2, tokenizer=False)
    shutil.copytree(out["b"], out["corrupt"])
    shard = next(out["corrupt"].glob("*.safetensors"))
    shard.write_bytes(shard.read_bytes()[:-1000])
    write_checkpoint(micro().replace(moe_inter_dim=64), out["other"], tokenizer=False)
    return out


@pytest.fixture(scope="module")
def rl_server(tmp_path_factory: pytest.TempPathFactory,
              ckpts: dict[str, Path]) -> Iterator[ServerProcess]:
    with running_server(tmp_path_factory.mktemp("rl_server"), "--model", str(ckpts["a"]),
                        "--served-model-name", MODEL, "--enable-return-routing", "--api-key", KEY,
                        "--shutdown-timeout", "2", **AUTH) as srv:
        yield srv


@pytest.fixture(scope="module")
def http(rl_server: ServerProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=rl_server.url, headers=AUTH, timeout=60.0) as c:
        yield c


def offline(path: Path, prompt: list[int], max_tokens: int = MAX_TOKENS) -> RequestOutput:
    llm = LLM(path, dtype="float32", device="cpu", page_size=16, max_total_tokens=1024,
              capture_routing=True)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=0)
    return llm.generate(prompt_token_ids=[prompt], sampling_params=params, use_tqdm=False)[0]


def complete(http: httpx.Client, **extra: Any) -> dict[str, Any]:
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0,
            "ignore_eos": True, "logprobs": 0, **extra}
    r = http.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    return dict(r.json())


def decoded(field: dict[str, Any]) -> np.ndarray:
    data = np.frombuffer(base64.b64decode(field["data"]), dtype="<i4")
    return data.reshape(field["shape"])


def error_of(r: httpx.Response, status: int, param: str) -> str:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["param"] == param, err
    return str(err["message"])


def test_routing_equals_the_offline_engine(http: httpx.Client, ckpts: dict[str, Path]) -> None:
    want = offline(ckpts["a"], PROMPT)
    assert want.routing is not None
    choice = complete(http, **ROUTING)["choices"][0]
    rows = len(PROMPT) + MAX_TOKENS - 1
    experts, picks = decoded(choice["routed_experts"]), decoded(choice["indexer_topk"])
    assert experts.shape == (rows, 5, 2) and picks.shape == (rows, 2, 4)
    assert np.array_equal(experts, want.routing["experts"].numpy())
    assert np.array_equal(picks, want.routing["indexer"].numpy())
    assert (picks == -1).any() and (picks >= 0).any()
    only = complete(http, return_routed_experts=True)["choices"][0]
    assert "indexer_topk" not in only and only["routed_experts"] == choice["routed_experts"]
    assert "routed_experts" not in complete(http)["choices"][0]


def test_native_generate_carries_the_same_routing(http: httpx.Client,
                                                  rl_server: ServerProcess) -> None:
    """SGLang's /generate (Miles' rollout call): meta_info's routed_experts / indexer_topk are the
    base64 rows /v1/completions returns, and output_token_logprobs its log-probs (greedy); the
    native endpoints need the API key too."""
    for path in ("/generate", "/abort_request"):
        assert httpx.post(rl_server.url + path, json={"input_ids": PROMPT}).status_code == 401
    assert httpx.get(rl_server.url + "/get_server_info").status_code == 401
    choice = complete(http, **ROUTING)["choices"][0]
    r = http.post("/generate", json={"input_ids": PROMPT, "return_logprob": True, **ROUTING,
                                     "sampling_params": {"max_new_tokens": MAX_TOKENS,
                                                         "temperature": 0, "ignore_eos": True}})
    assert r.status_code == 200, r.text
    meta = r.json()["meta_info"]
    assert meta["routed_experts"] == choice["routed_experts"]["data"]
    assert meta["indexer_topk"] == choice["indexer_topk"]["data"]
    lps = [t[0] for t in meta["output_token_logprobs"]]
    assert max(abs(a - b) for a, b in zip(lps, choice["logprobs"]["token_logprobs"],
                                          strict=True)) <= TOL


def test_routing_stops_at_the_kept_tokens(http: httpx.Client) -> None:
    """A stop string cuts the choice inside the engine's output: rows follow the kept tokens."""
    full = complete(http, **ROUTING)["choices"][0]
    tokens = full["logprobs"]["tokens"]
    cut = next(i for i in range(2, len(tokens)) if tokens[i].strip()
               and tokens[i] not in "".join(tokens[:i]))
    stopped = complete(http, stop=tokens[cut], **ROUTING)
    choice, kept = stopped["choices"][0], stopped["usage"]["completion_tokens"]
    assert choice["finish_reason"] == "stop" and kept == cut + 1
    rows = decoded(choice["routed_experts"])
    assert rows.shape[0] == len(PROMPT) + kept - 1
    assert np.array_equal(rows, decoded(full["routed_experts"])[:rows.shape[0]])


def test_chat_carries_routing(http: httpx.Client) -> None:
    r = http.post("/v1/chat/completions", json={
        "model": MODEL, "messages": [{"role": "user", "content": "hi there"}], "max_tokens": 3,
        "temperature": 0, "ignore_eos": True, "return_indexer_topk": True})
    assert r.status_code == 200, r.text
    out = r.json()
    rows = out["usage"]["prompt_tokens"] + out["usage"]["completion_tokens"] - 1
    assert decoded(out["choices"][0]["indexer_topk"]).shape == (rows, 2, 4)
    assert "routed_experts" not in out["choices"][0]


def test_routing_options_are_refused_with_stream_or_without_the_flag(
        http: httpx.Client, server: ServerProcess) -> None:
    r = http.post("/v1/completions", json={"prompt": PROMPT, "stream": True, **ROUTING})
    assert "stream=true" in error_of(r, 400, "return_routed_experts")
    r = http.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "x"}], "stream": True,
        "return_indexer_topk": True})
    error_of(r, 400, "return_indexer_topk")
    r = httpx.post(f"{server.url}/v1/completions", timeout=30.0,
                   json={"prompt": "hi", "max_tokens": 1, "return_indexer_topk": True})
    assert "--enable-return-routing" in error_of(r, 400, "return_indexer_topk")


def served(http: httpx.Client) -> tuple[str, list[float]]:
    choice = complete(http)["choices"][0]
    return choice["text"], choice["logprobs"]["token_logprobs"]


def update(http: httpx.Client, path: Path) -> httpx.Response:
    return http.post("/update_weights_from_disk", json={"model_path": str(path)}, timeout=120.0)


def test_update_weights_from_disk(http: httpx.Client, rl_server: ServerProcess,
                                  ckpts: dict[str, Path]) -> None:
    text_a, lps_a = served(http)
    want_b = offline(ckpts["b"], PROMPT)
    assert httpx.post(f"{rl_server.url}/update_weights_from_disk",
                      json={"model_path": str(ckpts["b"])}).status_code == 401
    assert "cannot be read" in error_of(update(http, ckpts["corrupt"]), 400, "model_path")
    assert "moe_inter_dim=64" in error_of(update(http, ckpts["other"]), 400, "model_path")
    assert "not a checkpoint directory" in error_of(update(http, ckpts["a"] / "nope"), 400,
                                                    "model_path")
    assert served(http) == (text_a, lps_a)
    assert rl_server.engine_stats(**AUTH)["weight_version"] == 0

    r = update(http, ckpts["b"])
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["success"] is True and body["weight_version"] == 1 and body["num_tensors"] > 100
    text_b, lps_b = served(http)
    assert text_b != text_a
    assert max(abs(a - b) for a, b in zip(lps_b, want_b.logprobs, strict=True)) <= TOL
    # the served model's routing is the new weights' routing
    choice = complete(http, **ROUTING)["choices"][0]
    assert want_b.routing is not None
    assert np.array_equal(decoded(choice["routed_experts"]), want_b.routing["experts"].numpy())

    assert update(http, ckpts["a"]).json()["weight_version"] == 2
    assert served(http) == (text_a, lps_a)
    assert rl_server.engine_stats(**AUTH)["weight_version"] == 2
    assert_pools_free(rl_server.wait_idle(**AUTH), rl_server.initial)
