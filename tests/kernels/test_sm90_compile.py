"""Every Triton kernel variant `benchmarks/aot_compile_sm90.py` lists compiles for sm_90 on the
CPU (no GPU needed): what the interpreter accepts and the compiler rejects (a non-constexpr global
read inside a kernel, an early return in a constexpr branch, a layout the MMA cannot take) fails
here instead of on the first GPU call."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


# two halves of about a minute each on a 2-core CPU (the routed experts' ~100 variants, the
# rest), so the test workers share them
GROUPS = {"moe": 100, "attention,compressor,fp8_linear,gemv,metadata,mhc,small,topk": 80}


@pytest.mark.slow
@pytest.mark.parametrize("kernels", sorted(GROUPS))
def test_every_listed_variant_compiles_for_sm90(kernels: str) -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(PYTHONPATH=str(ROOT / "src"), OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "aot_compile_sm90.py"),
                           "--kernels", kernels],
                          capture_output=True, text=True, env=env, timeout=900, check=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    errors = [line for line in out.splitlines() if "COMPILE ERROR" in line]
    assert not errors, "\n".join(errors)
    assert sum("instr" in line for line in out.splitlines()) >= GROUPS[kernels], out[-3000:]


def test_groups_cover_every_kernel_family() -> None:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        from aot_compile_sm90 import KERNELS
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    listed = [k for group in GROUPS for k in group.split(",")]
    assert sorted(listed) == sorted(KERNELS)
