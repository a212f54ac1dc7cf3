"""Smoke runs of the multi-rank benchmarks on a CPU (gloo), as `benchmarks/device.sh multi` runs
them on GPUs: `parallel_decode.py` (one process, TP 2 and DP 2 + EP 2 of the in-memory micro
model: every point timed, fp32 agreement exact against one process, rank 0's memory equal to the
plan, collective time only where there are collectives) and `weight_sync.py` (the disaggregated
bucketed sync between two processes and the colocated one)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]


def run(tmp_path: Path, script: str, *args: str) -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1",
           "DSV4_CACHE": str(tmp_path / "cache")}
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), *args],
                          capture_output=True, text=True, env=env, timeout=600, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return dict(json.loads(proc.stdout.strip().splitlines()[-1]))


@pytest.mark.slow
def test_parallel_decode_on_cpu(tmp_path: Path) -> None:
    result = run(tmp_path, "parallel_decode.py", "--model", "in-memory:micro", "--device", "cpu",
                 "--dtype", "float32", "--layouts", "1,tp2,dp2-ep2", "--points", "2:32",
                 "--steps", "3", "--warmup-steps", "1", "--profile-steps", "2",
                 "--agree-tokens", "40", "--page-size", "16", "--chunk", "32")
    rows = result["rows"]
    assert [(r["layout"], r["batch"], r["context"]) for r in rows] == [
        (layout, 2, 32) for layout in ("1", "tp2", "dp2-ep2")]
    for r in rows:
        assert r["status"] == "ok" and r["ms_per_step"] > 0, r
        assert r["weights_gb"] == r["plan_weights_gb"] and r["kv_gb"] == r["plan_kv_gb"], r
        if r["layout"] == "1":
            assert r["collective_ms_per_step"] == 0 and "top1_agreement" not in r, r
        else:
            assert r["collective_ms_per_step"] > 0, r
            assert r["top1_agreement"] == 1.0 and r["max_abs_logprob_diff"] <= 1e-5, r


@pytest.mark.slow
def test_weight_sync_on_cpu(tmp_path: Path) -> None:
    result = run(tmp_path, "weight_sync.py", "--model", "in-memory:micro", "--device", "cpu",
                 "--dtype", "float32", "--syncs", "2", "--bucket-mb", "0.5", "--chunk-gb",
                 "0.001", "--page-size", "16", "--tmp", str(tmp_path))
    disagg, coloc = result["rows"]
    assert disagg["placement"] == "disaggregated" and coloc["placement"] == "colocated"
    assert disagg["buckets"] > 1 and coloc["chunks"] > 1
    assert coloc["gb"] > 0 and abs(disagg["gb"] - coloc["gb"]) <= 0.01 * coloc["gb"] + 1e-3
    for r in (disagg, coloc):
        assert len(r["sync_s"]) == 2 and r["gb_s"] > 0, r
