"""`dsv4 serve --speculative-num-steps 3` on the embedded dsv4-tiny, through the official `openai`
client: greedy completions and chat (streaming and not) equal the offline engine without
speculation; `usage.completion_tokens_details` reports the drafts accepted / rejected and agrees
with the engine's counters; `/metrics` and `/v1/engine_stats` carry the speculative series;
structured output (`response_format` json_schema: greedy equal to the offline engine, sampled
valid) and a forced tool call (named `tool_choice`) decode under their grammar. Also the startup
errors of the flag: an out-of-range value and a checkpoint without an MTP block."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import pytest
from openai.types import CompletionUsage
from openai.types.chat import ChatCompletionMessageParam

from dsv4 import LLM, SamplingParams
from dsv4.assets import default_model_path
from dsv4.checkpoint.presets import micro
from dsv4.checkpoint.writer import write_checkpoint
from dsv4.cli.main import build_parser
from dsv4.cli.serve import build_config
from dsv4.engine.sampling_params import StructuredOutput
from dsv4.server.chat_template import ChatTemplate
from dsv4.server.protocol import ChatMessage
from dsv4.server.tokenizer import ServerTokenizer

from .conftest import ServerProcess, assert_pools_free, refused_serve, running_server
from .test_tools import ADD, CALL_TOKENS

N = 3
MODEL = "dsv4-tiny"
PROMPT = "def fibonacci(n):\n    "
USER = "Count to five."
MESSAGES: list[ChatCompletionMessageParam] = [{"role": "user", "content": USER}]
MAX_TOKENS = 24
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
NO_EOS = {"ignore_eos": True}
SCHEMA = {"type": "object", "properties": {
    "answer": {"type": "integer", "minimum": 0, "maximum": 999},
    "unit": {"enum": ["apples", "pears"]}}, "required": ["answer", "unit"]}


@pytest.fixture(scope="module")
def spec_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    with running_server(tmp_path_factory.mktemp("spec"), "--speculative-num-steps", str(N),
                        "--shutdown-timeout", "5") as srv:
        yield srv


@pytest.fixture(scope="module")
def client(spec_server: ServerProcess) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{spec_server.url}/v1", api_key="unused", max_retries=0,
                       timeout=60.0) as c:
        yield c


@pytest.fixture(scope="module")
def llm(model_path: Path) -> LLM:
    """The offline engine without speculation: the reference output."""
    return LLM(model_path, dtype="float32", device="cpu", page_size=128, max_total_tokens=4096)


@pytest.fixture(scope="module")
def expected(llm: LLM) -> str:
    """The offline engine's greedy text of PROMPT (the completion tests' reference)."""
    return llm.generate(PROMPT, GREEDY, use_tqdm=False)[0].text


def drafts_of(usage: CompletionUsage | None) -> tuple[int, int]:
    """(drafts verified, drafts accepted) of a response's usage, checked for consistency."""
    assert usage is not None and usage.completion_tokens_details is not None, usage
    accepted = usage.completion_tokens_details.accepted_prediction_tokens
    rejected = usage.completion_tokens_details.rejected_prediction_tokens
    assert accepted is not None and rejected is not None, usage
    assert accepted >= 0 and rejected >= 0, usage
    return accepted + rejected, accepted


def assert_accounted(usage: CompletionUsage | None) -> None:
    """One request alone on the server drafts N tokens at every verify pass; its first token comes
    from the prefill and each pass emits its accepted drafts + 1, so the tokens emitted reach
    max_tokens, overshooting by at most N on the last pass."""
    drafts, accepted = drafts_of(usage)
    assert usage is not None and usage.completion_tokens == MAX_TOKENS
    assert drafts > 0 and drafts % N == 0, usage
    assert 0 <= 1 + drafts // N + accepted - MAX_TOKENS <= N, usage


def test_greedy_completion_equals_plain_engine_and_usage_matches_the_engine(
        client: openai.OpenAI, spec_server: ServerProcess, expected: str) -> None:
    before = spec_server.engine_stats()
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=MAX_TOKENS,
                                    temperature=0, extra_body=NO_EOS)
    after = spec_server.engine_stats()
    assert out.choices[0].text == expected and out.choices[0].finish_reason == "length"
    assert_accounted(out.usage)
    drafts, accepted = drafts_of(out.usage)
    assert after["spec_draft_tokens"] - before["spec_draft_tokens"] == drafts
    assert after["spec_accepted_tokens"] - before["spec_accepted_tokens"] == accepted
    passes = [b - a for a, b in zip(before["spec_accept_hist"], after["spec_accept_hist"],
                                    strict=True)]
    assert sum(passes) * N == drafts and sum(k * n for k, n in enumerate(passes)) == accepted


def test_streaming_completion_reports_drafts_in_the_usage_chunk(client: openai.OpenAI,
                                                                expected: str) -> None:
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=MAX_TOKENS,
                                            temperature=0, stream=True,
                                            stream_options={"include_usage": True},
                                            extra_body=NO_EOS))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected
    assert all(c.usage is None for c in chunks[:-1]) and chunks[-1].choices == []
    assert_accounted(chunks[-1].usage)


def test_greedy_chat_equals_plain_engine(client: openai.OpenAI, spec_server: ServerProcess,
                                         llm: LLM) -> None:
    root = str(default_model_path())
    text = ChatTemplate.from_checkpoint(root).render([ChatMessage(role="user", content=USER)])
    ids = ServerTokenizer.from_checkpoint(root).encode(text, add_special_tokens=False)
    expected = llm.generate(prompt_token_ids=[ids], sampling_params=GREEDY, use_tqdm=False)[0]
    full = client.chat.completions.create(model=MODEL, messages=MESSAGES,
                                          max_tokens=MAX_TOKENS, temperature=0, extra_body=NO_EOS)
    assert full.choices[0].message.content == expected.text
    assert_accounted(full.usage)
    chunks = list(client.chat.completions.create(model=MODEL, messages=MESSAGES,
                                                 max_tokens=MAX_TOKENS, temperature=0, stream=True,
                                                 stream_options={"include_usage": True},
                                                 extra_body=NO_EOS))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected.text
    assert_accounted(chunks[-1].usage)


def _chat_ids(content: str) -> list[int]:
    root = str(default_model_path())
    text = ChatTemplate.from_checkpoint(root).render([ChatMessage(role="user", content=content)])
    return ServerTokenizer.from_checkpoint(root).encode(text, add_special_tokens=False)


def test_json_schema_output_equals_plain_engine(client: openai.OpenAI, llm: LLM) -> None:
    """Greedy: the offline engine's constrained text, without speculation; sampled: valid JSON.
    Each response verified drafts."""
    question = "What is 12+7?"
    params = SamplingParams(max_tokens=64, temperature=0.0,
                            structured=StructuredOutput("json_schema", json.dumps(SCHEMA)))
    expected = llm.generate(prompt_token_ids=[_chat_ids(question)], sampling_params=params,
                            use_tqdm=False)[0]
    fmt = {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA, "strict": True}}
    # one sampled request: a second seed takes the same sampled, grammar-masked verify path
    for temperature, seed in ((0.0, 0), (1.0, 1)):
        out = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": question}], max_tokens=64,
            temperature=temperature, seed=seed, response_format=fmt)  # type: ignore[arg-type]
        text = out.choices[0].message.content
        assert text is not None and out.choices[0].finish_reason == "stop", out
        jsonschema.validate(json.loads(text), SCHEMA)
        if temperature == 0:
            assert text == expected.text and expected.finish_reason == "stop"
        assert drafts_of(out.usage)[0] > 0


def test_named_tool_choice_returns_a_valid_call(client: openai.OpenAI) -> None:
    out = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "What is 12+7?"}], tools=[ADD],
        tool_choice={"type": "function", "function": {"name": "add"}}, max_tokens=CALL_TOKENS,
        temperature=0)  # type: ignore[arg-type]
    msg = out.choices[0].message
    assert out.choices[0].finish_reason == "tool_calls" and msg.tool_calls, msg
    for call in msg.tool_calls:
        assert call.type == "function" and call.function.name == "add"
        jsonschema.validate(json.loads(call.function.arguments),
                            ADD["function"]["parameters"])  # type: ignore[index]
    assert drafts_of(out.usage)[0] > 0


def test_sampled_n_choices_sum_their_drafts(client: openai.OpenAI,
                                            spec_server: ServerProcess) -> None:
    before = spec_server.engine_stats()
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=1.0,
                                    n=3, seed=11, extra_body=NO_EOS)
    after = spec_server.engine_stats()
    assert out.usage is not None and out.usage.completion_tokens == 3 * 12
    drafts, accepted = drafts_of(out.usage)
    assert drafts > 0
    assert after["spec_draft_tokens"] - before["spec_draft_tokens"] == drafts
    assert after["spec_accepted_tokens"] - before["spec_accepted_tokens"] == accepted


def test_metrics_and_engine_stats_carry_the_speculative_series(
        spec_server: ServerProcess) -> None:
    stats = spec_server.engine_stats()
    hist = stats["spec_accept_hist"]
    assert stats["spec_num_steps"] == N and len(hist) == N + 1 and sum(hist) > 0, stats
    assert stats["spec_draft_tokens"] == N * sum(hist), stats
    assert stats["spec_accepted_tokens"] == sum(k * n for k, n in enumerate(hist)), stats
    values = _metric_values(httpx.get(f"{spec_server.url}/metrics").text)
    assert values["dsv4_spec_num_steps"] == N
    assert [values[f'dsv4_spec_accepted_drafts_total{{accepted="{k}"}}']
            for k in range(N + 1)] == hist
    assert values["dsv4_spec_draft_tokens_total"] == stats["spec_draft_tokens"]
    assert values["dsv4_spec_accepted_tokens_total"] == stats["spec_accepted_tokens"]
    mean = values["dsv4_spec_mean_acceptance_length"]
    assert mean == pytest.approx(1 + stats["spec_accepted_tokens"] / sum(hist), abs=1e-6)
    assert 1 <= mean <= N + 1


def test_pools_are_free_after_the_module(spec_server: ServerProcess) -> None:
    assert_pools_free(spec_server.wait_idle(), spec_server.initial)


# ---- startup errors ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def no_mtp(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("no_mtp")
    write_checkpoint(micro().replace(num_mtp_layers=0), path, seed=0)
    return path


@pytest.mark.parametrize("value", ["9", "-1", "two"])
def test_serve_refuses_an_out_of_range_value(value: str,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(["serve", "--speculative-num-steps", value])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "--speculative-num-steps" in err and "[0, 8]" in err, err


def test_build_config_passes_the_flag_and_checks_for_mtp(no_mtp: Path) -> None:
    def config(*argv: str) -> Any:
        return build_config(build_parser().parse_args(["serve", "--device", "cpu", *argv]))

    assert config("--speculative-num-steps", str(N)).engine_config.speculative_num_steps == N
    assert config().engine_config.speculative_num_steps == 0
    assert config("--model", str(no_mtp)).speculative_num_steps == 0
    with pytest.raises(ValueError, match="--speculative-num-steps=2 needs a checkpoint with an"):
        config("--model", str(no_mtp), "--speculative-num-steps", "2")


def test_serve_without_mtp_exits_2_naming_the_flag(no_mtp: Path,
                                                   caplog: pytest.LogCaptureFixture) -> None:
    """`dsv4 serve`'s entry point, run in this process: refused before any process starts."""
    code, log = refused_serve(caplog, "--model", str(no_mtp), "--speculative-num-steps", "2")
    assert code == 2, log
    assert "--speculative-num-steps=2 needs a checkpoint with an MTP block" in log


def _metric_values(text: str) -> dict[str, float]:
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line and not line.startswith("#")}
