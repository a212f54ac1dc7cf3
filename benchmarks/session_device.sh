# One device call for the session's GPU checks (issues 19-20): the CUDA-default and engine GPU
# tests, then dsv4-tiny speculative decoding in bf16 (free-running and teacher-forced agreement).
export PYTHONPATH=$PWD/src
timeout 200 python -m pytest -q -m gpu tests/engine/test_engine_gpu.py tests/engine/test_spec_decode.py \
  tests/engine/test_cuda_graph.py > $OUT/gpu_tests.log 2>&1; tail -4 $OUT/gpu_tests.log
timeout 200 python benchmarks/spec_decode.py --device cuda --kernel-backend triton --dtype bfloat16 \
  --batches 1,8,32 --output-len 64 --out $OUT/spec_tiny_bf16.json > $OUT/spec_tiny_bf16.log 2>&1
grep -v "INFO\|^{" $OUT/spec_tiny_bf16.log | tail -4
