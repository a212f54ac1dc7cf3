#!/usr/bin/env bash
# Device call: grouped-GEMM MoE parity, backend equivalence on flash-4l, prefix-cache benchmark with the triton backend.
set -uo pipefail
export PYTHONPATH=src PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
timeout 60 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_grouped_moe.py > "$OUT/grouped_moe_test.txt" 2>&1
tail -2 "$OUT/grouped_moe_test.txt"
timeout 150 python3 benchmarks/engine_backend_check.py --preset flash-4l --device cuda --dtype bfloat16 \
  > "$OUT/backend_check.txt" 2>&1; grep -v " INFO " "$OUT/backend_check.txt" | tail -2
timeout 230 python3 benchmarks/prefix_cache.py --preset flash-4l --device cuda --dtype bfloat16 --page-size 128 \
  --conversations 32 --turns 8 --system-len 1024 --user-len 256 --output-len 32 --chunked-prefill-size 8192 \
  --kernel-backend triton 2>&1 | grep -v " INFO " | tee "$OUT/prefix_cache_triton.txt" | tail -3
