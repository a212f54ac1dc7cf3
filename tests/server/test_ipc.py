"""The engine <-> API message codec: every message round-trips exactly, and nothing but JSON
crosses."""

from __future__ import annotations

import dataclasses
import json

import pytest

from dsv4.engine.sampling_params import SamplingParams
from dsv4.server import ipc

SNAPSHOT = ipc.EngineSnapshot(pid=7, num_running=1, num_waiting=2, num_requests=3, full_free=10,
                              full_usable=12, full_cached=0, swa_free=4, swa_usable=5,
                              swa_cached=0, free_slots=63, num_slots=64, steps=9,
                              prefill_tokens=100, decode_tokens=50, num_finished=4, num_aborted=1,
                              num_preemptions=0, integrity="ok")
SPEC_SNAPSHOT = dataclasses.replace(SNAPSHOT, spec_num_steps=3, spec_accept_hist=(5, 1, 0, 2),
                                    spec_draft_tokens=24, spec_accepted_tokens=7)
MESSAGES: list[ipc.Message] = [
    ipc.AddRequest("r-0", [0, 5, 9], SamplingParams.create(max_tokens=7, temperature=0.5,
                                                           stop=["\n", "ab"], stop_token_ids=[1],
                                                           seed=3, logprobs=2,
                                                           logit_bias={5: -100.0, 9: 2.5})),
    ipc.AbortRequests(["a", "b"]),
    ipc.StatsQuery(4, check_integrity=True, flush_cache=True),
    ipc.ShutdownEngine(),
    ipc.UpdateWeights(5, "/tmp/ckpt", "step-2"),
    ipc.InitWeightsGroup(6, "127.0.0.1", 29500, 1, 2, "wg", "gloo"),
    ipc.UpdateWeightsDistributed(7, ["embed.weight", "norm.weight"], ["bfloat16", "float32"],
                                 [[512, 64], [64]], "wg"),
    ipc.DestroyWeightsGroup(8, "wg"),
    ipc.PauseGeneration(9, "retract"),
    ipc.ContinueGeneration(10),
    ipc.ReleaseMemory(11, resume=False, tags=["kv_cache"]),
    ipc.ReleaseMemory(12, resume=True),
    ipc.UpdateWeightsReply(7, success=True, message="ok", num_tensors=2, weight_version=1),
    ipc.EngineReady(pid=11, model=ipc.ModelInfo(context_length=4096, max_total_tokens=8192,
                                                vocab_size=512, eos_token_id=1)),
    ipc.StepOutputs([ipc.RequestDelta("r-0", [4, 5], [-0.5, -1.25], [[(4, -0.5), (6, -2.0)], []],
                                      None, 3, 0),
                     ipc.RequestDelta("r-1", [], [], [], "abort", 8, 2),
                     ipc.RequestDelta("r-2", [7, 8, 9], [-0.1, -0.2, -0.3], [[], [], []], None, 4,
                                      0, spec_draft_tokens=6, spec_accepted_tokens=2)],
                    num_running=1, num_waiting=0, weight_version="step-2"),
    ipc.RequestsAccepted(["r-0", "r-1"]),
    ipc.RequestError("r-2", "max_tokens=0 is invalid; allowed: max_tokens >= 1"),
    ipc.StatsReply(4, SNAPSHOT),
    ipc.StatsReply(5, SPEC_SNAPSHOT),
    ipc.EngineFailed("RuntimeError: boom"),
]


@pytest.mark.parametrize("msg", MESSAGES, ids=lambda m: type(m).__name__)
def test_round_trip(msg: ipc.Message) -> None:
    data = ipc.encode(msg)
    assert json.loads(data)["kind"] == type(msg).__name__
    assert ipc.decode(data) == msg


def test_unknown_kind_and_non_finite_floats_are_refused() -> None:
    with pytest.raises(ValueError, match="unknown message kind"):
        ipc.decode(b'{"kind": "Pickle", "x": 1}')
    with pytest.raises(ValueError):
        ipc.encode(ipc.StepOutputs([ipc.RequestDelta("r", [1], [float("-inf")], [[]], None, 1, 0)],
                                   0, 0))
    assert ipc.finite_logprob(float("-inf")) == -9999.0
