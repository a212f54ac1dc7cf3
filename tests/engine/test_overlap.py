"""Overlap scheduling (`EngineConfig.overlap_schedule`): the engine launches step N + 1 before it
resolves step N, feeding N's sampled tokens to N + 1 on the device.

Every workload runs twice on the `micro` preset (CPU, fp32), overlap off and on, and must give
the same token ids, finish reasons and log-probs: staggered arrivals with different prompt
lengths and max_tokens, small chunked-prefill budgets, prefix-cache hits, stop token ids and stop
strings finishing requests mid-batch, aborts mid-generation, a pool small enough to preempt, and
seeded sampling. After each workload every pool is back to its initial free count and
`check_integrity()` passes. A spy on `ModelRunner.run` / `StepOutput.resolve` shows that the
overlapped engine really launches step N + 1 before resolving step N.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from test_engine_equivalence import LogitRecorder
from test_engine_equivalence import assert_pools_free as assert_no_leak

from dsv4 import LLM, SamplingParams
from dsv4.checkpoint.presets import micro
from dsv4.checkpoint.writer import random_model, write_checkpoint
from dsv4.config.engine import EngineConfig
from dsv4.config.engine_defaults import resolve_overlap
from dsv4.engine.cuda_graph import DecodeGraphs
from dsv4.engine.engine import LLMEngine
from dsv4.engine.request import Request
from dsv4.engine.runner import ModelRunner
from dsv4.engine.sampling_params import StructuredOutput
from dsv4.engine.scheduler import ScheduledStep, Scheduler
from dsv4.engine.step_output import StepOutput, StepResult

LOGPROB_TOL = 1e-5      # a step's batch differs by the finished requests' extra rows
Outputs = dict[str, tuple[list[int], str | None, list[float]]]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("overlap") / "micro"
    write_checkpoint(micro(), path, seed=2, tokenizer=True)
    return path


def make_llm(ckpt: Path, overlap: bool, **kwargs: object) -> LLM:
    args: dict[str, object] = {"page_size": 16, "max_total_tokens": 2048,
                               "max_running_requests": 6}
    args.update(kwargs)
    return LLM(ckpt, dtype="float32", device="cpu", overlap_schedule=overlap, **args)


def random_prompts(lengths: list[int], seed: int, vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


def drive(engine: LLMEngine, prompts: list[list[int]], params: list[SamplingParams],
          per_step: int = 2,
          on_step: Callable[[LLMEngine, dict[str, Request]], None] | None = None,
          rid_prefix: str = "") -> dict[str, Request]:
    """Requests join `per_step` at a time while others run; `on_step` sees the engine after
    every step (aborts). Request ids are `rid_prefix` + the prompt's index; results are keyed by
    the index."""
    reqs: dict[str, Request] = {}
    pending = list(enumerate(zip(prompts, params, strict=True)))
    while pending or engine.has_unfinished():
        for _ in range(per_step):
            if pending:
                i, (p, sp) = pending.pop(0)
                reqs[str(i)] = engine.add_request(p, sp, rid=rid_prefix + str(i))
        engine.step()
        engine.check_integrity()
        if on_step is not None:
            on_step(engine, reqs)
    return reqs


def outputs(reqs: dict[str, Request]) -> Outputs:
    return {rid: (r.output_ids, r.finish_reason, r.logprobs) for rid, r in reqs.items()}


def assert_same(off: Outputs, on: Outputs) -> None:
    assert off.keys() == on.keys()
    for rid in off:
        assert on[rid][0] == off[rid][0], f"request {rid}: tokens differ with overlap"
        assert on[rid][1] == off[rid][1], f"request {rid}: finish reason differs with overlap"
        assert len(on[rid][2]) == len(off[rid][2])
        if off[rid][2]:
            diff = (torch.tensor(on[rid][2]) - torch.tensor(off[rid][2])).abs().max().item()
            assert diff <= LOGPROB_TOL, f"request {rid}: log-probs differ by {diff}"


def assert_pools_free(engine: LLMEngine) -> None:
    """Nothing in flight, nothing leaked: with the prefix cache flushed every page and slot is
    free again."""
    assert not engine.has_unfinished() and engine._inflight is None
    assert_no_leak(engine)
    assert all(r.num_inflight == 0 for r in engine.requests.values())


def both(ckpt: Path, run: Callable[[LLM], Outputs], **kwargs: object
         ) -> tuple[Outputs, Outputs, LLM, LLM]:
    off_llm, on_llm = make_llm(ckpt, False, **kwargs), make_llm(ckpt, True, **kwargs)
    off, on = run(off_llm), run(on_llm)
    assert_pools_free(off_llm.engine)
    assert_pools_free(on_llm.engine)
    assert_same(off, on)
    # a request a step finishes may already be in the next one (its extra token is dropped)
    assert on_llm.engine.steps >= off_llm.engine.steps
    assert on_llm.engine.decode_tokens >= off_llm.engine.decode_tokens
    return off, on, off_llm, on_llm


@pytest.mark.parametrize("chunk", [3, 64])
def test_staggered_mixed_lengths(ckpt: Path, chunk: int) -> None:
    prompts = random_prompts([1, 5, 16, 17, 31, 40, 9, 2, 23], seed=chunk,
                             vocab=micro().vocab_size)
    params = [SamplingParams(max_tokens=2 + (5 * i) % 9, temperature=0.0, ignore_eos=True,
                             logprobs=2) for i in range(len(prompts))]

    def run(llm: LLM) -> Outputs:
        return outputs(drive(llm.engine, prompts, params))

    off, _, off_llm, on_llm = both(ckpt, run, chunked_prefill_size=chunk)
    assert all(reason == "length" for _, reason, _ in off.values())
    assert on_llm.engine.steps > off_llm.engine.steps / 2


def test_length_finish_is_not_scheduled_again(ckpt: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """A request whose in-flight token reaches max_tokens is left out of the next step: with
    overlap on, every request samples exactly as many rows as it has tokens and the engine feeds
    as many decode tokens as with overlap off (before, each request computed one more row)."""
    rec = LogitRecorder(monkeypatch)
    vocab = micro().vocab_size
    prompts = random_prompts([5, 40, 17, 3, 60, 9], seed=11, vocab=vocab)
    params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True)
              for m in (1, 2, 5, 8, 3, 13)]

    def run(llm: LLM) -> Outputs:
        return outputs(drive(llm.engine, prompts, params, rid_prefix=f"{llm.engine.overlap}-"))

    off, on, off_llm, on_llm = both(ckpt, run, chunked_prefill_size=32)
    for i, p in enumerate(params):
        for overlap in (False, True):
            assert len(rec.rows[f"{overlap}-{i}"]) == p.max_tokens, (overlap, i)
    assert on_llm.engine.decode_tokens == off_llm.engine.decode_tokens


def test_prefix_cache_hits(ckpt: Path) -> None:
    g = torch.Generator().manual_seed(7)
    head = torch.randint(0, micro().vocab_size, (40,), generator=g).tolist()
    prompts = [head + torch.randint(0, micro().vocab_size, (n,), generator=g).tolist()
               for n in (1, 5, 0, 12, 3, 20)]
    params = [SamplingParams(max_tokens=4 + i, temperature=0.0, ignore_eos=True, logprobs=0)
              for i in range(len(prompts))]

    def run(llm: LLM) -> Outputs:
        return outputs(drive(llm.engine, prompts, params, per_step=1))

    _, _, _, llm = both(ckpt, run, chunked_prefill_size=24)
    assert llm.engine.scheduler.cached_prompt_tokens > 0, "the workload was meant to hit"


def test_stop_token_ids_mid_batch(ckpt: Path) -> None:
    prompts = random_prompts([4, 11, 18, 7, 25, 3], seed=3, vocab=micro().vocab_size)
    free = make_llm(ckpt, False)
    base = [o.token_ids for o in free.generate(
        prompt_token_ids=prompts, use_tqdm=False,
        sampling_params=SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))]
    # each request stops at a different point: on its own (1 + i)-th token, or runs to the end
    params = [SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, logprobs=0,
                             stop_token_ids=(base[i][1 + 2 * i],) if i < 5 else ())
              for i in range(len(prompts))]

    def run(llm: LLM) -> Outputs:
        return outputs(drive(llm.engine, prompts, params))

    off, _, _, _ = both(ckpt, run)
    assert sum(reason == "stop" for _, reason, _ in off.values()) >= 3
    assert any(reason == "length" for _, reason, _ in off.values())


def test_stop_strings(ckpt: Path) -> None:
    prompts = ["the quick brown fox", "a b c", "lorem ipsum dolor sit amet", "x"]
    free = make_llm(ckpt, False)
    texts = [o.text for o in free.generate(prompts, SamplingParams(
        max_tokens=20, temperature=0.0, ignore_eos=True), use_tqdm=False)]
    stops = [t[len(t) // 3:len(t) // 3 + 2] for t in texts]
    params = [SamplingParams.create(max_tokens=20, temperature=0.0, ignore_eos=True,
                                    stop=[s] if s.strip() else [])
              for s in stops]

    def run(llm: LLM) -> Outputs:
        outs = llm.generate(prompts, params, use_tqdm=False)
        return {o.request_id: (o.token_ids, o.finish_reason, o.logprobs) for o in outs}

    off_llm, on_llm = make_llm(ckpt, False), make_llm(ckpt, True)
    off, on = run(off_llm), run(on_llm)
    assert sum(reason == "stop" for _, reason, _ in off.values()) >= 2
    assert [v[:2] for v in off.values()] == [v[:2] for v in on.values()]
    assert_pools_free(off_llm.engine)
    assert_pools_free(on_llm.engine)


def test_abort_mid_generation(ckpt: Path) -> None:
    prompts = random_prompts([6, 13, 2, 20, 9], seed=11, vocab=micro().vocab_size)
    params = [SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True,
                             logprobs=0)] * len(prompts)
    # request i is aborted once it has 3 + 2 i tokens on the host (request 4 runs to the end)

    def aborts(engine: LLMEngine, reqs: dict[str, Request]) -> None:
        for rid, req in reqs.items():
            if int(rid) < 4 and len(req.output_ids) >= 3 + 2 * int(rid):
                engine.abort(rid)

    def run(llm: LLM) -> Outputs:
        return outputs(drive(llm.engine, prompts, params, on_step=aborts))

    off, _, _, _ = both(ckpt, run, chunked_prefill_size=8)
    assert [off[str(i)][1] for i in range(5)] == ["abort"] * 4 + ["length"]


def test_preemption(ckpt: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Also: a request preempted while its token is in flight gets that token when the step
    resolves (it is part of what it re-prefills)."""
    prompts = random_prompts([5, 17, 30, 2, 23, 12, 40, 8], seed=5, vocab=micro().vocab_size)
    params = [SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True,
                             logprobs=0)] * len(prompts)
    in_flight: list[tuple[Request, int]] = []      # (request, its output length) at preemption
    checked = []
    preempt = Scheduler.preempt

    def spy_preempt(sched: Scheduler, req: Request) -> None:
        if req.num_inflight:
            in_flight.append((req, len(req.output_ids)))
        preempt(sched, req)

    def check(engine: LLMEngine, reqs: dict[str, Request]) -> None:
        while in_flight:
            req, n = in_flight.pop()
            assert len(req.output_ids) == n + 1, "the in-flight token of a preempted request"
            checked.append(req.rid)

    monkeypatch.setattr(Scheduler, "preempt", spy_preempt)

    def run(llm: LLM) -> Outputs:
        return outputs(drive(llm.engine, prompts, params, per_step=8, on_step=check))

    _, _, _, llm = both(ckpt, run, max_total_tokens=96, max_running_requests=8,
                        chunked_prefill_size=64)
    assert llm.engine.scheduler.num_preemptions > 0, "the pool was meant to be too small"
    assert checked, "no request was preempted with its token in flight"


def test_structured_output(ckpt: Path) -> None:
    """A request with a grammar needs its tokens on the host before its next mask: its steps
    are resolved before the next is scheduled, and it follows its grammar as without overlap."""
    prompts = random_prompts([6, 15, 3, 11], seed=19, vocab=micro().vocab_size)
    spec = StructuredOutput("regex", "[0-9]{2,4} apples")
    params = [SamplingParams(max_tokens=12, temperature=0.0, logprobs=0,
                             structured=spec if i % 2 == 0 else None, ignore_eos=i % 2 == 1)
              for i in range(len(prompts))]

    def run(llm: LLM) -> Outputs:
        # compiled up front (a cached grammar is admitted at once): otherwise when a request
        # joins depends on the compile thread's timing, and so do the two schedules compared
        assert llm.engine.grammars is not None
        llm.engine.grammars.prepare(spec).result()
        return outputs(drive(llm.engine, prompts, params))

    off, _, _, _ = both(ckpt, run, chunked_prefill_size=8)
    assert [off[str(i)][1] for i in (0, 2)] == ["stop", "stop"]


def test_routing_capture(ckpt: Path) -> None:
    """Captured routing (RL replay) per request is the same: a finished request's dropped token
    adds none."""
    prompts = random_prompts([7, 19, 2, 30], seed=23, vocab=micro().vocab_size)
    params = [SamplingParams(max_tokens=3 + 2 * i, temperature=0.0, ignore_eos=True, logprobs=0)
              for i in range(len(prompts))]
    routes = []

    def run(llm: LLM) -> Outputs:
        reqs = drive(llm.engine, prompts, params)
        routes.append({rid: {k: torch.cat(v) for k, v in r.routing.items()}
                       for rid, r in reqs.items()})
        return outputs(reqs)

    both(ckpt, run, capture_routing=True, disable_prefix_cache=True, chunked_prefill_size=12)
    off, on = routes
    for rid, req_routes in off.items():
        assert req_routes, "routing was meant to be captured"
        assert req_routes.keys() == on[rid].keys()
        for key, t in req_routes.items():
            assert on[rid][key].shape == t.shape, f"request {rid}: {key} routing shape differs"
            assert torch.equal(on[rid][key], t), f"request {rid}: {key} routing differs"


def test_seeded_sampling(ckpt: Path) -> None:
    prompts = random_prompts([3, 14, 8, 21, 1], seed=13, vocab=micro().vocab_size)
    params = [SamplingParams(max_tokens=10, temperature=1.0, top_k=50, seed=100 + i,
                             ignore_eos=True, repetition_penalty=1.3 if i % 2 else 1.0,
                             logprobs=0)
              for i in range(len(prompts))]

    def run(llm: LLM) -> Outputs:
        return outputs(drive(llm.engine, prompts, params))

    both(ckpt, run, chunked_prefill_size=10)


def test_logprobs_only_for_requests_that_ask(ckpt: Path) -> None:
    """Log-probs are kept for the requests that ask (one per output token) and for no other,
    whether their batch computed them or not (a step whose requests all ask for none skips
    them); the tokens are those of a run where every request asks."""
    prompts = random_prompts([6, 13, 2, 20, 9, 4], seed=31, vocab=micro().vocab_size)
    lengths = [3, 12, 5, 12, 4, 12]      # the askers finish first: later steps compute none
    params = [SamplingParams(max_tokens=n, temperature=0.0 if i % 3 else 1.0, seed=i,
                             ignore_eos=True, logprobs=1 if i % 2 == 0 else None)
              for i, n in enumerate(lengths)]
    every = [dataclasses.replace(p, logprobs=1) for p in params]

    def run(llm: LLM) -> Outputs:
        reqs = drive(llm.engine, prompts, params)
        for i, req in enumerate(reqs[str(i)] for i in range(len(prompts))):
            asked = params[i].logprobs is not None
            assert len(req.logprobs) == len(req.top_logprobs) == (
                len(req.output_ids) if asked else 0), f"request {i}"
        return outputs(reqs)

    off, _, _, _ = both(ckpt, run, chunked_prefill_size=10)
    want = outputs(drive(make_llm(ckpt, False, chunked_prefill_size=10).engine, prompts, every))
    assert [v[0] for v in off.values()] == [v[0] for v in want.values()]
    for rid in off:
        if off[rid][2]:
            assert off[rid][2] == want[rid][2], f"request {rid}: log-probs depend on the batch"


def test_prompt_logprobs_resolve_first(ckpt: Path) -> None:
    """A request asking for prompt log-probs makes the engine resolve its step before the next
    one is scheduled; its outputs and prompt log-probs are as without overlap."""
    prompts = random_prompts([9, 20, 4], seed=17, vocab=micro().vocab_size)
    params = [SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=0,
                             prompt_logprobs=1 if i == 1 else None) for i in range(3)]

    def run(llm: LLM) -> Outputs:
        reqs = drive(llm.engine, prompts, params)
        got = outputs(reqs)
        got["prompt"] = ([], None, [x for x in reqs["1"].prompt_logprobs if x is not None])
        return got

    both(ckpt, run, chunked_prefill_size=7)


class Spy:
    """Records the order of `ModelRunner.run` (launch) and `StepOutput.resolve` (host sync)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.events: list[tuple[str, int]] = []
        self.launched: dict[StepOutput, int] = {}      # StepOutput hashes by identity
        run, resolve = ModelRunner.run, StepOutput.resolve

        def spy_run(runner: ModelRunner, step: ScheduledStep) -> StepOutput:
            out = run(runner, step)
            self.launched[out] = len(self.launched)
            self.events.append(("run", self.launched[out]))
            return out

        def spy_resolve(out: StepOutput) -> StepResult:
            self.events.append(("resolve", self.launched[out]))
            return resolve(out)

        monkeypatch.setattr(ModelRunner, "run", spy_run)
        monkeypatch.setattr(StepOutput, "resolve", spy_resolve)

    def launched_ahead(self) -> int:
        """Steps whose successor was launched before they were resolved."""
        ahead = 0
        for k in range(len(self.launched) - 1):
            if self.events.index(("run", k + 1)) < self.events.index(("resolve", k)):
                ahead += 1
        return ahead


def test_overlap_through_decode_graphs(ckpt: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Overlap scheduling with decode steps through `DecodeGraphs` (eager replays on the CPU:
    the same static input rows, per-key constants and in-flight token fill as the GPU's captured
    graphs) gives the tokens and log-probs of plain steps without overlap."""
    prompts = random_prompts([5, 17, 31, 9, 12, 3], seed=5, vocab=micro().vocab_size)
    params = [SamplingParams(max_tokens=4 + 3 * (i % 3), ignore_eos=True, logprobs=0,
                             temperature=0.0 if i % 2 else 0.8, seed=i) for i in range(6)]

    def run(llm: LLM) -> Outputs:
        return outputs(drive(llm.engine, prompts, params))

    off_llm, on_llm = make_llm(ckpt, False), make_llm(ckpt, True)
    runner = on_llm.engine.runner
    graphs = runner.graphs = DecodeGraphs(on_llm.model, runner.table, runner.pools, runner.ops,
                                          max_batch=4, capture=False)
    filled = []
    original = graphs.run_streams

    def spy(*args: Any, **kwargs: Any) -> Any:
        filled.append(len(args) > 3 and args[3] is not None or kwargs.get("fill") is not None)
        return original(*args, **kwargs)

    monkeypatch.setattr(graphs, "run_streams", spy)
    off, on = run(off_llm), run(on_llm)
    assert_same(off, on)
    assert sum(filled) >= 5, "decode steps took in-flight tokens through the graphs"
    assert_pools_free(on_llm.engine)


@pytest.mark.parametrize("overlap", [False, True])
def test_step_n_plus_1_launches_before_step_n_resolves(ckpt: Path, overlap: bool,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    spy = Spy(monkeypatch)
    llm = make_llm(ckpt, overlap, chunked_prefill_size=16)
    prompts = random_prompts([5, 12, 30], seed=1, vocab=micro().vocab_size)
    params = [SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)] * 3
    drive(llm.engine, prompts, params, per_step=3)
    runs = [k for e, k in spy.events if e == "run"]
    resolves = [k for e, k in spy.events if e == "resolve"]
    # one host sync per step, in launch order
    assert runs == resolves == list(range(len(runs))) == list(range(llm.engine.steps))
    if overlap:
        # every step but the last has its successor launched first
        assert spy.launched_ahead() == len(runs) - 1
    else:
        assert spy.launched_ahead() == 0
        assert spy.events == [(e, k) for k in range(len(runs)) for e in ("run", "resolve")]


def test_prompt_logprobs_steps_resolve_first(ckpt: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """The rule: a step with a request that asks for prompt log-probs is resolved before the
    next step is launched; the others are launched ahead."""
    spy = Spy(monkeypatch)
    held: list[bool] = []            # per launched step: it holds the prompt log-probs request
    run = ModelRunner.run

    def note(runner: ModelRunner, step: ScheduledStep) -> StepOutput:
        held.append(any(r.params.prompt_logprobs is not None for r in step.requests))
        return run(runner, step)

    monkeypatch.setattr(ModelRunner, "run", note)
    llm = make_llm(ckpt, True, chunked_prefill_size=8)
    prompts = random_prompts([5, 20], seed=2, vocab=micro().vocab_size)
    params = [SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True,
                             prompt_logprobs=1 if i == 1 else None) for i in range(2)]
    drive(llm.engine, prompts, params, per_step=1)
    ahead = [spy.events.index(("run", k + 1)) < spy.events.index(("resolve", k))
             for k in range(len(held) - 1)]
    assert any(held) and not all(held)
    assert ahead == [not h for h in held[:-1]]


def test_unsupported_combination_raises() -> None:
    with pytest.raises(ValueError, match=r"overlap_schedule=True with speculative_num_steps=2 "
                                         r"is not supported.*allowed: overlap_schedule=False, or "
                                         r"speculative_num_steps=0"):
        EngineConfig(overlap_schedule=True, speculative_num_steps=2)
    with pytest.raises(ValueError, match=r"overlap_schedule='yes' is invalid; allowed: None, "
                                         r"True or False"):
        EngineConfig(overlap_schedule="yes")  # type: ignore[arg-type]
    assert EngineConfig().overlap_schedule is None
    EngineConfig(overlap_schedule=True)
    EngineConfig(speculative_num_steps=2)       # the default resolves off with speculation


def test_overlap_default_resolution() -> None:
    """Unset, overlap is on with CUDA and no speculative decoding, off elsewhere; an explicit
    choice wins. The CPU engine resolves it off, and the resolved value is what the engine runs."""
    assert resolve_overlap(None, "cuda", 0)
    assert not resolve_overlap(None, "cuda", 2)
    assert not resolve_overlap(None, "cpu", 0)
    assert not resolve_overlap(False, "cuda", 0)
    assert resolve_overlap(True, "cpu", 0)
    model = random_model(micro(), torch.float32, torch.device("cpu"))
    engine = LLMEngine(model, EngineConfig(page_size=16, max_total_tokens=512))
    assert engine.runner.config.overlap_schedule is False and not engine.overlap


@pytest.mark.gpu
def test_gpu_overlap_is_the_cuda_default() -> None:
    """`LLM(...)` on CUDA schedules with overlap unless told otherwise."""
    engine = LLMEngine(random_model(micro(), torch.float32, torch.device("cuda")),
                       EngineConfig(page_size=16, max_total_tokens=2048, warmup="none"))
    assert engine.runner.config.overlap_schedule is True and engine.overlap
    off = LLMEngine(random_model(micro(), torch.float32, torch.device("cuda")),
                    EngineConfig(page_size=16, max_total_tokens=2048, warmup="none",
                                 overlap_schedule=False))
    assert not off.overlap


@pytest.mark.gpu
@pytest.mark.parametrize("graphs", [True, False])
def test_gpu_overlap_equals_no_overlap(ckpt: Path, graphs: bool,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """On CUDA (triton kernels; decode steps replay CUDA graphs, whose input rows take the
    in-flight tokens on the device, or run eagerly): greedy and seeded outputs with overlap equal
    those without, and step N + 1 is launched before step N resolves."""
    torch.backends.cuda.matmul.allow_tf32 = False
    prompts = random_prompts([1, 5, 16, 17, 31, 40, 9, 2, 23], seed=29, vocab=micro().vocab_size)
    params = [SamplingParams(max_tokens=3 + (5 * i) % 11, ignore_eos=True, logprobs=1,
                             temperature=1.0 if i % 3 == 0 else 0.0, seed=i)
              for i in range(len(prompts))]
    spy = Spy(monkeypatch)

    def run(llm: LLM) -> Outputs:
        return outputs(drive(llm.engine, prompts, params))

    results = []
    for overlap in (False, True):
        llm = LLM(ckpt, dtype="float32", device="cuda", page_size=16, max_total_tokens=2048,
                  chunked_prefill_size=12, overlap_schedule=overlap,
                  disable_cuda_graph=not graphs)
        results.append(run(llm))
        assert_pools_free(llm.engine)
        if graphs:
            assert llm.engine.runner.graphs is not None and llm.engine.runner.graphs.replays > 0
    off, on = results
    assert [v[:2] for v in off.values()] == [v[:2] for v in on.values()]
    for rid in off:
        if off[rid][2]:
            diff = (torch.tensor(on[rid][2]) - torch.tensor(off[rid][2])).abs().max().item()
            assert diff <= 1e-4, f"request {rid}: log-probs differ by {diff}"
    assert spy.launched_ahead() > 0


@pytest.mark.gpu
def test_gpu_step_launch_never_waits_for_the_device(ckpt: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """`ModelRunner.run` launches a step without waiting for the device (its contract, and what
    overlap scheduling needs): under `torch.cuda.set_sync_debug_mode("error")` any hidden sync
    in it (a copy from pageable host memory, `.item()`, a bool of a device tensor) raises. Greedy,
    sampled, penalised and log-prob requests, CUDA graphs on. A first pass of the same workload
    runs unchecked: capturing a graph (warmup, or a shape's first use) is a named sync point. The
    checked pass must produce what the first one did."""
    original = ModelRunner.run

    def strict(self: ModelRunner, step: ScheduledStep) -> StepOutput:
        torch.cuda.set_sync_debug_mode("error")
        try:
            return original(self, step)
        finally:
            torch.cuda.set_sync_debug_mode("default")

    prompts = random_prompts([5, 17, 31, 9], seed=3, vocab=micro().vocab_size)
    params = [SamplingParams(max_tokens=6, ignore_eos=True, temperature=0.0),
              SamplingParams(max_tokens=6, ignore_eos=True, temperature=1.0, seed=1, logprobs=2),
              SamplingParams(max_tokens=6, ignore_eos=True, temperature=0.0,
                             repetition_penalty=1.3, frequency_penalty=0.5),
              SamplingParams(max_tokens=6, ignore_eos=True, temperature=0.7, top_p=0.9, seed=2)]
    llm = LLM(ckpt, dtype="float32", device="cuda", page_size=16, max_total_tokens=2048,
              overlap_schedule=True, disable_prefix_cache=True)
    graphs = llm.engine.runner.graphs
    assert graphs is not None
    first = {rid: r.output_ids for rid, r in drive(llm.engine, prompts, params).items()}
    replays = graphs.replays
    monkeypatch.setattr(ModelRunner, "run", strict)
    checked = {rid: r.output_ids
               for rid, r in drive(llm.engine, prompts, params, rid_prefix="b").items()}
    assert checked == first
    assert graphs.replays > replays
