#!/usr/bin/env bash
# Device call 2: kernel parity tests on the GPU (all of tests/kernels) and the backend equivalence at real shapes.
set -uo pipefail
export PYTHONPATH=src PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
timeout 240 python3 -m pytest -q -p no:cacheprovider tests/kernels > "$OUT/kernel_tests.txt" 2>&1; tail -4 "$OUT/kernel_tests.txt"
grep -E "^(FAILED|ERROR)" "$OUT/kernel_tests.txt" | head -5
timeout 250 python3 benchmarks/engine_backend_check.py --preset flash-4l --device cuda --dtype bfloat16 \
  > "$OUT/backend_check_flash4l.txt" 2>&1; grep -v " INFO " "$OUT/backend_check_flash4l.txt" | tail -4
