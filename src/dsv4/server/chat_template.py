"""Chat templating: OpenAI `messages` -> the prompt text the model was trained on.

Owns `ChatTemplate`. The template is the jinja2 `chat_template` of the checkpoint's
`tokenizer_config.json` (as transformers' `apply_chat_template` renders it: a sandboxed
environment, `messages`, `bos_token`, `eos_token`, `add_generation_prompt`, `raise_exception`, plus
any `chat_template_kwargs`). A checkpoint without one (the official DeepSeek-V4 release ships its
encoder as Python) gets `DEEPSEEK_V4_TEMPLATE`:
`<bos>{system}<｜User｜>{user}<｜Assistant｜>` turns, assistant turns closed by eos, and the
generation prompt opening the answer in non-thinking mode (`</think>`) or, with
`chat_template_kwargs={"thinking": true}`, in thinking mode (`<think>`). The rendered text already
contains bos, so it is tokenized without adding special tokens.

Test: `pytest tests/server/test_components.py -k template`.
"""

from __future__ import annotations

import datetime
import json
from pathlib import Path
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from dsv4.server.errors import APIError, bad_request
from dsv4.server.protocol import ChatMessage

DEEPSEEK_V4_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}{{ message['content'] }}"
    "{% elif message['role'] == 'user' %}{{ '<｜User｜>' + message['content'] }}"
    "{% elif message['role'] == 'assistant' %}"
    "{{ '<｜Assistant｜></think>' + message['content'] + eos_token }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}"
    "{{ '<｜Assistant｜><think>' if thinking is defined and thinking"
    " else '<｜Assistant｜></think>' }}"
    "{% endif %}"
)

ROLES = ("system", "developer", "user", "assistant")


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


class ChatTemplate:
    def __init__(self, source: str, bos_token: str, eos_token: str) -> None:
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now)
        self.source, self.bos_token, self.eos_token = source, bos_token, eos_token
        self._template = env.from_string(source)

    @staticmethod
    def from_checkpoint(path: str | Path) -> ChatTemplate:
        """The template of `path/tokenizer_config.json`, or `DEEPSEEK_V4_TEMPLATE` when it has
        none."""
        file = Path(path) / "tokenizer_config.json"
        cfg: dict[str, Any] = json.loads(file.read_text(encoding="utf-8")) if file.is_file() else {}
        source = cfg.get("chat_template") or DEEPSEEK_V4_TEMPLATE
        if isinstance(source, list):  # transformers' named-template list; "default" is the chat one
            source = next((t["template"] for t in source if t.get("name") == "default"),
                          source[0]["template"])
        return ChatTemplate(source, _token_str(cfg.get("bos_token"), "<｜begin▁of▁sentence｜>"),
                            _token_str(cfg.get("eos_token"), "<｜end▁of▁sentence｜>"))

    def render(self, messages: list[ChatMessage], add_generation_prompt: bool = True,
               kwargs: dict[str, Any] | None = None) -> str:
        """The prompt text; raises APIError(400) naming `messages` for content the template cannot
        take."""
        plain = [_plain_message(i, m) for i, m in enumerate(messages)]
        reserved = {"messages", "bos_token", "eos_token", "add_generation_prompt"}
        extra = {k: v for k, v in (kwargs or {}).items() if k not in reserved}
        try:
            return self._template.render(messages=plain, bos_token=self.bos_token,
                                         eos_token=self.eos_token,
                                         add_generation_prompt=add_generation_prompt, **extra)
        except jinja2.TemplateError as e:
            raise bad_request(f"messages could not be rendered with the chat template: {e}",
                              "messages") from e


def _plain_message(i: int, message: ChatMessage) -> dict[str, str]:
    if message.role not in ROLES:
        raise bad_request(f"messages[{i}].role={message.role!r} is invalid; allowed: {list(ROLES)}",
                          f"messages[{i}].role")
    role = "system" if message.role == "developer" else message.role
    return {"role": role, "content": _text_of(i, message)}


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
