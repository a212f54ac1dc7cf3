"""The scheduler and the engine's step loop against a fake runner (no model compute).

The fake runner answers every step with tokens that are a pure function of (request, position), one
or several per request: so outputs are known in advance whatever the batching, chunking or
preemption, and the tests check the scheduling itself — the token budget, decode-first order, the
running-request limit, recompute preemption under a small cache, multi-token steps (a later step
feeds all the new tokens), a finish inside a step's tokens (eos, max_tokens) — with every manager's
`check_integrity()` after each step and every page free at the end, with the prefix cache on and
off.
"""

from __future__ import annotations

import pytest
import torch

from dsv4.checkpoint.presets import micro
from dsv4.checkpoint.writer import random_model
from dsv4.config.engine import EngineConfig
from dsv4.engine.engine import LLMEngine
from dsv4.engine.request import Request
from dsv4.engine.sampling_params import SamplingParams
from dsv4.engine.scheduler import ScheduledStep
from dsv4.engine.step_output import RequestTokens, StepResult
from dsv4.model.deepseek_v4 import DeepSeekV4ForCausalLM

VOCAB = micro().vocab_size
EOS = micro().eos_token_id


def token_at(rid: str, position: int) -> int:
    """The fake model's token at `position` of request `rid` (never eos: eos tests place it
    themselves)."""
    tok = (1009 * int(rid) + 31 * position) % (VOCAB - 2) + 1
    return tok + 1 if tok >= EOS else tok


class FakeStep:
    def __init__(self, result: StepResult) -> None:
        self.result = result

    def resolve(self) -> StepResult:
        return self.result


class FakeRunner:
    """Stands in for `ModelRunner.run`: a request whose step reaches its last token gets `per_step`
    tokens (its next positions' `token_at`, or what `override` says), and every step is recorded."""

    def __init__(self, engine: LLMEngine, per_step: int = 1) -> None:
        self.engine, self.per_step = engine, per_step
        self.steps: list[ScheduledStep] = []
        self.override: dict[tuple[str, int], int] = {}
        engine.runner.run = self.run  # type: ignore[method-assign]

    def run(self, step: ScheduledStep) -> FakeStep:
        self.steps.append(step)
        reqs, outs = [], []
        for req, k in zip(step.requests, step.shape.num_logits, strict=True):
            if k == 0:
                continue
            start = len(req.all_ids)
            toks = [self.override.get((req.rid, p), token_at(req.rid, p))
                    for p in range(start, start + self.per_step)]
            reqs.append(req)
            outs.append(RequestTokens(toks, [-0.5] * len(toks), [{} for _ in toks]))
        return FakeStep(StepResult(reqs, outs))


@pytest.fixture(scope="module")
def model() -> DeepSeekV4ForCausalLM:
    return random_model(micro(), torch.float32, torch.device("cpu"))


def make_engine(model: DeepSeekV4ForCausalLM, **kwargs: object) -> LLMEngine:
    args: dict[str, object] = dict(page_size=16, max_total_tokens=2048, max_running_requests=4,
                                   chunked_prefill_size=24)
    args.update(kwargs)
    return LLMEngine(model, EngineConfig(**args))  # type: ignore[arg-type]


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 70, (n,), generator=g).tolist()
    return [torch.randint(1, VOCAB, (m,), generator=g).tolist() for m in lengths]


def drive(engine: LLMEngine, fake: FakeRunner, max_tokens: list[int]) -> dict[str, Request]:
    """Run every prompt to its end, checking the scheduler's invariants at every step."""
    reqs = {}
    for i, p in enumerate(prompts(len(max_tokens))):
        reqs[str(i)] = engine.add_request(p, SamplingParams(max_tokens=max_tokens[i],
                                                            temperature=0.0), rid=str(i))
    while engine.has_unfinished():
        engine.step()
        step = fake.steps[-1]
        assert step.num_tokens <= engine.config.chunked_prefill_size
        assert len(step.requests) <= engine.config.max_running_requests
        engine.check_integrity()
    return reqs


def expected_output(rid: str, prompt_len: int, n: int) -> list[int]:
    return [token_at(rid, prompt_len + j) for j in range(n)]


@pytest.mark.parametrize("prefix_cache", [True, False])
@pytest.mark.parametrize("per_step", [1, 3])
def test_outputs_follow_the_fake_model(model: DeepSeekV4ForCausalLM, prefix_cache: bool,
                                       per_step: int) -> None:
    engine = make_engine(model, disable_prefix_cache=not prefix_cache)
    fake = FakeRunner(engine, per_step)
    max_tokens = [1, 2, 5, 9, 4, 7, 3, 8]
    reqs = drive(engine, fake, max_tokens)
    for rid, req in reqs.items():
        n = max_tokens[int(rid)]
        # cut exactly at max_tokens
        assert req.output_ids == expected_output(rid, len(req.prompt_ids), n), rid
        assert req.finish_reason == "length"
        assert req.all_ids == req.prompt_ids + req.output_ids
    if per_step > 1:    # a step after a multi-token result feeds all of those tokens
        assert any(n == per_step for s in fake.steps for n in s.shape.lens)
    assert_all_free(engine)


def test_budget_and_decode_first(model: DeepSeekV4ForCausalLM) -> None:
    engine = make_engine(model, chunked_prefill_size=10, max_running_requests=3)
    fake = FakeRunner(engine)
    drive(engine, fake, [6] * 7)
    for step in fake.steps:
        # a request decodes when the token it feeds is an output: every one comes before any chunk
        # of several
        decoding = [i for i, (r, start)
                    in enumerate(zip(step.requests, step.shape.starts, strict=True))
                    if start >= len(r.prompt_ids)]
        chunks = [i for i, n in enumerate(step.shape.lens) if n > 1]
        assert not decoding or not chunks or max(decoding) < min(chunks), step.shape
    assert max(len(s.requests) for s in fake.steps) == 3
    assert_all_free(engine)


def test_preemption_recomputes_to_the_same_outputs(model: DeepSeekV4ForCausalLM) -> None:
    max_tokens = [12] * 6
    big = make_engine(model)
    expected = {rid: r.output_ids for rid, r in drive(big, FakeRunner(big), max_tokens).items()}
    small = make_engine(model, max_total_tokens=96, max_running_requests=6, chunked_prefill_size=64)
    fake = FakeRunner(small)
    got = drive(small, fake, max_tokens)
    assert small.scheduler.num_preemptions > 0, "the pool was meant to be too small for the batch"
    assert {rid: r.output_ids for rid, r in got.items()} == expected
    restarted = [s for s in fake.steps
                 if 0 in s.shape.starts and any(r.output_ids for r in s.requests)]
    assert restarted, "a preempted request re-prefills from position 0"
    assert_all_free(small)


def test_finish_inside_a_multi_token_step(model: DeepSeekV4ForCausalLM) -> None:
    """eos at the second of three tokens: the request keeps the first two and stops."""
    engine = make_engine(model)
    fake = FakeRunner(engine, per_step=3)
    p = prompts(1, seed=7)[0]
    fake.override[("0", len(p) + 4)] = EOS          # second token of the second step
    req = engine.add_request(p, SamplingParams(max_tokens=50, temperature=0.0, logprobs=0),
                             rid="0")
    while engine.has_unfinished():
        updated = engine.step()
        engine.check_integrity()
        assert all(r is req for r in updated)
    assert req.finish_reason == "stop"
    assert req.output_ids == expected_output("0", len(p), 4) + [EOS]
    assert len(req.logprobs) == len(req.token_times) == 5
    assert_all_free(engine)


def assert_all_free(engine: LLMEngine) -> None:
    engine.flush_cache()
    engine.check_integrity()
    table = engine.runner.table
    assert (table.full.num_free == table.full.num_usable
            and table.swa.num_free == table.swa.num_usable)
    assert table.num_free_slots == engine.config.max_running_requests
