# MTP speculative decoding on one H200 (issue 19): GPU tests, dsv4-tiny decode speed with and
# without speculation (bf16; fp32 agreement), flash-4l verify-step cost. Run from the repo root
# by the device tool; logs and JSON under $OUT.
export PYTHONPATH=$PWD/src
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python -c "import torch, triton; print(torch.__version__, triton.__version__)"
timeout 150 python -m pytest -q -m gpu tests/engine/test_spec_decode.py \
  tests/kernels/test_sparse_attention_triton.py -k "spec or captured or pv_terms" \
  > $OUT/spec_tests.log 2>&1; tail -3 $OUT/spec_tests.log
B="python benchmarks/spec_decode.py --device cuda --kernel-backend triton"
timeout 200 $B --dtype bfloat16 --batches 1,8,32 --output-len 64 --out $OUT/spec_tiny_bf16.json \
  > $OUT/spec_tiny_bf16.log 2>&1; grep -v "INFO\|^{" $OUT/spec_tiny_bf16.log | tail -5
timeout 120 $B --dtype float32 --batches 8 --output-len 32 --out $OUT/spec_tiny_fp32.json \
  > $OUT/spec_tiny_fp32.log 2>&1; grep -v "INFO\|^{" $OUT/spec_tiny_fp32.log | tail -3
timeout 240 $B --dtype bfloat16 --preset flash-4l --batches 1,32 --steps 20 \
  --out $OUT/spec_flash4l.json > $OUT/spec_flash4l.log 2>&1
grep -v "INFO\|^{" $OUT/spec_flash4l.log | tail -4
