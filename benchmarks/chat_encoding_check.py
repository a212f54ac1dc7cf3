"""dsv4's DeepSeek-V4 chat encoding and output parsing against the official encoder (issue 23).

The official checkpoint ships its chat format as Python (`encoding/encoding_dsv4.py`, with gold
examples `encoding/tests/test_input_N.json` -> `test_output_N.txt`), not as a jinja template;
dsv4 re-implements it (`server/dsv4_encoding.py`, `server/tool_calls.py`,
`server/chat_output.py`). Nothing of the official files is part of dsv4: point `--official` at a
copy of that `encoding/` folder (from the model repository) and this script checks

1. the gold examples 1 and 2 (OpenAI-style messages: tools + tool results in thinking mode, and
   multi-turn thinking without tools) render to exactly the gold text (3 and 4 use roles and
   tasks outside OpenAI's chat API: latest_reminder, developer, quick-instruction tasks);
2. `--conversations` random conversations (system or not, 1-3 user turns, assistant turns with
   and without reasoning, 0-2 parallel tool calls with string / number / bool / array / object
   arguments, tool results, thinking and chat mode, ending on an assistant turn or asking for
   the next one) render to the official encoder's text;
3. `--completions` random completions (the official rendering of an assistant turn, with or
   without reasoning and tool calls) parse to the official parser's reasoning, content and
   calls.

    PYTHONPATH=src python benchmarks/chat_encoding_check.py --official /path/to/encoding

Prints a table, then one JSON line; exits 1 on any difference.
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import json
import random
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

from dsv4.server.chat_output import parse_choice
from dsv4.server.dsv4_encoding import encode_chat

TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Weather in a city",
        "parameters": {"type": "object", "required": ["city"], "properties": {
            "city": {"type": "string"}, "days": {"type": "integer"}}}}},
    {"type": "function", "function": {
        "name": "add", "description": "Add numbers",
        "parameters": {"type": "object", "properties": {
            "a": {"type": "number"}, "b": {"type": "number"}, "tags": {"type": "array"}}}}}]
NAMES = {t["function"]["name"] for t in TOOLS}
WORDS = ["hello", "Paris", "12+7?", "数学", "line\nbreak", 'a "quote"', "x", "What is 3*4?"]


def load_official(folder: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location("encoding_dsv4", folder / "encoding_dsv4.py")
    if spec is None or spec.loader is None:
        raise FileNotFoundError(f"--official {folder}: no encoding_dsv4.py there")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def random_arguments(rng: random.Random) -> str:
    value = rng.choice([{"city": rng.choice(WORDS)}, {"city": "Oslo", "days": rng.randint(1, 9)},
                        {"a": rng.randint(-5, 5), "b": 2.5, "tags": ["u", 1, None]},
                        {"a": True}, {"nested": {"k": [1, 2]}, "s": "v"}])
    return json.dumps(value, ensure_ascii=rng.random() < 0.5)


def random_calls(rng: random.Random, most: int, ids: list[int]) -> list[dict[str, Any]]:
    calls = []
    for _ in range(rng.randint(1, most)):
        ids[0] += 1
        calls.append({"id": f"call_{ids[0]}", "type": "function", "function": {
            "name": rng.choice(sorted(NAMES)), "arguments": random_arguments(rng)}})
    return calls


def random_conversation(rng: random.Random, with_tools: bool) -> list[dict[str, Any]]:
    msgs: list[dict[str, Any]] = []
    ids = [0]
    if rng.random() < 0.6:
        msgs.append({"role": "system", "content": rng.choice(["You are helpful.", "Brief.", ""])})
    for turn in range(rng.randint(1, 3)):
        msgs.append({"role": "user", "content": rng.choice(WORDS)})
        last = turn == 2 or rng.random() < 0.3
        if last and rng.random() < 0.5:
            break                                             # ask for the next assistant turn
        calls = random_calls(rng, 2, ids) if with_tools and rng.random() < 0.6 else []
        reply: dict[str, Any] = {"role": "assistant", "content": (
            rng.choice(["", "Sure.", "It is 19.", "多"]) if not calls or rng.random() < 0.5
            else "")}
        if rng.random() < 0.7:
            reply["reasoning_content"] = rng.choice(["think a", "Let me compute.", "用户"])
        if calls:
            reply["tool_calls"] = calls
        msgs.append(reply)
        for call in calls:
            msgs.append({"role": "tool", "tool_call_id": call["id"],
                         "content": rng.choice(["22C", '{"v": 3}', "ok"])})
        if calls and rng.random() < 0.5:
            msgs.append({"role": "assistant", "content": "Done.", "reasoning_content": "Got it."})
        if last:
            break
    return msgs


def official_text(off: ModuleType, msgs: list[dict[str, Any]], thinking: bool,
                  tools: list[dict[str, Any]] | None) -> str:
    """The official encoding: tools ride on the first system message (inserted when none)."""
    msgs = copy.deepcopy(msgs)
    if tools:
        if not msgs or msgs[0]["role"] != "system":
            msgs.insert(0, {"role": "system", "content": ""})
        msgs[0]["tools"] = tools
    return str(off.encode_messages(msgs, thinking_mode="thinking" if thinking else "chat"))


def check_gold(off_dir: Path) -> dict[str, bool]:
    tests = off_dir / "tests"
    first = json.loads((tests / "test_input_1.json").read_text())
    second = json.loads((tests / "test_input_2.json").read_text())
    return {
        "gold_1": encode_chat(first["messages"], thinking=True, tools=first["tools"])
        == (tests / "test_output_1.txt").read_text(),
        "gold_2": encode_chat(second, thinking=True) == (tests / "test_output_2.txt").read_text()}


def check_conversations(off: ModuleType, n: int, seed: int) -> dict[str, int]:
    rng = random.Random(seed)
    different = asking = 0
    for _ in range(n):
        with_tools = rng.random() < 0.6
        msgs = random_conversation(rng, with_tools)
        thinking = rng.random() < 0.5
        tools = TOOLS if with_tools else None
        asking += msgs[-1]["role"] != "assistant"
        different += encode_chat(msgs, thinking=thinking, tools=tools) != official_text(
            off, msgs, thinking, tools)
    return {"conversations": n, "conversations_asking_for_a_turn": asking,
            "conversations_different": different}


def check_completions(off: ModuleType, n: int, seed: int) -> dict[str, int]:
    rng = random.Random(seed)
    different = 0
    for i in range(n):
        thinking = i % 2 == 1
        reply: dict[str, Any] = {"role": "assistant",
                                 "content": rng.choice(["", "Sure.", "It is 19.", "多\nline"])}
        if thinking:
            reply["reasoning_content"] = rng.choice(["think a", "Let me\ncompute.", "用户", ""])
        if rng.random() < 0.7:
            reply["tool_calls"] = random_calls(rng, 3, [0])
        mode = "thinking" if thinking else "chat"
        text = off.render_message(1, [{"role": "user", "content": "q"}, reply], thinking_mode=mode)
        text = text.removesuffix(off.eos_token)
        if not thinking:
            text = text.removeprefix(off.thinking_end_token)
        want = off.parse_message_from_completion_text(text + off.eos_token, thinking_mode=mode)
        reasoning, content, calls = parse_choice(text, thinking, NAMES)
        as_pairs = [[(c["function"]["name"], json.loads(c["function"]["arguments"]))
                     for c in cs] for cs in (want["tool_calls"], calls)]
        different += ((want["reasoning_content"] or "", want["content"], as_pairs[0])
                      != (reasoning, content, as_pairs[1]))
    return {"completions": n, "completions_different": different}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--official", type=Path, required=True,
                   help="the official encoding/ folder (encoding_dsv4.py, tests/)")
    p.add_argument("--conversations", type=int, default=1000)
    p.add_argument("--completions", type=int, default=1000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    off = load_official(args.official)
    result: dict[str, Any] = {**check_gold(args.official),
                              **check_conversations(off, args.conversations, args.seed),
                              **check_completions(off, args.completions, args.seed + 1)}
    for key, value in result.items():
        print(f"{key:36} {value}")
    print(json.dumps(result))
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    ok = (result["gold_1"] and result["gold_2"] and not result["conversations_different"]
          and not result["completions_different"])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
