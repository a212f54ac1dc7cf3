"""Tool calling and reasoning: DeepSeek-V4's chat encoding (worked examples of the official
format), DSML tool-call parsing (whole and streamed), the tool-call grammar, the reasoning split,
and the server end to end with the openai client (tool_choice required / named / none, streaming
deltas equal to the non-streaming message, multi-turn tool conversations, thinking mode)."""

from __future__ import annotations

import json
import random
import shutil
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pytest

from dsv4.server.chat_output import ChoiceParser, parse_choice
from dsv4.server.dsv4_encoding import encode_chat, render_tool_calls
from dsv4.server.tokenizer import ServerTokenizer
from dsv4.server.tool_calls import ToolCallStream, parse_tool_calls, tool_call_grammar

from .conftest import ServerProcess, running_server

BOS, EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
U, A, D = "<｜User｜>", "<｜Assistant｜>", "｜DSML｜"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 12},
        "days": {"type": "integer", "minimum": 1, "maximum": 7}},
        "required": ["city", "days"]}}}
ADD = {"type": "function", "function": {
    "name": "add", "parameters": {"type": "object", "properties": {
        "a": {"type": "integer", "minimum": 0, "maximum": 99},
        "b": {"type": "integer", "minimum": 0, "maximum": 99}}, "required": ["a", "b"]}}}
CALL = {"id": "call_1", "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 3}'}}
BLOCK = (f'<{D}tool_calls>\n<{D}invoke name="get_weather">\n'
         f'<{D}parameter name="city" string="true">Paris</{D}parameter>\n'
         f'<{D}parameter name="days" string="false">3</{D}parameter>\n'
         f"</{D}invoke>\n</{D}tool_calls>")


# ---- the encoding ---------------------------------------------------------------------------

def test_encoding_chat_turns() -> None:
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "2+2?"}]
    assert encode_chat(msgs) == (f"{BOS}Be brief.{U}Hi{A}</think>Hello{EOS}{U}2+2?{A}</think>")


def test_encoding_thinking_keeps_only_the_last_turns_reasoning() -> None:
    msgs = [{"role": "user", "content": "Q1"},
            {"role": "assistant", "content": "A1", "reasoning_content": "r1"},
            {"role": "user", "content": "Q2"},
            {"role": "assistant", "content": "A2", "reasoning_content": "r2"}]
    assert encode_chat(msgs, thinking=True, add_generation_prompt=False) == (
        f"{BOS}{U}Q1{A}</think>A1{EOS}{U}Q2{A}<think>r2</think>A2{EOS}")
    assert encode_chat(msgs[:3], thinking=True) == f"{BOS}{U}Q1{A}</think>A1{EOS}{U}Q2{A}<think>"


def test_encoding_tools_calls_and_results() -> None:
    second = dict(CALL, id="call_2",
                  function={"name": "get_weather", "arguments": '{"city": "Oslo", "days": 1}'})
    msgs = [{"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": "", "tool_calls": [CALL, second]},
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
            {"role": "tool", "tool_call_id": "call_2", "content": "rain"},
            {"role": "user", "content": "And now?"}]
    text = encode_chat(msgs, tools=[WEATHER])
    head, _, rest = text.partition(f"{U}Weather?")
    assert head.startswith(f"{BOS}\n\n## Tools\n") and json.dumps(WEATHER["function"]) in head
    oslo = BLOCK.replace("Paris", "Oslo").replace(">3<", ">1<")
    calls = BLOCK.replace(f"\n</{D}tool_calls>", "") + "\n" + oslo.replace(f"<{D}tool_calls>\n", "")
    assert rest == (f"{A}</think>\n\n{calls}{EOS}"
                    f"{U}<tool_result>sunny</tool_result>\n\n<tool_result>rain</tool_result>"
                    f"\n\nAnd now?{A}</think>")
    assert render_tool_calls([CALL]) == BLOCK


@pytest.mark.parametrize(("msgs", "message"), [
    ([{"role": "user", "content": "x"}, {"role": "tool", "content": "y"}],
     "without a preceding assistant tool call"),
    ([{"role": "assistant", "content": "", "tool_calls": [CALL]},
      {"role": "tool", "tool_call_id": "nope", "content": "y"}], "names no call"),
])
def test_encoding_rejects_orphan_tool_results(msgs: list[dict[str, Any]], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        encode_chat(msgs)


# ---- parsing ----------------------------------------------------------------------------------

def test_parse_tool_calls() -> None:
    content, calls = parse_tool_calls("Checking.\n\n" + BLOCK)
    assert content == "Checking." and len(calls) == 1
    assert calls[0]["function"] == {"name": "get_weather",
                                    "arguments": json.dumps({"city": "Paris", "days": 3})}
    assert calls[0]["id"].startswith("call_") and calls[0]["type"] == "function"
    for bad in (BLOCK.replace(">3<", ">3x<"), BLOCK[:-5], BLOCK + "tail",
                BLOCK.replace("invoke name", "invoke nom")):
        assert parse_tool_calls("Hi " + bad) == ("Hi " + bad, [])
    assert parse_tool_calls(BLOCK, names={"add"}) == (BLOCK, [])


@pytest.mark.parametrize("text", ["plain answer", "Checking.\n\n" + BLOCK, "x\n\n" + BLOCK[:-3],
                                  "a <｜DSML｜ not a call", "\n\n" + BLOCK])
def test_streamed_tool_calls_equal_the_whole_parse(text: str) -> None:
    whole_content, whole_calls = parse_tool_calls(text)
    rng = random.Random(0)
    for _ in range(20):
        stream, out, i = ToolCallStream(), "", 0
        while i < len(text):
            step = rng.randint(1, 7)
            out += stream.feed(text[i:i + step])
            i += step
        rest, calls = stream.finish()
        assert out + rest == whole_content
        assert [c["function"] for c in calls] == [c["function"] for c in whole_calls]


@pytest.mark.parametrize("text", ["think hard</think>The answer.\n\n" + BLOCK,
                                  "unfinished reason", "r</thi", "</think>", "a</think>b"])
def test_streamed_reasoning_equals_the_whole_parse(text: str) -> None:
    whole = parse_choice(text, True, {"get_weather"})
    rng = random.Random(1)
    for _ in range(20):
        parser, r, c, i = ChoiceParser(True, {"get_weather"}), "", "", 0
        while i < len(text):
            step = rng.randint(1, 5)
            dr, dc = parser.feed(text[i:i + step])
            r, c, i = r + dr, c + dc, i + step
        fr, fc, calls = parser.finish()
        assert (r + fr, c + fc) == whole[:2]
        assert [x["function"] for x in calls] == [x["function"] for x in whole[2]]
    if "</think>" not in text:
        assert whole == (text, "", [])


def test_tool_call_grammar_accepts_valid_calls_only() -> None:
    import xgrammar as xgr
    compiled = xgr.GrammarCompiler(xgr.TokenizerInfo([])).compile_grammar(
        tool_call_grammar([WEATHER, ADD]))

    def matches(text: str) -> bool:
        m = xgr.GrammarMatcher(compiled, terminate_without_stop_token=True)
        return bool(m.accept_string(text)) and m.is_terminated()

    assert matches(BLOCK)
    two = BLOCK.replace(f"\n</{D}tool_calls>", "") + (
        f'\n<{D}invoke name="add">\n<{D}parameter name="a" string="false">1</{D}parameter>\n'
        f'<{D}parameter name="b" string="false">2</{D}parameter>\n</{D}invoke>\n</{D}tool_calls>')
    assert matches(two)
    assert not matches(BLOCK.replace(">3<", ">9<"))                # days > maximum
    assert not matches(BLOCK.replace(f'\n<{D}parameter name="days"', "x"))   # required missing
    assert not matches(BLOCK.replace("get_weather", "get_time"))


CALL_TOKENS = 480   # dsv4-tiny's 4K vocabulary spends ~3 tokens per full-width DSML character

# ---- the server -----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def client(server: ServerProcess) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0,
                       timeout=60.0) as c:
        yield c


def _chat(client: openai.OpenAI, messages: list[dict[str, Any]] | str, **kw: Any) -> Any:
    msgs = [{"role": "user", "content": messages}] if isinstance(messages, str) else messages
    kw = {"max_tokens": 96, "temperature": 0, **kw}
    return client.chat.completions.create(model="dsv4-tiny", messages=msgs, **kw)  # type: ignore


def test_required_and_named_tool_choice_return_valid_calls(client: openai.OpenAI) -> None:
    """Both requests are in flight together (the server batches them, each under its own
    grammar); each returns valid calls of the tools it allows."""
    choices = (("required", {"get_weather", "add"}),
               ({"type": "function", "function": {"name": "add"}}, {"add"}))
    with ThreadPoolExecutor(len(choices)) as pool:
        outs = list(pool.map(lambda choice: _chat(
            client, "What is 12+7?", tools=[WEATHER, ADD], tool_choice=choice,
            max_tokens=CALL_TOKENS), [choice for choice, _ in choices]))
    for out, (_, names) in zip(outs, choices, strict=True):
        msg = out.choices[0].message
        assert out.choices[0].finish_reason == "tool_calls" and msg.tool_calls, msg
        schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, ADD)}
        for call in msg.tool_calls:
            assert call.type == "function" and call.function.name in names
            jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])


def test_streamed_tool_calls_reassemble(client: openai.OpenAI) -> None:
    kw = {"tools": [WEATHER], "tool_choice": "required", "max_tokens": CALL_TOKENS}
    whole = _chat(client, "Weather in Oslo?", **kw).choices[0]
    chunks = list(_chat(client, "Weather in Oslo?", stream=True, **kw))
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    calls = [t for c in chunks if c.choices for t in c.choices[0].delta.tool_calls or []]
    assert content == (whole.message.content or "")
    assert [(t.index, t.function.name, t.function.arguments) for t in calls] == [
        (i, t.function.name, t.function.arguments) for i, t in enumerate(whole.message.tool_calls)]
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"


def test_tool_choice_none_and_auto_keep_text(client: openai.OpenAI) -> None:
    for choice in ("none", "auto"):
        out = _chat(client, "What is 2+3?", tools=[ADD], tool_choice=choice, max_tokens=8)
        assert out.choices[0].message.tool_calls is None
        assert out.choices[0].finish_reason in ("stop", "length")


def test_multi_turn_tool_conversation_is_accepted(client: openai.OpenAI) -> None:
    msgs = [{"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": None, "tool_calls": [CALL]},
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    out = _chat(client, msgs, tools=[WEATHER], max_tokens=8)
    assert out.choices[0].finish_reason in ("stop", "length", "tool_calls")


@pytest.mark.parametrize(("kw", "param"), [
    ({"tools": [{"type": "function"}]}, "tools"),
    ({"tools": [ADD], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [ADD], "tool_choice": "required", "response_format": {"type": "json_object"}},
     "tool_choice"),
    ({"messages": [{"role": "assistant", "content": "", "tool_calls": [{"function": {}}]}]},
     "messages[0].tool_calls"),
])
def test_bad_tool_requests_are_400(client: openai.OpenAI, kw: dict[str, Any], param: str) -> None:
    msgs = kw.pop("messages", "hi")
    with pytest.raises(openai.BadRequestError) as err:
        _chat(client, msgs, **kw)
    assert isinstance(err.value.body, dict) and err.value.body["param"] == param


@pytest.fixture(scope="module")
def v4_server(tmp_path_factory: pytest.TempPathFactory,
              model_path: Path) -> Iterator[ServerProcess]:
    """dsv4-tiny without a jinja chat template: the server renders DeepSeek-V4's encoding."""
    path = tmp_path_factory.mktemp("v4") / "model"
    shutil.copytree(model_path, path)
    cfg = json.loads((path / "tokenizer_config.json").read_text())
    cfg.pop("chat_template")
    (path / "tokenizer_config.json").write_text(json.dumps(cfg))
    with running_server(tmp_path_factory.mktemp("v4log"), "--model", str(path),
                        "--served-model-name", "dsv4-tiny") as srv:
        yield srv


def test_v4_encoding_server_renders_tools_and_splits_reasoning(v4_server: ServerProcess,
                                                               model_path: Path) -> None:
    with openai.OpenAI(base_url=f"{v4_server.url}/v1", api_key="x", max_retries=0) as client:
        msgs = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": None, "tool_calls": [CALL]},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
        out = _chat(client, msgs, tools=[WEATHER], max_tokens=4)
        plain = [dict(msgs[0]), dict(msgs[1], content=""), dict(msgs[2])]
        expected = ServerTokenizer.from_checkpoint(model_path).encode(
            encode_chat(plain, tools=[WEATHER]), add_special_tokens=False)
        assert out.usage is not None and out.usage.prompt_tokens == len(expected)
        kw = {"extra_body": {"chat_template_kwargs": {"thinking": True}}, "max_tokens": 24}
        whole = _chat(client, "What is 12+7?", **kw).choices[0].message
        chunks = list(_chat(client, "What is 12+7?", stream=True, **kw))
        deltas = [c.choices[0].delta for c in chunks if c.choices]
        reasoning = "".join(getattr(d, "reasoning_content", None) or "" for d in deltas)
        assert reasoning == whole.reasoning_content  # type: ignore[attr-defined]
        assert "".join(d.content or "" for d in deltas) == (whole.content or "")
