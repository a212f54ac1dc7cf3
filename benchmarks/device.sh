#!/usr/bin/env bash
# One script for every GPU-machine call: `bash benchmarks/device.sh PART [PART ...]` from the repo root.
#
#   gpu-tests     the `gpu`-marked tests (kernel parity at real shapes, CUDA graphs vs eager) and the triton
#                 engine backend vs ref (compiled kernels here, the interpreter on CI); the rest of the suite
#                 is CI's: log gpu_tests.txt. TESTS="tests/kernels/test_topk.py ..." runs those files instead
#                 (every test in them, on CUDA)
#   kernels       every kernel benchmark (benchmarks/kernels/bench_*.py at their default shapes): one log each
#                 (bench_<name>.txt, + bench_<name>.json where the script writes one), table then JSON line.
#                 KERNELS="topk compressor" runs those only; BENCH_ARGS="--sweep" (or --probe, --configs ...)
#                 is passed to each, each under BENCH_TIMEOUT_S (150; a --sweep takes up to ~400)
#   decode        decode ms/token vs context at batch 1 and tokens/s at batch 8/32/128 on flash-4l bf16 (triton,
#                 CUDA graphs) against the HBM floor: decode.txt / decode.json / decode.png. DECODE_ARGS is added
#                 (e.g. "--overlap-schedule")
#   decode-hf     decode ms/token at batch 1, 4K-128K, against transformers eager on the same weights (the peer;
#                 needs the pinned transformers wheel in .wheels): decode_hf.txt / .json / .png
#   engine        the triton backend against ref on one model (engine_backend_check.py, tiny fp32 and flash-4l
#                 bf16) and a profile of flash-4l decode steps: engine_check_*.txt, profile_engine_step.txt.
#                 ENGINE_ARGS is added to the flash-4l check (e.g. "--noise-floor", "--weight-format
#                 checkpoint", or "--dtype float32 --weight-format checkpoint --shared-weights")
#   prefix-cache  TTFT with the prefix cache on vs off, multi-turn chat on flash-4l bf16 (triton):
#                 prefix_cache.txt
#   serving       issue 20 in one call: 32 copies of one 4K prompt at batch 32 with default settings, and
#                 32 distinct 4K prompts run twice (prefix_repeat.py, flash-4l), the first 128K request in a fresh process against a warm one
#                 (cold_start.py, empty Triton cache, warmup fast), overlap scheduling on vs off (dsv4-tiny):
#                 serving_{prefix,cold,overlap}.txt / .json
#   http          benchmarks/serving.py against `dsv4 serve` on flash-4l (random weights built in memory:
#                 --load-format dummy), 4K-token prompts, 256 output tokens, concurrency 1, 8, 32, 128: TTFT,
#                 TPOT, ITL p50/p99, tok/s, and the server against offline LLM.generate: http.txt
#   profile       where a decode step's GPU time goes under CUDA graphs: flash-4l bf16 (triton), 4K context, batch
#                 1 and 32: the top kernels by GPU time, kernels and GPU ms per step: profile_b{1,32}.txt
#   transient     the post-prefill slowdown of long-context decode (issue 20's 900K line): flash-4l bf16 batch 1
#                 at 4K and 900K (4,096-token prefill chunks) timed right after the prefill and after a 3 s pause,
#                 each step's device ms, host ms and host ms blocked on the device (--step-times); then a trace
#                 of three 128K decode steps right after their prefill, read by trace_gaps.py:
#                 transient_settle{0,3}.json, transient_trace_gaps.txt (INDEX_CACHE_DTYPE=model|fp8: the sweeps
#                 with those indexer keys; unset: the engine default)
#   drift         the 900K slow state against the GPU's temperatures and clocks: nvidia-smi every 50 ms
#                 (smi.csv: SM / HBM temperature, clocks, power, clock-event reasons) beside three one-engine
#                 runs (4K and 900K, 6 phases of 32 steps each): 900K first then 4K (--order desc), and 4K
#                 first without overlap scheduling and without multi-stream: drift_{desc,no_overlap,
#                 no_ms}.json; the phases carry unix start times to align with smi.csv
#   train         a profile of `dsv4 train run` steps (needs data carried at .data/tiny: `dsv4 train data`):
#                 profile_train_step.txt
#   train-tiny    one training stage of dsv4-tiny (`dsv4 train run` + export; data at .data/tiny): STEPS=N
#                 required; BATCH (16), LR (2e-3), WARMUP (200), QAT_START (0.8), INIT (an earlier export),
#                 COMPILE=1 (per-block torch.compile), TIME_LIMIT_S (540). Returns train.log, metrics.jsonl,
#                 loss.png, the model shards and model_meta.tar: run it alone
#   hisparse      issue 25 in one call: the HiSparse GPU tests (UVA copies in a graph, engine on vs off through the
#                 captured decode graphs, fp32), the copy benchmark (mirror on the device and pinned), then
#                 hisparse.py on flash-43l-e16 (40 GB KV, 200K + 2K, --fill shared-prefix; concurrency 1 and 16 in
#                 both modes, for TPOT at equal load, and each mode's admitted count; the step's GPU time by
#                 kernel family at every level: --profile-steps 4): hisparse_tests.txt,
#                 bench_hisparse_swap.txt / .json, bench_hot_plan.txt / .json (the plan kernel), hisparse.txt.
#                 HISPARSE_ARGS is added to hisparse.py
#   hisparse-trace  issue 25's one-request step on flash-43l-e16 (32K context) with HiSparse off and on: torch.profiler
#                 tables (prof_hisparse_{off,on}.txt) and, with it on, a Chrome trace of 3 decode steps read by
#                 trace_gaps.py (the two streams' busy and idle time, the largest gaps: hisparse_trace_gaps.txt);
#                 then hisparse.py at concurrency 1 and 16 in both modes (hisparse.txt) for TPOT
#   w8a8          issue 21's FP8-tensor-core loops in one call: their GPU tests (act_quant bit-equality, the
#                 W8A8 experts FP8 / FP4 and the W8A8 linear against their references: w8a8_tests.txt), the
#                 experts at N 2048 / 8192 with the prefill sweep, w8a8 beside the bf16-MMA "scaled" loop
#                 (w8a8_moe_{fp8,fp4}.txt / .json, with each kernel's us), the linears at M 512 / 2048 / 8192
#                 (w8a8_linear.txt / .json: weight-only, bf16 and W8A8)
#   checkpoint    issue 21's end-to-end line in one call: the GPU tests of the checkpoint-format kernels
#                 (FP8 linear and its SwiGLU mode, the project op on bf16 weights: checkpoint_tests.txt), the
#                 FP8 linear at M 1 / 2 / 4 with the SwiGLU rows (checkpoint_fp8_linear.json), flash-4l
#                 decode at batch 1 and 32 (4K) in bf16 and in checkpoint precision, each in its own process
#                 (checkpoint_decode_{bf16,checkpoint}.json), and profiles of the batch-1 step in both formats
#                 ({checkpoint,bf16}_profile.txt) with their traces read by trace_gaps.py (each stream's busy
#                 time, the idle gaps: checkpoint_trace_gaps.txt)
#   pdl-ab        PDL's EARLY mode (the next kernel's programs scheduled while a kernel runs) for the
#                 small decode graphs only (--pdl-early-max-batch 8) against none (0): flash-4l decode at
#                 batch 1 and 32 (4K) in checkpoint precision, twice each in turn
#                 (pdl_checkpoint_e{0,8}_{a,b}.json), bf16 with 8 (pdl_bf16_e8_a.json); then the checkpoint
#                 batch-1 step's profile with 0 and its trace read by trace_gaps.py (each stream's busy
#                 time, the gaps: pdl_profile.txt, pdl_trace_gaps.txt)
#   fixed-costs   the 29th session's batch-1 kernels in one call: bench_mhc.py post_pre (the decode op) with
#                 the finish's post / comb programs apart and together (fixed_mhc.json), the top-k row
#                 path at 1,024-4,096 keys (its early stop: fixed_topk.txt), then the GPU tests of the
#                 kernels PDL launches (top-k, sparse attention, mHC, RoPE / norms, FP8 linear, GEMV, the
#                 PDL chain and graph buckets: fixed_tests.txt); step-ab has the decode runs
#   step-ab       the shortest call over the 29th / 30th sessions' batch-1 work: flash-4l decode at batch
#                 1 / 32 (4K) in turn, each format with PDL's EARLY mode off (0) and at the default (<= 8)
#                 (step_decode.txt); the GPU tests of those changes (step_tests.txt); the checkpoint
#                 batch-1 profile, EARLY <= 8 (step_profile.txt)
#   frag-stream   the frag loop's weights skipping L1 (plan_moe's stream_weights) against the default, in turn,
#                 FP4 and FP8 at STREAM_TOKENS (1,2,8: its one-slot programs), after test_moe_frag.py and
#                 test_moe_tile_map.py -m gpu and bench_moe_tile_map.py: frag_stream.txt,
#                 frag_stream_<run>.json, tile_map.json
#   fp8-frag      the FP8 routed experts' frag loop (the default at N*k < E / 2) against "scaled" at N = 1 / 8 /
#                 16 / 32 with the kernels' times, the FP8 linears' FMA tile at 3 / 4 pipeline stages and
#                 the frag path at M = 1 (bench_fp8_linear.py --stage-sweep), test_moe_frag.py -m gpu
#                 (fp8_frag.txt)
#   pdl-auto      flash-4l decode batch 1 / 4K at the engine's default PDL buckets (EARLY <= 8 with FP8
#                 linears, none in bf16), checkpoint and bf16 twice in turn (pdl_auto.txt); the FP8 linear's
#                 FMA tile at 3 / 4 stages (bench_fp8_linear.py --stage-sweep --m 1: fp8_stages.txt); the
#                 PDL tests on the GPU (pdl_tests.txt)
#   crit          flash-4l batch 1 / 4K: checkpoint and bf16 at the engine default (crit_decode.txt), then a
#                 traced profile of each read by trace_gaps.py (per-stream sums, idle gaps: both in
#                 crit_profile_<fmt>.txt; the trace: trace_<fmt>.json.gz); the PDL tests (pdl_tests.txt).
#                 CRIT_FORMATS (default "checkpoint bf16"), CRIT_DECODE_ARGS (added to the decode runs),
#                 CRIT_TESTS= (empty: no PDL tests)
#   shared-join   flash-4l checkpoint decode with the shared expert beside the routed experts up to a batch bound
#                 (--shared-expert-beside-max-tokens 8) or never (0), batch 1 / 4K in turn with bf16 at its
#                 default, then batch 8 and the default at batch 32 (4K);
#                 the GPU tests of test_multi_stream.py and test_moe_combine.py: shared_join*.txt. SJ_RUNS
#                 ("format:beside:batch ..."), SJ_TESTS= (empty: no tests)
#   tree-ab       this tree against commit TREE_AB_BASE (default the parent of HEAD; `git archive` into
#                 /tmp/tree_ab_base): flash-4l batch 1 / 4K, one process per run, 64 timed steps with
#                 --step-times, TREE_AB_RUNS ("tree:format ...", tree new or base; default checkpoint and
#                 bf16 pairs): ms per step, the steps' p50 / p90 / max and the host's own ms per step
#                 (p50, max): tree_ab.txt
#   prefill-check the prefill paths of the compressor projections, FP8 linears and quantised experts:
#                 their GPU tests (test_project_gemv, test_fp8_linear, test_dequant_triton:
#                 prefill_check_tests.txt), bench_fp8_linear.py at M 512 / 2048 / 8192 (the weight's
#                 decode + F.linear, the tiles pinned beside it), bench_moe_prefill.py, then
#                 prefill-profile (PP_FORMATS; ~6 min with one format)
#   moe-chunks    the quantised experts at prefill through decoded bf16 chunks (moe_dequant.py): its
#                 GPU tests and test_moe_quant's V4-Flash rows / prefill tiles (moe_chunks_tests.txt),
#                 bench_moe_prefill.py at N 2048 / 4096 / 8192 with chunks of 16 / 32 / 64 / E, then
#                 prefill-profile (PP_FORMATS, default checkpoint)
#   prefill-stall the ~100 s batch-32 / 4K checkpoint prefill after the engine's warmup (37th session;
#                 38th: one ~90 s compile of the mHC finish): decode_context_sweep.py with --engine-warmup
#                 fast, --prefill-step-times, --compile-times (the slowest Triton builds and their
#                 constexprs) and --stack-dump-s 10 in a fresh TRITON_CACHE_DIR, checkpoint then bf16 (stall_<fmt>.json,
#                 stall_<fmt>.txt: the stacks); first the GPU tests of the gate's prefill GEMM and the
#                 decoded chunks (stall_tests.txt)
#   prefill-cold  flash-4l batch 32 / 4K (the sweep's protocol: the prefill steps include the early requests'
#                 decode steps), PC_FORMATS (default "checkpoint bf16"), each twice in a fresh Triton cache
#                 directory of its own: prefill seconds cold and warm, ms per step, and the kernels compiled
#                 (cache entries per kernel name): prefill_cold.txt
#   prefill-profile  flash-4l prefill, PP_FORMATS (default "checkpoint bf16"): profile_engine_step.py on
#                 2 x 8K prompts (two 8K-token chunks profiled after a warm batch of the same shapes), the
#                 top kernels by GPU time and the warm batch's seconds (kernel compiles included):
#                 prefill_<fmt>.txt
#   multi         issue 22 on a 2-GPU kind (nvidia-h200-x2 / nvidia-h100-x2): the multi_gpu tests (fp32
#                 tiny under TP 2, TP 2 + EP 2, DP 2 + EP 2 against one GPU; a weight update; dummy weights
#                 per rank: multi_tests.txt), then benchmarks/parallel_decode.py on flash-4l (MULTI_FORMAT,
#                 default bf16) at layouts MULTI_LAYOUTS (default "1 tp2 tp2-ep2", one process each)
#                 and points MULTI_POINTS (default "1:4096,32:4096,128:32768"): ms per step, collective
#                 ms per step, teacher-forced agreement against the first layout, rank 0's memory
#                 against the plan (multi_decode_<layout>.json); MULTI_TESTS= skips the tests
#   multi-flash   the full V4-Flash geometry (in-memory, checkpoint precision) on 2+ GPUs: decode at
#                 FLASH_POINTS (default "1:4096,32:4096,1:131072") with FLASH_LAYOUT (default tp2-ep2):
#                 multi_flash.json
#   multi-sync    issue 24's weight sync on 2 GPUs: benchmarks/weight_sync.py on flash-4l bf16, disaggregated
#                 (NCCL buckets of SYNC_BUCKET_MB, default 512, trainer GPU 0 -> engine GPU 1) and colocated
#                 (in place, chunks): multi_sync.json
#   per-layer     issue 21's per-layer decode of the full V4-Flash geometry on one GPU: the first L layers of
#                 its schedule (decode_context_sweep.py --preset flash --num-layers L, checkpoint precision,
#                 batch 1 and 32 at 4K), one process per L in LAYERS (default "8 16"; an H200 holds 24+):
#                 per_layer_L<L>.json; the slope between two L is the per-layer time
#   after-warmup  the Triton builds a served workload still meets after the fast warmup: one engine sized
#                 for every point (--one-engine, batches 8 / 32 at 4K and 32K) in a fresh Triton cache, each
#                 build after the warmup with its constexprs and key (builds_after_warmup) per format in
#                 AW_FORMATS (default "bf16 checkpoint"): after_warmup_<fmt>.json
#   index-fp8     index_cache_dtype "model" against "fp8" at batch-1 decode, 4K and 900K, alternating
#                 formats run by run (model, fp8, model, fp8: the device's slow state after a long prefill
#                 varies by process), checkpoint precision on an H100 (bf16 does not fit 900K there), bf16
#                 on an H200 (IF_FORMAT overrides): decode_context_sweep.py --phases 3 --step-times per run,
#                 index_fp8_<run>.json (IF_RUNS="1": one run of each)
#   line          issue 20's 900K line as its protocol measures it: one engine for 4K and 900K (--one-engine,
#                 4,096-token prefill chunks, settle 0), batch 1, 6 phases of 32 steps with each step's device
#                 time (--step-times): line_<fmt>.json. bf16 on an H200, checkpoint precision on an H100 (bf16
#                 900K does not fit there; LINE_FORMAT overrides); INDEX_CACHE_DTYPE=model|fp8 (unset: the
#                 engine default); LINE_TIMEOUT_S (240)
#   long-attn     the split-KV attention at batch-1 decode (issue 20's 900K line): its GPU tests (64 splits,
#                 900K), then bench_sparse_attention.py --sweep on the 900K C128 list, the 128K list and the
#                 C4 picks at batch 1: long_attn_tests.txt, long_attn.json
#   sass          compile the Triton kernels for sm_90 ahead of time and count their SASS instructions, loads,
#                 registers (benchmarks/aot_compile_sm90.py; needs no GPU): sass.txt
#
# The flash-4l decode runs of pdl-ab, step-ab and fixed-costs stop after DECODE_TIMEOUT_S (default 240 s:
# a fresh machine's first run builds the model and compiles every kernel; 90 s was too short).
# Every part writes its logs under $OUT (at most 8 files come back from one call: run few parts per call)
# and env.txt (GPU, driver, torch / triton / transformers versions, commit). The device has no registry:
# wheels carried in .wheels/ (e.g. the transformers version pyproject pins) are installed first.
# Results worth keeping go into a dated report under benchmarks/results/ (benchmarks/README.md).
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
if ls .wheels/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .wheels/*.whl
  export PYTHONPATH=src:/tmp/site
else
  export PYTHONPATH=src
fi

env_info() {
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
  python3 -c "import transformers; print('transformers', transformers.__version__)" 2>/dev/null
  git rev-parse --short HEAD 2>/dev/null || echo "commit: unknown (no git metadata)"
}

summary() {   # the pytest / benchmark lines worth reading in the call's output
  grep -E "passed|failed|error|Error|^FAILED" "$1" | tail -8
}

gpu_tests() {   # (test_hf_parity and the server tests are CI's: the device lacks their pinned packages)
  if [ -n "${TESTS:-}" ]; then
    # shellcheck disable=SC2086  # TESTS is a list of paths
    timeout 540 python3 -m pytest -q -p no:cacheprovider -rs --durations=15 $TESTS > "$OUT/gpu_tests.txt" 2>&1
    summary "$OUT/gpu_tests.txt"
    return
  fi
  { timeout 420 python3 -m pytest -q -p no:cacheprovider -rs -m gpu --durations=15 tests \
      --ignore=tests/model/test_hf_parity.py --ignore=tests/server
    timeout 120 python3 -m pytest -q -p no:cacheprovider -rs tests/kernels/test_engine_triton_backend.py
  } > "$OUT/gpu_tests.txt" 2>&1
  summary "$OUT/gpu_tests.txt"
}

kernels() {
  for script in benchmarks/kernels/bench_*.py; do
    name=$(basename "$script" .py)
    [ "$name" = bench_common ] && continue   # the shared helper, not a benchmark
    if [ -n "${KERNELS:-}" ] && ! [[ " ${KERNELS//,/ } " == *" ${name#bench_} "* ]]; then continue; fi
    args=()
    if grep -q -e 'base_parser(' -e '"--out"' "$script"; then args=(--out "$OUT/$name.json"); fi
    # shellcheck disable=SC2086  # BENCH_ARGS is a list of flags
    timeout "${BENCH_TIMEOUT_S:-150}" python3 "$script" "${args[@]}" ${BENCH_ARGS:-} > "$OUT/$name.txt" 2>&1
    echo "== $name (exit $?)"; grep -v "^{" "$OUT/$name.txt" | tail -6
  done
}

decode() {
  # shellcheck disable=SC2086  # DECODE_ARGS is a list of flags
  timeout 400 python3 benchmarks/decode_context_sweep.py --device cuda --dtype bfloat16 --preset flash-4l \
    --kernel-backend triton --contexts 4096,131072 --batches 8,32,128 --plot "$OUT/decode.png" \
    --out "$OUT/decode.json" ${DECODE_ARGS:-} > "$OUT/decode.txt" 2>&1
  grep -v "^{" "$OUT/decode.txt" | tail -14
}

decode_hf() {   # batch 1 only, every default context (4K, 16K, 64K, 128K); the peer OOMs past 4K on one H200
  timeout 300 python3 benchmarks/decode_context_sweep.py --device cuda --dtype bfloat16 --preset flash-4l \
    --kernel-backend triton --batches "" --hf --plot "$OUT/decode_hf.png" --out "$OUT/decode_hf.json" \
    > "$OUT/decode_hf.txt" 2>&1
  grep -v "^{" "$OUT/decode_hf.txt" | tail -14
}

engine() {
  timeout 120 python3 benchmarks/engine_backend_check.py --preset tiny --device cuda --dtype float32 \
    --prompt-len 1500 --num-prompts 2 --max-tokens 64 > "$OUT/engine_check_tiny.txt" 2>&1
  tail -3 "$OUT/engine_check_tiny.txt"
  # shellcheck disable=SC2086  # ENGINE_ARGS is a list of flags
  timeout 200 python3 benchmarks/engine_backend_check.py --preset flash-4l --device cuda --dtype bfloat16 \
    --prompt-len 3000 --num-prompts 2 --max-tokens 128 ${ENGINE_ARGS:-} > "$OUT/engine_check_flash4l.txt" 2>&1
  tail -3 "$OUT/engine_check_flash4l.txt"
  timeout 150 python3 benchmarks/profile_engine_step.py --preset flash-4l --device cuda --dtype bfloat16 \
    --kernel-backend triton --num-prompts 1 --prompt-len 4096 --warm-steps 2 --steps 4 \
    > "$OUT/profile_engine_step.txt" 2>&1
  tail -2 "$OUT/profile_engine_step.txt"
}

prefix_cache() {   # the workload of prefix_cache_h200_202611.md's runs 3-4 (32 conversations x 8 turns)
  timeout 400 python3 benchmarks/prefix_cache.py --preset flash-4l --device cuda --dtype bfloat16 \
    --kernel-backend triton --conversations 32 --turns 8 --system-len 1024 --user-len 256 --output-len 32 \
    --page-size 128 --chunked-prefill-size 8192 > "$OUT/prefix_cache.txt" 2>&1
  grep -v " INFO " "$OUT/prefix_cache.txt" | tail -4
}

serving() {
  timeout 150 python3 benchmarks/prefix_repeat.py --preset flash-4l --device cuda \
    --out "$OUT/serving_prefix.json" > "$OUT/serving_prefix.txt" 2>&1
  timeout 200 python3 benchmarks/prefix_repeat.py --preset flash-4l --device cuda --distinct \
    >> "$OUT/serving_prefix.txt" 2>&1
  grep -v " INFO " "$OUT/serving_prefix.txt" | grep "^reuse"
  timeout 240 python3 benchmarks/cold_start.py --device cuda --prompt-len 131072 --fresh-triton-cache \
    --out "$OUT/serving_cold.json" > "$OUT/serving_cold.txt" 2>&1
  grep -v " INFO " "$OUT/serving_cold.txt" | tail -3 | cut -c 1-300
  timeout 150 python3 benchmarks/overlap_schedule.py --device cuda --batches 1,8,32,128 \
    --out "$OUT/serving_overlap.json" > "$OUT/serving_overlap.txt" 2>&1
  grep -v " INFO " "$OUT/serving_overlap.txt" | tail -6 | cut -c 1-200
}

http() {
  python3 -m dsv4 init --preset flash-4l --out /tmp/flash-4l --no-weights > "$OUT/http.txt" 2>&1
  timeout 560 python3 benchmarks/serving.py --model /tmp/flash-4l --load-format dummy --device cuda \
    --concurrency 1,8,32,128 --min-prompt 4096 --max-prompt 4096 --output-len 256 --num-requests 128 \
    --repeats 2 --warmup-pass --plot "$OUT/http.png" --server-log "$OUT/http_server.txt" >> "$OUT/http.txt" 2>&1
  grep -v " INFO " "$OUT/http.txt" | tail -8 | cut -c 1-600
}

profile() {
  for b in 1 32; do
    timeout 200 python3 benchmarks/profile_engine_step.py --preset flash-4l --device cuda --dtype bfloat16 \
      --kernel-backend triton --num-prompts "$b" --prompt-len 4096 --decode-only --warm-steps 3 --steps 5 \
      --rows 45 \
      > "$OUT/profile_b$b.txt" 2>&1
    tail -1 "$OUT/profile_b$b.txt" | cut -c 1-400
  done
}

transient() {
  for s in 0 3; do
    timeout 150 python3 benchmarks/decode_context_sweep.py --device cuda --dtype bfloat16 --preset flash-4l \
      --kernel-backend triton --contexts 4096,921600 --batches "" --chunked-prefill-size 4096 --step-times \
      --settle-s "$s" ${INDEX_CACHE_DTYPE:+--index-cache-dtype "$INDEX_CACHE_DTYPE"} \
      --out "$OUT/transient_settle$s.json" > "$OUT/transient_settle$s.txt" 2>&1
    grep -v "^{" "$OUT/transient_settle$s.txt" | tail -3
  done
  timeout 120 python3 benchmarks/profile_engine_step.py --preset flash-4l --device cuda --dtype bfloat16 \
    --kernel-backend triton --num-prompts 1 --prompt-len 131072 --decode-only --warm-steps 0 --steps 3 \
    --rows 20 --trace /tmp/transient_trace.json > "$OUT/transient_profile.txt" 2>&1
  python3 benchmarks/trace_gaps.py /tmp/transient_trace.json --top 15 > "$OUT/transient_trace_gaps.txt" 2>&1
  grep -E "^step" "$OUT/transient_trace_gaps.txt"
}

drift() {
  nvidia-smi --query-gpu=timestamp,temperature.gpu,temperature.memory,clocks.sm,clocks.mem,power.draw,\
clocks_event_reasons.active --format=csv,noheader -lms 50 > "$OUT/smi.csv" 2>&1 &
  local smi=$! name flags
  for name in desc no_overlap no_ms; do
    case $name in
      desc) flags="--order desc" ;;
      no_overlap) flags="--no-overlap-schedule" ;;
      no_ms) flags="--no-multi-stream" ;;
    esac
    # shellcheck disable=SC2086  # flags is a list of flags
    timeout 170 python3 benchmarks/decode_context_sweep.py --device cuda --dtype bfloat16 --preset flash-4l \
      --kernel-backend triton --contexts 4096,921600 --batches "" --chunked-prefill-size 4096 --step-times \
      --one-engine --phases 6 $flags --out "$OUT/drift_$name.json" > "/tmp/drift_$name.txt" 2>&1
    echo "$name exit $?"; grep -E "dsv4 batch|Error" "/tmp/drift_$name.txt" | tail -4
  done
  kill "$smi"
}

train() {
  timeout 400 python3 benchmarks/profile_train_step.py --data .data/tiny --device cuda --batch-size 16 \
    > "$OUT/profile_train_step.txt" 2>&1
  head -12 "$OUT/profile_train_step.txt"
}

train_tiny() {   # the stages of train_tiny_h200_202611.md; give STEPS (a fixed count: no probe, compile included)
  if [ -z "${STEPS:-}" ]; then echo "train-tiny needs STEPS=N (see the header)"; return 2; fi
  local data=${DATA:-.data/tiny} run=/tmp/dsv4-run warmup=${WARMUP:-200}
  python3 -m dsv4.cli.main train run --data "$data" --out "$run" --device cuda --steps "$STEPS" \
    --batch-size "${BATCH:-16}" --lr "${LR:-2e-3}" --warmup-steps "$((STEPS < 2 * warmup ? STEPS / 2 : warmup))" \
    --qat-start "${QAT_START:-0.8}" ${INIT:+--init-from "$INIT"} $([ "${COMPILE:-0}" = 1 ] && echo --compile) \
    --eval-every 500 --eval-tokens 131072 --ckpt-every 1000 --log-every 25 --time-limit-s "${TIME_LIMIT_S:-540}" \
    > "$OUT/train.log" 2>&1
  tail -3 "$run/metrics.jsonl"
  python3 -m dsv4.cli.main train export --run "$run" --data "$data" --out "$run/model" >> "$OUT/train.log" 2>&1
  cp "$run"/model/model-*.safetensors "$run/metrics.jsonl" "$OUT/"
  cp "$run/loss.png" "$OUT/" 2>/dev/null
  tar -C "$run/model" -cf "$OUT/model_meta.tar" config.json model.safetensors.index.json training.json
}

hisparse() {
  timeout 150 python3 -m pytest -q -p no:cacheprovider -rs tests/kernels/test_hisparse_swap.py tests/kernels/test_hot_plan.py \
    tests/engine/test_hisparse_engine.py tests/cache/test_hisparse.py > "$OUT/hisparse_tests.txt" 2>&1
  summary "$OUT/hisparse_tests.txt"
  timeout 80 python3 benchmarks/kernels/bench_hisparse_swap.py --out "$OUT/bench_hisparse_swap.json" \
    > "$OUT/bench_hisparse_swap.txt" 2>&1
  grep -v "^{" "$OUT/bench_hisparse_swap.txt" | tail -18
  timeout 45 python3 benchmarks/kernels/bench_hot_plan.py --out "$OUT/bench_hot_plan.json" \
    > "$OUT/bench_hot_plan.txt" 2>&1
  grep -v "^{" "$OUT/bench_hot_plan.txt" | tail -5
  # shellcheck disable=SC2086  # HISPARSE_ARGS is a list of flags
  timeout 340 python3 benchmarks/hisparse.py --preset flash-43l-e16 --device cuda --kv-cache-memory-gb 40 \
    --prompt-len 200000 --output-len 2048 --concurrency 1,16,max --fill shared-prefix \
    --max-running-requests 256 --profile-steps 4 ${HISPARSE_ARGS:-} > "$OUT/hisparse.txt" 2>&1
  grep -v "^{" "$OUT/hisparse.txt" | grep -v "level:" | tail -20
}

hisparse_trace() {
  local m flags
  for m in off on; do
    flags=""
    [ "$m" = on ] && flags="--enable-hisparse --trace /tmp/hisparse_trace.json"
    # shellcheck disable=SC2086  # flags is a list of flags
    timeout 150 python3 benchmarks/profile_engine_step.py --preset flash-43l-e16 --device cuda --dtype bfloat16 \
      --kernel-backend triton --num-prompts 1 --prompt-len 32768 --decode-only --warm-steps 4 --steps 3 \
      --rows 40 $flags > "$OUT/prof_hisparse_$m.txt" 2>&1
    tail -1 "$OUT/prof_hisparse_$m.txt" | cut -c 1-400
  done
  python3 benchmarks/trace_gaps.py /tmp/hisparse_trace.json --top 15 > "$OUT/hisparse_trace_gaps.txt" 2>&1
  grep -E "^step" "$OUT/hisparse_trace_gaps.txt"
  timeout 300 python3 benchmarks/hisparse.py --preset flash-43l-e16 --device cuda --kv-cache-memory-gb 40 \
    --prompt-len 200000 --output-len 2048 --concurrency 1,16 --fill shared-prefix \
    --max-running-requests 256 > "$OUT/hisparse.txt" 2>&1
  grep -v "^{" "$OUT/hisparse.txt" | tail -6
}

w8a8() {
  local fmt
  timeout 150 python3 -m pytest -q -m gpu tests/kernels/test_act_quant.py tests/kernels/test_moe_w8a8.py \
    tests/kernels/test_fp8_linear_a8.py > "$OUT/w8a8_tests.txt" 2>&1
  tail -3 "$OUT/w8a8_tests.txt"
  for fmt in fp8 fp4; do
    timeout 200 python3 benchmarks/kernels/bench_moe_quant.py --fmts "$fmt" --variants w8a8,scaled \
      --tokens 2048,8192 --prefill-sweep --iters 20 --kernels --out "$OUT/w8a8_moe_$fmt.json" \
      > "$OUT/w8a8_moe_$fmt.txt" 2>&1
    grep -v "^{" "$OUT/w8a8_moe_$fmt.txt" | tail -8
  done
  timeout 150 python3 benchmarks/kernels/bench_fp8_linear.py --m 512,2048,8192 \
    --out "$OUT/w8a8_linear.json" > "$OUT/w8a8_linear.txt" 2>&1
  grep -v "^{" "$OUT/w8a8_linear.txt" | tail -12
}

checkpoint() {
  local fmt
  timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/kernels/test_fp8_swiglu.py \
    tests/kernels/test_fp8_linear.py tests/kernels/test_project_gemv.py > "$OUT/checkpoint_tests.txt" 2>&1
  tail -3 "$OUT/checkpoint_tests.txt"
  timeout 120 python3 benchmarks/kernels/bench_fp8_linear.py --m 1,2,4 \
    --out "$OUT/checkpoint_fp8_linear.json" > /tmp/checkpoint_fp8_linear.txt 2>&1
  grep -v "^{" /tmp/checkpoint_fp8_linear.txt | tail -26
  for fmt in bf16 checkpoint; do
    timeout 150 python3 benchmarks/decode_context_sweep.py --device cuda --dtype bfloat16 --preset flash-4l \
      --kernel-backend triton --contexts 4096 --batches 32 --batch-contexts 4096 --weight-format "$fmt" \
      --out "$OUT/checkpoint_decode_$fmt.json" > /tmp/checkpoint_decode_$fmt.txt 2>&1
    grep -v "^{" /tmp/checkpoint_decode_$fmt.txt | tail -4
  done
  for fmt in ${CRIT_FORMATS:-checkpoint bf16}; do
    timeout 150 python3 benchmarks/profile_engine_step.py --preset flash-4l --device cuda --dtype bfloat16 \
      --kernel-backend triton --num-prompts 1 --prompt-len 4096 --decode-only --warm-steps 3 --steps 20 \
      --rows 40 --weight-format "$fmt" --trace "/tmp/${fmt}_trace.json" > "$OUT/${fmt}_profile.txt" 2>&1
    tail -1 "$OUT/${fmt}_profile.txt" | cut -c 1-300
    echo "=== $fmt" >> "$OUT/checkpoint_trace_gaps.txt"
    python3 benchmarks/trace_gaps.py "/tmp/${fmt}_trace.json" --top 15 >> "$OUT/checkpoint_trace_gaps.txt" 2>&1
    grep -E "^step" "$OUT/checkpoint_trace_gaps.txt" | tail -3
  done
}

pdl_ab() {   # EARLY for the decode graphs of batch <= 8 (--pdl-early-max-batch 8) against none (0)
  local run fmt early rep
  for run in checkpoint:0:a checkpoint:8:a checkpoint:0:b checkpoint:8:b bf16:8:a; do
    IFS=: read -r fmt early rep <<< "$run"
    timeout "${DECODE_TIMEOUT_S:-240}" python3 benchmarks/decode_context_sweep.py --device cuda \
      --dtype bfloat16 --preset flash-4l --kernel-backend triton --contexts 4096 --batches 32 \
      --batch-contexts 4096 --weight-format "$fmt" --pdl-early-max-batch "$early" \
      --out "$OUT/pdl_${fmt}_e${early}_$rep.json" > /tmp/pdl_run.txt 2>&1
    echo "--- $fmt early<=$early ($rep)"; grep -v "^{" /tmp/pdl_run.txt | tail -3
  done
  timeout 120 python3 benchmarks/profile_engine_step.py --preset flash-4l --device cuda \
    --dtype bfloat16 --kernel-backend triton --num-prompts 1 --prompt-len 4096 --decode-only \
    --warm-steps 3 --steps 20 --rows 40 --weight-format checkpoint --trace /tmp/pdl_trace.json \
    > "$OUT/pdl_profile.txt" 2>&1
  tail -1 "$OUT/pdl_profile.txt" | cut -c 1-300
  python3 benchmarks/trace_gaps.py /tmp/pdl_trace.json --top 15 > "$OUT/pdl_trace_gaps.txt" 2>&1
  grep -E "^step|stream" "$OUT/pdl_trace_gaps.txt" | head -8
}

step_ab() {   # one call: the step's A/B, the new kernels' GPU tests, a profile (most wanted first)
  local run
  step_decode() {   # FORMAT:EARLY_MAX_BATCH
    local fmt early
    IFS=: read -r fmt early <<< "$1"
    timeout "${DECODE_TIMEOUT_S:-240}" python3 benchmarks/decode_context_sweep.py --device cuda \
      --dtype bfloat16 --preset flash-4l --kernel-backend triton --contexts 4096 --batches 32 \
      --batch-contexts 4096 --weight-format "$fmt" --pdl-early-max-batch "$early" \
      --out "/tmp/step_${fmt}_e${early}.json" > /tmp/step_run.txt 2>&1
    { echo "--- $fmt early<=$early"; grep -v "^{" /tmp/step_run.txt | tail -3
      grep "^{" /tmp/step_run.txt | tail -1; } | tee -a "$OUT/step_decode.txt"
  }
  for run in checkpoint:0 checkpoint:8 bf16:0 bf16:8; do step_decode "$run"; done
  timeout 60 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_topk.py \
    tests/kernels/test_sparse_attention_triton.py -k "whole_bin or inverse_rope" \
    > "$OUT/step_tests.txt" 2>&1
  grep -E "passed|failed" "$OUT/step_tests.txt"
  timeout 120 python3 -m pytest -q -p no:cacheprovider -m gpu tests/kernels/test_mhc_triton.py \
    tests/kernels/test_mhc_post_pre.py tests/kernels/test_rope_norm.py tests/engine/test_pdl.py \
    >> "$OUT/step_tests.txt" 2>&1
  grep -E "passed|failed" "$OUT/step_tests.txt"
  timeout 60 python3 benchmarks/profile_engine_step.py --preset flash-4l \
    --device cuda --dtype bfloat16 --kernel-backend triton --num-prompts 1 --prompt-len 4096 \
    --decode-only --warm-steps 3 --steps 20 --rows 40 --weight-format checkpoint \
    --pdl-early-max-batch 8 > "$OUT/step_profile.txt" 2>&1
  tail -1 "$OUT/step_profile.txt" | cut -c 1-300
}

fp8_frag() {   # FP8 experts: "frag" (the default at N*k < E/2) against "scaled"; FP8 linear stages
  timeout 150 python3 benchmarks/kernels/bench_moe_quant.py --fmts fp8 --variants frag,scaled \
    --tokens 1,8,16,32 --deterministic --kernels --out /tmp/fp8_moe.json > /tmp/fp8_moe.txt 2>&1
  { grep -v "^{" /tmp/fp8_moe.txt | tail -16; grep "^{" /tmp/fp8_moe.txt | tail -1; } \
    | tee "$OUT/fp8_frag.txt" | cut -c 1-200
  timeout 150 python3 benchmarks/kernels/bench_fp8_linear.py --stage-sweep --m 1 \
    --out /tmp/fp8_stages.json > /tmp/fp8_stages.txt 2>&1
  { grep -v "^{" /tmp/fp8_stages.txt | tail -12; grep "^{" /tmp/fp8_stages.txt | tail -1; } \
    | tee -a "$OUT/fp8_frag.txt" | cut -c 1-200
  timeout 180 python3 -m pytest -q -p no:cacheprovider -m gpu tests/kernels/test_moe_frag.py \
    > /tmp/fp8_frag_tests.txt 2>&1
  grep -E "passed|failed|Error" /tmp/fp8_frag_tests.txt | tail -12 | tee -a "$OUT/fp8_frag.txt"
}

frag_stream() {   # the frag loop's weights skipping L1 (stream_weights) against the default, in turn
  timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/kernels/test_moe_frag.py \
    tests/kernels/test_moe_tile_map.py > /tmp/frag_stream_tests.txt 2>&1
  grep -E "passed|failed|Error" /tmp/frag_stream_tests.txt | tail -12 | tee "$OUT/frag_stream.txt"
  timeout 90 python3 benchmarks/kernels/bench_moe_tile_map.py --out "$OUT/tile_map.json" \
    > /tmp/tile_map.txt 2>&1
  grep -v "^{" /tmp/tile_map.txt | tail -12 | tee -a "$OUT/frag_stream.txt"
  local flags run=0
  # the plain loop first and last (the machine's drift)
  for flags in "" "--frag-stream-weights" "" "--frag-stream-weights" ""; do
    run=$((run + 1))
    # shellcheck disable=SC2086  # flags is empty or one flag
    timeout 60 python3 benchmarks/kernels/bench_moe_quant.py --fmts fp4,fp8 --variants frag \
      --tokens "${STREAM_TOKENS:-1,2,8}" --deterministic --kernels $flags \
      --out "$OUT/frag_stream_$run.json" > /tmp/frag_stream.txt 2>&1
    { echo "== run $run: ${flags:-plain}"; grep -v "^{" /tmp/frag_stream.txt | tail -7; } \
      | tee -a "$OUT/frag_stream.txt" | cut -c 1-120
  done
}

fixed_costs() {   # the mHC finish apart, the top-k row path, the PDL kernels' GPU tests
  local f             # numbers first, the GPU tests last (what is under $OUT comes back on a timeout)
  timeout 150 python3 benchmarks/kernels/bench_mhc.py --ops post_pre --out "$OUT/fixed_mhc.json" \
    > /tmp/fixed_mhc.txt 2>&1
  grep -v "^{" /tmp/fixed_mhc.txt | tail -14
  timeout 90 python3 benchmarks/kernels/bench_topk.py --cases 1x1024x512,1x2048x512,1x4096x512 \
    > "$OUT/fixed_topk.txt" 2>&1
  grep -v "^{" "$OUT/fixed_topk.txt" | tail -5
  for f in test_fp8_linear test_gemv test_topk test_sparse_attention_triton test_mhc_triton \
      test_mhc_post_pre test_rope_norm; do   # SIGINT: pytest still prints its summary on a timeout
    timeout -s INT 120 python3 -m pytest -q -p no:cacheprovider -m gpu "tests/kernels/$f.py" \
      2>&1 | tail -20 >> "$OUT/fixed_tests.txt"
  done
  timeout -s INT 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/engine/test_pdl.py \
    2>&1 | tail -20 >> "$OUT/fixed_tests.txt"
  grep -E "passed|failed" "$OUT/fixed_tests.txt"
}

pdl_auto() {   # the engine's default PDL buckets per format, the 3 / 4-stage FP8 tile, test_pdl
  local fmt
  for fmt in checkpoint bf16 checkpoint bf16; do   # batch 1 / 4K, each run its own process
    timeout "${DECODE_TIMEOUT_S:-240}" python3 benchmarks/decode_context_sweep.py --device cuda \
      --dtype bfloat16 --preset flash-4l --kernel-backend triton --contexts 4096 --batches= \
      --weight-format "$fmt" --out /tmp/auto.json > /tmp/auto.txt 2>&1
    { echo "--- $fmt (engine default)"; grep "^{" /tmp/auto.txt | tail -1; } \
      | tee -a "$OUT/pdl_auto.txt" | cut -c 1-160
  done
  timeout 150 python3 benchmarks/kernels/bench_fp8_linear.py --stage-sweep --m 1 \
    > /tmp/stages.txt 2>&1
  { grep -v "^{" /tmp/stages.txt | tail -9; grep "^{" /tmp/stages.txt | tail -1; } \
    | tee "$OUT/fp8_stages.txt" | cut -c 1-160
  timeout -s INT 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/engine/test_pdl.py \
    2>&1 | tail -20 | tee "$OUT/pdl_tests.txt" | grep -E "passed|failed"
}

crit() {   # batch 1 / 4K: both formats at the engine default, then where each step's time goes
  local fmt           # (per-kernel profile + Chrome trace read by trace_gaps: per-stream sums, gaps)
  for fmt in ${CRIT_FORMATS:-checkpoint bf16}; do
    # shellcheck disable=SC2086
    timeout "${DECODE_TIMEOUT_S:-240}" python3 benchmarks/decode_context_sweep.py --device cuda \
      --dtype bfloat16 --preset flash-4l --kernel-backend triton --contexts 4096 --batches= \
      --weight-format "$fmt" ${CRIT_DECODE_ARGS:-} --out /tmp/crit.json > /tmp/crit.txt 2>&1
    { echo "--- $fmt (engine default ${CRIT_DECODE_ARGS:-})"; grep "^{" /tmp/crit.txt | tail -1; } \
      | tee -a "$OUT/crit_decode.txt" | cut -c 1-160
  done
  for fmt in ${CRIT_FORMATS:-checkpoint bf16}; do
    timeout 150 python3 benchmarks/profile_engine_step.py --preset flash-4l --device cuda \
      --dtype bfloat16 --kernel-backend triton --num-prompts 1 --prompt-len 4096 --decode-only \
      --warm-steps 3 --steps 6 --rows 60 --weight-format "$fmt" --trace "/tmp/trace_$fmt.json" \
      > "$OUT/crit_profile_$fmt.txt" 2>&1
    tail -1 "$OUT/crit_profile_$fmt.txt" | cut -c 1-200
    timeout 60 python3 benchmarks/trace_gaps.py "/tmp/trace_$fmt.json" --top 15 \
      > /tmp/crit_gaps.txt 2>&1
    grep -v "^{" /tmp/crit_gaps.txt | head -30
    cat /tmp/crit_gaps.txt >> "$OUT/crit_profile_$fmt.txt"
    gzip -c "/tmp/trace_$fmt.json" > "$OUT/trace_$fmt.json.gz"
  done
  [ -n "${CRIT_TESTS-1}" ] || return 0
  timeout -s INT 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/engine/test_pdl.py \
    2>&1 | tail -20 | tee "$OUT/pdl_tests.txt" | grep -E "passed|failed"
}

shared_join() {   # the shared expert beside the gate or the routed experts: b1, b8, b32 (4K), tests
  local run fmt beside batch
  for run in ${SJ_RUNS:-checkpoint:8:1 checkpoint:0:1 bf16:default:1 checkpoint:8:1 \
      checkpoint:0:1 bf16:default:1 checkpoint:8:8 checkpoint:0:8 checkpoint:default:32}; do
    IFS=: read -r fmt beside batch <<< "$run"
    local args=(--contexts 4096 --batches=)
    [ "$batch" = 1 ] || args=(--contexts 4096 --batches "$batch" --batch-contexts 4096)
    [ "$beside" = default ] || args+=(--shared-expert-beside-max-tokens "$beside")
    timeout "${DECODE_TIMEOUT_S:-240}" python3 benchmarks/decode_context_sweep.py --device cuda \
      --dtype bfloat16 --preset flash-4l --kernel-backend triton --weight-format "$fmt" \
      "${args[@]}" --out /tmp/sj.json > /tmp/sj.txt 2>&1
    { echo "--- $fmt beside_max_tokens=$beside batch=$batch"; grep "^{" /tmp/sj.txt | tail -1; } \
      | tee -a "$OUT/shared_join.txt" | grep -o '"ms_per_step": [0-9.]*\|"tok_s": [0-9.]*'
  done
  [ -n "${SJ_TESTS-1}" ] || return 0
  timeout -s INT 240 python3 -m pytest -q -p no:cacheprovider -m gpu \
    tests/engine/test_multi_stream.py tests/kernels/test_moe_combine.py 2>&1 | tail -20 \
    | tee "$OUT/shared_join_tests.txt" | grep -E "passed|failed"
}

multi() {   # issue 22 on 2 GPUs: the multi_gpu tests, then flash-4l decode per layout
  if [ -n "${MULTI_TESTS-1}" ]; then
    timeout -s INT 420 python3 -m pytest -q -p no:cacheprovider -rs tests/distributed/test_multi_gpu.py \
      > "$OUT/multi_tests.txt" 2>&1
    summary "$OUT/multi_tests.txt"
  fi
  local layout
  for layout in ${MULTI_LAYOUTS:-1 tp2 tp2-ep2}; do
    # the reference layout first in each run: agreement is against one GPU
    local layouts=$layout
    [ "$layout" = 1 ] || layouts="1,$layout"
    timeout "${MULTI_TIMEOUT_S:-480}" python3 benchmarks/parallel_decode.py --model in-memory:flash-4l \
      --weight-format "${MULTI_FORMAT:-bf16}" --layouts "$layouts" \
      --points "${MULTI_POINTS:-1:4096,32:4096,128:32768}" --out "$OUT/multi_decode_$layout.json" \
      > /tmp/multi_$layout.txt 2>&1
    echo "--- $layout (exit $?)"; grep -v "^{" /tmp/multi_$layout.txt | tail -8
  done
}

multi_flash() {   # the full V4-Flash geometry in checkpoint precision across GPUs
  timeout "${MULTI_TIMEOUT_S:-540}" python3 benchmarks/parallel_decode.py --model in-memory:flash \
    --weight-format checkpoint --layouts "${FLASH_LAYOUT:-tp2-ep2}" --agree-tokens 256 \
    --points "${FLASH_POINTS:-1:4096,32:4096,1:131072}" --out "$OUT/multi_flash.json" \
    > /tmp/multi_flash.txt 2>&1
  echo "multi-flash exit $?"; grep -v "^{" /tmp/multi_flash.txt | tail -8
}

multi_sync() {   # issue 24: the flash-4l weight sync, disaggregated over NCCL and colocated
  timeout "${MULTI_TIMEOUT_S:-540}" python3 benchmarks/weight_sync.py --model in-memory:flash-4l \
    --bucket-mb "${SYNC_BUCKET_MB:-512}" --out "$OUT/multi_sync.json" > /tmp/multi_sync.txt 2>&1
  echo "multi-sync exit $?"; grep -v "^{" /tmp/multi_sync.txt | tail -6
}

tree_ab() {   # this tree against another commit, batch-1 decode with step times
  local base=/tmp/tree_ab_base run tree fmt src
  rm -rf "$base" && mkdir -p "$base"
  git archive "${TREE_AB_BASE:-HEAD~1}" | tar -x -C "$base" || { echo "no base tree"; return 1; }
  for run in ${TREE_AB_RUNS:-new:checkpoint base:checkpoint new:checkpoint base:checkpoint \
      new:bf16 base:bf16}; do
    IFS=: read -r tree fmt <<< "$run"
    src=src; [ "$tree" = base ] && src="$base/src"
    PYTHONPATH=$src timeout "${DECODE_TIMEOUT_S:-120}" python3 benchmarks/decode_context_sweep.py \
      --device cuda --dtype bfloat16 --preset flash-4l --kernel-backend triton --weight-format "$fmt" \
      --contexts 4096 --batches= --step-times --steps 64 --out /tmp/tree_ab.json > /tmp/tree_ab.log 2>&1 \
      || { echo "$run failed: $(tail -1 /tmp/tree_ab.log)" | tee -a "$OUT/tree_ab.txt"; continue; }
    python3 - "$run" <<'PY' | tee -a "$OUT/tree_ab.txt"
import json, statistics, sys
r = json.load(open("/tmp/tree_ab.json"))["rows"][0]
d = sorted(r["step_ms_device"])
own = [h - w for h, w in zip(r["step_ms_host"], r["step_ms_host_wait"])]
print(sys.argv[1], "ms", r["ms_per_step"], "p50 %.4f p90 %.4f max %.4f host_own p50 %.4f max %.4f"
      % (statistics.median(d), d[int(0.9 * len(d))], d[-1], statistics.median(own), max(own)))
PY
  done
}

prefill_profile() {   # where a prefill chunk's time goes, per weight format
  for fmt in ${PP_FORMATS:-checkpoint bf16}; do
    timeout "${PP_TIMEOUT_S:-240}" python3 benchmarks/profile_engine_step.py --preset flash-4l \
      --device cuda --dtype bfloat16 --kernel-backend triton --weight-format "$fmt" --num-prompts 2 \
      --prompt-len 8192 --steps 2 --rows 40 > "$OUT/prefill_$fmt.txt" 2>&1
    echo "$fmt exit $?: $(tail -1 "$OUT/prefill_$fmt.txt" | cut -c 1-300)"
  done
}

prefill_check() {   # the CPU-built prefill paths: GPU tests, then their timings and the chunk profile
  timeout 240 python3 -m pytest -q -p no:cacheprovider -rs -m gpu tests/kernels/test_project_gemv.py \
    tests/kernels/test_fp8_linear.py tests/kernels/test_dequant_triton.py \
    > "$OUT/prefill_check_tests.txt" 2>&1
  summary "$OUT/prefill_check_tests.txt"
  timeout 150 python3 benchmarks/kernels/bench_fp8_linear.py --m 512,2048,8192 --iters 10 \
    --out "$OUT/bench_fp8_linear.json" > "$OUT/bench_fp8_linear.txt" 2>&1
  echo "== bench_fp8_linear (exit $?)"; grep -E "M=(512|2048|8192)" "$OUT/bench_fp8_linear.txt" | head -24
  timeout 200 python3 benchmarks/kernels/bench_moe_prefill.py --out "$OUT/bench_moe_prefill.json" \
    > "$OUT/bench_moe_prefill.txt" 2>&1
  echo "== bench_moe_prefill (exit $?)"; grep -v "^{" "$OUT/bench_moe_prefill.txt" | tail -14
  prefill_profile
}

moe_chunks() {   # the quantised experts' prefill through decoded chunks: tests, timings, profile
  timeout 240 python3 -m pytest -q -p no:cacheprovider -rs -m gpu tests/kernels/test_moe_dequant.py \
    tests/kernels/test_moe_quant.py -k "flash_chunks or rows_batch_invariant or prefill_tiles" \
    > "$OUT/moe_chunks_tests.txt" 2>&1
  summary "$OUT/moe_chunks_tests.txt"
  timeout 300 python3 benchmarks/kernels/bench_moe_prefill.py --out "$OUT/bench_moe_prefill.json" \
    > "$OUT/bench_moe_prefill.txt" 2>&1
  echo "== bench_moe_prefill (exit $?)"; grep -v "^{" "$OUT/bench_moe_prefill.txt" | tail -40
  PP_FORMATS=${PP_FORMATS:-checkpoint} prefill_profile
}

prefill_stall() {   # where the batch-32 checkpoint prefill's ~100 s go: per-step times and stacks
  timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu tests/kernels/test_moe_gate_logits.py \
    tests/kernels/test_moe_dequant.py > "$OUT/stall_tests.txt" 2>&1
  summary "$OUT/stall_tests.txt"
  local fmt
  for fmt in ${STALL_FORMATS:-checkpoint bf16}; do
    TRITON_CACHE_DIR=/tmp/stall_cache_$fmt timeout "${DECODE_TIMEOUT_S:-240}" python3 \
      benchmarks/decode_context_sweep.py --device cuda --dtype bfloat16 --preset flash-4l \
      --kernel-backend triton --weight-format "$fmt" --contexts 4096 --batches 32 \
      --batch-contexts 4096 --engine-warmup fast --prefill-step-times --compile-times \
      --stack-dump-s 10 \
      --out "$OUT/stall_$fmt.json" > "$OUT/stall_$fmt.txt" 2>&1
    echo "== $fmt (exit $?)"
    python3 - "$OUT/stall_$fmt.json" <<'PY'
import json, sys
for r in json.load(open(sys.argv[1]))["rows"]:
    steps = r.get("prefill_steps", [])
    slow = sorted(range(len(steps)), key=lambda i: -steps[i][0])[:5]
    print(r["batch"], r["context"], "prefill_s", r.get("prefill_s"), "steps", len(steps),
          "slowest [step, s, prefill, decode]:", [[i, *steps[i]] for i in slow])
    print("  builds:", {k: (v["count"], v["s"]) for k, v in r.get("compiles", {}).items()},
          "slowest:", r.get("slowest_compiles", [])[:3])
PY
  done
}

per_layer() {   # issue 21: the full V4-Flash geometry's per-layer decode from prefixes of its layers
  local L
  for L in ${LAYERS:-8 16}; do
    timeout "${DECODE_TIMEOUT_S:-240}" python3 benchmarks/decode_context_sweep.py --device cuda \
      --dtype bfloat16 --preset flash --num-layers "$L" --kernel-backend triton \
      --weight-format checkpoint --contexts 4096 --batches 32 --batch-contexts 4096 \
      --engine-warmup fast --out "$OUT/per_layer_L$L.json" > /tmp/per_layer_L$L.txt 2>&1
    echo "== L $L (exit $?)"
    python3 - "$OUT/per_layer_L$L.json" <<'PY' || tail -5 /tmp/per_layer_L$L.txt
import json, sys
for r in json.load(open(sys.argv[1]))["rows"]:
    print(r["batch"], r["context"], r["status"][:60], r.get("ms_per_step"), "floor", r.get("floor_ms"))
PY
  done
}

long_attn() {   # the split-KV attention at batch-1 decode: GPU tests, then the sweep
  timeout -s INT 200 python3 -m pytest -q -p no:cacheprovider -m gpu \
    tests/kernels/test_sparse_attention_triton.py -k "split or 900k" 2>&1 | tail -4 \
    | tee "$OUT/long_attn_tests.txt" | grep -E "passed|failed"
  timeout "${LONG_ATTN_TIMEOUT_S:-300}" python3 benchmarks/kernels/bench_sparse_attention.py --sweep \
    --cases "V=7200 B=1,V=1024 B=1,k=512 B=1" --out "$OUT/long_attn.json" > /tmp/long_attn.txt 2>&1
  echo "bench exit $?"
  python3 - "$OUT/long_attn.json" <<'PY' || tail -5 /tmp/long_attn.txt
import json, sys
for r in json.load(open(sys.argv[1]))["results"]:
    best = sorted(r["configs_us"].items(), key=lambda kv: kv[1])[:6]
    print(r["case"], "default", round(r["us_default"], 1), "splits", r["splits"], "best",
          [(k, round(v, 1)) for k, v in best], "failed", list(r["configs_failed"]))
PY
}

after_warmup() {   # the builds after the fast warmup, one engine for every point, fresh Triton cache
  local fmt
  for fmt in ${AW_FORMATS:-bf16 checkpoint}; do
    rm -rf "/tmp/aw_cache_$fmt"
    TRITON_CACHE_DIR=/tmp/aw_cache_$fmt timeout "${DECODE_TIMEOUT_S:-240}" python3 \
      benchmarks/decode_context_sweep.py --device cuda --dtype bfloat16 --preset flash-4l \
      --kernel-backend triton --weight-format "$fmt" --one-engine --contexts 4096,32768 \
      --batches 8,32 --batch-contexts 4096,32768 --engine-warmup fast --compile-times --steps 16 \
      --out "$OUT/after_warmup_$fmt.json" > /tmp/after_warmup_$fmt.txt 2>&1
    echo "== $fmt (exit $?)"
    python3 - "$OUT/after_warmup_$fmt.json" <<'PY' || tail -5 /tmp/after_warmup_$fmt.txt
import json, sys
d = json.load(open(sys.argv[1]))
print("warmup s", d.get("shared_engine_warmup_s"))
for r in d["rows"]:
    print(r["batch"], r["context"], r["status"][:60], r.get("ms_per_step"),
          {k: (v["count"], v["s"]) for k, v in r.get("compiles", {}).items()})
    for b in r.get("builds_after_warmup", []):
        print("   ", b[0], b[1], b[2], json.dumps(b[3])[:300], "|", b[4][:500])
PY
  done
}

long_context_format() {   # flash-4l's weight format for 900K decode: bf16 fits an H200, not an H100
  nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200 && echo bf16 || echo checkpoint
}

index_fp8() {   # index_cache_dtype model vs fp8 at batch 1, 4K and 900K, formats alternating
  local fmt run idx
  fmt=${IF_FORMAT:-$(long_context_format)}
  for run in ${IF_RUNS:-1 2}; do
    for idx in model fp8; do
      timeout "${DECODE_TIMEOUT_S:-240}" python3 benchmarks/decode_context_sweep.py --device cuda \
        --dtype bfloat16 --preset flash-4l --kernel-backend triton --weight-format "$fmt" \
        --one-engine --contexts 4096,921600 --batches "" --chunked-prefill-size 8192 --phases 3 \
        --step-times --index-cache-dtype "$idx" --out "$OUT/index_fp8_${idx}_$run.json" \
        > "/tmp/index_fp8_${idx}_$run.txt" 2>&1
      echo "== $fmt $idx run $run (exit $?)"
      python3 - "$OUT/index_fp8_${idx}_$run.json" <<'PY' || tail -5 "/tmp/index_fp8_${idx}_$run.txt"
import json, sys
d = json.load(open(sys.argv[1]))
for r in d["rows"]:
    print(r["batch"], r["context"], r["status"][:40], r.get("ms_per_step"), r.get("phase_ms"))
PY
    done
  done
}

line() {   # issue 20's 900K / 4K line at its protocol (the header)
  local fmt
  fmt=${LINE_FORMAT:-$(long_context_format)}
  timeout "${LINE_TIMEOUT_S:-240}" python3 benchmarks/decode_context_sweep.py --device cuda \
    --dtype bfloat16 --preset flash-4l --kernel-backend triton --weight-format "$fmt" \
    --contexts 4096,921600 --batches "" --chunked-prefill-size 4096 --step-times --one-engine \
    --phases 6 --settle-s 0 ${INDEX_CACHE_DTYPE:+--index-cache-dtype "$INDEX_CACHE_DTYPE"} \
    --out "$OUT/line_$fmt.json" > "$OUT/line_$fmt.txt" 2>&1
  echo "== line $fmt (exit $?)"
  python3 - "$OUT/line_$fmt.json" <<'PY' || tail -5 "$OUT/line_$fmt.txt"
import json, sys
rows = {r["context"]: r for r in json.load(open(sys.argv[1]))["rows"]}
for ctx, r in rows.items():
    print(ctx, r["status"][:40], "phases", r.get("phase_ms"))
if all(r.get("phase_ms") for r in rows.values()) and len(rows) == 2:
    short, long = (rows[c]["phase_ms"] for c in sorted(rows))
    print(f"900K / 4K: first phase {long[0] / short[0]:.3f}, phases 3-6 "
          f"{sum(long[2:]) / sum(short[2:]):.3f}")
PY
}

prefill_cold() {   # is the sweep's batch-32 prefill time kernel compiles? cold against warm cache
  local fmt pass cache
  for fmt in ${PC_FORMATS:-checkpoint bf16}; do
    cache=/tmp/triton_cache_$fmt && rm -rf "$cache"
    for pass in cold warm; do
      TRITON_CACHE_DIR=$cache timeout "${DECODE_TIMEOUT_S:-240}" python3 \
        benchmarks/decode_context_sweep.py --device cuda --dtype bfloat16 --preset flash-4l \
        --kernel-backend triton --weight-format "$fmt" --contexts 4096 --batches 32 \
        --batch-contexts 4096 --out /tmp/pc.json > /tmp/pc.txt 2>&1
      echo "--- $fmt $pass exit $?" | tee -a "$OUT/prefill_cold.txt"
      python3 -c 'import json, sys
for r in json.load(open(sys.argv[1]))["rows"]:
    print(r["batch"], r["context"], "prefill_s", r.get("prefill_s"), "ms", r.get("ms_per_step"))' \
        /tmp/pc.json 2>&1 | tee -a "$OUT/prefill_cold.txt"
      [ "$pass" = cold ] || continue
      echo "kernels compiled (cache entries by name):" >> "$OUT/prefill_cold.txt"
      find "$cache" -name "*.json" ! -name "__grp__*" -printf "%f\n" | sed 's/\.json$//' | sort \
        | uniq -c | sort -rn | tee -a "$OUT/prefill_cold.txt" | head -5
    done
  done
}

sass() {
  timeout 300 python3 benchmarks/aot_compile_sm90.py > "$OUT/sass.txt" 2>&1
  echo "sass exit $?"; grep -c "instr" "$OUT/sass.txt"; grep "ERROR" "$OUT/sass.txt" | head -5
}

if [ $# -eq 0 ]; then
  sed -n '2,/^set -uo pipefail/p' "$0" | grep '^#'
  exit 2
fi
env_info | tee "$OUT/env.txt"
for part in "$@"; do
  echo "=== $part"
  case "$part" in
    gpu-tests) gpu_tests ;;
    kernels) kernels ;;
    decode) decode ;;
    engine) engine ;;
    decode-hf) decode_hf ;;
    prefix-cache) prefix_cache ;;
    serving) serving ;;
    http) http ;;
    profile) profile ;;
    transient) transient ;;
    train) train ;;
    train-tiny) train_tiny ;;
    hisparse) hisparse ;;
    hisparse-trace) hisparse_trace ;;
    drift) drift ;;
    w8a8) w8a8 ;;
    checkpoint) checkpoint ;;
    pdl-ab) pdl_ab ;;
    fixed-costs) fixed_costs ;;
    step-ab) step_ab ;;
    fp8-frag) fp8_frag ;;
    frag-stream) frag_stream ;;
    pdl-auto) pdl_auto ;;
    sass) sass ;;
    crit) crit ;;
    shared-join) shared_join ;;
    tree-ab) tree_ab ;;
    prefill-profile) prefill_profile ;;
    prefill-cold) prefill_cold ;;
    prefill-check) prefill_check ;;
    moe-chunks) moe_chunks ;;
    prefill-stall) prefill_stall ;;
    per-layer) per_layer ;;
    after-warmup) after_warmup ;;
    long-attn) long_attn ;;
    index-fp8) index_fp8 ;;
    line) line ;;
    multi) multi ;;
    multi-flash) multi_flash ;;
    multi-sync) multi_sync ;;
    *) echo "unknown part '$part'; allowed: gpu-tests kernels decode decode-hf engine prefix-cache serving http" \
         "profile transient drift train train-tiny hisparse hisparse-trace w8a8 checkpoint pdl-ab fixed-costs" \
         "step-ab fp8-frag frag-stream pdl-auto sass crit shared-join tree-ab prefill-profile prefill-cold prefill-check moe-chunks prefill-stall per-layer after-warmup long-attn index-fp8 line multi multi-flash multi-sync"; exit 2 ;;
  esac
done
