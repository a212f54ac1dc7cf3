"""A run directory's files, shared by `dsv4 train run` and `dsv4 rl run`.

`RunConfig` is the mixin of a frozen run config: JSON round trip (unknown fields refused) and the
fields a resumed run may not change (all but the class's `INVOCATION_FIELDS`). `save_state` writes
`state.pt` atomically (temporary file + rename), so a run killed mid-write keeps its last state.
`append_metrics` / `truncate_metrics` keep `metrics.jsonl` one JSON object per logged step; a
resumed run drops the lines logged after its state and logs them again.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any, ClassVar, Self

import torch

STATE = "state.pt"
METRICS = "metrics.jsonl"


class RunConfig:
    """Mixin of a frozen-dataclass run config; `INVOCATION_FIELDS` may change on resume."""

    INVOCATION_FIELDS: ClassVar[tuple[str, ...]] = ()

    def replace(self, **changes: Any) -> Self:
        return dataclasses.replace(self, **changes)  # type: ignore[type-var]

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)  # type: ignore[call-overload]

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Self:
        known = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown {cls.__name__} fields {unknown}; allowed: {sorted(known)}")
        return cls(**cls._from_json(dict(d)))

    @classmethod
    def _from_json(cls, d: dict[str, Any]) -> dict[str, Any]:
        """Field values as read from JSON -> constructor arguments (e.g. lists back to tuples)."""
        return d

    def save(self, path: Path) -> None:
        path.write_text(json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n")

    def changed_fields(self, other: Self) -> list[str]:
        """The fields other than `INVOCATION_FIELDS` in which `other` differs from this config."""
        a, b = self.to_dict(), other.to_dict()
        return sorted(k for k in a if k not in self.INVOCATION_FIELDS and a[k] != b[k])


def save_state(run_dir: Path, state: dict[str, Any]) -> None:
    """`run_dir/state.pt` atomically."""
    run_dir.mkdir(parents=True, exist_ok=True)
    tmp = run_dir / (STATE + ".tmp")
    torch.save(state, tmp)
    os.replace(tmp, run_dir / STATE)


def append_metrics(run_dir: Path, record: dict[str, Any]) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    with open(run_dir / METRICS, "a") as f:
        f.write(json.dumps(record) + "\n")


def truncate_metrics(run_dir: Path, step: int) -> None:
    """Drop the metrics lines of steps after `step` (a resumed run logs them again)."""
    metrics = run_dir / METRICS
    if metrics.exists():
        kept = [line for line in metrics.read_text().splitlines()
                if json.loads(line)["step"] <= step]
        metrics.write_text("".join(line + "\n" for line in kept))
