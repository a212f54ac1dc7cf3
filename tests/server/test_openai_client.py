"""The official `openai` client against a real `dsv4 serve`: completions, chat, streaming, n > 1,
logprobs, stop, echo, seed reproducibility, and greedy output equal to `LLM.generate` on the same
prompt."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from dsv4 import LLM, SamplingParams
from dsv4.server.chat_template import ChatTemplate
from dsv4.server.protocol import ChatMessage
from dsv4.server.tokenizer import ServerTokenizer

from .conftest import ServerProcess, assert_pools_free

MODEL = "dsv4-tiny"
PROMPT = "def fibonacci(n):\n    "
NO_EOS = {"ignore_eos": True}


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0,
                       timeout=60.0) as c:
        yield c


@pytest.fixture(scope="module")
def llm(model_path: Path) -> LLM:
    return LLM(model_path, dtype="float32", device="cpu", page_size=128, max_total_tokens=4096)


def test_models_lists_the_embedded_trained_model(client: openai.OpenAI,
                                                 server: ServerProcess) -> None:
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL]
    card = httpx.get(f"{server.url}/v1/models").json()["data"][0]
    assert card["random_weights"] is False and card["max_model_len"] == 2048
    assert card["root"] == MODEL, "no server path in the model card"
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")


def test_completion_shape_and_usage(client: openai.OpenAI, server: ServerProcess) -> None:
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0,
                                    extra_body=NO_EOS)
    prompt_len = len(ServerTokenizer.from_checkpoint(server_model(server)).encode(PROMPT))
    assert out.id.startswith("cmpl-") and out.object == "text_completion" and out.model == MODEL
    assert out.created > 0 and len(out.choices) == 1 and out.choices[0].index == 0
    assert out.choices[0].finish_reason == "length" and out.choices[0].text
    assert out.usage is not None
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (prompt_len, 8)
    assert out.usage.total_tokens == prompt_len + 8
    assert (out.usage.prompt_tokens_details is not None
            and out.usage.prompt_tokens_details.cached_tokens == 0)
    assert out.usage.completion_tokens_details is None     # no speculation: no draft counts


def test_greedy_completion_equals_llm_generate(client: openai.OpenAI, llm: LLM) -> None:
    expected = llm.generate(PROMPT, SamplingParams(max_tokens=24, temperature=0.0),
                            use_tqdm=False)[0]
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0)
    assert out.choices[0].text == expected.text
    assert out.usage is not None and out.usage.completion_tokens == len(expected.token_ids)
    assert out.choices[0].finish_reason == expected.finish_reason
    by_ids = client.completions.create(model=MODEL, prompt=expected.prompt_token_ids, max_tokens=24,
                                       temperature=0)
    assert by_ids.choices[0].text == expected.text


def test_greedy_chat_equals_llm_generate(client: openai.OpenAI, llm: LLM,
                                         server: ServerProcess) -> None:
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "What is a heap?"}]
    text = ChatTemplate.from_checkpoint(server_model(server)).render([ChatMessage(**m)
                                                                       for m in messages])
    ids = ServerTokenizer.from_checkpoint(server_model(server)).encode(text,
                                                                      add_special_tokens=False)
    expected = llm.generate(prompt_token_ids=[ids],
                            sampling_params=SamplingParams(max_tokens=20, temperature=0.0),
                            use_tqdm=False)[0]
    out = client.chat.completions.create(model=MODEL, messages=messages,  # type: ignore[arg-type]
                                         max_tokens=20, temperature=0)
    assert out.id.startswith("chatcmpl-") and out.object == "chat.completion"
    assert out.choices[0].message.role == "assistant"
    assert out.choices[0].message.content == expected.text
    assert out.usage is not None and out.usage.prompt_tokens == len(ids)


def test_streaming_completion_equals_non_streaming(client: openai.OpenAI) -> None:
    full = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0,
                                     extra_body=NO_EOS)
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16,
                                            temperature=0, stream=True,
                                            stream_options={"include_usage": True},
                                            extra_body=NO_EOS))
    text_chunks = [c for c in chunks if c.choices]
    assert "".join(c.choices[0].text for c in text_chunks) == full.choices[0].text
    assert text_chunks[-1].choices[0].finish_reason == "length"
    assert all(c.choices[0].finish_reason is None for c in text_chunks[:-1])
    assert (chunks[-1].choices == [] and chunks[-1].usage is not None
            and chunks[-1].usage.completion_tokens == 16)


def test_streaming_chat(client: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": "Count to five."}]
    full = client.chat.completions.create(model=MODEL, messages=messages,  # type: ignore[arg-type]
                                          max_tokens=12, temperature=0, extra_body=NO_EOS)
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages,  # type: ignore[arg-type]
                                                 max_tokens=12, temperature=0, stream=True,
                                                 stream_options={"include_usage": True},
                                                 extra_body=NO_EOS))
    assert (chunks[0].object == "chat.completion.chunk"
            and chunks[0].choices[0].delta.role == "assistant")
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content == full.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 12


def test_n_samples_differ_and_seed_reproduces_them(client: openai.OpenAI) -> None:
    def sample(n: int, seed: int) -> list[str]:
        out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=1.0,
                                        n=n, seed=seed, extra_body=NO_EOS)
        assert [c.index for c in out.choices] == list(range(n))
        assert out.usage is not None and out.usage.completion_tokens == 12 * n
        return [c.text for c in out.choices]

    first = sample(4, seed=1234)
    assert len(set(first)) > 1, first
    assert sample(4, seed=1234) == first
    assert sample(1, seed=1234) == first[:1]
    assert sample(4, seed=99) != first


def test_chat_n_and_seed(client: openai.OpenAI) -> None:
    def sample(seed: int) -> list[str | None]:
        out = client.chat.completions.create(model=MODEL,  # type: ignore[arg-type]
                                             messages=[{"role": "user", "content": "Hi"}],
                                             n=2, max_tokens=10, temperature=1.0, seed=seed,
                                             extra_body=NO_EOS)
        return [c.message.content for c in out.choices]

    first = sample(7)
    assert len(first) == 2 and first[0] != first[1]
    assert sample(7) == first


def test_completion_logprobs(client: openai.OpenAI) -> None:
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0,
                                    logprobs=3, extra_body=NO_EOS)
    lp = out.choices[0].logprobs
    assert lp is not None and lp.tokens is not None and lp.token_logprobs is not None
    assert lp.top_logprobs is not None and lp.text_offset is not None
    assert (len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs)
            == len(lp.text_offset) == 6)
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs, strict=True):
        assert chosen is not None and chosen <= 0 and top is not None and 1 <= len(top) <= 3
        # greedy picks the raw argmax (top is keyed by token text, so two byte tokens may share a
        # key)
        assert chosen >= max(top.values()) - 1e-5


def test_chat_logprobs(client: openai.OpenAI) -> None:
    out = client.chat.completions.create(model=MODEL,  # type: ignore[arg-type]
                                         messages=[{"role": "user", "content": "Hi"}],
                                         max_tokens=5, temperature=0, logprobs=True,
                                         top_logprobs=2, extra_body=NO_EOS)
    content = out.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and len(content) == 5
    for entry in content:
        assert entry.logprob <= 0 and entry.bytes and len(entry.top_logprobs) == 2
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob, abs=1e-5)
    plain = client.chat.completions.create(model=MODEL,  # type: ignore[arg-type]
                                           messages=[{"role": "user", "content": "Hi"}],
                                           max_tokens=2)
    assert plain.choices[0].logprobs is None


def test_logit_bias(client: openai.OpenAI, llm: LLM) -> None:
    """-100 on the first greedy token changes it; +100 on another forces it (the server's text
    equals offline generation with the same bias); out-of-range values and keys that are not
    token ids of the vocabulary are 400s naming logit_bias."""
    plain = llm.generate(PROMPT, SamplingParams(max_tokens=1, temperature=0.0),
                         use_tqdm=False)[0].token_ids[0]
    for bias, n in (({plain: -100.0}, 1), ({7: 100.0}, 3)):
        offline = llm.generate(PROMPT, SamplingParams.create(max_tokens=n, temperature=0.0,
                                                             logit_bias=bias),
                               use_tqdm=False)[0]
        served = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=n,
                                           temperature=0,
                                           logit_bias={str(k): v for k, v in bias.items()})
        assert served.choices[0].text == offline.text
        if n == 1:
            assert offline.token_ids != [plain]
        else:
            assert offline.token_ids == [7, 7, 7]
    for bad in ({"7": 101}, {"x": 1}, {"99999999": 1}):
        with pytest.raises(openai.BadRequestError, match="logit_bias"):
            client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1, logit_bias=bad)


def test_prompt_plus_max_tokens_over_the_context_is_a_400(client: openai.OpenAI) -> None:
    """vLLM's answer: the message names the context length and both numbers."""
    for max_tokens in (10**9, 2048):
        with pytest.raises(openai.BadRequestError, match=r"maximum context length is 2048 tokens"
                           r".*\(\d+ in the prompt, \d+ in the completion\)") as info:
            client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=max_tokens)
        assert info.value.body["param"] == "max_tokens"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        client.chat.completions.create(model=MODEL, max_tokens=5000,
                                       messages=[{"role": "user", "content": "What is 1+1?"}])


def test_stop_string_cuts_the_text(client: openai.OpenAI, server: ServerProcess) -> None:
    """Stop strings are applied in the API process: the text ends before the stop string, the tokens
    after the one that completed it are not reported, and the engine is told to finish the request
    (a finish, not an abort)."""
    full = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0,
                                     extra_body=NO_EOS).choices[0].text
    k = next(k for k in range(3, len(full) - 3)
             if full.find(full[k:k + 3]) == k and "\ufffd" not in full[k:k + 3])
    stop = full[k:k + 3]
    before = server.wait_idle()
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0,
                                    stop=[stop, "@@@@"], extra_body=NO_EOS, logprobs=0)
    assert out.choices[0].text == full[:k] and out.choices[0].finish_reason == "stop"
    assert out.usage is not None and out.usage.completion_tokens < 24
    assert out.choices[0].logprobs is not None
    assert len(out.choices[0].logprobs.tokens or []) == out.usage.completion_tokens
    # the last token completed the stop string
    assert stop in "".join(out.choices[0].logprobs.tokens or [])
    streamed = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0,
                                         stop=stop, stream=True, extra_body=NO_EOS)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == full[:k]
    after = server.wait_idle()
    assert (after["num_finished"] - before["num_finished"] == 2
            and after["num_aborted"] == before["num_aborted"])


def test_echo_and_batched_prompts(client: openai.OpenAI) -> None:
    out = client.completions.create(model=MODEL, prompt=["import os", "class A:"], n=2,
                                    max_tokens=4, temperature=0, echo=True, extra_body=NO_EOS)
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    assert (out.choices[0].text.startswith("import os")
            and out.choices[2].text.startswith("class A:"))
    assert out.choices[0].text == out.choices[1].text     # greedy: both samples of a prompt agree


def test_repeated_prompt_reports_cached_tokens(client: openai.OpenAI) -> None:
    prompt = "class PrefixCacheProbe:\n" + "    def method(self, x):\n        return x * 2\n" * 12
    first = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    second = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    assert first.usage is not None and second.usage is not None
    assert first.usage.prompt_tokens_details.cached_tokens == 0  # type: ignore[union-attr]
    cached = second.usage.prompt_tokens_details.cached_tokens  # type: ignore[union-attr]
    assert 0 < cached < second.usage.prompt_tokens, second.usage
    assert second.choices[0].text == first.choices[0].text


def test_abort_endpoint_ends_a_running_stream(server: ServerProcess) -> None:
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 2000, "stream": True,
            "ignore_eos": True}
    finish = []
    with httpx.Client(base_url=server.url, timeout=60.0) as http, \
            http.stream("POST", "/v1/completions", json=body) as r:
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line.removeprefix("data: "))
            if not finish:
                assert http.post("/v1/abort",
                                 json={"request_id": chunk["id"]}).json()["aborted"] is True
            finish.append(chunk["choices"][0]["finish_reason"])
    assert finish[-1] == "abort" and len(finish) < 2000


def test_metrics_exposition(server: ServerProcess) -> None:
    # a repeated prompt of its own: the hit rate must not depend on which tests ran before on
    # this server (pytest-xdist spreads them over workers)
    prompt = "class MetricsProbe:\n" + "    def method(self, x):\n        return x + 1\n" * 12
    for _ in range(2):
        httpx.post(f"{server.url}/v1/completions", timeout=60.0,
                   json={"model": MODEL, "prompt": prompt, "max_tokens": 2, "temperature": 0})
    text = httpx.get(f"{server.url}/metrics").text
    for name in ("dsv4_requests_running", "dsv4_requests_waiting",
                 "dsv4_generation_tokens_per_second", "dsv4_time_to_first_token_seconds_bucket",
                 "dsv4_time_per_output_token_seconds_count", "dsv4_prefix_cache_hit_rate",
                 'dsv4_kv_pages_free{pool="full"}', 'dsv4_kv_cache_usage{pool="swa"}'):
        assert name in text, name
    values = {line.split()[0]: float(line.split()[1]) for line in text.splitlines()
              if not line.startswith("#")}
    assert values["dsv4_generation_tokens_total"] > 0 and values["dsv4_prefix_cache_hit_rate"] > 0
    assert "dsv4_spec_" not in text      # the series of speculative decoding only when it is on


def test_pools_are_free_after_the_module(server: ServerProcess) -> None:
    assert_pools_free(server.wait_idle(), server.initial)


def server_model(server: ServerProcess) -> str:
    """The checkpoint the test server serves (the shipped dsv4-tiny; /v1/models names it only)."""
    from dsv4.assets import default_model_path

    assert httpx.get(f"{server.url}/v1/models").json()["data"][0]["root"] == MODEL
    return str(default_model_path())
