"""A chat request's tools, tool_choice and thinking mode -> what rendering, decoding and parsing do.

`ChatMode.of(body)` validates `tools` (OpenAI function tools) and `tool_choice` ("none", "auto",
"required", or `{"type": "function", "function": {"name": ...}}`; default "auto" with tools) and
decides:
    tools      rendered into the prompt (None with tool_choice "none", as OpenAI: no calls)
    names      the tool names the output parser accepts (None: the output is not parsed for calls)
    structured the decoding constraint: the request's own (`server/structured.py`), or, for
               "required" / a named function, a DSML tool-call grammar (`tool_calls.py`); in
               thinking mode prefixed by the free reasoning and `</think>` (the prompt opened a
               `<think>` block), so the constraint applies to the answer only
    thinking   `chat_template_kwargs` thinking / enable_thinking
Errors are 400s naming the field.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from dsv4.engine.grammar import parse_grammar
from dsv4.engine.sampling_params import StructuredOutput
from dsv4.server.chat_template import thinking_mode
from dsv4.server.dsv4_encoding import END_THINK
from dsv4.server.errors import bad_request
from dsv4.server.protocol import ChatCompletionRequest
from dsv4.server.structured import structured_output
from dsv4.server.tool_calls import tool_call_grammar

MAX_REASONING_CHARS = 2048
"""Reasoning before a constrained answer: at most this many characters (no `<`)."""


@dataclass(frozen=True)
class ChatMode:
    tools: list[dict[str, Any]] | None
    names: set[str] | None
    structured: StructuredOutput | None
    thinking: bool

    @staticmethod
    def of(body: ChatCompletionRequest) -> ChatMode:
        tools = _check_tools(body.tools) if body.tools else None
        choice = _tool_choice(body.tool_choice, tools)
        thinking = thinking_mode(body.chat_template_kwargs)
        structured = structured_output(body)
        if choice not in ("none", "auto"):
            if structured is not None:
                raise bad_request("tool_choice 'required' or a named function cannot be combined "
                                  "with a structured-output field", "tool_choice")
            assert tools is not None
            structured = StructuredOutput("ebnf", tool_call_grammar(
                tools, None if choice == "required" else choice))
        if structured is not None and thinking:
            structured = _after_reasoning(structured)
        use = tools if choice != "none" else None
        names = {t["function"]["name"] for t in use} if use else None
        return ChatMode(use, names, structured, thinking)


def _check_tools(tools: list[Any]) -> list[dict[str, Any]]:
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if (not isinstance(t, dict) or t.get("type") != "function" or not isinstance(fn, dict)
                or not isinstance(fn.get("name"), str) or not fn["name"]
                or not isinstance(fn.get("parameters", {}), dict)):
            raise bad_request(f"tools[{i}] must be {{'type': 'function', 'function': {{'name': "
                              "str, 'description': str, 'parameters': JSON schema}}}", "tools")
    return tools


def _tool_choice(choice: str | dict[str, Any] | None, tools: list[dict[str, Any]] | None) -> str:
    """"none", "auto", "required" or the named function."""
    if choice is None:
        return "auto" if tools else "none"
    if choice in ("none", "auto", "required"):
        if choice != "none" and not tools:
            raise bad_request(f"tool_choice={choice!r} needs tools", "tool_choice")
        return str(choice)
    fn = choice.get("function") if isinstance(choice, dict) else None
    name = fn.get("name") if isinstance(fn, dict) else None
    names = [t["function"]["name"] for t in tools or []]
    if name not in names:
        raise bad_request(f"tool_choice={choice!r} is invalid; allowed: 'none', 'auto', "
                          f"'required', or {{'type': 'function', 'function': {{'name': one of "
                          f"{names}}}}}", "tool_choice")
    return str(name)


def _after_reasoning(structured: StructuredOutput) -> StructuredOutput:
    """The same constraint after free reasoning and `</think>` (an EBNF grammar)."""
    import xgrammar as xgr
    answer = parse_grammar(structured)
    reasoning = xgr.Grammar.from_ebnf(f"root ::= [^<]{{0,{MAX_REASONING_CHARS}}} "
                                      + json.dumps(END_THINK))
    return StructuredOutput("ebnf", str(xgr.Grammar.concat(reasoning, answer)))
