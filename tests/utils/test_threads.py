"""CPU thread defaults (utils/threads.py): cores - 1 unless the process chose, and `dsv4 generate`
beside a CPU-bound process stays within 2.5x of its quiet time."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from dsv4.utils import threads

ROOT = Path(__file__).resolve().parents[2]


def test_cpu_threads_leave_one_core() -> None:
    assert threads.cpu_threads(8) == 7
    assert threads.cpu_threads(2) == 1
    assert threads.cpu_threads(1) == 1


def test_use_cpu_threads_respects_an_explicit_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    before = torch.get_num_threads()
    try:
        monkeypatch.setattr(threads.os, "cpu_count", lambda: 4)
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
        torch.set_num_threads(4)                       # torch's default: one per core
        assert threads.use_cpu_threads() == 3 and torch.get_num_threads() == 3
        torch.set_num_threads(2)                       # the process chose
        assert threads.use_cpu_threads() == 2
        torch.set_num_threads(4)
        monkeypatch.setenv("OMP_NUM_THREADS", "4")      # the environment chose
        assert threads.use_cpu_threads() == 4
    finally:
        torch.set_num_threads(before)


def _generate(tokens: int) -> float:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    env["PYTHONPATH"] = str(ROOT / "src")
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "dsv4", "generate", "--max-tokens", str(tokens),
                    "--temperature", "0", "What is 12+7?"], env=env, check=True,
                   capture_output=True, timeout=300)
    return time.perf_counter() - t0


@pytest.mark.slow
def test_generate_beside_a_cpu_bound_process() -> None:
    quiet = _generate(64)
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        loaded = _generate(64)
    finally:
        busy.kill()
        busy.wait()
    assert loaded <= 2.5 * quiet, f"{loaded:.1f} s beside a busy process, {quiet:.1f} s quiet"
