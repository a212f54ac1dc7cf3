#!/usr/bin/env bash
# Device calls for the CUDA-graph decode path (issue 7's 5x target) and Lightning TopK II (issue 6).
# Usage (device, repo root; transformers 5.23 wheel carried in .wheels for the peer):
#   PART=check bash benchmarks/scripts/h200_graphs.sh   GPU tests (graphs, fused norms, engine backend), the
#                                                       engine check with graphs, decode vs context
#                                                       at batch 1 with the transformers peer
#   PART=kernels bash benchmarks/scripts/h200_graphs.sh GPU parity + benchmarks of Lightning TopK and the FP4 MoE
#   PART=batch bash benchmarks/scripts/h200_graphs.sh   decode throughput at batch 8/32/128 (4K, 32K) with graphs,
#                                                       the GPU tests again, the flash-4l engine check, the MoE benchmark
source "$(dirname "$0")/device_env.sh"
if [ "$PART" = check ]; then
  timeout 170 python3 -m pytest -q -p no:cacheprovider -x tests/engine/test_cuda_graph.py tests/kernels/test_rope_norm.py \
    tests/kernels/test_engine_triton_backend.py > "$OUT/gpu_tests.txt" 2>&1
  grep -E "passed|failed|Error" "$OUT/gpu_tests.txt" | tail -6
  timeout 50 python3 benchmarks/engine_backend_check.py --preset tiny --device cuda --dtype float32 --prompt-len 1500 \
    --num-prompts 2 --max-tokens 64 > "$OUT/engine_check_tiny.txt" 2>&1; tail -3 "$OUT/engine_check_tiny.txt"
  timeout 250 python3 benchmarks/decode_context_sweep.py --device cuda --dtype bfloat16 --preset flash-4l \
    --kernel-backend triton --batches "" --hf --plot "$OUT/decode_b1.png" --out "$OUT/decode_b1.json" \
    > "$OUT/decode_b1.txt" 2>&1; grep -v "^{" "$OUT/decode_b1.txt" | tail -14
elif [ "$PART" = kernels ]; then   # Lightning TopK II and the nibble-split FP4 MoE: GPU parity, then benchmarks
  timeout 240 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_topk.py tests/kernels/test_moe_quant.py \
    tests/kernels/test_engine_triton_backend.py > "$OUT/gpu_tests_kernels.txt" 2>&1
  grep -E "passed|failed|Error" "$OUT/gpu_tests_kernels.txt" | tail -6
  timeout 70 python3 benchmarks/kernels/bench_topk.py > "$OUT/bench_topk.txt" 2>&1
  grep -v "^{" "$OUT/bench_topk.txt" | tail -12
  timeout 110 python3 benchmarks/kernels/bench_moe_quant.py --out "$OUT/bench_moe_quant.json" \
    > "$OUT/bench_moe_quant.txt" 2>&1; grep -v "^{" "$OUT/bench_moe_quant.txt" | tail -20
else
  timeout 100 python3 -m pytest -q -p no:cacheprovider tests/engine/test_cuda_graph.py tests/kernels/test_rope_norm.py \
    tests/kernels/test_engine_triton_backend.py > "$OUT/gpu_tests.txt" 2>&1
  grep -E "passed|failed|Error" "$OUT/gpu_tests.txt" | tail -6
  timeout 200 python3 benchmarks/decode_context_sweep.py --device cuda --dtype bfloat16 --preset flash-4l \
    --kernel-backend triton --contexts 4096,32768 --batches 8,32,128 --steps 16 --plot "$OUT/decode_batch.png" \
    --out "$OUT/decode_batch.json" > "$OUT/decode_batch.txt" 2>&1; grep -v "^{" "$OUT/decode_batch.txt" | tail -12
  timeout 120 python3 benchmarks/engine_backend_check.py --preset flash-4l --device cuda --dtype bfloat16 \
    --prompt-len 3000 --num-prompts 2 --max-tokens 128 > "$OUT/engine_check_flash4l.txt" 2>&1
  tail -4 "$OUT/engine_check_flash4l.txt"
  timeout 100 python3 benchmarks/kernels/bench_moe_quant.py --out "$OUT/bench_moe_quant.json" \
    > "$OUT/bench_moe_quant.txt" 2>&1; grep -v "^{" "$OUT/bench_moe_quant.txt" | tail -12
fi
