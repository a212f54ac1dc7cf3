"""The serving path's RoPE cache (`RotaryEmbedding.build_cache` / `lookup`): the rows it returns
are `RotaryEmbedding.forward`'s bit for bit (both tables, the YaRN one included), it is no model
state (state_dict, buffers), the engine builds it over its request table's span and refuses
requests past it, and engine steps give the same logits with and without it (CPU, fp32).

    PYTHONPATH=src python -m pytest -q tests/model/test_rope_cache.py
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from dsv4 import SamplingParams
from dsv4.checkpoint.presets import get_preset, micro
from dsv4.checkpoint.writer import random_model
from dsv4.config.engine import EngineConfig
from dsv4.engine.engine import LLMEngine
from dsv4.engine.request import Request
from dsv4.engine.runner import ModelRunner
from dsv4.engine.sampler import SampleOutput
from dsv4.model.deepseek_v4 import DeepSeekV4ForCausalLM
from dsv4.model.layers.rope import RotaryEmbedding, rope_cache_bytes


@pytest.mark.parametrize("compressed", [False, True], ids=["main", "compress-yarn"])
def test_lookup_equals_forward_bit_for_bit(compressed: bool) -> None:
    """V4-Flash's tables (rd 64, YaRN on the compressed one) over 70K positions: any positions,
    any shape (a step's [T], a plan's [T], a [B, S] grid), the same bits as computing them."""
    rope = RotaryEmbedding(get_preset("flash-4l"), compressed)
    n = 70_001
    assert rope.build_cache(n) == n * 64 * 4 and rope.cached_positions == n
    g = torch.Generator().manual_seed(int(compressed))
    for shape in [(1,), (3,), (17,), (1000,), (4, 33)]:
        pos = torch.randint(0, n, shape, generator=g)
        pos[..., 0] = n - 1
        want, got = rope(pos), rope.lookup(pos)
        for w, x in zip(want, got, strict=True):
            assert x.shape == (*shape, 32) and x.is_contiguous() and x.dtype == torch.float32
            assert torch.equal(x, w)
    assert torch.equal(rope.cache, torch.stack(rope(torch.arange(n))))


def test_cache_is_not_model_state() -> None:
    """Built caches add no state_dict entry or buffer; reset_buffers rebuilds them the same."""
    model = random_model(micro(), torch.float32, torch.device("cpu"), seed=0)
    keys, buffers = set(model.state_dict()), {n for n, _ in model.named_buffers()}
    assert model.rope_cache_positions is None
    assert model.build_rope_cache(96) == rope_cache_bytes(model.config, 96)
    assert model.rope_cache_positions == 96
    assert set(model.state_dict()) == keys and {n for n, _ in model.named_buffers()} == buffers
    before = model.rope_compress.cache.clone()
    model.reset_buffers()
    assert torch.equal(model.rope_compress.cache, before)


def test_engine_builds_the_cache_over_the_span_and_checks_it() -> None:
    model = random_model(micro(), torch.float32, torch.device("cpu"), seed=1)
    engine = LLMEngine(model, EngineConfig(page_size=16, max_running_requests=2,
                                           max_total_tokens=1024, context_length=100))
    table = engine.runner.table
    assert model.rope_cache_positions == table.max_pages * table.P == 112
    engine.runner.rope_positions = 50            # a cache shorter than the context: refused
    with pytest.raises(ValueError, match="RoPE cache"):
        engine.validate([1] * 40, SamplingParams(max_tokens=20))
    engine.validate([1] * 40, SamplingParams(max_tokens=10))


def _logits_of_a_workload(model: DeepSeekV4ForCausalLM, monkeypatch: pytest.MonkeyPatch,
                          drop_cache: bool) -> dict[str, list[torch.Tensor]]:
    """Every sampled logit row of a few greedy requests (prefill chunks, decode across compress
    boundaries), with the RoPE cache or (`drop_cache`) computing every row."""
    rows: dict[str, list[torch.Tensor]] = {}
    original = ModelRunner._sample

    def record(runner: ModelRunner, logits: torch.Tensor, reqs: list[Request],
               steps: list[int], **kw: Any) -> SampleOutput:
        for req, row in zip(reqs, logits, strict=True):
            rows.setdefault(req.rid, []).append(row.clone())
        return original(runner, logits, reqs, steps, **kw)

    monkeypatch.setattr(ModelRunner, "_sample", record)
    engine = LLMEngine(model, EngineConfig(page_size=16, max_running_requests=4,
                                           max_total_tokens=2048, chunked_prefill_size=24,
                                           disable_prefix_cache=True))
    if drop_cache:
        model.rope_main.cache = model.rope_compress.cache = None
    g = torch.Generator().manual_seed(3)
    for i, n in enumerate((1, 9, 31, 70)):
        prompt = torch.randint(0, 512, (n,), generator=g).tolist()
        engine.add_request(prompt, SamplingParams(max_tokens=12, temperature=0.0,
                                                  ignore_eos=True), rid=str(i))
    while engine.has_unfinished():
        engine.step()
    monkeypatch.setattr(ModelRunner, "_sample", original)
    return rows


def test_engine_logits_equal_with_and_without_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    model = random_model(micro(), torch.float32, torch.device("cpu"), seed=2)
    cached = _logits_of_a_workload(model, monkeypatch, drop_cache=False)
    computed = _logits_of_a_workload(model, monkeypatch, drop_cache=True)
    assert cached.keys() == computed.keys() == {"0", "1", "2", "3"}
    for rid in cached:
        assert len(cached[rid]) == 12
        assert all(torch.equal(a, b) for a, b in zip(cached[rid], computed[rid], strict=True))
