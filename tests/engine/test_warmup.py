"""Engine warmup (`engine/warmup.py`, `warm_up`): the plan of each mode, one step per
planned shape through the normal engine path, and an engine left exactly as before (no request,
free pools, empty prefix cache, counters and seed stream untouched, same greedy and seeded
outputs)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from test_engine_equivalence import assert_pools_free

from dsv4 import LLM, SamplingParams
from dsv4.checkpoint.presets import micro
from dsv4.checkpoint.writer import write_checkpoint
from dsv4.config.engine import EngineConfig
from dsv4.config.engine_defaults import resolve_warmup
from dsv4.engine.cuda_graph import DecodeGraphs, GraphKey
from dsv4.engine.engine import LLMEngine
from dsv4.engine.scheduler import ScheduledStep
from dsv4.engine.step_output import StepOutput
from dsv4.engine.warmup import FULL_MAX_CONTEXT, WarmupShape, warm_up, warmup_plan

KW: dict[str, object] = dict(dtype="float32", device="cpu", page_size=16, max_total_tokens=4096,
                             chunked_prefill_size=64, max_running_requests=12)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("warmup") / "micro"
    write_checkpoint(micro(), path, seed=3, tokenizer=False)
    return path


def P(tokens: int) -> WarmupShape:
    return WarmupShape("prefill", 1, tokens)


def D(batch: int, tokens: int = 1, context: int = 4096, anchor: int = 0) -> WarmupShape:
    return WarmupShape("decode", batch, tokens, context, anchor)


def G(batch: int, tokens: int, contexts: tuple[int, ...] = (8192, 16384, 32768)
      ) -> list[WarmupShape]:
    return [WarmupShape("graph", batch, tokens, c) for c in contexts]


# ---- the plan -----------------------------------------------------------------------------------
def plan(mode: str, graph_max_batch: int | None, spec: int = 0, max_running: int = 64,
         context_length: int = 32768, max_total: int = 1 << 20) -> list[WarmupShape]:
    config = EngineConfig(warmup=mode, speculative_num_steps=spec,  # type: ignore[arg-type]
                          max_running_requests=max_running)
    return warmup_plan(config, context_length, context_length, max_total, graph_max_batch)


def test_plan_none_is_empty() -> None:
    assert plan("none", 64) == []


def test_plan_fast_graphs_on() -> None:
    """Graphs on: the batch-1 graph of every context bucket above the first, up to the context
    length, captured without a request."""
    assert plan("fast", 64) == [P(2048), P(16), D(1), D(8), D(64)] + G(1, 1)
    long = plan("fast", 64, context_length=1 << 20)
    assert [s.context for s in long if s.kind == "graph"] == [1 << i for i in range(13, 21)]


def test_plan_fast_small_batch_and_graphs_off() -> None:
    assert plan("fast", 4, max_running=4) == [P(2048), P(16), D(1), D(4)] + G(1, 1)
    # graphs off: batches up to max_running_requests
    assert plan("fast", None, max_running=20) == [P(2048), P(16), D(1), D(8), D(20)]


def test_plan_decodes_only_batches_the_scheduler_can_form() -> None:
    """A step's token budget and the KV pools bound a decode batch: larger buckets are left out
    (they would never come up; graphs of those buckets are captured on first use)."""
    config = EngineConfig(warmup="fast", chunked_prefill_size=7, max_running_requests=64,
                          page_size=16)
    assert warmup_plan(config, 32768, 32768, 1 << 20, None) == [P(7), D(1), D(4)]
    assert warmup_plan(config, 32768, 32768, 1 << 20, 64, pool_pages=2) == [P(7), D(1), D(2)] + \
        G(1, 1)
    spec = dataclasses.replace(config, speculative_num_steps=3, chunked_prefill_size=64)
    assert warmup_plan(spec, 32768, 32768, 1 << 20, 64) == [P(64), P(16), D(1, 4), D(8, 4),
                                                              D(16, 4)] + G(1, 4)


MID = [P(t) for t in (32, 64, 128, 256, 512, 1024, 2048, 4096)]


def test_plan_triton_adds_a_long_prefill() -> None:
    """With the triton kernels: a prefill of whole chunks past 4096 C4 entries plus a short last
    chunk, capped by the context length and the KV cache; "full" runs a prefill step of every
    power of two from 32 to 4096 tokens below the chunk before it, "fast" does not."""
    config = EngineConfig(warmup="fast", kernel_backend="triton", max_running_requests=8,
                          chunked_prefill_size=8192)
    shapes = warmup_plan(config, 1 << 20, 1 << 20, 1 << 20, 8)
    assert shapes[:3] == [P(8192), P(16), P(32768 + 16)]
    capped = warmup_plan(config, 30000, 30000, 1 << 20, 8)
    assert capped[:3] == [P(8192), P(16), P(24576 + 16)]
    assert P(16384 + 16) not in warmup_plan(config, 16390, 16390, 1 << 20, 8)
    assert len([s for s in warmup_plan(config, 8200, 8200, 1 << 20, 8)
                if s.kind == "prefill"]) == 2
    full = dataclasses.replace(config, warmup="full")
    assert warmup_plan(full, 1 << 20, 1 << 20, 1 << 20, 8)[:11] == \
        [P(8192), P(16)] + MID + [P(32768 + 16)]


def test_plan_triton_mid_prefills_stay_below_the_chunk() -> None:
    """"full", a chunk of 300 tokens: the mid-size steps below it only (300 itself is the full
    step)."""
    config = EngineConfig(warmup="full", kernel_backend="triton", max_running_requests=8,
                          chunked_prefill_size=300)
    shapes = [s for s in warmup_plan(config, 1 << 20, 1 << 20, 1 << 20, 8) if s.kind == "prefill"]
    assert shapes == [P(300), P(16), P(32), P(64), P(128), P(256), P(32700 + 16)]
    ref = dataclasses.replace(config, kernel_backend="ref")
    assert [s for s in warmup_plan(ref, 1 << 20, 1 << 20, 1 << 20, 8)
            if s.kind == "prefill"] == [P(300), P(16)]


def test_plan_fast_speculative_verifies() -> None:
    assert plan("fast", 64, spec=3) == [P(2048), P(16), D(1, 4), D(8, 4), D(64, 4)] + G(1, 4)


def test_plan_full_graphs_on() -> None:
    batches = [1, 2, 4, 8, 16, 20]
    want = [P(2048), P(16)] + [D(b) for b in batches]
    want += [WarmupShape("graph", b, 1, ctx) for ctx in (8192, 16384, 32768) for b in batches]
    assert plan("full", 20, max_running=20) == want


def test_plan_full_speculative_and_caps() -> None:
    # a request of at most 20000 tokens (the KV cache) reaches the 32768 bucket, none above;
    # verify steps of 1 + 2 tokens
    want = [P(2048), P(16), D(1, 3), D(2, 3), D(3, 3)]
    want += [WarmupShape("graph", b, 3, ctx) for ctx in (8192, 16384, 32768) for b in (1, 2, 3)]
    assert plan("full", 3, spec=2, max_running=3, max_total=20000, context_length=65536) == want
    # graphs need no anchor prefill: every bucket up to the context length; eager steps do, and
    # stop at FULL_MAX_CONTEXT
    long = plan("full", 1, max_running=1, context_length=1 << 20)
    assert max(s.context for s in long) == 1 << 20
    eager = plan("full", None, max_running=1, context_length=1 << 20)
    assert max(s.context for s in eager) == FULL_MAX_CONTEXT


def test_plan_full_graphs_off_one_batch_per_context() -> None:
    want = [P(2048), P(16), D(1), D(8), D(12), D(1, 1, 8192, 4097)]
    assert plan("full", None, max_running=12, context_length=8192) == want


def test_plan_short_context_caps_the_prefill() -> None:
    """A 99-token prompt cannot fill a step: 2 of them (the running cap) prefill together."""
    assert plan("fast", 2, max_running=2, context_length=100) == [
        P(99), WarmupShape("prefill", 2, 99), P(16), D(1, 1, 100), D(2, 1, 100)]


CHUNK = EngineConfig().chunked_prefill_size


@pytest.mark.parametrize("max_running,max_total,want", [(128, 1 << 20, -(-CHUNK // 99)),
                                                         (128, 500, 5), (3, 1 << 20, 3)])
def test_plan_fills_a_chunk_with_short_prompts(max_running: int, max_total: int,
                                               want: int) -> None:
    """ceil(chunk / 99) requests of 99 tokens fill a step, within the running cap and the KV
    cache (499 tokens: 5 requests)."""
    shapes = plan("fast", 8, max_running=max_running, context_length=100, max_total=max_total)
    assert shapes[1] == WarmupShape("prefill", want, 99)
    assert sum(s.kind == "prefill" and s.batch > 1 for s in shapes) == 1


def test_plan_one_request_fills_the_chunk() -> None:
    assert all(s.batch == 1 for s in plan("full", 64) if s.kind == "prefill")


@pytest.mark.parametrize("bad", ["fastest", "", "FULL", 1])
def test_bad_warmup_value_is_a_clear_error(bad: object) -> None:
    with pytest.raises(ValueError, match=r"warmup=.* is invalid; allowed: \['none', 'fast', "
                                         r"'full'\]"):
        EngineConfig(warmup=bad)  # type: ignore[arg-type]


def test_default_mode() -> None:
    assert resolve_warmup(None, "cuda", "triton") == "fast"
    assert resolve_warmup(None, "cuda", "ref") == "none"
    assert resolve_warmup(None, "cpu", "ref") == "none"
    assert resolve_warmup("full", "cpu", "ref") == "full"


# ---- the engine ---------------------------------------------------------------------------------
def spy_steps(engine: LLMEngine, monkeypatch: pytest.MonkeyPatch) -> list[ScheduledStep]:
    steps: list[ScheduledStep] = []
    run = engine.runner.run

    def record(step: ScheduledStep) -> StepOutput:
        steps.append(step)
        return run(step)

    monkeypatch.setattr(engine.runner, "run", record)
    return steps


def engine_plan(engine: LLMEngine, mode: str) -> list[WarmupShape]:
    table = engine.runner.table
    config = dataclasses.replace(engine.runner.config, warmup=mode)  # type: ignore[arg-type]
    return warmup_plan(config, engine.context_length, table.max_pages * table.P,
                       engine.max_total_tokens, None,
                       min(table.full.num_usable, table.swa.num_usable))


def matches(step: ScheduledStep, shape: WarmupShape) -> bool:
    if shape.kind == "prefill":
        return step.shape.lens == [shape.tokens] and step.shape.num_logits == [1]
    n = shape.tokens
    return (len(step.requests) == shape.batch and all(x == n for x in step.shape.lens)
            and all(k == n for k in step.shape.num_logits)
            and (shape.anchor == 0 or max(step.shape.starts) + n > shape.context // 2))


@pytest.mark.parametrize("mode", ["fast", "full"])
def test_warmup_runs_one_step_per_planned_shape(ckpt: Path, mode: str,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    llm = LLM(ckpt, **KW)  # type: ignore[arg-type]
    engine = llm.engine
    steps = spy_steps(engine, monkeypatch)
    shapes = engine_plan(engine, mode)
    assert len(shapes) >= 5
    warm_up(engine, mode, progress=False)
    assert len(steps) == len(shapes)
    for step, shape in zip(steps, shapes, strict=True):
        assert matches(step, shape), (step.shape, shape)


def test_warmup_with_a_small_budget_and_pools(ckpt: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """A 7-token step budget and a KV cache of 128 pages (fewer than the 256 request slots):
    warmup runs every planned shape (none larger than the scheduler can form) and leaves the
    engine clean."""
    llm = LLM(ckpt, **dict(KW, chunked_prefill_size=7, max_total_tokens=2048,  # type: ignore
                           max_running_requests=256))
    steps = spy_steps(llm.engine, monkeypatch)
    shapes = engine_plan(llm.engine, "fast")
    assert max(s.batch for s in shapes) <= 7
    warm_up(llm.engine, "fast", progress=False)
    for shape in shapes:
        assert any(matches(step, shape) for step in steps), shape
    assert_clean(llm.engine)


def test_short_context_warms_a_full_chunk(ckpt: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A 40-token context under a 64-token step budget: one step of warmup prefills 64 tokens
    from two requests (the second one chunked), and the engine is left clean."""
    llm = LLM(ckpt, **dict(KW, context_length=40))  # type: ignore[arg-type]
    steps = spy_steps(llm.engine, monkeypatch)
    shapes = engine_plan(llm.engine, "fast")
    assert shapes[:2] == [P(39), WarmupShape("prefill", 2, 39)]
    warm_up(llm.engine, "fast", progress=False)
    full = [st for st in steps if sum(st.shape.lens) == 64]
    assert full and len(full[0].requests) == 2 and full[0].shape.lens == [39, 25]
    assert_clean(llm.engine)


def test_full_warmup_with_a_context_bucket_anchor(ckpt: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """A context of 8192 tokens: "full" decodes at the 8192 bucket beside a 4097-token anchor
    (prefilled once, in 512-token chunks), and leaves the engine as it was."""
    kw = dict(KW, context_length=8192, max_total_tokens=9000, chunked_prefill_size=512,
              max_running_requests=4)
    cold, warm = LLM(ckpt, **kw), LLM(ckpt, **kw)  # type: ignore[arg-type]
    steps = spy_steps(warm.engine, monkeypatch)
    shapes = engine_plan(warm.engine, "full")
    anchored = [s for s in shapes if s.anchor]
    assert anchored == [D(1, 1, 8192, 4097)]
    warm_up(warm.engine, "full", progress=False)
    assert len(steps) == len(shapes) + -(-4097 // 512)
    for shape in shapes:
        assert any(matches(step, shape) for step in steps), shape
    assert max(steps[-1].shape.starts) + 1 > 4096          # the anchor's decode step
    assert_clean(warm.engine)
    assert outputs(warm) == outputs(cold)


@pytest.mark.parametrize("spec", [0, 2])
def test_fast_warmup_captures_every_context_bucket_without_a_request(
        ckpt: Path, spec: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """With graphs (here their CPU static-buffer form), "fast" prepares the batch-1 graph of the
    8192 and 16384 buckets (and their drafting graphs under speculation) on padding rows: no step
    of the warmup reaches past 4096 tokens, running those graphs' forward on padding rows writes
    nothing a request reads, and the engine is left as it was."""
    kw = dict(KW, context_length=16384, max_total_tokens=20000, max_running_requests=4,
              speculative_num_steps=spec)
    cold, warm = LLM(ckpt, **kw), LLM(ckpt, **kw)  # type: ignore[arg-type]
    for llm in (cold, warm):
        runner = llm.engine.runner
        runner.graphs = DecodeGraphs(llm.model, runner.table, runner.pools, runner.ops, 4,
                                     capture=False, max_tokens=1 + spec, with_streams=spec > 0)
    steps = spy_steps(warm.engine, monkeypatch)
    warm_up(warm.engine, "fast", progress=False)
    graphs = warm.engine.runner.graphs
    assert graphs is not None
    n = 1 + spec
    wanted = {GraphKey(1, n, n, ctx, False) for ctx in (8192, 16384)}
    assert wanted <= set(graphs._graphs)
    assert all(max(st.shape.starts) + max(st.shape.lens) <= 4096 for st in steps)
    for key in wanted:                # what a GPU capture runs, eagerly
        graphs._forward(graphs._graphs[key].inputs, graphs._graphs[key].consts, key)
        assert (graphs._graphs[key].draft is not None) == (spec > 0)
    assert_clean(warm.engine)
    assert outputs(warm) == outputs(cold)


def test_warmup_speculative_runs_verify_steps(ckpt: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    llm = LLM(ckpt, speculative_num_steps=2, **KW)  # type: ignore[arg-type]
    engine = llm.engine
    steps = spy_steps(engine, monkeypatch)
    shapes = engine_plan(engine, "fast")
    assert [s.tokens for s in shapes if s.kind == "decode"] == [3, 3, 3]
    warm_up(engine, "fast", progress=False)
    for shape in shapes:
        assert any(matches(step, shape) for step in steps), shape
    # a decode shape takes two steps: its requests' first token, then the verify step
    assert len(steps) == len(shapes) + sum(s.kind == "decode" for s in shapes)
    assert_clean(engine)


def assert_clean(engine: LLMEngine) -> None:
    table = engine.runner.table
    engine.check_integrity()
    assert not engine.requests and not engine.has_unfinished()
    assert table.full.num_free == table.full.num_usable
    assert table.swa.num_free == table.swa.num_usable
    assert table.num_free_slots == engine.config.max_running_requests
    state = engine.snapshot()
    assert state.full_cached == state.swa_cached == 0
    assert (state.steps, state.prefill_tokens, state.decode_tokens, state.num_preemptions) == \
        (0, 0, 0, 0)
    assert (state.spec_draft_tokens, state.spec_accepted_tokens) == (0, 0)
    assert not any(state.spec_accept_hist)
    assert engine.scheduler.prompt_tokens == engine.scheduler.cached_prompt_tokens == 0


def outputs(llm: LLM) -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(2, 512, (n,), generator=g).tolist() for n in (5, 23, 40, 9)]
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    seeded = SamplingParams(max_tokens=12, temperature=1.0, top_k=40, seed=11, ignore_eos=True)
    # unseeded sampling: its seed comes from the engine's seed stream
    drawn = SamplingParams(max_tokens=12, temperature=1.0, ignore_eos=True)
    params = [greedy, seeded, drawn, greedy]
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    return [o.token_ids for o in outs]


@pytest.mark.parametrize(("mode", "extra"), [("fast", {}), ("full", {}),
                                              ("fast", {"speculative_num_steps": 2}),
                                              ("fast", {"overlap_schedule": True})],
                         ids=["fast", "full", "fast-spec", "fast-overlap"])
def test_engine_after_warmup_is_as_before(ckpt: Path, mode: str, extra: dict[str, object]) -> None:
    cold = LLM(ckpt, **KW, **extra)  # type: ignore[arg-type]
    warm = LLM(ckpt, warmup=mode, **KW, **extra)  # type: ignore[arg-type]
    assert cold.engine.runner.config.warmup == "none"      # the CPU default
    assert_clean(warm.engine)
    assert outputs(warm) == outputs(cold)
    assert_pools_free(warm.engine)


def test_warmup_refused_with_requests(ckpt: Path) -> None:
    llm = LLM(ckpt, **KW)  # type: ignore[arg-type]
    llm.engine.add_request([1, 2, 3], SamplingParams(max_tokens=2))
    with pytest.raises(RuntimeError, match="idle engine"):
        warm_up(llm.engine, "fast", progress=False)
    assert warm_up(llm.engine, "none") == 0.0


# ---- the CLI ------------------------------------------------------------------------------------
def test_cli_warmup_flag(capsys: pytest.CaptureFixture[str]) -> None:
    from dsv4.cli.main import build_parser
    from dsv4.cli.serve import build_config

    parser = build_parser()
    config = build_config(parser.parse_args(["serve", "--device", "cpu", "--warmup", "full"]))
    assert config.engine_config.warmup == "full"
    assert build_config(parser.parse_args(["serve", "--device", "cpu"])).warmup is None
    assert parser.parse_args(["generate", "hi", "--warmup", "fast"]).warmup == "fast"
    with pytest.raises(SystemExit) as exit_:
        parser.parse_args(["serve", "--warmup", "always"])
    assert exit_.value.code == 2
    assert "--warmup" in capsys.readouterr().err
