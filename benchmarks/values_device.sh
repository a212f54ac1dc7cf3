# Issue 18, RL default mode with the trainer's values from the engine's kernels, on one H200:
# per-op token-count invariance (kernel_invariance.py, auto and invariant plans), the step-0 drift
# and step times of dsv4-tiny (rl_drift.py: real RL steps) and the step-0 drift of random
# flash-4l weights, per mode (default / formulation / true-on-policy / true-on-policy-ref).
#   PART=inv,tiny,flash,tests (comma list). Run from the repo root by the device tool.
set -x
export PYTHONPATH=$PWD/src
PART=${PART:-inv,tiny,flash}
MODES=${MODES:-default,kernels,formulation,true-on-policy-ref}
nvidia-smi --query-gpu=name,memory.total --format=csv
python -c "import torch, triton; print(torch.__version__, triton.__version__)"
if [[ $PART == *inv* ]]; then
  for a in "tiny_auto:" "tiny_inv:--invariant-plans" "flash_auto:--preset flash-4l --prompts 8" \
           "flash_inv:--preset flash-4l --prompts 8 --invariant-plans"; do
    timeout 150 python benchmarks/kernel_invariance.py --device cuda ${a#*:} \
      --out $OUT/inv_${a%%:*}.json > $OUT/inv_${a%%:*}.log 2>&1
    echo "== ${a%%:*}"; grep -v "INFO\|^{\|shards" $OUT/inv_${a%%:*}.log | grep -v " differ       0 " \
      | tail -12
  done
fi
if [[ $PART == *tests* ]]; then
  timeout 240 python -m pytest -q -m gpu tests/kernels/test_kernel_values.py \
    tests/kernels/test_mhc_triton.py tests/kernels/test_sparse_attention_triton.py \
    tests/rl/test_true_on_policy.py > $OUT/gpu_tests.log 2>&1
  tail -6 $OUT/gpu_tests.log | cut -c 1-300
fi
if [[ $PART == *tiny* ]]; then
  timeout ${TINY_LIMIT_S:-240} python benchmarks/rl_drift.py --device cuda --dtype bfloat16 \
    --kernel-backend triton --steps ${TINY_STEPS:-3} --prompts 8 --group-size 8 \
    --modes $MODES --replays ${REPLAYS:-routing+indexer} \
    --out $OUT/drift_tiny.json > $OUT/drift_tiny.log 2>&1
  grep -A8 "^mode" $OUT/drift_tiny.log | grep -v "^{" | cut -c 1-200
  tail -3 $OUT/drift_tiny.log | grep -i error
fi
if [[ $PART == *flash* ]]; then
  timeout ${FLASH_LIMIT_S:-300} python benchmarks/rl_drift.py --preset flash-4l --device cuda \
    --dtype bfloat16 --kernel-backend triton --prompts 8 --group-size 4 --prompt-len 256 \
    --modes $MODES --out $OUT/drift_flash.json > $OUT/drift_flash.log 2>&1
  grep -A14 "^mode" $OUT/drift_flash.log | grep -v "^{" | cut -c 1-200
  tail -3 $OUT/drift_flash.log | grep -i error
fi
