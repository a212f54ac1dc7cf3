"""Task registry for RL: prompts to roll out and the verifiable reward of a completion.

Owns `Prompt` (chat text plus the problem it asks), the `Task` protocol, `ArithmeticTask` and the
name -> task registry (`TASKS`, `make_task`), and `parse_levels` for the `--levels` CLI flag.

Invariants:

* Training prompts come from the task's train split only, held-out prompts from its held-out
  split only (`dsv4.tasks`), so RL never trains on a problem the evaluation scores.
* Prompt text is the shipped tokenizer's chat form with the generation prompt,
  `<｜User｜>{question}<｜Assistant｜>` (bos is added by the tokenizer).
* Rewards are exactly 1.0 (correct) or 0.0 (wrong).

Test: `pytest tests/rl/test_rewards.py`.
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Protocol

from dsv4.checkpoint.tokenizer import ASSISTANT_TOKEN, USER_TOKEN
from dsv4.tasks.arithmetic import (
    LEVELS,
    Problem,
    chat_messages,
    check_answer,
    eval_set,
    sample_problem,
)


@dataclass(frozen=True)
class Prompt:
    """One RL prompt: `text` goes to the engine, `problem` is what the reward checks against."""

    text: str
    problem: Problem

    @property
    def level(self) -> int:
        return self.problem.level


class Task(Protocol):
    """A verifiable task with difficulty levels."""

    @property
    def name(self) -> str:
        """The registry name, e.g. "arithmetic"."""
        ...

    @property
    def levels(self) -> tuple[int, ...]:
        """The difficulty levels prompts are drawn from."""
        ...

    def train_prompts(self, rng: random.Random, n: int) -> list[Prompt]:
        """`n` train-split prompts, each level uniform over `levels`; draws only from `rng`."""
        ...

    def heldout_prompts(self, per_level: int, seed: int = 0) -> list[Prompt]:
        """Deterministic held-out prompts, up to `per_level` per level, level by level."""
        ...

    def reward(self, prompt: Prompt, completion: str) -> float:
        """1.0 if `completion` answers `prompt` correctly, else 0.0."""
        ...


def chat_prompt(problem: Problem) -> str:
    """The chat rendering of the question with the generation prompt, e.g.
    "<｜User｜>What is 347+58?<｜Assistant｜>"."""
    (user,) = chat_messages(problem, include_answer=False)
    return f"{USER_TOKEN}{user['content']}{ASSISTANT_TOKEN}"


@dataclass(frozen=True)
class ArithmeticTask:
    """Integer arithmetic (`dsv4.tasks.arithmetic`) at the given difficulty `levels`."""

    levels: tuple[int, ...]

    def __post_init__(self) -> None:
        levels = self.levels
        if (not isinstance(levels, tuple) or not levels or len(set(levels)) != len(levels)
                or any(level not in LEVELS for level in levels)):
            raise ValueError(f"levels={levels!r} must be a non-empty tuple of distinct levels; "
                             f"allowed: {list(LEVELS)}")

    @property
    def name(self) -> str:
        return "arithmetic"

    def train_prompts(self, rng: random.Random, n: int) -> list[Prompt]:
        if n < 0:
            raise ValueError(f"n={n} must be >= 0")
        problems = [sample_problem(rng, rng.choice(self.levels), split="train") for _ in range(n)]
        return [Prompt(chat_prompt(p), p) for p in problems]

    def heldout_prompts(self, per_level: int, seed: int = 0) -> list[Prompt]:
        return [Prompt(chat_prompt(p), p) for p in eval_set(seed, per_level, self.levels)]

    def reward(self, prompt: Prompt, completion: str) -> float:
        return 1.0 if check_answer(prompt.problem, completion) else 0.0


TASKS: Mapping[str, Callable[[tuple[int, ...]], Task]] = MappingProxyType({
    "arithmetic": ArithmeticTask,
})


def make_task(name: str, levels: tuple[int, ...]) -> Task:
    """The registered task `name` at `levels`; ValueError lists the known names."""
    if name not in TASKS:
        raise ValueError(f"task={name!r} is unknown; allowed: {sorted(TASKS)}")
    return TASKS[name](levels)


_LEVEL_ITEM = re.compile(r"([0-9]+)(?:-([0-9]+))?")


def parse_levels(text: str) -> tuple[int, ...]:
    """Parse a `--levels` flag: comma-separated levels and ascending ranges, "3,4,5", "3-6",
    "1,4-6". The result keeps the written order; the task validates the values."""
    levels: list[int] = []
    for item in text.split(","):
        match = _LEVEL_ITEM.fullmatch(item.strip())
        if match is None or (match[2] is not None and int(match[2]) < int(match[1])):
            raise ValueError(f"levels={text!r} is not a level list; expected e.g. '3,4,5' or "
                             f"'3-6'")
        first, last = int(match[1]), int(match[2] or match[1])
        levels += range(first, last + 1)
    return tuple(levels)
