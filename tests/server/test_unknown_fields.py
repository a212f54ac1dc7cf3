"""Unknown request fields are ignored but named once per field name in a warning (vLLM's
behaviour), not silently dropped."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

from dsv4.server.protocol import CompletionRequest, unknown_fields
from dsv4.server.state import ServerState


def test_unknown_fields_are_named_once(caplog: pytest.LogCaptureFixture) -> None:
    body = CompletionRequest.model_validate_json(
        '{"prompt": "hi", "max_tokens": 1, "logit_bais": {"1": 2}, "best_of_n": 3}')
    assert unknown_fields(body) == ["best_of_n", "logit_bais"]
    assert body.logit_bias is None and body.max_tokens == 1
    state: ServerState = SimpleNamespace(warned_fields=set())  # type: ignore[assignment]
    logging.getLogger("dsv4").addHandler(caplog.handler)        # dsv4's logs do not propagate
    try:
        with caplog.at_level(logging.WARNING, logger="dsv4"):
            assert ServerState.warn_unknown_fields(state, body) == ["best_of_n", "logit_bais"]
            assert ServerState.warn_unknown_fields(state, body) == []
    finally:
        logging.getLogger("dsv4").removeHandler(caplog.handler)
    warned = [r.getMessage() for r in caplog.records if "not supported" in r.getMessage()]
    assert warned == ["request field 'best_of_n' is not supported and is ignored",
                      "request field 'logit_bais' is not supported and is ignored"]
