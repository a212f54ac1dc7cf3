"""SGLang's native API on a real `dsv4 serve` (native.py), as Miles' rollouts and
`sglang.bench_serving --backend sglang` call it: POST /generate with text or input_ids, batches and
n, log-probs (temperature-scaled output ones equal to the offline engine's, the prompt's equal to
/v1/completions' echo), stop reasons, streaming with cumulative text, /abort_request by rid, the
400s; the pools free afterwards."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from dsv4 import LLM, SamplingParams
from dsv4.server.tokenizer import ServerTokenizer

from .conftest import ServerProcess, assert_pools_free

PROMPT = "def fibonacci(n):\n    "
GREEDY = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}
TOL = 1e-5


@pytest.fixture(scope="module")
def http(server: ServerProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=60.0) as c:
        yield c


@pytest.fixture(scope="module")
def tok(model_path: Path) -> ServerTokenizer:
    return ServerTokenizer.from_checkpoint(model_path)


def generate(http: httpx.Client, **body: Any) -> Any:
    r = http.post("/generate", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def error_of(http: httpx.Client, body: dict[str, Any]) -> tuple[str | None, str]:
    """(param, message) of a /generate 400."""
    r = http.post("/generate", json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    return err["param"], str(err["message"])


def test_text_and_input_ids_match_the_completions_endpoint(http: httpx.Client,
                                                           tok: ServerTokenizer) -> None:
    out = generate(http, text=PROMPT, sampling_params=GREEDY)
    ids = tok.encode(PROMPT)
    assert generate(http, input_ids=ids, sampling_params=GREEDY)["output_ids"] == out["output_ids"]
    meta = out["meta_info"]
    assert meta["finish_reason"] == {"type": "length", "length": 8}
    assert (meta["prompt_tokens"], meta["completion_tokens"]) == (len(ids), 8)
    assert len(out["output_ids"]) == 8 and meta["e2e_latency"] > 0
    assert out["text"] == tok.decode(out["output_ids"])
    cmpl = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 8, "temperature": 0,
                                              "ignore_eos": True}).json()
    assert out["text"] == cmpl["choices"][0]["text"]
    assert "output_token_logprobs" not in meta


def test_batches_and_n_are_prompt_major(http: httpx.Client, tok: ServerTokenizer) -> None:
    prompts = [tok.encode(PROMPT), tok.encode("class Stack:\n")]
    outs = generate(http, input_ids=prompts, sampling_params={**GREEDY, "n": 2},
                    rid="batch-1")
    assert isinstance(outs, list) and len(outs) == 4
    assert [o["meta_info"]["id"] for o in outs] == [f"batch-1-{k}" for k in range(4)]
    assert [o["meta_info"]["prompt_tokens"] for o in outs] == [len(p) for p in prompts
                                                               for _ in range(2)]
    assert outs[0]["output_ids"] == outs[1]["output_ids"], "greedy samples agree"
    for p, o in zip(prompts, outs[::2], strict=True):
        assert generate(http, input_ids=p, sampling_params=GREEDY)["output_ids"] == o["output_ids"]
    single = generate(http, text=[PROMPT], sampling_params=GREEDY)
    assert isinstance(single, list) and len(single) == 1
    long = generate(http, input_ids=prompts[0][:5] * 400,
                    sampling_params={**GREEDY, "max_new_tokens": None})
    assert long["meta_info"]["completion_tokens"] == 2048 - 2000, "null: up to the context"


def test_output_logprobs_are_the_sampled_distributions(http: httpx.Client,
                                                       model_path: Path) -> None:
    """Sampled at T = 0.7 with a seed: the tokens and their temperature-scaled log-probs equal the
    offline engine's with `scaled_logprobs` (RL's rollout log-probs); the top-k rows too."""
    sp = {"temperature": 0.7, "max_new_tokens": 6, "ignore_eos": True, "sampling_seed": 11}
    out = generate(http, text=PROMPT, sampling_params=sp, return_logprob=True,
                   top_logprobs_num=3, return_text_in_logprobs=True)
    llm = LLM(model_path, dtype="float32", device="cpu", page_size=128, max_total_tokens=4096)
    want = llm.generate([PROMPT], SamplingParams(temperature=0.7, max_tokens=6, ignore_eos=True,
                                                 seed=11, logprobs=3, scaled_logprobs=True),
                        use_tqdm=False)[0]
    meta = out["meta_info"]
    assert out["output_ids"] == want.token_ids
    triples = meta["output_token_logprobs"]
    assert [t[1] for t in triples] == out["output_ids"]
    assert max(abs(t[0] - w) for t, w in zip(triples, want.logprobs, strict=True)) <= TOL
    assert "".join(t[2] for t in triples) == out["text"]
    tops = meta["output_top_logprobs"]
    assert len(tops) == 6 and all(len(row) == 3 for row in tops)
    for row, wrow in zip(tops, want.top_logprobs, strict=True):
        assert [t[1] for t in row] == list(wrow)
        assert max(abs(t[0] - wrow[t[1]]) for t in row) <= TOL
    assert "input_token_logprobs" not in meta, "logprob_start_len -1: the output's only"


def test_prompt_logprobs_from_a_start(http: httpx.Client, tok: ServerTokenizer) -> None:
    ids = tok.encode(PROMPT)
    out = generate(http, input_ids=ids, sampling_params=GREEDY, return_logprob=True,
                   logprob_start_len=0, top_logprobs_num=2)
    rows = out["meta_info"]["input_token_logprobs"]
    assert [r[1] for r in rows] == ids and rows[0][0] is None and rows[0][2] is None
    echo = http.post("/v1/completions", json={"prompt": ids, "max_tokens": 1, "temperature": 0,
                                              "echo": True, "logprobs": 2}).json()
    want = echo["choices"][0]["logprobs"]["token_logprobs"][:len(ids)]
    assert max(abs(r[0] - w) for r, w in zip(rows[1:], want[1:], strict=True)) <= TOL
    tops = out["meta_info"]["input_top_logprobs"]
    assert tops[0] is None and all(len(row) == 2 for row in tops[1:])
    later = generate(http, input_ids=ids, sampling_params=GREEDY, return_logprob=True,
                     logprob_start_len=3)["meta_info"]["input_token_logprobs"]
    assert [r[1] for r in later] == ids[3:]
    assert max(abs(a[0] - b[0]) for a, b in zip(later, rows[3:], strict=True)) <= TOL


def test_stop_reasons_name_what_matched(http: httpx.Client, tok: ServerTokenizer) -> None:
    full = generate(http, text=PROMPT, sampling_params={**GREEDY, "max_new_tokens": 12})
    text = full["text"]
    stop = next(text[i:i + 2] for i in range(2, len(text) - 2) if text[i:i + 2].strip()
                and text[i:i + 2] not in text[:i + 1])
    out = generate(http, text=PROMPT, sampling_params={**GREEDY, "max_new_tokens": 12,
                                                       "stop": [stop]})
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert out["text"] == text[:text.index(stop)]
    kept = generate(http, text=PROMPT, sampling_params={**GREEDY, "max_new_tokens": 12,
                                                        "stop": [stop], "no_stop_trim": True})
    assert kept["text"] == text[:text.index(stop) + len(stop)]
    token = full["output_ids"][3]
    by_token = {**GREEDY, "max_new_tokens": 12, "stop_token_ids": [token]}
    out = generate(http, text=PROMPT, sampling_params=by_token)
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": token}
    # SGLang's trim: output_ids keep the stop token, the text drops it
    assert out["output_ids"][-1] == token and out["text"] == tok.decode(out["output_ids"][:-1])
    cmpl = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 12, "temperature": 0,
                                              "ignore_eos": True, "stop_token_ids": [token]})
    assert cmpl.json()["choices"][0]["text"] == tok.decode(out["output_ids"]), "vLLM's: kept"
    kept = generate(http, text=PROMPT, sampling_params={**by_token, "no_stop_trim": True,
                                                        "skip_special_tokens": False})
    assert kept["text"] == tok.decode(kept["output_ids"])
    done = generate(http, text=PROMPT, sampling_params={**GREEDY, "regex": "[0-9]{3}"})
    assert done["meta_info"]["finish_reason"] == {"type": "stop", "matched": None}, \
        "a grammar's completion is no matched stop"
    assert len(done["text"]) == 3 and done["text"].isdigit()


def stream_events(http: httpx.Client, body: dict[str, Any]) -> list[Any]:
    events = []
    with http.stream("POST", "/generate", json={**body, "stream": True}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(line[len("data: "):])
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def test_stream_is_cumulative(http: httpx.Client) -> None:
    want = generate(http, text=PROMPT, sampling_params=GREEDY, return_logprob=True)
    events = stream_events(http, {"text": PROMPT, "sampling_params": GREEDY,
                                  "return_logprob": True})
    counts = [e["meta_info"]["completion_tokens"] for e in events]
    assert counts == sorted(counts) and counts[-1] == 8 and len(events) >= 2
    for e in events:
        assert want["text"].startswith(e["text"]) and e["index"] == 0
        assert e["output_ids"] == want["output_ids"][:len(e["output_ids"])]
    assert [e["meta_info"]["finish_reason"] for e in events[:-1]] == [None] * (len(events) - 1)
    last = events[-1]
    assert last["text"] == want["text"] and last["meta_info"]["finish_reason"]["type"] == "length"
    streamed = [t for e in events for t in e["meta_info"]["output_token_logprobs"]]
    assert [t[1] for t in streamed] == want["output_ids"]
    assert max(abs(a[0] - b[0]) for a, b in zip(
        streamed, want["meta_info"]["output_token_logprobs"], strict=True)) <= TOL


def test_abort_request_by_rid(http: httpx.Client, server: ServerProcess) -> None:
    """A long stream under rid "long": a second request with that rid is a 400 while it runs;
    /abort_request ends it with {"type": "abort"}."""
    body = {"text": PROMPT, "rid": "long", "sampling_params": {"max_new_tokens": 1500,
                                                               "ignore_eos": True}}
    events: list[Any] = []
    runner = threading.Thread(target=lambda: events.extend(stream_events(http, body)))
    runner.start()
    deadline = time.monotonic() + 60
    while http.get("/v1/engine_stats").json()["num_jobs"] == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert error_of(http, {**body, "stream": False})[0] == "rid"
    r = http.post("/abort_request", json={"rid": "long"})
    assert r.status_code == 200 and r.json()["aborted"] == ["long"]
    runner.join(60)
    assert events[-1]["meta_info"]["finish_reason"] == {"type": "abort", "message": "aborted"}
    assert events[-1]["meta_info"]["completion_tokens"] < 1500
    assert http.post("/abort_request", json={"rid": "gone"}).json()["aborted"] == []
    assert_pools_free(server.wait_idle(), server.initial)


@pytest.mark.parametrize(("body", "param"), [
    ({"text": PROMPT, "input_ids": [1, 2]}, "text"),
    ({"sampling_params": GREEDY}, "text"),
    ({"text": PROMPT, "sampling_params": {"min_new_tokens": 2}},
     "sampling_params.min_new_tokens"),
    ({"text": PROMPT, "return_logprob": True, "logprob_start_len": 10_000}, "logprob_start_len"),
    ({"text": PROMPT, "return_routed_experts": True}, "return_routed_experts"),
    ({"text": PROMPT, "sampling_params": {"temperature": -1.0}}, "temperature"),
    ({"text": PROMPT, "sampling_params": [GREEDY]}, "sampling_params"),
])
def test_bad_requests_name_the_field(http: httpx.Client, body: dict[str, Any],
                                     param: str) -> None:
    """The field in `param`, or (SamplingParams' range checks) in the message."""
    got, message = error_of(http, body)
    assert got == param or (got is None and param in message), (got, message)


def test_info_and_deep_health(http: httpx.Client) -> None:
    """/get_model_info, /get_server_info (/server_info) and /health_generate, as SGLang clients
    (routers, bench_serving) read them; no server path or key in them."""
    assert http.get("/health_generate").status_code == 200
    info = http.get("/get_model_info").json()
    assert info == {"model_path": "dsv4-tiny", "tokenizer_path": "dsv4-tiny",
                    "is_generation": True}
    server = http.get("/get_server_info").json()
    assert server["model_path"] == "dsv4-tiny" and "api_key" not in server and "model" not in server
    assert server["context_length"] == 2048 and server["max_running_requests"] == 64
    states = server["internal_states"]
    assert len(states) == 1 and states[0]["avg_spec_accept_length"] is None
    assert states[0]["steps"] > 0, "the engine's counters"
    assert http.get("/server_info").json()["version"] == server["version"]
    assert http.get("/flush_cache").status_code == 200, "SGLang's clients flush with GET too"
