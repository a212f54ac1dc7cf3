"""`benchmarks/trace_gaps.py` on a synthetic Chrome trace: steps split on idle time, busy time as
the union over streams, each stream's summed time, the largest gaps with their neighbours, time
per name, gz input."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest
from bench_script import load_benchmark


def _trace(path: Path) -> None:
    """Two steps 1 ms apart. Each: k1 [0, 10) on stream 7, k2 [5, 12) on stream 9 (overlaps),
    a 3 us gap, memcpy [15, 17), a 1 us gap, k1 [18, 20); host events and short runs ignored."""
    events = [{"cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 50, "tid": 1}]
    for base in (1000.0, 2000.0):
        events += [
            {"cat": "kernel", "name": "k1", "ts": base, "dur": 10, "tid": 7},
            {"cat": "kernel", "name": "k2", "ts": base + 5, "dur": 7, "tid": 9},
            {"cat": "gpu_memcpy", "name": "Memcpy HtoD", "ts": base + 15, "dur": 2, "tid": 7},
            {"cat": "kernel", "name": "k1", "ts": base + 18, "dur": 2, "tid": 7}]
    events.append({"cat": "kernel", "name": "tail", "ts": 5000.0, "dur": 1, "tid": 7})
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)


def test_steps_gaps_and_names(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bench = load_benchmark("trace_gaps")
    path, out = tmp_path / "t.json.gz", tmp_path / "gaps.json"
    _trace(path)
    record = bench.main([str(path), "--min-events", "3", "--top", "1", "--out", str(out)])
    assert json.loads(out.read_text()) == record
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == record
    assert record["steps"] == [{"events": 4, "span_us": 20.0, "busy_us": 16.0, "idle_us": 4.0}] * 2
    detail = record["detail"]
    assert record["step"] == 1
    assert detail["top_gaps"] == [{"gap_us": 3.0, "at_us": 15.0, "after": "k2",
                                   "before": "Memcpy HtoD"}]
    assert detail["by_name"][0] == {"name": "k1", "count": 2, "total_us": 12.0}
    assert detail["streams"] == [{"stream": 7, "events": 3, "busy_us": 14.0},
                                 {"stream": 9, "events": 1, "busy_us": 7.0}]


def test_rejects_a_trace_without_steps(tmp_path: Path) -> None:
    bench = load_benchmark("trace_gaps")
    path = tmp_path / "t.json.gz"
    _trace(path)
    with pytest.raises(SystemExit, match="no run of >= 50 device events"):
        bench.main([str(path), "--min-events", "50"])
    with pytest.raises(SystemExit, match=r"--step 5: the trace has 2 steps"):
        bench.main([str(path), "--min-events", "3", "--step", "5"])
