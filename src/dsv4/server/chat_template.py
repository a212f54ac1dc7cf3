"""Chat templating: OpenAI `messages` (and `tools`) -> the prompt text the model was trained on.

Owns `ChatTemplate`. The template is the jinja2 `chat_template` of the checkpoint's
`tokenizer_config.json` (as transformers' `apply_chat_template` renders it: a sandboxed
environment, `messages` with their `tool_calls` / `tool_call_id` / `reasoning_content`, `tools`
when the request has them, `bos_token`, `eos_token`, `add_generation_prompt`, `raise_exception`,
plus any `chat_template_kwargs`). A checkpoint without one (the official DeepSeek-V4 release ships
its encoder as Python) gets DeepSeek-V4's own encoding (`dsv4_encoding.py`): system / user /
assistant / tool turns, tools in the system prompt, DSML tool calls, and the generation prompt
opening the answer in non-thinking mode (`</think>`) or, with `chat_template_kwargs={"thinking":
true}` (or `enable_thinking`), in thinking mode (`<think>`). The rendered text already contains
bos, so it is tokenized without adding special tokens.

Test: `pytest tests/server/test_components.py -k template`, `tests/server/test_tools.py`.
"""

from __future__ import annotations

import datetime
import json
from pathlib import Path
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from dsv4.server.dsv4_encoding import encode_chat
from dsv4.server.errors import APIError, bad_request
from dsv4.server.protocol import ChatMessage

ROLES = ("system", "developer", "user", "assistant", "tool")


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


def thinking_mode(kwargs: dict[str, Any] | None) -> bool:
    """Whether `chat_template_kwargs` turn thinking on (`thinking` or `enable_thinking`)."""
    kw = kwargs or {}
    return bool(kw.get("thinking") or kw.get("enable_thinking"))


class ChatTemplate:
    def __init__(self, source: str | None, bos_token: str, eos_token: str) -> None:
        """`source`: a jinja2 template, or None for DeepSeek-V4's encoding."""
        self.source, self.bos_token, self.eos_token = source, bos_token, eos_token
        self._template = None
        if source is not None:
            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now)
            self._template = env.from_string(source)

    @staticmethod
    def from_checkpoint(path: str | Path) -> ChatTemplate:
        """The template of `path/tokenizer_config.json`, or DeepSeek-V4's encoding when it has
        none."""
        file = Path(path) / "tokenizer_config.json"
        cfg: dict[str, Any] = json.loads(file.read_text(encoding="utf-8")) if file.is_file() else {}
        source = cfg.get("chat_template") or None
        if isinstance(source, list):  # transformers' named-template list; "default" is the chat one
            source = next((t["template"] for t in source if t.get("name") == "default"),
                          source[0]["template"])
        return ChatTemplate(source, _token_str(cfg.get("bos_token"), "<｜begin▁of▁sentence｜>"),
                            _token_str(cfg.get("eos_token"), "<｜end▁of▁sentence｜>"))

    def render(self, messages: list[ChatMessage], add_generation_prompt: bool = True,
               kwargs: dict[str, Any] | None = None,
               tools: list[dict[str, Any]] | None = None) -> str:
        """The prompt text; raises APIError(400) naming `messages` for content the template cannot
        take."""
        plain = [_plain_message(i, m) for i, m in enumerate(messages)]
        if self._template is None:
            try:
                return encode_chat(plain, thinking_mode(kwargs), tools, add_generation_prompt)
            except ValueError as e:
                raise bad_request(str(e), "messages") from e
        reserved = {"messages", "bos_token", "eos_token", "add_generation_prompt", "tools"}
        extra = {k: v for k, v in (kwargs or {}).items() if k not in reserved}
        if tools:
            extra["tools"] = tools
        try:
            return self._template.render(messages=plain, bos_token=self.bos_token,
                                         eos_token=self.eos_token,
                                         add_generation_prompt=add_generation_prompt, **extra)
        except jinja2.TemplateError as e:
            raise bad_request(f"messages could not be rendered with the chat template: {e}",
                              "messages") from e


def _plain_message(i: int, message: ChatMessage) -> dict[str, Any]:
    if message.role not in ROLES:
        raise bad_request(f"messages[{i}].role={message.role!r} is invalid; allowed: {list(ROLES)}",
                          f"messages[{i}].role")
    role = "system" if message.role == "developer" else message.role
    out: dict[str, Any] = {"role": role, "content": _text_of(i, message)}
    if message.tool_calls:
        if role != "assistant":
            raise bad_request(f"messages[{i}].tool_calls is only allowed on assistant messages",
                              f"messages[{i}].tool_calls")
        out["tool_calls"] = [_tool_call(i, j, c) for j, c in enumerate(message.tool_calls)]
    if message.tool_call_id is not None:
        out["tool_call_id"] = message.tool_call_id
    if message.reasoning_content is not None:
        out["reasoning_content"] = message.reasoning_content
    return out


def _tool_call(i: int, j: int, call: dict[str, Any]) -> dict[str, Any]:
    """An assistant message's tool call, checked: function.name a str, function.arguments the
    JSON text of an object."""
    fn = call.get("function")
    name = fn.get("name") if isinstance(fn, dict) else None
    args = fn.get("arguments") if isinstance(fn, dict) else None
    try:
        ok = isinstance(name, str) and isinstance(json.loads(args), dict)  # type: ignore[arg-type]
    except (TypeError, json.JSONDecodeError):
        ok = False
    if not ok:
        raise bad_request(f"messages[{i}].tool_calls[{j}] must be {{'id', 'type': 'function', "
                          "'function': {'name': str, 'arguments': JSON object text}}",
                          f"messages[{i}].tool_calls")
    return {"id": call.get("id"), "type": "function",
            "function": {"name": name, "arguments": args}}


def _text_of(i: int, message: ChatMessage) -> str:
    content = message.content
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    parts = []
    for part in content:
        if part.type != "text" or part.text is None:
            raise APIError(400, f"messages[{i}].content has a {part.type!r} part; "
                           "allowed: text parts only", f"messages[{i}].content")
        parts.append(part.text)
    return "".join(parts)


def _token_str(value: object, default: str) -> str:
    """tokenizer_config stores special tokens as a str or as an AddedToken dict with `content`."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return default
