"""`ForwardContext.logits_all`: a plain decode step (every new token's logits, in order) takes the
logits rows as they are instead of gathering them with `logits_index`; a prefill chunk (the last
token's logits only) still gathers. The flag is host-known (`build_context` from the step shape,
the decode graphs from their key) and must never change a token or a log-prob.

    PYTHONPATH=src python3 -m pytest -q tests/engine/test_logits_rows.py
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from dsv4.checkpoint.presets import micro
from dsv4.checkpoint.writer import random_model
from dsv4.config.engine import EngineConfig
from dsv4.engine.engine import LLMEngine
from dsv4.engine.sampling_params import SamplingParams
from dsv4.model.deepseek_v4 import DeepSeekV4ForCausalLM
from dsv4.model.forward_context import ForwardContext


def _run(monkeypatch: pytest.MonkeyPatch, force_gather: bool) -> tuple[list[Any], list[bool]]:
    """Greedy outputs of two requests, and the `logits_all` of every serving forward; with
    `force_gather` every context's flag is cleared before the model reads it."""
    flags: list[bool] = []
    real = DeepSeekV4ForCausalLM.forward_batch_streams

    def spy(self: DeepSeekV4ForCausalLM, ids: torch.Tensor,
            ctx: ForwardContext) -> tuple[torch.Tensor, torch.Tensor]:
        if force_gather:
            ctx.logits_all = False
        flags.append(ctx.logits_all)
        return real(self, ids, ctx)

    monkeypatch.setattr(DeepSeekV4ForCausalLM, "forward_batch_streams", spy)
    cfg = micro()
    model = random_model(cfg, torch.float32, torch.device("cpu"), seed=3)
    engine = LLMEngine(model, EngineConfig(page_size=16, max_total_tokens=512,
                                           chunked_prefill_size=8, disable_cuda_graph=True))
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, cfg.vocab_size, (n,), generator=g).tolist() for n in (11, 19)]
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True, logprobs=0)
    reqs = [engine.add_request(p, params, rid=str(i)) for i, p in enumerate(prompts)]
    while engine.has_unfinished():
        engine.step()
    return [(r.output_ids, list(r.logprobs)) for r in reqs], flags


def test_decode_steps_skip_the_gather_with_identical_outputs(
        monkeypatch: pytest.MonkeyPatch) -> None:
    fast, flags = _run(monkeypatch, force_gather=False)
    assert any(flags), "no plain decode step set logits_all"
    assert not all(flags), "the chunked prefill steps (last-token logits) must gather"
    with monkeypatch.context() as m:
        gathered, forced = _run(m, force_gather=True)
    assert not any(forced)
    assert fast == gathered
