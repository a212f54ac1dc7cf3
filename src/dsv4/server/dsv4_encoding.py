"""DeepSeek-V4's chat encoding (the official release ships it as Python, not as a jinja template).

`encode_chat(messages, thinking, tools)` renders OpenAI-style messages into the V4 wire text:

    <bos>{system}[\\n\\n## Tools ...]                          system (tools attached to it)
    <｜User｜>{user}                                            user
    <｜User｜><tool_result>{r1}</tool_result>\\n\\n<tool_result>{r2}</tool_result>
                                                               tool results: one user turn
    <｜Assistant｜></think>{content}[\\n\\n<｜DSML｜tool_calls>...]<eos>   assistant
    <｜Assistant｜><think> | </think>                           the generation prompt

A user turn (or tool results) followed by an assistant turn or the generation prompt opens it with
`<｜Assistant｜>` and then `<think>` in thinking mode, `</think>` otherwise. In thinking mode the
last assistant turn after the last user turn keeps its `reasoning_content` (`{reasoning}</think>`
before the content); earlier turns drop it and open with `</think>`, unless the request has tools
(then every turn keeps its reasoning). Tool calls are DSML blocks:

    <｜DSML｜tool_calls>
    <｜DSML｜invoke name="NAME">
    <｜DSML｜parameter name="KEY" string="true">raw text</｜DSML｜parameter>
    <｜DSML｜parameter name="KEY" string="false">JSON value</｜DSML｜parameter>
    </｜DSML｜invoke>
    </｜DSML｜tool_calls>

Tool results are matched to their call by order; `tool_call_id`s, when given, must name a call of
the preceding assistant turn. Malformed input raises ValueError naming the message.

Test: `pytest tests/server/test_tools.py -k encoding`; checked against the official encoder with
`benchmarks/chat_encoding_check.py` (`benchmarks/results/chat_encoding_official_202612.md`).
"""

from __future__ import annotations

import json
from typing import Any

BOS, EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
USER, ASSISTANT = "<｜User｜>", "<｜Assistant｜>"
THINK, END_THINK = "<think>", "</think>"
DSML = "｜DSML｜"
TOOL_CALLS_OPEN, TOOL_CALLS_CLOSE = f"<{DSML}tool_calls>", f"</{DSML}tool_calls>"

_TOOLS_TEMPLATE = """## Tools

You have access to a set of tools to help answer the user's question. You can invoke tools by \
writing a "{open}" block like the following:

{open}
<{d}invoke name="$TOOL_NAME">
<{d}parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</{d}parameter>
...
</{d}invoke>
<{d}invoke name="$TOOL_NAME2">
...
</{d}invoke>
{close}

String parameters should be specified as is and set `string="true"`. For all other types \
(numbers, booleans, arrays, objects), pass the value in JSON format and set `string="false"`.

If thinking_mode is enabled (triggered by {think}), you MUST output your complete reasoning \
inside {think}...{end_think} BEFORE any tool calls or final response.

Otherwise, output directly after {end_think} with tool calls or final response.

### Available Tool Schemas

{schemas}

You MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.
"""


def render_tools(tools: list[dict[str, Any]]) -> str:
    """The tools section appended to the system prompt."""
    schemas = "\n".join(json.dumps(t["function"], ensure_ascii=False) for t in tools)
    return _TOOLS_TEMPLATE.format(open=TOOL_CALLS_OPEN, close=TOOL_CALLS_CLOSE, d=DSML,
                                  think=THINK, end_think=END_THINK, schemas=schemas)


def render_tool_calls(calls: list[dict[str, Any]]) -> str:
    """An assistant turn's calls (OpenAI shape, `arguments` a JSON object text) as one DSML
    block."""
    invokes = []
    for call in calls:
        fn = call["function"]
        args = json.loads(fn["arguments"]) if isinstance(fn["arguments"], str) else fn["arguments"]
        if not isinstance(args, dict):
            raise ValueError(f"tool call {fn['name']!r}: arguments must be a JSON object")
        params = [f'<{DSML}parameter name="{k}" string="{"true" if isinstance(v, str) else "false"}'
                  f'">{v if isinstance(v, str) else json.dumps(v, ensure_ascii=False)}'
                  f"</{DSML}parameter>" for k, v in args.items()]
        invokes.append(f'<{DSML}invoke name="{fn["name"]}">\n' + "\n".join(params)
                       + f"\n</{DSML}invoke>")
    return f"{TOOL_CALLS_OPEN}\n" + "\n".join(invokes) + f"\n{TOOL_CALLS_CLOSE}"


def encode_chat(messages: list[dict[str, Any]], thinking: bool = False,
                tools: list[dict[str, Any]] | None = None,
                add_generation_prompt: bool = True) -> str:
    """The V4 prompt text of `messages` (dicts with role, content, and for assistants
    reasoning_content / tool_calls, for tools tool_call_id); see the module docstring."""
    turns = _merge_tool_results(_with_tools(messages, tools))
    keep_reasoning = bool(tools)
    last_user = max((i for i, t in enumerate(turns) if t["role"] in ("user", "developer")),
                    default=-1)
    out = BOS
    for i, turn in enumerate(turns):
        role = turn["role"]
        if role == "system":
            out += turn["text"]
        elif role == "assistant":
            reasoning = ""
            if thinking and (keep_reasoning or i > last_user):
                reasoning = (turn.get("reasoning_content") or "") + END_THINK
            calls = turn.get("tool_calls") or []
            out += reasoning + turn["text"] + ("\n\n" + render_tool_calls(calls) if calls else "")
            out += EOS
        else:                                                  # user / developer / tool results
            out += USER + turn["text"]
            nxt = turns[i + 1]["role"] if i + 1 < len(turns) else None
            if nxt == "assistant" or (nxt is None and add_generation_prompt):
                opens = thinking and (keep_reasoning or i >= last_user)
                out += ASSISTANT + (THINK if opens else END_THINK)
    return out


def _with_tools(messages: list[dict[str, Any]],
                tools: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """Messages with `text`, the tools section appended to the first system message (one is
    inserted if there is none)."""
    out = [dict(m, text=m.get("content") or "") for m in messages]
    if tools:
        if not out or out[0]["role"] != "system":
            out.insert(0, {"role": "system", "text": ""})
        first = out[0]
        first["text"] = (first["text"] + "\n\n" if first["text"] else "\n\n") + render_tools(tools)
    return out


def _merge_tool_results(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Tool results (and a user message right after them) become one user turn of blocks."""
    out: list[dict[str, Any]] = []
    calls: list[dict[str, Any]] = []
    for i, m in enumerate(messages):
        role = m["role"]
        if role == "tool":
            if not calls:
                raise ValueError(f"messages[{i}] is a tool result without a preceding assistant "
                                 "tool call")
            ids = [c.get("id") for c in calls]
            if m.get("tool_call_id") and m["tool_call_id"] not in ids:
                raise ValueError(f"messages[{i}].tool_call_id={m['tool_call_id']!r} names no "
                                 f"call of the preceding assistant turn; allowed: {ids}")
            block = f"<tool_result>{m['text']}</tool_result>"
            if out and out[-1].get("tool_turn"):
                out[-1]["text"] += "\n\n" + block
            else:
                out.append({"role": "user", "text": block, "tool_turn": True})
            continue
        if role == "user" and out and out[-1].get("tool_turn"):
            out[-1]["text"] += "\n\n" + m["text"]
            out[-1]["tool_turn"] = False
            continue
        calls = (m.get("tool_calls") or []) if role == "assistant" else []
        out.append(m)
    return out
