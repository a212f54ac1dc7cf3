"""Decode steps through `DecodeGraphs` (engine/cuda_graph.py) equal plain eager steps.

CPU: the graphs' static-buffer step (padding rows on the pad slot, candidate lists sized by the
context bucket) runs eagerly (`capture=False`) and must give the eager engine's greedy tokens,
logits and routing, with every pool free afterwards. GPU: captured graphs replayed against the same
engine without graphs.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from test_engine_equivalence import LogitRecorder, assert_pools_free, prompts_for, run_staggered

from dsv4 import LLM, SamplingParams
from dsv4.cache.pools import KVPools
from dsv4.checkpoint.presets import micro
from dsv4.checkpoint.writer import write_checkpoint
from dsv4.engine.cuda_graph import (
    MIN_CONTEXT,
    DecodeGraphs,
    batch_buckets,
    context_bucket,
    graph_pdl_mode,
)
from dsv4.kernels.triton.pdl import EARLY


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("graphs") / "micro"
    write_checkpoint(micro(), path, seed=3, tokenizer=False)
    return path


def test_batch_buckets() -> None:
    assert batch_buckets(1) == [1]
    assert batch_buckets(8) == [1, 2, 4, 8]
    assert batch_buckets(6) == [1, 2, 4, 6]
    assert batch_buckets(20) == [1, 2, 4, 8, 16, 20]
    assert batch_buckets(256)[-3:] == [240, 248, 256]


def test_context_bucket() -> None:
    assert context_bucket(1, 1 << 20) == MIN_CONTEXT
    assert context_bucket(MIN_CONTEXT, 1 << 20) == MIN_CONTEXT
    assert context_bucket(MIN_CONTEXT + 1, 1 << 20) == 2 * MIN_CONTEXT
    assert context_bucket(5000, 6144) == 6144          # capped at the table's span
    assert context_bucket(100, 512) == 512
    with pytest.raises(AssertionError):
        context_bucket(513, 512)


def _compare(ckpt: Path, device: str, capture: bool, monkeypatch: pytest.MonkeyPatch,
             backend: str) -> None:
    """Same workload with and without graphs: tokens equal, logits within 1e-5, routing equal."""
    kwargs = dict(dtype="float32", device=device, page_size=16, chunked_prefill_size=13,
                  max_running_requests=6, max_total_tokens=4096, capture_routing=True,
                  kernel_backend=backend)
    outputs = []
    rec = LogitRecorder(monkeypatch)
    for graphs in (False, True):
        rec.rows = {}
        llm = LLM(ckpt, disable_cuda_graph=True, **kwargs)
        runner = llm.engine.runner
        if graphs:
            runner.graphs = DecodeGraphs(llm.model, runner.table, runner.pools, runner.ops,
                                         max_batch=6, capture=capture)
        prompts = prompts_for(llm.model.config, seed=4)
        max_tokens = [6 + (5 * i) % 9 for i in range(len(prompts))]
        reqs = run_staggered(llm.engine, prompts, max_tokens)
        outputs.append((reqs, rec.rows))
        if graphs:
            assert runner.graphs is not None
            assert runner.graphs.num_graphs() >= 2 and runner.graphs.replays >= 10, \
                "decode steps ran as graphs"
        assert_pools_free(llm.engine)
    (eager, eager_rows), (graph, graph_rows) = outputs
    for rid, req in eager.items():
        other = graph[rid]
        assert other.output_ids == req.output_ids, f"request {rid}: greedy tokens differ"
        diff = (torch.stack(graph_rows[rid]) - torch.stack(eager_rows[rid])).abs().max().item()
        assert diff <= 1e-5, f"request {rid}: logits differ by {diff}"
        for key in ("experts", "indexer"):
            a, b = torch.cat(req.routing[key]), torch.cat(other.routing[key])
            assert torch.equal(a, b), f"request {rid}: {key} routing differs"


def test_static_decode_step_equals_eager(ckpt: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _compare(ckpt, "cpu", capture=False, monkeypatch=monkeypatch, backend="ref")


def _multi_token_step(ckpt: Path, device: str, capture: bool, backend: str) -> None:
    """A uniform step of n = 2 fed tokens per request, with logits at the last k of them (k = 1: a
    multi-token decode; k = 2: a verify pass), through the graphs and eagerly: same logits and
    routing, and both equal to the full-sequence model at those positions."""
    llm = LLM(ckpt, dtype="float32", device=device, page_size=16, max_total_tokens=4096,
              max_running_requests=4, capture_routing=True, kernel_backend=backend,
              disable_cuda_graph=True, overlap_schedule=False,   # the test schedules by hand
              index_cache_dtype="model")   # fp32 index scores, as the full-sequence model's
    engine, runner = llm.engine, llm.engine.runner
    graphs = DecodeGraphs(llm.model, runner.table, runner.pools, runner.ops, max_batch=4,
                          capture=capture, max_tokens=2)
    prompts = [p for p in prompts_for(llm.model.config, seed=6) if len(p) > 1][:3]
    reqs = [engine.add_request(p, SamplingParams(max_tokens=64, temperature=0.0)) for p in prompts]
    while not all(r.output_ids for r in reqs):
        engine.step()
    # one more token each (what an accepted draft would add): two pending per request
    for r in reqs:
        r.append_token(int(torch.randint(0, llm.model.config.vocab_size, ())), 0.0, None, 0.0)
    step = engine.scheduler.schedule()
    assert step is not None and step.shape.lens == [2] * len(reqs)
    before = _pool_tensors(runner.pools)
    saved = [t.clone() for t in before]

    # a step rewrites compressor rings it read: every run starts from `saved`
    def restore() -> None:
        for t, v in zip(before, saved, strict=True):
            t.copy_(v)

    for k in (1, 2):
        shape = dataclasses.replace(step.shape, num_logits=[k] * len(reqs))
        assert graphs.fits(shape)
        restore()
        with torch.no_grad():
            eager, eager_routing = runner._forward_eager(dataclasses.replace(step, shape=shape))
        eager = eager.clone()
        restore()
        got, routing = graphs.run(step.input_ids, shape, capture_routing=True)
        assert got.shape == (len(reqs) * k, llm.model.config.vocab_size)
        assert (got - eager).abs().max().item() <= 1e-5
        assert routing is not None and eager_routing is not None
        for key in ("experts", "indexer"):
            assert all(torch.equal(a, b)
                       for a, b in zip(routing[key], eager_routing[key], strict=True)), key
        for r, rows in zip(reqs, got.split(k), strict=True):
            with torch.no_grad():
                full = llm.model(torch.tensor([r.all_ids], device=device))[0, -k:]
            assert (rows - full).abs().max().item() <= 1e-4, r.rid
    assert not graphs.fits(dataclasses.replace(step.shape, lens=[1] + [2] * (len(reqs) - 1)))


def _pool_tensors(pools: KVPools) -> list[torch.Tensor]:
    out = []
    for c in pools.layers:
        out += [t for t in (c.swa, c.entries, c.index_keys) if t is not None]
        out += [t for s in (c.state, c.index_state) if s is not None for t in (s.kv, s.score)]
    return out


def test_static_multi_token_step_equals_eager(ckpt: Path) -> None:
    _multi_token_step(ckpt, "cpu", capture=False, backend="ref")


@pytest.mark.gpu
def test_captured_multi_token_step_equals_eager_on_gpu(ckpt: Path) -> None:
    torch.backends.cuda.matmul.allow_tf32 = False
    _multi_token_step(ckpt, "cuda", capture=True, backend="triton")


def test_runner_runs_eagerly_on_cpu(ckpt: Path) -> None:
    # (not with the triton backend under TRITON_INTERPRET here: setting it would make every Triton
    # kernel module imported later in the session an interpreter one, also on a GPU machine)
    llm = LLM(ckpt, dtype="float32", device="cpu", page_size=16, max_total_tokens=1024)
    assert llm.engine.runner.graphs is None


def test_cuda_graph_max_bs_is_validated() -> None:
    from dsv4.config.engine import EngineConfig

    with pytest.raises(ValueError, match="cuda_graph_max_bs"):
        EngineConfig(cuda_graph_max_bs=0)


def test_pdl_early_buckets() -> None:
    """Buckets up to `pdl_early_max_batch` are captured in PDL's EARLY mode, the rest in
    DSV4_PDL's (None); by default EARLY up to 8 requests with FP8 linears, none with float
    ones; a bad bound is refused."""
    from dsv4.config.engine import EngineConfig
    from dsv4.config.engine_defaults import resolve_pdl_early_max_batch

    assert [graph_pdl_mode(b, 2) for b in (1, 2, 4, 8)] == [EARLY, EARLY, None, None]
    assert graph_pdl_mode(1, 0) is None
    # by default EARLY for the small decode graphs of a model with FP8 linears only
    fp8 = resolve_pdl_early_max_batch(EngineConfig().pdl_early_max_batch, fp8_linears=True)
    assert graph_pdl_mode(1, fp8) == EARLY and graph_pdl_mode(32, fp8) is None
    assert resolve_pdl_early_max_batch(None, fp8_linears=False) == 0
    assert resolve_pdl_early_max_batch(2, fp8_linears=False) == 2
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="pdl_early_max_batch"):
            EngineConfig(pdl_early_max_batch=bad)  # type: ignore[arg-type]


@pytest.mark.parametrize(("weight_format", "early"), [("checkpoint", 8), ("bf16", 0)])
def test_runner_resolves_early_buckets_by_the_weights(weight_format: str, early: int) -> None:
    """The runner's resolution of `pdl_early_max_batch=None`: 8 for a model with FP8 linears
    (checkpoint precision), 0 for float linears; an explicit bound wins either way."""
    from dsv4.checkpoint.writer import random_model
    from dsv4.config.engine import EngineConfig
    from dsv4.engine.runner_setup import resolve

    model = random_model(micro(), torch.float32, torch.device("cpu"), seed=0,
                         weight_format=weight_format)  # type: ignore[arg-type]
    cpu = torch.device("cpu")
    assert resolve(EngineConfig(), cpu, model).pdl_early_max_batch == early
    assert resolve(EngineConfig(pdl_early_max_batch=3), cpu, model).pdl_early_max_batch == 3


@pytest.mark.gpu
def test_captured_graphs_equal_eager_on_gpu(ckpt: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    torch.backends.cuda.matmul.allow_tf32 = False
    _compare(ckpt, "cuda", capture=True, monkeypatch=monkeypatch, backend="triton")


@pytest.mark.gpu
def test_runner_captures_by_default_on_gpu(ckpt: Path) -> None:
    llm = LLM(ckpt, dtype="float32", device="cuda", page_size=16, max_total_tokens=1024,
              kernel_backend="triton")
    assert llm.engine.runner.graphs is not None
    off = LLM(ckpt, dtype="float32", device="cuda", page_size=16, max_total_tokens=1024,
              kernel_backend="ref")
    assert off.engine.runner.graphs is None


def test_serve_flags_reach_the_engine_config() -> None:
    from dsv4.cli.main import build_parser
    from dsv4.cli.serve import build_config

    args = build_parser().parse_args(["serve", "--device", "cpu", "--disable-cuda-graph",
                                      "--cuda-graph-max-bs", "16"])
    config = build_config(args).engine_config
    assert config.disable_cuda_graph and config.cuda_graph_max_bs == 16
    default = build_config(build_parser().parse_args(["serve", "--device", "cpu"])).engine_config
    assert not default.disable_cuda_graph and default.cuda_graph_max_bs == 256
