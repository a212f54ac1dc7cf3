"""Every Triton kernel variant `benchmarks/aot_compile_sm90.py` lists compiles for sm_90 on the
CPU (no GPU needed): what the interpreter accepts and the compiler rejects (a non-constexpr global
read inside a kernel, an early return in a constexpr branch, a layout the MMA cannot take, PTX
that ptxas refuses) fails here instead of on the first GPU call.

The variants compile through the script's own `compile_variant` (the JIT's signature and
divisibility hints, down to a cubin), in a subprocess without TRITON_INTERPRET. The script's SASS
counts (`nvdisasm` / `cuobjdump` per variant) report costs, not errors: they run on one variant
per group, so the reporting path stays exercised without disassembling every cubin."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


# two halves (the routed experts' ~100 variants, the rest), so the test workers share them; the
# values are the least number of variants each lists
GROUPS = {"moe": 100, "attention,compressor,fp8_linear,gemv,metadata,mhc,small,topk": 80}

# compiles every variant of the groups in argv[2] with the script's `compile_variant`; prints a
# line per variant ("compiled" or "COMPILE ERROR") and the first variant's SASS counts
COMPILE_ALL = """
import sys
sys.path.insert(0, sys.argv[1])
import aot_compile_sm90 as aot
counted = False
for group in sys.argv[2].split(","):
    for label, kernel, types, consts, options in aot.KERNELS[group]():
        try:
            compiled = aot.compile_variant(kernel, types, consts, options)
        except Exception as exc:
            print(f"{label}: COMPILE ERROR: {str(exc).splitlines()[0] if str(exc) else exc!r}")
            continue
        if not compiled.asm["cubin"]:
            print(f"{label}: COMPILE ERROR: empty cubin")
            continue
        if not counted:
            counts = aot.sass_counts(compiled.asm["cubin"])
            assert counts["instr"] > 0 and counts["regs"] > 0, (label, counts)
            print(f"{label}: counts {counts}")
            counted = True
        print(f"{label}: compiled")
"""


@pytest.mark.slow
@pytest.mark.parametrize("kernels", sorted(GROUPS))
def test_every_listed_variant_compiles_for_sm90(kernels: str) -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(PYTHONPATH=str(ROOT / "src"), OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-c", COMPILE_ALL, str(ROOT / "benchmarks"), kernels],
                          capture_output=True, text=True, env=env, timeout=900, check=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    lines = proc.stdout.splitlines()
    errors = [line for line in lines if "COMPILE ERROR" in line]
    assert not errors, "\n".join(errors)
    assert sum(": counts " in line for line in lines) == 1, out[-3000:]
    assert sum(line.endswith(": compiled") for line in lines) >= GROUPS[kernels], out[-3000:]


def test_groups_cover_every_kernel_family() -> None:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        from aot_compile_sm90 import KERNELS
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    listed = [k for group in GROUPS for k in group.split(",")]
    assert sorted(listed) == sorted(KERNELS)
