"""Verifiable arithmetic tasks with a difficulty knob: pre-training data, eval set and RL reward.

Owns `Problem`, the difficulty levels, the train / held-out split of the problem space and the
answer checker. A problem is plain integer arithmetic written without spaces, `347+58=` with
answer `405`; its chat form is "What is 347+58?" / "405".

Levels (`level` = digits of the larger operand for + and -; digit pairs for *):

    level |  +  and  -         |  *
    ------+--------------------+---------
      1   |  1-digit           |  1 x 1      easy
      2   |  2-digit           |  2 x 1      easy
      3   |  3-digit           |  3 x 1      medium
      4   |  4-digit           |  2 x 2      medium
      5   |  5-digit           |  3 x 2      hard
      6   |  6-digit           |  3 x 3      hard

The smaller operand of + and - has 1..level digits, uniformly; operands of + and * come in either
order; `a-b` always has a >= b, so every answer is a non-negative integer in canonical form.

Invariant: every problem belongs to exactly one split, decided by a hash of its prompt
(`is_heldout`, about 1 in 32). Training data and RL sample `split="train"`, `eval_set` samples
`split="heldout"`, so evaluation never sees a problem that was trained on.

`check_answer` is the verifiable reward: the first integer of the completion must equal the
answer.

Test: `pytest tests/train/test_tasks.py`.
"""

from __future__ import annotations

import hashlib
import random
import re
from dataclasses import dataclass
from typing import Literal

Split = Literal["train", "heldout"]

OPS: tuple[str, ...] = ("+", "-", "*")
NUM_LEVELS = 6
LEVELS: tuple[int, ...] = tuple(range(1, NUM_LEVELS + 1))

_MUL_DIGITS: dict[int, tuple[int, int]] = {1: (1, 1), 2: (2, 1), 3: (3, 1), 4: (2, 2), 5: (3, 2),
                                           6: (3, 3)}

HELDOUT_MODULUS = 32
"""A problem is held out when the hash of its prompt is 0 modulo this (about 3% of the space)."""

_MAX_DRAWS = 100_000
_FIRST_INT = re.compile(r"-?[0-9]+")


@dataclass(frozen=True)
class Problem:
    """One arithmetic problem: `prompt` (e.g. "347+58=") is completed by `answer` (e.g. "405")."""

    prompt: str
    answer: str
    op: str
    level: int

    @property
    def expression(self) -> str:
        """The prompt without its trailing "=", e.g. "347+58"."""
        return self.prompt[:-1]

    @property
    def text(self) -> str:
        """The solved line, e.g. "347+58=405"."""
        return self.prompt + self.answer


def _check_level_op(level: int, op: str | None) -> None:
    if level not in LEVELS:
        raise ValueError(f"level={level!r} is not a difficulty level; allowed: {list(LEVELS)}")
    if op is not None and op not in OPS:
        raise ValueError(f"op={op!r} is not supported; allowed: {list(OPS)}")


def _number(rng: random.Random, digits: int) -> int:
    """A uniform integer with exactly `digits` digits (0..9 for one digit)."""
    if digits == 1:
        return rng.randint(0, 9)
    return rng.randint(10 ** (digits - 1), 10**digits - 1)


def _operand_digits(rng: random.Random, level: int, op: str) -> tuple[int, int]:
    if op == "*":
        return _MUL_DIGITS[level]
    return level, rng.randint(1, level)


def _draw(rng: random.Random, level: int, op: str) -> Problem:
    big_digits, small_digits = _operand_digits(rng, level, op)
    a, b = _number(rng, big_digits), _number(rng, small_digits)
    if op == "-":
        a, b = max(a, b), min(a, b)
        result = a - b
    else:
        if rng.random() < 0.5:
            a, b = b, a
        result = a + b if op == "+" else a * b
    return Problem(prompt=f"{a}{op}{b}=", answer=str(result), op=op, level=level)


def is_heldout(problem: Problem) -> bool:
    """Whether `problem` belongs to the held-out split (a fixed function of its prompt)."""
    digest = hashlib.blake2b(problem.prompt.encode("ascii"), digest_size=8).digest()
    return int.from_bytes(digest, "little") % HELDOUT_MODULUS == 0


def sample_problem(rng: random.Random, level: int, op: str | None = None,
                   split: Split = "train") -> Problem:
    """Draw a problem of difficulty `level` from `split`; `op` (one of OPS) is uniform when None.

    Draws only from `rng`, so the same generator state yields the same problem. Raises
    `ValueError` for an unknown level, op or split.
    """
    _check_level_op(level, op)
    if split not in ("train", "heldout"):
        raise ValueError(f"split={split!r} is not supported; allowed: ['train', 'heldout']")
    want_heldout = split == "heldout"
    for _ in range(_MAX_DRAWS):
        problem = _draw(rng, level, op if op is not None else rng.choice(OPS))
        if is_heldout(problem) == want_heldout:
            return problem
    raise RuntimeError(f"no {split} problem found for level={level} op={op!r} "
                       f"in {_MAX_DRAWS} draws")


def check_answer(problem: Problem, completion: str) -> bool:
    """The verifiable reward: True iff the first integer in `completion` is exactly
    `problem.answer`.

    Text around the integer (spaces, newlines, an eos string, an explanation) is ignored; the
    integer itself must be canonical ("0405" does not answer 405).
    """
    match = _FIRST_INT.search(completion)
    return match is not None and match.group() == problem.answer


def eval_set(seed: int, per_level: int, levels: tuple[int, ...] = LEVELS) -> list[Problem]:
    """Deterministic held-out evaluation problems, level by level, ops in turn.

    Up to `per_level` distinct problems per level: the held-out split of the lowest levels is
    small (level 1 has only a few held-out problems per op), so those levels return fewer.
    """
    if per_level < 0:
        raise ValueError(f"per_level must be >= 0, got {per_level}")
    rng = random.Random(f"dsv4-eval-{seed}")
    problems: list[Problem] = []
    for level in levels:
        seen: set[str] = set()
        for i in range(per_level * 20):
            if len(seen) == per_level:
                break
            problem = sample_problem(rng, level, OPS[i % len(OPS)], split="heldout")
            if problem.prompt not in seen:
                seen.add(problem.prompt)
                problems.append(problem)
    return problems


def chat_messages(problem: Problem, include_answer: bool = True) -> list[dict[str, str]]:
    """The chat form: user "What is 347+58?", then (unless `include_answer` is False) assistant
    "405"."""
    messages = [{"role": "user", "content": f"What is {problem.expression}?"}]
    if include_answer:
        messages.append({"role": "assistant", "content": problem.answer})
    return messages
