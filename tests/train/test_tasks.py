"""Tests for dsv4.tasks.arithmetic: problem generation, difficulty levels, the split and the
reward."""

from __future__ import annotations

import random

import pytest

from dsv4.tasks.arithmetic import (
    LEVELS,
    OPS,
    Problem,
    chat_messages,
    check_answer,
    eval_set,
    is_heldout,
    sample_problem,
)


def _operands(problem: Problem) -> tuple[int, int]:
    a, b = problem.expression.split(problem.op)
    return int(a), int(b)


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("level", LEVELS)
def test_answers_are_correct(level: int, op: str) -> None:
    rng = random.Random(level)
    for _ in range(200):
        p = sample_problem(rng, level, op)
        a, b = _operands(p)
        expected = {"+": a + b, "-": a - b, "*": a * b}[op]
        assert p.answer == str(expected) and int(p.answer) >= 0
        assert p.prompt == f"{a}{op}{b}=" and p.text == p.prompt + p.answer
        assert (p.op, p.level) == (op, level)


@pytest.mark.parametrize("level", LEVELS)
def test_level_sets_operand_digits(level: int) -> None:
    rng = random.Random(0)
    mul_digits = {1: (1, 1), 2: (2, 1), 3: (3, 1), 4: (2, 2), 5: (3, 2), 6: (3, 3)}
    for op in OPS:
        for _ in range(200):
            digits = sorted((len(str(x)) for x in _operands(sample_problem(rng, level, op))),
                            reverse=True)
            if op == "*":
                assert tuple(digits) == mul_digits[level]
            else:
                assert digits[0] == level and 1 <= digits[1] <= level


def test_sampling_is_deterministic_and_mixes_ops() -> None:
    first = [sample_problem(random.Random(7), 3) for _ in range(3)]
    assert first[0] == first[1] == first[2]
    rng = random.Random(1)
    assert {sample_problem(rng, 2).op for _ in range(100)} == set(OPS)


def test_splits_are_disjoint() -> None:
    rng = random.Random(0)
    for level in LEVELS:
        assert not any(is_heldout(sample_problem(rng, level)) for _ in range(300))
        assert all(is_heldout(sample_problem(rng, level, split="heldout")) for _ in range(30))


def test_eval_set() -> None:
    problems = eval_set(seed=0, per_level=30)
    assert problems == eval_set(seed=0, per_level=30)
    assert problems != eval_set(seed=1, per_level=30)
    assert all(is_heldout(p) for p in problems)
    for level in LEVELS:
        prompts = [p.prompt for p in problems if p.level == level]
        assert len(prompts) == len(set(prompts)) and 0 < len(prompts) <= 30
        if level >= 2:
            assert len(prompts) == 30
            assert {p.op for p in problems if p.level == level} == set(OPS)


@pytest.mark.parametrize(
    "completion",
    ["405", " 405", "405\n", "405<｜end▁of▁sentence｜>", "405\n12+3=15\n", "The answer is 405.",
     "=405 (easy)"],
)
def test_check_answer_accepts(completion: str) -> None:
    assert check_answer(Problem("347+58=", "405", "+", 3), completion)


@pytest.mark.parametrize("completion", ["", "four hundred", "406", "4050", "0405", "-405", "40 5",
                                        "347+58=405", "٤٠٥"])
def test_check_answer_rejects(completion: str) -> None:
    assert not check_answer(Problem("347+58=", "405", "+", 3), completion)


def test_check_answer_zero_and_long_digit_runs() -> None:
    assert check_answer(Problem("7*0=", "0", "*", 1), "0<｜end▁of▁sentence｜>")
    assert not check_answer(Problem("7*0=", "0", "*", 1), "00")
    assert not check_answer(Problem("7*0=", "0", "*", 1), "9" * 10_000)  # no int() conversion limit


def test_chat_messages() -> None:
    p = Problem("347+58=", "405", "+", 3)
    assert chat_messages(p) == [
        {"role": "user", "content": "What is 347+58?"},
        {"role": "assistant", "content": "405"},
    ]
    assert chat_messages(p, include_answer=False) == [
        {"role": "user", "content": "What is 347+58?"},
    ]


@pytest.mark.parametrize(("level", "op", "split"), [(0, None, "train"), (7, "+", "train"),
                                                    (1, "/", "train"), (1, "+", "test")])
def test_invalid_arguments(level: int, op: str | None, split: str) -> None:
    with pytest.raises(ValueError):
        sample_problem(random.Random(0), level, op, split=split)  # type: ignore[arg-type]
