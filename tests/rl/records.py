"""The metrics.jsonl records of RL runs, compared key by key (the placement tests)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest


def read_records(run: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def assert_same_records(got: list[dict[str, Any]], want: list[dict[str, Any]],
                        uncompared: set[str], exact: set[str], tol: float) -> None:
    """The same keys step by step but `uncompared`; `exact` ones equal, the others within
    `tol`."""
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert set(g) - uncompared == set(w) - uncompared, g["step"]
        for key in set(w) - uncompared:
            if key in exact:
                assert g[key] == w[key], (g["step"], key)
            else:
                assert g[key] == pytest.approx(w[key], abs=tol), (g["step"], key)
