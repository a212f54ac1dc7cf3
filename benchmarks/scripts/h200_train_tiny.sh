#!/usr/bin/env bash
# Train dsv4-tiny on one H200 in one device call (issue 8): probe the step time, size the run to the time
# budget, train with the recipe's config, export the official FP8/FP4 checkpoint.
# Usage (device machine, repo root; data built here with `dsv4 train data --out .data/tiny` and carried):
#   BUDGET_S=420 [COMPILE=0] [STEPS=N] bash benchmarks/scripts/h200_train_tiny.sh      (files under $OUT)
# With COMPILE=1 give STEPS: the probe compiles too (2026-11-30: 325 s of warm-up for whole-forward compilation,
# 253 ms per 32 x 2048 step compiled vs 807 ms eager; benchmarks/results/train_tiny/stage3_attempt.md).
set -uo pipefail
export PYTHONPATH=src PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
DATA=${DATA:-.data/tiny}; RUN=${RUN:-/tmp/dsv4-run}; BUDGET_S=${BUDGET_S:-420}
BATCH=${BATCH:-16}; LR=${LR:-2e-3}; STEPS=${STEPS:-}; DEVICE=${DEVICE:-cuda}; EVAL_TOKENS=${EVAL_TOKENS:-131072}
INIT=${INIT:-}; WARMUP=${WARMUP:-200}; QAT_START=${QAT_START:-0.8}   # INIT: a stage-1 export to continue from
COMPILE=${COMPILE:-1}   # 1: torch.compile each block of the training forward (--compile) in the probe and the run
LOG="$OUT/train.log"
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"; } | tee "$LOG"
probe() {   # time 14 steps (7 plain + 7 QAT) at the run's shape; print the step count that fits the budget
  python3 - "$DATA" "$BATCH" "$BUDGET_S" "$COMPILE" <<'PY' 2>>"$LOG"
import sys, time, tempfile, torch
from dsv4.train.config import TrainConfig
from dsv4.train.trainer import Trainer
data, batch, budget, compile_ = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), sys.argv[4] == "1"
cfg = TrainConfig(data_dir=data, out_dir=tempfile.mkdtemp(), steps=14, batch_size=batch, warmup_steps=1,
                  qat_start=0.5, device="cuda", log_every=100, eval_every=100, ckpt_every=100, compile=compile_)
t = Trainer(cfg)
times = []
for i in range(14):
    torch.cuda.synchronize(); s = time.perf_counter(); t.train_step(); torch.cuda.synchronize()
    times.append(time.perf_counter() - s)
# the first 3 steps of each phase hold compile warm-up (and any recompile when QAT starts): not timed
plain, qat = sum(times[3:7]) / 4, sum(times[10:14]) / 4
warmup = sum(times[:3]) + sum(times[7:10]) - 3 * (plain + qat)
# 80% of steps plain, 20% QAT (qat_start=0.8); 8% of the budget kept for evaluations and saving; the run
# compiles again, so its warm-up is taken off the budget too
per_step = 0.8 * plain + 0.2 * qat
steps = int((0.92 * budget - warmup) / per_step)
print(f"probe: compile={compile_} plain {plain*1e3:.1f} ms/step, qat {qat*1e3:.1f} ms/step, warm-up {warmup:.1f} s, "
      f"peak mem {torch.cuda.max_memory_allocated()/2**30:.1f} GiB -> {steps} steps", file=sys.stderr)
print(steps)
PY
}
if [ -z "$STEPS" ]; then
  STEPS=$(probe)
  if ! [[ "$STEPS" =~ ^[0-9]+$ ]] && [ "$COMPILE" = 1 ]; then   # compile failed here: say so, train eagerly
    tail -5 "$LOG"; echo "compiled probe failed; falling back to COMPILE=0" | tee -a "$LOG"; COMPILE=0; STEPS=$(probe)
  fi
  grep "^probe:" "$LOG" | tail -1
fi
echo "steps=$STEPS batch=$BATCH lr=$LR compile=$COMPILE" | tee -a "$LOG"
python3 -m dsv4.cli.main train run --data "$DATA" --out "$RUN" --device "$DEVICE" --steps "$STEPS" --batch-size "$BATCH" \
  --lr "$LR" --warmup-steps "$((STEPS < 2 * WARMUP ? STEPS / 2 : WARMUP))" --qat-start "$QAT_START" ${INIT:+--init-from "$INIT"} $([ "$COMPILE" = 1 ] && echo --compile) --eval-every 500 --eval-tokens "$EVAL_TOKENS" --ckpt-every 1000 --log-every 25 \
  --time-limit-s "$((BUDGET_S + 20))" >>"$LOG" 2>&1
tail -3 "$RUN/metrics.jsonl" | tee -a "$LOG"
python3 -m dsv4.cli.main train export --run "$RUN" --data "$DATA" --out "$RUN/model" >>"$LOG" 2>&1
ls -la "$RUN/model" | tee -a "$LOG"
cp "$RUN"/model/model-*.safetensors "$OUT/"
cp "$RUN/metrics.jsonl" "$RUN/loss.png" "$OUT/" 2>/dev/null
tar -C "$RUN/model" -cf "$OUT/model_meta.tar" config.json model.safetensors.index.json training.json
