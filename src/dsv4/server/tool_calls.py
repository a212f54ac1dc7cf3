"""Tool calls in DeepSeek-V4's DSML format (`dsv4_encoding.py`): parsing, streaming, constraining.

`parse_tool_calls(text)` splits a completion into its content and its calls (OpenAI shape: `id`,
`type` "function", `function.name`, `function.arguments` as JSON text). A block that does not
parse (unknown structure, bad JSON in a `string="false"` value, a name that is not one of the
request's tools) leaves the whole text as content and no calls: a malformed call is never an error.

`ToolCallStream` does the same incrementally for streams: it passes content through until the
block's opening tag may have begun, then holds the rest; `finish()` parses the held text. The
content it emits plus `finish()`'s equals `parse_tool_calls`'s content, and its calls are the same.

`tool_call_grammar(tools, name)` is the EBNF (via xgrammar's JSON-schema grammars) of a block that
calls the named tool, or any of `tools`, one or more times, each with every required parameter of
its schema (string parameters raw, others as JSON that validates against the property's schema):
what `tool_choice: "required"` / a named function decode under.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

from dsv4.engine.stop import partial_prefix_len
from dsv4.server.dsv4_encoding import DSML, TOOL_CALLS_CLOSE, TOOL_CALLS_OPEN

_BLOCK = re.compile(r"\s*" + re.escape(TOOL_CALLS_OPEN) + r"\n(.*?)\n" + re.escape(TOOL_CALLS_CLOSE)
                    + r"\s*$", re.DOTALL)
_INVOKE = re.compile(rf'<{DSML}invoke name="([^"<>\n]+)">\n(.*?)\n?</{DSML}invoke>', re.DOTALL)
_PARAM = re.compile(rf'<{DSML}parameter name="([^"<>\n]+)" string="(true|false)">(.*?)'
                    rf"</{DSML}parameter>", re.DOTALL)
_MAX_STRING = 64          # raw string parameters of a constrained call: at most this many chars


def parse_tool_calls(text: str, names: set[str] | None = None
                     ) -> tuple[str, list[dict[str, Any]]]:
    """(content, calls) of a completion; calls to names outside `names` (when given) or any
    malformed block leave (text, [])."""
    start = text.find(TOOL_CALLS_OPEN)
    if start < 0:
        return text, []
    block = _BLOCK.match(text, start)
    if block is None:
        return text, []
    calls, pos, body = [], 0, block.group(1)
    for inv in _INVOKE.finditer(body):
        if body[pos:inv.start()].strip() or (names is not None and inv.group(1) not in names):
            return text, []
        args = _arguments(inv.group(2))
        if args is None:
            return text, []
        calls.append({"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                      "function": {"name": inv.group(1),
                                   "arguments": json.dumps(args, ensure_ascii=False)}})
        pos = inv.end()
    if not calls or body[pos:].strip():
        return text, []
    return text[:start].rstrip("\n"), calls


def _arguments(params: str) -> dict[str, Any] | None:
    args: dict[str, Any] = {}
    pos = 0
    for p in _PARAM.finditer(params):
        if params[pos:p.start()].strip() or p.group(1) in args:
            return None
        if p.group(2) == "true":
            args[p.group(1)] = p.group(3)
        else:
            try:
                args[p.group(1)] = json.loads(p.group(3))
            except json.JSONDecodeError:
                return None
        pos = p.end()
    return args if not params[pos:].strip() else None


class ToolCallStream:
    """Streaming `parse_tool_calls`: `feed` returns the content that is safe to emit."""

    def __init__(self, names: set[str] | None = None) -> None:
        self.names, self._text, self._sent = names, "", 0

    def feed(self, delta: str) -> str:
        self._text += delta
        safe = self._text.find(TOOL_CALLS_OPEN)
        if safe < 0:   # hold a tail that could be the start of the tag
            safe = len(self._text) - partial_prefix_len(self._text, (TOOL_CALLS_OPEN,))
        while safe > self._sent and self._text[safe - 1] == "\n":   # and newlines before it
            safe -= 1
        out = self._text[self._sent:max(safe, self._sent)]
        self._sent = max(safe, self._sent)
        return out

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        """(the content not yet emitted, the calls)."""
        content, calls = parse_tool_calls(self._text, self.names)
        return content[self._sent:], calls


def tool_call_grammar(tools: list[dict[str, Any]], name: str | None = None) -> str:
    """EBNF of a DSML block calling `name` (or any of `tools`) once or more; see the module
    docstring."""
    import xgrammar as xgr

    def lit(s: str) -> Any:
        return xgr.Grammar.from_ebnf("root ::= " + json.dumps(s))

    def invoke(fn: dict[str, Any]) -> Any:
        schema = fn.get("parameters") or {}
        props = schema.get("properties") or {}
        parts = [lit(f'<{DSML}invoke name="{fn["name"]}">\n')]
        for i, key in enumerate(schema.get("required") or []):
            prop = props.get(key, {})
            raw = prop.get("type") == "string" and "enum" not in prop
            parts.append(lit(("\n" if i else "") + f'<{DSML}parameter name="{key}" '
                             f'string="{"true" if raw else "false"}">'))
            if raw:
                limit = min(int(prop.get("maxLength", _MAX_STRING)), _MAX_STRING)
                parts.append(xgr.Grammar.from_ebnf(f"root ::= [^<\\n]{{1,{max(limit, 1)}}}"))
            else:
                parts.append(xgr.Grammar.from_json_schema(json.dumps(prop), any_whitespace=False))
            parts.append(lit(f"</{DSML}parameter>"))
        parts.append(lit(f"\n</{DSML}invoke>"))
        return xgr.Grammar.concat(*parts)

    calls = [invoke(t["function"]) for t in tools
             if name is None or t["function"]["name"] == name]
    if not calls:
        raise ValueError(f"tool_choice names {name!r}, which is not one of the tools")
    one = calls[0] if len(calls) == 1 else xgr.Grammar.union(*calls)
    second = xgr.Grammar.union(lit(""), xgr.Grammar.concat(lit("\n"), one))    # optional
    return str(xgr.Grammar.concat(lit(TOOL_CALLS_OPEN + "\n"), one, second,
                                  lit("\n" + TOOL_CALLS_CLOSE)))
