"""The runner's argmax-only sampling: when every sampling row of a step is greedy with no penalty,
logit bias, log-probs or grammar (`sampler.argmax_only`), it takes the logits' argmax without
building a `SamplingBatch` (host tensors and copies per step). It must never change a token.

    PYTHONPATH=src python3 -m pytest -q tests/engine/test_argmax_only.py
"""

from __future__ import annotations

import pytest
import torch

from dsv4.checkpoint.presets import micro
from dsv4.checkpoint.writer import random_model
from dsv4.config.engine import EngineConfig
from dsv4.engine import runner
from dsv4.engine.cuda_graph import DecodeGraphs
from dsv4.engine.engine import LLMEngine
from dsv4.engine.sampler import SamplingBatch
from dsv4.engine.sampling_params import SamplingParams

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def _run(monkeypatch: pytest.MonkeyPatch, params: list[SamplingParams],
         force_batch: bool, graphs: bool = False) -> tuple[list[list[int]], int]:
    """Outputs of one request per params entry (chunked prefill, then decode steps together) and
    how many sampling batches the runner built; `force_batch` turns the argmax-only path off;
    `graphs`: decode steps through `DecodeGraphs` run eagerly (`capture=False`)."""
    builds = [0]
    real = SamplingBatch.build.__func__     # type: ignore[attr-defined]

    def counted(cls: type[SamplingBatch], *args: object, **kwargs: object) -> SamplingBatch:
        builds[0] += 1
        return real(cls, *args, **kwargs)   # type: ignore[no-any-return]

    monkeypatch.setattr(SamplingBatch, "build", classmethod(counted))
    if force_batch:
        monkeypatch.setattr(runner, "argmax_only", lambda params: False)
    cfg = micro()
    model = random_model(cfg, torch.float32, torch.device("cpu"), seed=5)
    engine = LLMEngine(model, EngineConfig(page_size=16, max_total_tokens=512,
                                           chunked_prefill_size=8, disable_cuda_graph=True))
    if graphs:
        r = engine.runner
        r.graphs = DecodeGraphs(model, r.table, r.pools, r.ops, max_batch=2, capture=False)
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, cfg.vocab_size, (n,), generator=g).tolist() for n in (13, 21)]
    reqs = [engine.add_request(p, q, rid=str(i))
            for i, (p, q) in enumerate(zip(prompts, params, strict=True))]
    while engine.has_unfinished():
        engine.step()
    return [r.output_ids for r in reqs], builds[0]


def test_greedy_steps_skip_the_sampling_batch_with_the_same_tokens(
        monkeypatch: pytest.MonkeyPatch) -> None:
    fast, builds = _run(monkeypatch, [GREEDY, GREEDY], force_batch=False)
    assert builds == 0, "plain greedy steps built a sampling batch"
    with monkeypatch.context() as m:
        full, full_builds = _run(m, [GREEDY, GREEDY], force_batch=True)
    assert full_builds > 0
    assert fast == full


@pytest.mark.parametrize("other", [
    SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=1),
    SamplingParams(max_tokens=6, temperature=0.8, seed=3, ignore_eos=True),
    SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, presence_penalty=0.5),
])
def test_a_row_that_needs_more_than_the_argmax_builds_the_batch(
        monkeypatch: pytest.MonkeyPatch, other: SamplingParams) -> None:
    _, builds = _run(monkeypatch, [GREEDY, other], force_batch=False)
    assert builds > 0


def test_graph_steps_take_the_argmax_of_the_graphs_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    """Decode steps through the graphs' static buffers take their tokens from `argmax_last` (on
    the GPU the argmax graph captured with the step graph; here the op on the same rows): the
    same tokens as the engine without graphs."""
    calls = [0]
    real = DecodeGraphs.argmax_last

    def counted(self: DecodeGraphs, rows: int) -> torch.Tensor:
        calls[0] += 1
        return real(self, rows)

    monkeypatch.setattr(DecodeGraphs, "argmax_last", counted)
    graphed, builds = _run(monkeypatch, [GREEDY, GREEDY], force_batch=False, graphs=True)
    assert builds == 0 and calls[0] >= 5, f"{calls[0]} graph argmax calls"
    with monkeypatch.context() as m:
        eager, _ = _run(m, [GREEDY, GREEDY], force_batch=True)
    assert graphed == eager
