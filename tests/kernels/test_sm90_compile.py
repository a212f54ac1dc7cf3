"""Every code path of the Triton kernel variants `benchmarks/aot_compile_sm90.py` lists compiles
for sm_90 on the CPU (no GPU needed): what the interpreter accepts and the compiler rejects (a
non-constexpr global read inside a kernel, an early return in a constexpr branch, a layout the
MMA cannot take, PTX that ptxas refuses) fails here instead of on the first GPU call.

The variants compile through the script's own `compile_variant` (the JIT's signature and
divisibility hints, down to a cubin), in a subprocess without TRITON_INTERPRET, one per code path
(`distinct_paths`: the script's tile, warp and stage sweeps of one path compile the same code;
`aot_compile_sm90.py` alone compiles them all). The script's SASS counts (`nvdisasm` /
`cuobjdump` per variant) report costs, not errors: they run on one variant per group, so the
reporting path stays exercised without disassembling every cubin."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


# two halves (the routed experts' ~75 code paths, the rest), so the test workers share them; the
# values are the least number of distinct code paths (`distinct_paths`) each lists
GROUPS = {"moe": 79, "attention,compressor,fp8_linear,gemv,metadata,mhc,small,topk": 117}

# compiles every variant of the groups in argv[2] with the script's `compile_variant`; prints a
# line per variant ("compiled" or "COMPILE ERROR") and the first variant's SASS counts
COMPILE_ALL = """
import sys
sys.path.insert(0, sys.argv[1])
import aot_compile_sm90 as aot
counted = False
for group in sys.argv[2].split(","):
    for label, kernel, types, consts, options in aot.distinct_paths(aot.KERNELS[group]()):
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


def test_distinct_paths_keeps_one_variant_per_code_path() -> None:
    """Tiles, warps and stages merge; a constexpr that picks code, the types, and BLOCK_M on
    either side of 64 (16-bit wgmma or not) do not."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        from aot_compile_sm90 import distinct_paths
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    types = {"x_ptr": "*bf16"}
    base = {"FMT": 1, "BLOCK_M": 16, "BLOCK_N": 64}
    variants = [
        ("base", "k", types, base, {"num_warps": 4}),
        ("tile", "k", types, {**base, "BLOCK_N": 32, "BLOCK_M": 32}, {"num_warps": 8,
                                                                       "num_stages": 2}),
        ("wgmma", "k", types, {**base, "BLOCK_M": 128}, {"num_warps": 4}),
        ("fmt", "k", types, {**base, "FMT": 2}, {"num_warps": 4}),
        ("types", "k", {"x_ptr": "*fp32"}, base, {"num_warps": 4}),
        ("kernel", "other", types, base, {"num_warps": 4}),
        ("pdl", "k", types, base, {"num_warps": 4, "launch_pdl": True}),
    ]
    assert [v[0] for v in distinct_paths(iter(variants))] == [
        "base", "wgmma", "fmt", "types", "kernel", "pdl"]
