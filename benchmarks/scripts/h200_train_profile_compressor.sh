export PYTHONPATH=src PYTHONUNBUFFERED=1
timeout 200 python3 benchmarks/profile_train_step.py --data .data/tiny --device cuda --batch-size 16 --rows 40 > $OUT/profile_train.txt 2>&1
grep -E "ms/step" $OUT/profile_train.txt
timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/kernels/test_compressor_triton.py > $OUT/compressor_gpu_tests.txt 2>&1; tail -5 $OUT/compressor_gpu_tests.txt
timeout 200 python3 benchmarks/kernels/bench_compressor.py --out $OUT/bench_compressor.json > $OUT/bench_compressor.txt 2>&1; tail -30 $OUT/bench_compressor.txt
