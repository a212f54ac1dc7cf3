#!/usr/bin/env bash
# One device call: GPU correctness of the engine + the prefix-cache benchmark on flash-4l (random bf16 weights).
# Usage (device machine, repo root): bash benchmarks/scripts/h200_engine.sh   (logs under $OUT)
set -uo pipefail
export PYTHONPATH=src PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"; git rev-parse --short HEAD 2>/dev/null; } | tee "$OUT/env.txt"
python3 -m pytest -q -p no:cacheprovider tests/engine/test_engine_gpu.py tests/engine/test_sampler.py -k "gpu or cuda" \
  > "$OUT/gpu_tests.txt" 2>&1; tail -3 "$OUT/gpu_tests.txt"
timeout 420 python3 benchmarks/prefix_cache.py --preset flash-4l --device cuda --dtype bfloat16 --page-size 128 \
  --conversations 32 --turns 8 --system-len 1024 --user-len 256 --output-len 32 --chunked-prefill-size 8192 2>&1 \
  | grep -v " INFO " | tee "$OUT/prefix_cache_flash4l_sys1024.txt"
