#!/usr/bin/env bash
# One device call for issue 7's kernels written without a GPU: compiled parity (-m gpu) and benchmarks of the
# hybrid sparse attention and fused mHC (sweeps included). Usage (device, repo root): bash benchmarks/scripts/h200_kernels_ii.sh
set -uo pipefail
export PYTHONPATH=src PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"; } | tee "$OUT/env.txt"
timeout 240 python3 -m pytest -q -p no:cacheprovider -m gpu tests/kernels/test_sparse_attention_triton.py \
  tests/kernels/test_mhc_triton.py tests/kernels/test_moe_quant.py > "$OUT/gpu_tests.txt" 2>&1; tail -3 "$OUT/gpu_tests.txt"
timeout 150 python3 benchmarks/kernels/bench_sparse_attention.py --sweep --out "$OUT/bench_sparse_attention.json" \
  > "$OUT/bench_sparse_attention.txt" 2>&1; grep -v "^{" "$OUT/bench_sparse_attention.txt" | tail -25
timeout 120 python3 benchmarks/kernels/bench_mhc.py --sweep --out "$OUT/bench_mhc.json" > "$OUT/bench_mhc.txt" 2>&1
grep -v "^{" "$OUT/bench_mhc.txt" | tail -25
timeout 150 python3 benchmarks/kernels/bench_moe_quant.py --out "$OUT/bench_moe_quant.json" > "$OUT/bench_moe_quant.txt" 2>&1; grep -v "^{" "$OUT/bench_moe_quant.txt" | tail -25
