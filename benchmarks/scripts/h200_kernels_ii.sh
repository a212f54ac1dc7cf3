#!/usr/bin/env bash
# Device calls for issue 7 (hybrid sparse attention, quantised MoE, fused mHC, all registered in the `triton`
# backend). Usage (device, repo root; transformers 5.23 wheel carried in .wheels for the peer):
#   PART=check bash benchmarks/scripts/h200_kernels_ii.sh   compiled parity (-m gpu), the engine with the triton
#                                                           backend vs ref (tiny fp32, flash-4l bf16 256 tokens),
#                                                           decode vs context at batch 1 with the transformers peer
#   PART=final bash benchmarks/scripts/h200_kernels_ii.sh   prefix-cache TTFT (issue 4) with the triton backend,
#                                                           engine checks (FP4 experts, noise floor), decode
#                                                           throughput at batch 8/32/128
#   PART=bench bash benchmarks/scripts/h200_kernels_ii.sh   the kernel benchmarks
source "$(dirname "$0")/device_env.sh"
LOG="$OUT/$PART.log"
if [ "$PART" = check ]; then
  timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu tests/kernels/test_sparse_attention_triton.py \
    tests/kernels/test_mhc_triton.py tests/kernels/test_moe_quant.py > "$OUT/gpu_tests.txt" 2>&1
  timeout 60 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_engine_triton_backend.py >> "$OUT/gpu_tests.txt" 2>&1
  grep -E "passed|failed|Error" "$OUT/gpu_tests.txt" | tail -8
  timeout 60 python3 benchmarks/engine_backend_check.py --preset tiny --device cuda --dtype float32 --prompt-len 1500 \
    --num-prompts 2 --max-tokens 64 > "$OUT/engine_check_tiny.txt" 2>&1; tail -3 "$OUT/engine_check_tiny.txt"
  timeout 170 python3 benchmarks/engine_backend_check.py --preset flash-4l --device cuda --dtype bfloat16 \
    --prompt-len 3000 --num-prompts 4 --max-tokens 256 > "$OUT/engine_check_flash4l.txt" 2>&1
  tail -3 "$OUT/engine_check_flash4l.txt"
  timeout 200 python3 benchmarks/decode_context_sweep.py --device cuda --dtype bfloat16 --preset flash-4l \
    --kernel-backend triton --batches "" --hf --plot "$OUT/decode_b1.png" --out "$OUT/decode_b1.json" \
    > "$OUT/decode_b1.txt" 2>&1; grep -v "^{" "$OUT/decode_b1.txt" | tail -14
elif [ "$PART" = final ]; then   # after the fp32 MoE-dot fix: checks, issue-4 TTFT, throughput rows
  timeout 170 python3 benchmarks/prefix_cache.py --preset flash-4l --device cuda --dtype bfloat16 --kernel-backend triton \
    --system-len 1024 --user-len 256 --output-len 32 --page-size 128 --chunked-prefill-size 8192 \
    > "$OUT/prefix_cache.txt" 2>&1; tail -4 "$OUT/prefix_cache.txt"
  timeout 60 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_moe_quant.py -k "not flash" \
    tests/kernels/test_engine_triton_backend.py > "$OUT/gpu_tests.txt" 2>&1; tail -2 "$OUT/gpu_tests.txt"
  timeout 40 python3 benchmarks/engine_backend_check.py --preset tiny --device cuda --dtype float32 --prompt-len 1500 \
    --num-prompts 2 --max-tokens 64 > "$OUT/engine_check_tiny.txt" 2>&1; tail -3 "$OUT/engine_check_tiny.txt"
  timeout 150 python3 benchmarks/engine_backend_check.py --preset flash-4l --device cuda --dtype bfloat16 \
    --prompt-len 3000 --num-prompts 2 --max-tokens 128 --weight-format checkpoint --noise-floor \
    > "$OUT/engine_check_flash4l.txt" 2>&1; tail -4 "$OUT/engine_check_flash4l.txt"
  timeout 130 python3 benchmarks/decode_context_sweep.py --device cuda --dtype bfloat16 --preset flash-4l \
    --kernel-backend triton --contexts 4096,32768 --batches 8,32,128 --steps 8 --plot "$OUT/decode_batch.png" \
    --out "$OUT/decode_batch.json" > "$OUT/decode_batch.txt" 2>&1; grep -v "^{" "$OUT/decode_batch.txt" | tail -12
else
  timeout 100 python3 benchmarks/kernels/bench_sparse_attention.py --out "$OUT/bench_sparse_attention.json" \
    > "$OUT/bench_sparse_attention.txt" 2>&1; grep -v "^{" "$OUT/bench_sparse_attention.txt" | tail -12
  timeout 60 python3 benchmarks/kernels/bench_mhc.py --out "$OUT/bench_mhc.json" > "$OUT/bench_mhc.txt" 2>&1
  grep -v "^{" "$OUT/bench_mhc.txt" | tail -12
  timeout 90 python3 benchmarks/kernels/bench_moe_quant.py --out "$OUT/bench_moe_quant.json" \
    > "$OUT/bench_moe_quant.txt" 2>&1; grep -v "^{" "$OUT/bench_moe_quant.txt" | tail -12
fi
