"""API-process pieces without a server: chat templating, token bytes, per-sample seeds, parameter
validation, error shapes, the usage object and the Prometheus exposition (speculative series
included)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from dsv4.server.chat_template import ChatTemplate
from dsv4.server.errors import APIError, field_of
from dsv4.server.generation import build_params, choice_seed
from dsv4.server.ipc import EngineSnapshot, RequestDelta
from dsv4.server.metrics import RequestTiming, ServerMetrics
from dsv4.server.protocol import (
    ChatMessage,
    CompletionRequest,
    CompletionTokensDetails,
    PromptTokensDetails,
    Usage,
)
from dsv4.server.tokenizer import ServerTokenizer

BOS, EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"


def test_checkpoint_chat_template(model_path: Path) -> None:
    template = ChatTemplate.from_checkpoint(model_path)
    text = template.render([ChatMessage(role="system", content="S"),
                            ChatMessage(role="user", content="Hi"),
                            ChatMessage(role="assistant", content="Yo"),
                            ChatMessage(role="user", content="More")])
    assert text == (f"{BOS}S<｜User｜>Hi<｜Assistant｜>Yo{EOS}"
                    "<｜User｜>More<｜Assistant｜>")


def test_deepseek_v4_fallback_template(tmp_path: Path) -> None:
    template = ChatTemplate.from_checkpoint(tmp_path)   # no tokenizer_config.json
    assert template.source is None                      # DeepSeek-V4's own encoding
    msgs = [ChatMessage(role="user", content=[{"type": "text", "text": "a"},
                                              {"type": "text", "text": "b"}])]
    assert template.render(msgs) == f"{BOS}<｜User｜>ab<｜Assistant｜></think>"
    assert template.render(msgs, kwargs={"thinking": True}).endswith("<｜Assistant｜><think>")
    with pytest.raises(APIError) as err:
        template.render([ChatMessage(role="user", content=[{"type": "image_url"}])])
    assert err.value.status == 400 and err.value.param == "messages[0].content"


def test_token_bytes_are_exact_for_byte_level_bpe(model_path: Path) -> None:
    tok = ServerTokenizer.from_checkpoint(model_path)
    ids = tok.encode("héllo ✓ wörld", add_special_tokens=False)
    assert b"".join(tok.token_bytes(t) for t in ids) == "héllo ✓ wörld".encode()
    assert tok.token_str(1) == EOS


def test_choice_seeds_are_distinct_reproducible_and_in_range() -> None:
    seeds = [choice_seed(42, j) for j in range(8)]
    assert (seeds[0] == 42 and len(set(seeds)) == 8
            and seeds == [choice_seed(42, j) for j in range(8)])
    assert all(s is not None and 0 <= s < 2**63 for s in seeds)
    assert choice_seed(None, 3) is None


def test_build_params_names_the_field() -> None:
    params = build_params(CompletionRequest(prompt="x", n=3, seed=5, stop="\n", top_k=4), 9,
                          logprobs=2)
    assert [p.seed for p in params] == [choice_seed(5, j) for j in range(3)]
    assert params[0].stop == ("\n",) and params[0].top_k == 4 and params[0].max_tokens == 9
    with pytest.raises(APIError) as err:
        build_params(CompletionRequest(prompt="x", top_p=0.0), 9, None)
    assert err.value.param == "top_p"
    assert field_of("prompt has 5000 tokens; allowed: ...") == "prompt"


def test_usage_has_completion_tokens_details_only_under_speculation() -> None:
    plain = Usage(prompt_tokens=3, completion_tokens=4, total_tokens=7,
                  prompt_tokens_details=PromptTokensDetails(cached_tokens=0))
    assert "completion_tokens_details" not in plain.model_dump()
    assert "completion_tokens_details" not in plain.model_dump_json()
    spec = plain.model_copy(update={"completion_tokens_details": CompletionTokensDetails(
        accepted_prediction_tokens=5, rejected_prediction_tokens=1)})
    assert spec.model_dump()["completion_tokens_details"] == {"accepted_prediction_tokens": 5,
                                                              "rejected_prediction_tokens": 1}


def _snapshot(**spec: Any) -> EngineSnapshot:
    return EngineSnapshot(num_running=0, num_waiting=0, num_requests=0, full_free=90,
                          full_usable=100, full_cached=0, swa_free=9, swa_usable=10, swa_cached=0,
                          free_slots=64, num_slots=64, steps=5, prefill_tokens=10,
                          decode_tokens=3, num_preemptions=0, pid=1, num_finished=1,
                          num_aborted=0, **spec)


def test_speculative_metrics() -> None:
    m = ServerMetrics()
    assert "dsv4_spec" not in m.render(_snapshot(), healthy=True, num_inflight=0)
    fresh = m.render(_snapshot(spec_num_steps=2, spec_accept_hist=(0, 0, 0)), True, 0)
    assert "dsv4_spec_mean_acceptance_length NaN" in fresh and "dsv4_spec_num_steps 2" in fresh
    text = m.render(_snapshot(spec_num_steps=2, spec_accept_hist=(3, 1, 4), spec_draft_tokens=16,
                              spec_accepted_tokens=9), True, 0)
    for line in ('dsv4_spec_accepted_drafts_total{accepted="0"} 3',
                 'dsv4_spec_accepted_drafts_total{accepted="2"} 4',
                 "# TYPE dsv4_spec_accepted_drafts_total counter",
                 "dsv4_spec_draft_tokens_total 16", "dsv4_spec_accepted_tokens_total 9",
                 "dsv4_spec_mean_acceptance_length 2.125"):     # 1 + 9 / 8 passes
        assert line in text.splitlines(), line


def test_metrics_exposition() -> None:
    m = ServerMetrics()
    t = RequestTiming(sent=0.0)
    m.on_delta(t, RequestDelta("r", [1], [-1.0], [[]], None, 10, 4), now=0.2)
    m.on_delta(t, RequestDelta("r", [2, 3], [-1.0, -1.0], [[], []], "length", 10, 4), now=0.4)
    snapshot = EngineSnapshot(num_running=0, num_waiting=0, num_requests=0, full_free=90,
                              full_usable=100, full_cached=0, swa_free=9, swa_usable=10,
                              swa_cached=0, free_slots=64, num_slots=64, steps=5, prefill_tokens=10,
                              decode_tokens=3, num_preemptions=0, pid=1, num_finished=1,
                              num_aborted=0)
    text = m.render(snapshot, healthy=True, num_inflight=0)
    assert 'dsv4_time_to_first_token_seconds_bucket{le="0.25"} 1' in text
    assert "dsv4_time_per_output_token_seconds_sum 0.1" in text
    assert "dsv4_generation_tokens_total 3" in text and "dsv4_prefix_cache_hit_rate 0.4" in text
    assert 'dsv4_kv_cache_usage{pool="full"} 0.100000' in text
    assert 'dsv4_requests_finished_total{finish_reason="length"} 1' in text
