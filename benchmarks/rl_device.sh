# RL on one H200 (issue 18): drift ablation (bf16, triton backend) and learning runs.
#   PART=drift|flash|learn  LEARN_ARGS='...'  (one run), or LEARN_RUNS='name:args;name:args' (several,
#   LEARN_LIMIT_S seconds each)  (run from the repo root by the device tool)
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
learn() {  # name, limit, args...
  local name=$1 limit=$2; shift 2
  timeout $((limit + 90)) python -m dsv4 rl run --out $OUT/$name --device cuda --dtype bfloat16 \
    --kernel-backend triton --eval-per-level 50 --time-limit-s $limit "$@" > $OUT/$name.log 2>&1
  tail -1 $OUT/$name.log | cut -c 1-300
  python - "$OUT/$name/metrics.jsonl" <<'PY'
import json, sys
for line in open(sys.argv[1]):
    r = json.loads(line)
    if "heldout_by_level" in r:
        print(r["step"], round(r["heldout_accuracy"], 3), r["heldout_by_level"])
PY
  rm -f $OUT/$name/state.pt
}
if [[ $PART == *flash* ]]; then   # step-0 drift of random flash-4l weights, forward only
  timeout 400 python benchmarks/rl_drift.py --preset flash-4l --device cuda --dtype bfloat16 \
    --kernel-backend triton --prompts 8 --group-size 4 --prompt-len 256 --max-tokens 16 \
    --out $OUT/drift_flash4l.json > $OUT/drift_flash4l.log 2>&1
  tail -5 $OUT/drift_flash4l.log
fi
if [[ $PART == *learn* ]]; then
  if [[ -n ${LEARN_RUNS:-} ]]; then
    IFS=';' read -ra runs <<< "$LEARN_RUNS"
    for run in "${runs[@]}"; do
      learn "${run%%:*}" ${LEARN_LIMIT_S:-150} ${run#*:}
    done
  else
    learn learn 330 --levels 3-6 --eval-every 20 \
      ${LEARN_ARGS:---algo grpo --group-size 8 --prompts-per-step 32 --steps 400 --lr 5e-5}
  fi
fi
