"""Tests for dsv4.engine.sampling_params: edge validation and create() normalisation."""

from __future__ import annotations

from typing import Any

import pytest

from dsv4.engine.sampling_params import SamplingParams

INVALID: list[tuple[str, Any]] = [
    ("max_tokens", 0),
    ("max_tokens", -3),
    ("max_tokens", 2.0),
    ("temperature", -0.1),
    ("temperature", float("nan")),
    ("temperature", float("inf")),
    ("top_p", 0.0),
    ("top_p", 1.5),
    ("top_p", -0.2),
    ("top_k", 0),
    ("top_k", -2),
    ("top_k", 2.5),
    ("min_p", -0.01),
    ("min_p", 1.01),
    ("repetition_penalty", 0.0),
    ("repetition_penalty", -1.0),
    ("frequency_penalty", 2.5),
    ("frequency_penalty", -2.01),
    ("presence_penalty", 3.0),
    ("presence_penalty", -2.5),
    ("logprobs", -1),
    ("logprobs", 21),
    ("seed", -1),
    ("seed", 2**63),
    ("seed", 1.5),
    ("stop", "abc"),
    ("stop", ["abc"]),
    ("stop", ("",)),
    ("stop_token_ids", [1, 2]),
    ("stop_token_ids", (-1,)),
    ("ignore_eos", 1),
]


@pytest.mark.parametrize(("field", "value"), INVALID, ids=[f"{f}={v!r}" for f, v in INVALID])
def test_invalid_field_raises_naming_it(field: str, value: Any) -> None:
    with pytest.raises(ValueError, match=rf"^{field}=.* is invalid; allowed: .+"):
        SamplingParams(**{field: value})


def test_message_format_example() -> None:
    with pytest.raises(ValueError) as info:
        SamplingParams(top_p=1.5)
    assert str(info.value) == "top_p=1.5 is invalid; allowed: 0 < top_p <= 1"


def test_defaults_are_valid_and_match_vllm() -> None:
    p = SamplingParams()
    assert (p.max_tokens, p.temperature, p.top_p, p.top_k, p.min_p) == (16, 1.0, 1.0, -1, 0.0)
    assert (p.repetition_penalty, p.frequency_penalty, p.presence_penalty) == (1.0, 0.0, 0.0)
    assert p.seed is None and p.stop == () and p.stop_token_ids == () and p.logprobs is None
    assert not p.ignore_eos and p.skip_special_tokens and not p.is_greedy


@pytest.mark.parametrize(
    "kwargs",
    [
        {"top_k": -1},
        {"top_k": 1},
        {"top_p": 1},
        {"min_p": 1},
        {"temperature": 0},
        {"frequency_penalty": -2, "presence_penalty": 2},
        {"logprobs": 0},
        {"logprobs": 20},
        {"seed": 0},
        {"seed": 2**63 - 1},
        {"stop": ("a", "bc"), "stop_token_ids": (0, 5)},
    ],
)
def test_boundary_values_are_valid(kwargs: dict[str, Any]) -> None:
    params = SamplingParams(**kwargs)
    assert all(getattr(params, k) == v for k, v in kwargs.items())


def test_is_greedy() -> None:
    assert SamplingParams(temperature=0.0).is_greedy
    assert SamplingParams(temperature=0.8, top_k=1).is_greedy
    assert not SamplingParams(temperature=0.8, top_k=2).is_greedy


def test_create_normalises_stop() -> None:
    assert SamplingParams.create(stop="###").stop == ("###",)
    assert SamplingParams.create(stop=["a", "b"]).stop == ("a", "b")
    assert SamplingParams.create(stop=None).stop == ()
    assert SamplingParams.create(stop_token_ids=[7, 9]).stop_token_ids == (7, 9)
    assert SamplingParams.create(stop_token_ids=7).stop_token_ids == (7,)
    p = SamplingParams.create(stop="x", temperature=0.5, max_tokens=3)
    assert (p.temperature, p.max_tokens) == (0.5, 3)


def test_create_still_validates() -> None:
    with pytest.raises(ValueError, match="^stop="):
        SamplingParams.create(stop=["ok", ""])
    with pytest.raises(ValueError, match="^top_k="):
        SamplingParams.create(stop="x", top_k=0)


def test_frozen() -> None:
    p = SamplingParams()
    with pytest.raises(AttributeError):
        p.temperature = 0.5  # type: ignore[misc]
