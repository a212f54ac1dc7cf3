# RL on one H200 (issue 18): drift ablation (bf16, triton backend) and a learning run.
#   PART=drift|learn  LEARN_ARGS='...'  (run from the repo root by the device tool)
set -x
export PYTHONPATH=src
PART=${PART:-drift,learn}
nvidia-smi --query-gpu=name,memory.total --format=csv
python -c "import torch, triton; print(torch.__version__, triton.__version__)"
if [[ $PART == *drift* ]]; then
  timeout 170 python benchmarks/rl_drift.py --device cuda --dtype bfloat16 --kernel-backend triton \
    --steps 2 --prompts 8 --group-size 8 --out $OUT/drift_bf16.json > $OUT/drift_bf16.log 2>&1
  tail -9 $OUT/drift_bf16.log
fi
if [[ $PART == *learn* ]]; then
  timeout 420 python -m dsv4 rl run --out $OUT/learn --device cuda --dtype bfloat16 \
    --kernel-backend triton --levels 3-6 --eval-every 20 --eval-per-level 50 \
    --time-limit-s 330 ${LEARN_ARGS:---algo grpo --group-size 8 --prompts-per-step 32 --steps 400 --lr 5e-5} \
    > $OUT/learn.log 2>&1
  tail -2 $OUT/learn.log | cut -c 1-400
  rm -f $OUT/learn/state.pt
fi
