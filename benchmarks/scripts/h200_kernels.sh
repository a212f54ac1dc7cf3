#!/usr/bin/env bash
# One device call: GPU parity of the Triton kernels (Lightning TopK, indexer scores, the engine's triton
# backend) and their benchmarks. Usage (device machine, repo root): bash benchmarks/scripts/h200_kernels.sh
set -uo pipefail
export PYTHONPATH=src PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"; } | tee "$OUT/env.txt"
timeout 200 python3 -m pytest -q -p no:cacheprovider -x tests/kernels > "$OUT/kernel_tests.txt" 2>&1; tail -3 "$OUT/kernel_tests.txt"
timeout 150 python3 benchmarks/kernels/bench_topk.py > "$OUT/bench_topk.txt" 2>&1; tail -12 "$OUT/bench_topk.txt"
timeout 150 python3 benchmarks/kernels/bench_index_scores.py > "$OUT/bench_index_scores.txt" 2>&1; tail -12 "$OUT/bench_index_scores.txt"
