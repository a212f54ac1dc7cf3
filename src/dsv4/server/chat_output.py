"""One chat choice's completion -> reasoning, content and tool calls, whole or streamed.

In thinking mode the prompt ends with `<think>`, so a completion is `{reasoning}</think>{answer}`;
the answer may end with a DSML tool-call block (`tool_calls.py`). `ChoiceParser.feed` returns the
(reasoning, content) deltas that are safe to stream: a tail that could be the start of `</think>`
or of the tool-call tag is held until the next text decides it. `finish` returns the rest and the
calls. Fed whole or in any pieces, the concatenated deltas equal `parse_choice`'s result, so a
stream reassembles to the non-streaming message. A completion that ends inside its reasoning
(max_tokens) is all reasoning; without thinking there is none.

Test: `pytest tests/server/test_tools.py`.
"""

from __future__ import annotations

from typing import Any

from dsv4.engine.stop import partial_prefix_len
from dsv4.server.dsv4_encoding import END_THINK
from dsv4.server.tool_calls import ToolCallStream


class ChoiceParser:
    def __init__(self, thinking: bool, tool_names: set[str] | None) -> None:
        """`tool_names`: the request's tools (None: calls are not parsed: no tools, or
        tool_choice "none")."""
        self.in_reasoning = thinking
        self.tools = ToolCallStream(tool_names) if tool_names is not None else None
        self._held = ""

    def feed(self, text: str) -> tuple[str, str]:
        """(reasoning delta, content delta) of the next piece of the completion."""
        reasoning = ""
        if self.in_reasoning:
            self._held += text
            end = self._held.find(END_THINK)
            if end < 0:
                keep = partial_prefix_len(self._held, (END_THINK,))
                reasoning, self._held = self._held[:len(self._held) - keep], self._held[
                    len(self._held) - keep:]
                return reasoning, ""
            reasoning, text = self._held[:end], self._held[end + len(END_THINK):]
            self._held, self.in_reasoning = "", False
        return reasoning, self.tools.feed(text) if self.tools is not None else text

    def finish(self) -> tuple[str, str, list[dict[str, Any]]]:
        """(reasoning, content, calls) not yet returned; the calls are all of them."""
        reasoning = self._held if self.in_reasoning else ""
        self._held = ""
        if self.tools is None:
            return reasoning, "", []
        content, calls = self.tools.finish()
        return reasoning, content, calls


def parse_choice(text: str, thinking: bool,
                 tool_names: set[str] | None) -> tuple[str, str, list[dict[str, Any]]]:
    """(reasoning, content, calls) of a whole completion."""
    parser = ChoiceParser(thinking, tool_names)
    reasoning, content = parser.feed(text)
    r, c, calls = parser.finish()
    return reasoning + r, content + c, calls
