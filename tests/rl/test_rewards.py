"""Tests for dsv4.rl.rewards: the task registry, prompts, splits and rewards."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from dsv4.checkpoint.tokenizer import ASSISTANT_TOKEN, USER_TOKEN
from dsv4.rl.rewards import (
    TASKS,
    ArithmeticTask,
    Prompt,
    Task,
    chat_prompt,
    make_task,
    parse_levels,
)
from dsv4.tasks.arithmetic import Problem, is_heldout


def test_registry_builds_arithmetic() -> None:
    assert list(TASKS) == ["arithmetic"]
    task: Task = make_task("arithmetic", (3, 4))
    assert isinstance(task, ArithmeticTask)
    assert task.name == "arithmetic" and task.levels == (3, 4)


def test_registry_rejects_unknown_task() -> None:
    with pytest.raises(ValueError, match=r"task='x' is unknown; allowed: \['arithmetic'\]"):
        make_task("x", (1,))


@pytest.mark.parametrize("levels", [(), (0,), (7,), (1, 1), [1, 2]])
def test_arithmetic_task_validates_levels(levels: tuple[int, ...]) -> None:
    with pytest.raises(ValueError, match=r"levels=.*allowed: \[1, 2, 3, 4, 5, 6\]"):
        ArithmeticTask(levels)


def test_chat_text_form() -> None:
    problem = Problem(prompt="347+58=", answer="405", op="+", level=3)
    assert chat_prompt(problem) == "<｜User｜>What is 347+58?<｜Assistant｜>"
    assert chat_prompt(problem) == f"{USER_TOKEN}What is 347+58?{ASSISTANT_TOKEN}"


def test_train_prompts_are_deterministic_train_split_and_cover_levels() -> None:
    task = ArithmeticTask((2, 5))
    first = task.train_prompts(random.Random(7), 200)
    assert first == task.train_prompts(random.Random(7), 200)
    assert first != task.train_prompts(random.Random(8), 200)
    assert len(first) == 200 and task.train_prompts(random.Random(7), 0) == []
    assert not any(is_heldout(p.problem) for p in first)
    assert all(p.text == chat_prompt(p.problem) for p in first)
    counts = Counter(p.level for p in first)
    assert set(counts) == {2, 5} and min(counts.values()) > 60   # uniform: ~100 each
    with pytest.raises(ValueError, match="n=-1"):
        task.train_prompts(random.Random(0), -1)


def test_heldout_prompts_are_heldout_and_deterministic() -> None:
    task = ArithmeticTask((3, 4))
    prompts = task.heldout_prompts(per_level=10)
    assert len(prompts) == 20 and all(is_heldout(p.problem) for p in prompts)
    assert [p.level for p in prompts] == [3] * 10 + [4] * 10
    assert prompts == task.heldout_prompts(per_level=10, seed=0)
    assert prompts != task.heldout_prompts(per_level=10, seed=1)
    assert all(p.text == chat_prompt(p.problem) for p in prompts)


def test_reward_correct_and_wrong() -> None:
    problem = Problem(prompt="347+58=", answer="405", op="+", level=3)
    prompt = Prompt(chat_prompt(problem), problem)
    task = ArithmeticTask((3,))
    assert prompt.level == 3
    assert task.reward(prompt, "405") == 1.0
    assert task.reward(prompt, " 405<｜end▁of▁sentence｜>") == 1.0
    assert task.reward(prompt, "404") == 0.0
    assert task.reward(prompt, "0405") == 0.0
    assert task.reward(prompt, "") == 0.0


@pytest.mark.parametrize("text, expected", [
    ("3", (3,)), ("3,4,5", (3, 4, 5)), ("3-6", (3, 4, 5, 6)), (" 1, 4-6 ", (1, 4, 5, 6)),
    ("2-2", (2,)),
])
def test_parse_levels(text: str, expected: tuple[int, ...]) -> None:
    assert parse_levels(text) == expected


@pytest.mark.parametrize("text", ["", "a", "3,", "6-3", "-3", "3-", "1;2", "3.5"])
def test_parse_levels_rejects_malformed(text: str) -> None:
    with pytest.raises(ValueError, match="levels="):
        parse_levels(text)
