# RL on one H200 (issue 18): drift ablation (bf16, triton backend) and learning runs.
#   PART=attn|ablation|bitests|bibench|drift|events|flash|graphs|rounding|learn (comma list),
#   MODES=default,true-on-policy (drift, flash),
#   LEARN_ARGS='...' (one run) or LEARN_RUNS='name:args;name:args' (several, LEARN_LIMIT_S
#   seconds each; LEARN_PARALLEL=1 runs them at once, sharing the GPU; EVAL_PER_LEVEL held-out
#   problems per level, default 50). Run from the repo root by the device tool.
set -x
export PYTHONPATH=$PWD/src
PART=${PART:-drift,learn}
nvidia-smi --query-gpu=name,memory.total --format=csv
python -c "import torch, triton; print(torch.__version__, triton.__version__)"
MODES=${MODES:-default,true-on-policy}
if [[ $PART == *bitests* ]]; then   # batch-invariant CUDA ops: GPU tests
  timeout 150 python -m pytest -q -m gpu tests/kernels/test_batch_invariant_triton.py \
    > $OUT/bi_tests.log 2>&1
  tail -15 $OUT/bi_tests.log | cut -c 1-300
fi
if [[ $PART == *bibench* ]]; then
  (cd benchmarks/kernels && timeout 120 python bench_batch_invariant.py \
    --out $OUT/bench_batch_invariant.json > $OUT/bench_batch_invariant.log 2>&1)
  grep -v '^{' $OUT/bench_batch_invariant.log | cut -c 1-250
fi
if [[ $PART == *ablation* ]]; then   # step-0 drift with one engine op swapped between backends
  timeout 200 python benchmarks/drift_ablation.py --out $OUT/drift_ablation.json \
    > $OUT/drift_ablation.log 2>&1
  grep -v "INFO\|^{\|shards" $OUT/drift_ablation.log | tail -32
fi
if [[ $PART == *graphs* ]]; then   # what the graphed decode and the backend contribute
  for v in "triton:" "triton:--disable-cuda-graph" "ref:--disable-cuda-graph"; do
    timeout 120 python benchmarks/rl_drift.py --device cuda --dtype bfloat16 --steps 1 \
      --prompts 8 --group-size 8 --modes default --replays routing --kernel-backend ${v%%:*} \
      ${v#*:} > $OUT/graphs_${v%%:*}${v#*:}.log 2>&1
    echo "$v"; grep -A1 "^mode" $OUT/graphs_${v%%:*}${v#*:}.log
  done
fi
if [[ $PART == *attn* ]]; then   # sparse-attention P.V precision: GPU tests, then the benchmark
  timeout 120 python -m pytest -q -m gpu tests/kernels/test_sparse_attention_triton.py \
    -k "pv_terms or flash_decode or flash_prefill" > $OUT/attn_tests.log 2>&1 &
fi
if [[ $PART == *drift* ]]; then
  timeout ${DRIFT_LIMIT_S:-170} python benchmarks/rl_drift.py --device cuda --dtype bfloat16 \
    --kernel-backend triton --steps 2 --prompts 8 --group-size 8 --modes $MODES \
    --out $OUT/drift_bf16.json > $OUT/drift_bf16.log 2>&1
  tail -9 $OUT/drift_bf16.log
fi
learn() {  # name, limit, args...
  local name=$1 limit=$2; shift 2
  timeout $((limit + 90)) python -m dsv4 rl run --out $OUT/$name --device cuda --dtype bfloat16 \
    --kernel-backend triton --eval-per-level ${EVAL_PER_LEVEL:-50} --time-limit-s $limit "$@" \
    > $OUT/$name.log 2>&1
  echo "== $name"; tail -1 $OUT/$name.log | cut -c 1-300
  python - "$OUT/$name/metrics.jsonl" <<'PY'
import json, sys
for line in open(sys.argv[1]):
    r = json.loads(line)
    if "heldout_by_level" in r:
        print(r["step"], round(r["heldout_accuracy"], 3), r["heldout_by_level"])
PY
  cp $OUT/$name/metrics.jsonl $OUT/${name}_metrics.jsonl; cp $OUT/$name/rl.png $OUT/${name}_rl.png
  rm -rf $OUT/$name
}
if [[ $PART == *events* ]]; then   # true on-policy steps with drift: engine or trainer side
  timeout ${EVENTS_LIMIT_S:-300} python benchmarks/drift_events.py --device cuda \
    --dtype bfloat16 --steps ${EVENTS_STEPS:-25} --out $OUT/drift_events.json \
    > $OUT/drift_events.log 2>&1 &
fi
if [[ $PART == *flash* ]]; then   # step-0 drift of random flash-4l weights, forward only
  timeout ${FLASH_LIMIT_S:-400} python benchmarks/rl_drift.py --preset flash-4l --device cuda \
    --dtype bfloat16 --kernel-backend triton --prompts 8 --group-size 4 --prompt-len 256 \
    --max-tokens 16 --modes $MODES --out $OUT/drift_flash4l.json > $OUT/drift_flash4l.log 2>&1
  tail -8 $OUT/drift_flash4l.log | cut -c 1-300
fi
if [[ $PART == *attn* ]]; then
  wait; tail -3 $OUT/attn_tests.log
  (cd benchmarks/kernels && timeout 150 python bench_sparse_attention.py \
    --out $OUT/bench_sparse_attention.json > $OUT/bench_sparse_attention.log 2>&1)
  grep -v '^{' $OUT/bench_sparse_attention.log | cut -c 1-250
fi
if [[ $PART == *rounding* ]]; then   # compiled Triton kernels vs ref ops on ref's own inputs
  timeout 200 python benchmarks/backend_rounding.py --device cuda --prompts 8 --max-tokens 16 \
    > $OUT/rounding.log 2>&1
  grep -v '^{' $OUT/rounding.log | grep -v INFO | head -40
fi
if [[ $PART == *learn* ]]; then
  if [[ -n ${LEARN_RUNS:-} ]]; then
    IFS=';' read -ra runs <<< "$LEARN_RUNS"
    for run in "${runs[@]}"; do
      if [[ -n ${LEARN_PARALLEL:-} ]]; then
        learn "${run%%:*}" ${LEARN_LIMIT_S:-150} ${run#*:} > $OUT/learn_${run%%:*}.txt &
      else
        learn "${run%%:*}" ${LEARN_LIMIT_S:-150} ${run#*:}
      fi
    done
    wait
    cat $OUT/learn_*.txt 2>/dev/null
  else
    learn learn 330 --levels 3-6 --eval-every 20 \
      ${LEARN_ARGS:---algo grpo --group-size 8 --prompts-per-step 32 --steps 400 --lr 5e-5}
  fi
fi
if [[ $PART == *events* ]]; then
  wait; grep -v "INFO\|shards" $OUT/drift_events.log | tail -12 | cut -c 1-600
fi
