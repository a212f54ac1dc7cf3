"""The runner keeps penalty state (output-token counts, prompt-or-output membership) only for
requests with penalties: a batch mixing penalised and plain requests, and a penalised request
that takes over the slot a plain request left (whose rows were never kept), sample exactly as
each request does alone."""

from __future__ import annotations

import torch

from dsv4 import EngineConfig, SamplingParams
from dsv4.checkpoint.presets import get_preset
from dsv4.checkpoint.writer import random_model
from dsv4.engine.engine import LLMEngine

PENALISED = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True,
                           repetition_penalty=1.6, frequency_penalty=1.5, presence_penalty=1.0)
PLAIN = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


def engine(max_running: int = 2) -> LLMEngine:
    model = random_model(get_preset("micro"), torch.float32, torch.device("cpu"), seed=1)
    return LLMEngine(model, EngineConfig(page_size=16, max_running_requests=max_running,
                                         disable_prefix_cache=True))


def prompt(seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(2, 512, (24,), generator=g).tolist()


def alone(p: list[int], params: SamplingParams) -> list[int]:
    eng = engine()
    req = eng.add_request(p, params)
    while eng.has_unfinished():
        eng.step()
    return req.output_ids


def test_uses_penalties() -> None:
    assert PENALISED.uses_penalties and not PLAIN.uses_penalties
    assert SamplingParams(presence_penalty=0.5).uses_penalties


def test_mixed_batch_with_stale_rows_equals_each_request_alone() -> None:
    """x (penalised, short) leaves its slot to y (plain: its rows keep x's state) while a
    (penalised) runs beside it, so y's stale rows are read, with neutral penalties."""
    short = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True,
                           frequency_penalty=2.0, repetition_penalty=2.0)
    eng = engine()
    a = eng.add_request(prompt(1), PENALISED)
    x = eng.add_request(prompt(2), short)
    y = eng.add_request(prompt(2), PLAIN)        # waits for x's slot (2 running at most)
    while eng.has_unfinished():
        eng.step()
    for req, p, params in ((a, 1, PENALISED), (x, 2, short), (y, 2, PLAIN)):
        assert req.output_ids == alone(prompt(p), params), p
    # the penalties change the tokens here, so the test would see stale or missing state
    assert a.output_ids != alone(prompt(1), PLAIN)


def test_penalised_request_after_a_plain_one_gets_its_own_rows() -> None:
    """One slot: y (plain) then b (penalised, the same prompt) in it; b's rows are rebuilt at
    admission from its own prompt, whatever y left."""
    eng = engine(max_running=1)
    y = eng.add_request(prompt(3), PLAIN)
    b = eng.add_request(prompt(3), PENALISED)
    while eng.has_unfinished():
        eng.step()
    assert y.output_ids == alone(prompt(3), PLAIN)
    assert b.output_ids == alone(prompt(3), PENALISED) != y.output_ids
