#!/usr/bin/env bash
# Device calls for issue 6 (GPU kernels I), sixth session. Usage (device, repo root):
#   PART=coop  bash benchmarks/scripts/h200_kernels_i_s6.sh   Lightning TopK's coop path (one launch, grid barriers):
#                                                             GPU parity of test_topk_coop.py (fused form), bench_topk
#                                                             at the default and with the coop path (+ probe, + a
#                                                             sweep of its knobs); indexer scores T=1 with blocks per
#                                                             program; the compressor's persistent grid
#   PART=other bash benchmarks/scripts/h200_kernels_i_s6.sh   the EVEN_D loads (16-byte vectors, cp.async gathers) of the
#                                                             indexer scores and the sparse attention: GPU parity and
#                                                             benchmarks (call 2 also ran the compressor's persistent
#                                                             grid, measured slower everywhere and not kept)
#   PART=final bash benchmarks/scripts/h200_kernels_i_s6.sh   GPU parity of the TopK (coop + compact), indexer scores and
#                                                             engine triton-backend tests at the session's defaults
#   PART=last  bash benchmarks/scripts/h200_kernels_i_s6.sh   GPU parity of the coop tests (TopKRunner under capture) and
#                                                             the engine's triton backend; the C4 indexer compressor at
#                                                             decode batches 4096 / 8192 / 16384
#   PART=bench bash benchmarks/scripts/h200_kernels_i_s6.sh   TopK (defaults, + probe; the compact path at the same
#                                                             shapes; coop_cap 16 / 64) and indexer scores benchmarks
# At most 8 files come back from $OUT: one log per step.
source "$(dirname "$0")/device_env.sh"
COOP='{"coop_programs": 65536}'
if [ "$PART" = coop ]; then
  timeout 190 python3 -m pytest -q -x -p no:cacheprovider tests/kernels/test_topk_coop.py > "$OUT/gpu_tests_coop.txt" 2>&1
  grep -E "passed|failed|Error" "$OUT/gpu_tests_coop.txt" | tail -4; grep -E "^FAILED|Error" "$OUT/gpu_tests_coop.txt" | head -5
  { timeout 60 python3 benchmarks/kernels/bench_topk.py --probe --cases 1x262144x512,2x262144x512,4x262144x512
    timeout 130 python3 benchmarks/kernels/bench_topk.py --probe --config "$COOP" --sweep --knobs '[{"coop_warps": 4},
      {"coop_warps": 16}, {"coop_chunk": 4096}, {"coop_cap": 32}, {"coop_cap": 128}, {"coop_split": true}]'
  } > "$OUT/bench_topk_coop.txt" 2>&1
  grep -v "^{" "$OUT/bench_topk_coop.txt" | grep -vE "^(sweep B|probe)" | head -20
  grep -E "^(probe|sweep B)" "$OUT/bench_topk_coop.txt"
  timeout 70 python3 benchmarks/kernels/bench_index_scores.py --only "T=1 " \
    --configs 64/4/2/1,64/4/2/2,64/4/3/2,64/4/2/4,64/8/2/2,64/8/3/2,128/8/2/1,128/4/2/1,32/4/2/2,32/2/2/4 \
    > "$OUT/bench_index_scores.txt" 2>&1
  grep -v "^{" "$OUT/bench_index_scores.txt" | tail -4; grep -o '"configs_us": {[^}]*}' "$OUT/bench_index_scores.txt"
elif [ "$PART" = other ]; then
  timeout 200 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_index_scores.py \
    tests/kernels/test_sparse_attention_triton.py > "$OUT/gpu_tests_other.txt" 2>&1
  grep -E "passed|failed|Error" "$OUT/gpu_tests_other.txt" | tail -4; grep -E "^FAILED" "$OUT/gpu_tests_other.txt" | head -5
  { timeout 70 python3 benchmarks/kernels/bench_index_scores.py --configs 64/4/2/2,64/4/3/2,64/8/2/2,128/8/2/1
    timeout 110 python3 benchmarks/kernels/bench_sparse_attention.py; } > "$OUT/bench_even_d.txt" 2>&1
  grep -v "^{" "$OUT/bench_even_d.txt" | tail -30
elif [ "$PART" = final ]; then
  timeout 560 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_topk_coop.py tests/kernels/test_topk.py \
    tests/kernels/test_index_scores.py tests/kernels/test_engine_triton_backend.py > "$OUT/gpu_tests_final.txt" 2>&1
  grep -E "passed|failed|Error" "$OUT/gpu_tests_final.txt" | tail -4; grep -E "^FAILED" "$OUT/gpu_tests_final.txt" | head -5
elif [ "$PART" = bench ]; then
  { timeout 110 python3 benchmarks/kernels/bench_topk.py --probe
    timeout 70 python3 benchmarks/kernels/bench_topk.py --config '{"coop_programs": 0}' \
      --cases 1x262144x512,2x262144x512,4x262144x512,1x65536x1024
    timeout 60 python3 benchmarks/kernels/bench_topk.py --cases 1x262144x512 --sweep \
      --knobs '[{"coop_cap": 16}, {"coop_cap": 64}, {"coop_programs": 0}]'; } > "$OUT/bench_topk_final.txt" 2>&1
  grep -v "^{" "$OUT/bench_topk_final.txt" | grep -vE "^(sweep B|probe)"; grep -E "^(probe|sweep B)" "$OUT/bench_topk_final.txt"
  timeout 150 python3 benchmarks/kernels/bench_index_scores.py --configs 64/4/2/1,64/4/2/4 \
    > "$OUT/bench_index_scores_final.txt" 2>&1
  grep -v "^{" "$OUT/bench_index_scores_final.txt"; grep -o '"configs_us": {[^}]*}' "$OUT/bench_index_scores_final.txt"
elif [ "$PART" = last ]; then
  timeout 330 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_topk_coop.py \
    tests/kernels/test_engine_triton_backend.py > "$OUT/gpu_tests_last.txt" 2>&1
  grep -E "passed|failed|Error" "$OUT/gpu_tests_last.txt" | tail -4; grep -E "^FAILED" "$OUT/gpu_tests_last.txt" | head -5
  timeout 150 python3 benchmarks/kernels/bench_compressor.py --only "c4-indexer decode" --batches 4096,8192,16384 \
    --configs 8/4/2/4 --out "$OUT/bench_compressor_batches.json" > "$OUT/bench_compressor_batches.txt" 2>&1
  grep -v "^{" "$OUT/bench_compressor_batches.txt"; grep -o '"target": {[^}]*}[^}]*}' "$OUT/bench_compressor_batches.txt"
fi
