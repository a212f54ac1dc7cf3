"""The MTP block's serving path (`DeepSeekV4ForCausalLM.mtp_forward_batch`, the drafter of issue 19)
equals the full-sequence MTP oracle (`mtp_logits`), over one prefill, chunked prefill, and
prefill + decode steps that each feed one token (its own SWA cache carried across steps)."""

from __future__ import annotations

import pytest
import torch

from dsv4.checkpoint.presets import micro
from dsv4.checkpoint.writer import random_model
from dsv4.config.engine import EngineConfig
from dsv4.engine.engine import LLMEngine
from dsv4.engine.metadata import StepShape, build_context

S = 41


@pytest.fixture(scope="module")
def setup():
    model = random_model(micro(), torch.float32, torch.device("cpu"), seed=3)
    engine = LLMEngine(model, EngineConfig(page_size=16, max_total_tokens=512,
                                           disable_prefix_cache=True))
    ids = torch.randint(2, model.config.vocab_size, (1, S), generator=torch.Generator()
                        .manual_seed(0))
    with torch.no_grad():
        streams = model.forward_streams(ids[:, :-1])
        oracle = model.mtp_logits(streams, ids[:, 1:])[0]                  # [S-1, V]
    return model, engine.runner, ids[0], oracle


def _run(setup, chunks: list[int]) -> torch.Tensor:
    """Feed ids[:S-1] in steps of `chunks` tokens, the MTP pass after each; its logits rows."""
    model, runner, ids, _ = setup
    slot = runner.table.open()
    assert runner.table.reserve(slot, 0, S - 1)
    rows, start = [], 0
    try:
        for n in chunks:
            shape = StepShape([slot], [start], [n], [n])
            ctx = build_context(shape, runner.table, runner.pools, model.config, runner.device,
                                runner.ops)
            step = ids[start:start + n]
            with torch.no_grad():
                _, streams = model.forward_batch_streams(step, ctx)
                logits, out = model.mtp_forward_batch(streams, ids[start + 1:start + n + 1], ctx)
            assert out.shape == streams.shape
            rows.append(logits)
            start += n
    finally:
        runner.table.free(slot)
    assert start == S - 1
    return torch.cat(rows)


@pytest.mark.parametrize("chunks", [[S - 1], [17, S - 18], [30] + [1] * (S - 31)],
                         ids=["prefill", "chunked", "decode"])
def test_mtp_serving_path_matches_the_full_sequence_oracle(setup, chunks: list[int]) -> None:
    got, oracle = _run(setup, chunks), setup[3]
    torch.testing.assert_close(got, oracle, rtol=1e-4, atol=1e-4)
    assert bool((got.argmax(-1) == oracle.argmax(-1)).all())


def test_mtp_depth_is_checked(setup) -> None:
    model = setup[0]
    with pytest.raises(ValueError, match="mtp depth=1 out of range"):
        model.mtp_forward_batch(torch.zeros(1), torch.zeros(1), None, depth=1)
