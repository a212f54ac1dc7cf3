#!/usr/bin/env bash
# One script for every GPU-machine call: `bash benchmarks/device.sh PART [PART ...]` from the repo root.
#
#   gpu-tests  the `gpu`-marked tests (kernel parity at real shapes, CUDA graphs vs eager) and the triton
#              engine backend vs ref (compiled kernels here, the interpreter on CI); the rest of the suite
#              is CI's: log gpu_tests.txt
#   kernels    every kernel benchmark (benchmarks/kernels/bench_*.py at their default shapes): one log each
#              (bench_<name>.txt, + bench_<name>.json where the script writes one), table then JSON line
#   decode     decode ms/token vs context at batch 1 and tokens/s at batch 8/32/128 on flash-4l bf16 (triton,
#              CUDA graphs) against the HBM floor: decode.txt / decode.json / decode.png
#   engine     the triton backend against ref on one model (engine_backend_check.py, tiny fp32 and flash-4l
#              bf16) and a profile of flash-4l decode steps: engine_check_*.txt, profile_engine_step.txt
#   train      a profile of `dsv4 train run` steps (needs data carried at .data/tiny: `dsv4 train data`):
#              profile_train_step.txt
#
# Every part writes its logs under $OUT (at most 8 files come back from one call: run few parts per call)
# and env.txt (GPU, driver, torch / triton / transformers versions, commit). The device has no registry:
# wheels carried in .wheels/ (e.g. the transformers version pyproject pins) are installed first.
# Results worth keeping go into a dated report under benchmarks/results/ (benchmarks/README.md).
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
if ls .wheels/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .wheels/*.whl
  export PYTHONPATH=src:/tmp/site
else
  export PYTHONPATH=src
fi

env_info() {
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
  python3 -c "import transformers; print('transformers', transformers.__version__)" 2>/dev/null
  git rev-parse --short HEAD 2>/dev/null || echo "commit: unknown (no git metadata)"
}

summary() {   # the pytest / benchmark lines worth reading in the call's output
  grep -E "passed|failed|error|Error|^FAILED" "$1" | tail -8
}

gpu_tests() {   # (test_hf_parity and the server tests are CI's: the device lacks their pinned packages)
  { timeout 420 python3 -m pytest -q -p no:cacheprovider -rs -m gpu --durations=15 tests \
      --ignore=tests/model/test_hf_parity.py --ignore=tests/server
    timeout 120 python3 -m pytest -q -p no:cacheprovider -rs tests/kernels/test_engine_triton_backend.py
  } > "$OUT/gpu_tests.txt" 2>&1
  summary "$OUT/gpu_tests.txt"
}

kernels() {
  for script in benchmarks/kernels/bench_*.py; do
    name=$(basename "$script" .py)
    args=()
    if grep -q -e 'base_parser(' -e '"--out"' "$script"; then args=(--out "$OUT/$name.json"); fi
    timeout 150 python3 "$script" "${args[@]}" > "$OUT/$name.txt" 2>&1
    echo "== $name (exit $?)"; grep -v "^{" "$OUT/$name.txt" | tail -6
  done
}

decode() {
  timeout 400 python3 benchmarks/decode_context_sweep.py --device cuda --dtype bfloat16 --preset flash-4l \
    --kernel-backend triton --contexts 4096,131072 --batches 8,32,128 --plot "$OUT/decode.png" \
    --out "$OUT/decode.json" > "$OUT/decode.txt" 2>&1
  grep -v "^{" "$OUT/decode.txt" | tail -14
}

engine() {
  timeout 120 python3 benchmarks/engine_backend_check.py --preset tiny --device cuda --dtype float32 \
    --prompt-len 1500 --num-prompts 2 --max-tokens 64 > "$OUT/engine_check_tiny.txt" 2>&1
  tail -3 "$OUT/engine_check_tiny.txt"
  timeout 200 python3 benchmarks/engine_backend_check.py --preset flash-4l --device cuda --dtype bfloat16 \
    --prompt-len 3000 --num-prompts 2 --max-tokens 128 > "$OUT/engine_check_flash4l.txt" 2>&1
  tail -3 "$OUT/engine_check_flash4l.txt"
  timeout 150 python3 benchmarks/profile_engine_step.py --preset flash-4l --device cuda --dtype bfloat16 \
    --kernel-backend triton --num-prompts 1 --prompt-len 4096 --warm-steps 2 --steps 4 \
    > "$OUT/profile_engine_step.txt" 2>&1
  tail -2 "$OUT/profile_engine_step.txt"
}

train() {
  timeout 400 python3 benchmarks/profile_train_step.py --data .data/tiny --device cuda --batch-size 16 \
    > "$OUT/profile_train_step.txt" 2>&1
  head -12 "$OUT/profile_train_step.txt"
}

if [ $# -eq 0 ]; then
  sed -n '2,20p' "$0"
  exit 2
fi
env_info | tee "$OUT/env.txt"
for part in "$@"; do
  echo "=== $part"
  case "$part" in
    gpu-tests) gpu_tests ;;
    kernels) kernels ;;
    decode) decode ;;
    engine) engine ;;
    train) train ;;
    *) echo "unknown part '$part'; allowed: gpu-tests kernels decode engine train"; exit 2 ;;
  esac
done
