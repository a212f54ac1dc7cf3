"""Smoke runs of the benchmarks on a CPU: each script, with a user's command line, on a tiny
workload, ends with its one JSON line; in a fresh process where the process is part of what is
under test (a server, env settings, launch counts, a patched interpreter), else in this one. The
kernel benchmarks run their `--cpu-smoke` shapes under the Triton interpreter (their timings mean
nothing there; benchmarks/device.sh runs them on a GPU)."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import math
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
from bench_script import load_benchmark

ROOT = Path(__file__).resolve().parents[2]


def run_benchmark(script: str, *args: str, **extra_env: str) -> dict[str, Any]:
    """Run benchmarks/<script> and return its last output line parsed as JSON."""
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1", **extra_env}
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), *args],
                          capture_output=True, text=True, env=env, timeout=600, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    last = proc.stdout.strip().splitlines()[-1]
    return dict(json.loads(last))


def run_in_process(script: str, *args: str) -> dict[str, Any]:
    """benchmarks/<script>'s `main()` in this process, with `args` as its command line; its last
    output line parsed as JSON. For the scripts whose work, not their process, is under test: a
    fresh process would re-import torch and dsv4 first. Where this process does not run Triton
    under the interpreter (conftest sets it on a CPU machine) the script's `--cpu-smoke` needs a
    process of its own, which sets it before importing Triton: `run_benchmark` there."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        return run_benchmark(script, *args)
    out, argv, threads = io.StringIO(), sys.argv, torch.get_num_threads()
    try:
        with script_module(script) as module:
            sys.argv = [str(module.__file__), *args]
            with contextlib.redirect_stdout(out):
                module.main()
    finally:
        sys.argv = argv
        torch.set_num_threads(threads)
    return dict(json.loads(out.getvalue().strip().splitlines()[-1]))


@contextlib.contextmanager
def script_module(script: str) -> Iterator[ModuleType]:
    """benchmarks/<script> executed as a module, registered in `sys.modules` while in use (a
    dataclass looks its module up while it is defined)."""
    path = ROOT / "benchmarks" / script
    if str(path.parent) not in sys.path:       # its sibling imports (`from bench_common ...`)
        sys.path.append(str(path.parent))
    name = f"_smoke_{path.stem}"
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    try:
        sys.modules[name] = module
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop(name, None)


@pytest.mark.parametrize(("script", "args", "keys"), [
    ("prefix_cache.py",
     ["--conversations", "2", "--turns", "2", "--user-len", "8", "--output-len", "2"],
     {"hit_rate"}),
    ("offline_throughput.py",
     ["--num-requests", "3", "--max-prompt", "24", "--output-len", "2", "--skip-hf"],
     set()),
    ("profile_engine_step.py",
     ["--num-prompts", "2", "--prompt-len", "20", "--warm-prompt-len", "12", "--steps", "2"],
     {"step_s"}),
])
def test_benchmark_runs_and_ends_with_json(script: str, args: list[str], keys: set[str]) -> None:
    result = run_in_process(script, *args)
    assert result and keys <= set(_flat_keys(result)), result


def test_serving_benchmark_through_either_api(monkeypatch: pytest.MonkeyPatch) -> None:
    """benchmarks/serving.py's `start_server` starts `dsv4 serve` on the default model (its default
    page size, the script's defaults); the script streams through that one server's
    /v1/completions and SGLang's /generate (`--url`): every request returns its tokens."""
    monkeypatch.setattr(sys, "argv", ["serving.py"])
    # the server's environment, as `run_benchmark` gives its processes
    monkeypatch.setenv("PYTHONPATH", str(ROOT / "src"))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    with script_module("serving.py") as serving:
        proc, url = serving.start_server(serving.parse_args(), serving.default_model_path(), 2)
    try:
        for api in ("openai", "native"):
            result = run_in_process("serving.py", "--url", url, "--api", api, "--concurrency",
                                    "2", "--num-requests", "4", "--repeats", "1", "--output-len",
                                    "4", "--max-prompt", "24", "--skip-offline")
            assert result["api"] == api
            (level,) = result["levels"]
            assert level["requests"] == 4 and level["tok_s"] > 0, level
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def test_op_census_counts_a_decode_step() -> None:
    """The census of micro's decode step under the interpreter: Triton launches are counted per
    source line; the MoE tile map is one launch per layer (its torch form is ~30), the step
    metadata one launch and no torch op, the picks' slots one per CSA layer, the
    indexer queries' RoPE one per CSA layer (no torch RoPE op left), the ape add one per
    compressor, the RoPE rows of every table lookup (main, compress, one per ratio) one launch, the
    gate's selection and the combine one each per MoE layer, the projections and the gate's
    logits one skinny GEMM per call site (fused groups: one; the shared expert's SwiGLU inside its
    w2's: no launch of its own)."""
    result = run_benchmark("op_census.py", "--preset", "micro", "--experts", "8", "--vocab",
                           "512", TRITON_INTERPRET="1")
    assert result["launches"] > result["triton"] > 0, result
    assert result["by_file"]["kernels/triton/moe_tile_map.py"] == 5, result
    # one launch per CSA layer maps the indexer picks; the metadata is one launch
    assert result["by_file"]["kernels/triton/pick_slots.py"] == 2, result
    assert result["by_file"]["kernels/triton/metadata.py"] == 1, result
    # the indexer's head weights are cast and scaled inside its `index_scores` launch
    assert "model/indexer.py" not in result["by_file"], result
    assert "engine/metadata.py" not in result["by_file"], result
    assert "kernels/ref/rope_norm.py" not in result["by_file"], result
    # the gate scores' ape is added inside the compress launches: no launch of its own
    assert not any("add_ape" in f for f in result["by_file"]), result
    # the step's four RoPE-row lookups: one `rope_rows` launch, no torch gather
    assert result["by_file"]["kernels/triton/rope_rows.py"] == 1, result
    assert "model/layers/rope.py" not in result["by_file"], result
    # decode GEMVs (`decode_gemv`): one skinny-GEMM launch per projection call site, fused
    # groups one each: per layer x | ... , wq_b (| the indexer's on the 2 CSA layers), wo_b, the
    # shared expert's w1 | w3 and its SwiGLU + w2 (`swiglu_linear`: one GEMV) (5 x 5), the gate's
    # logits (5), one fp32 `project` per compressed layer (4), plus the held project counters'
    # first zero-fill
    assert result["by_file"]["kernels/triton/gemv.py"] == 5 * 5 + 5 + 4 + 1, result
    assert "model/layers/fused.py" not in result["by_file"], result
    assert "model/compressor.py" not in result["by_file"], result
    # the gate after its GEMM: one launch per MoE layer; the shared expert's SwiGLU runs inside
    # its w2 GEMV above (no launch of its own)
    assert result["by_file"]["kernels/triton/moe_gate.py"] == 5, result
    assert "kernels/triton/swiglu.py" not in result["by_file"], result
    assert "kernels/ref/moe.py" not in result["by_file"], result
    # the layer's combine (k-sum + shared expert + cast): one launch per MoE layer; the gate's
    # logits are the decode GEMV above (no fp32 casts: `kernels/ref/moe.py` has no launch), so
    # model/moe.py keeps only the hash layers' table lookups (2 hash layers)
    assert result["by_file"]["kernels/triton/moe_combine.py"] == 5, result
    assert result["by_file"]["model/moe.py"] == 2, result


def test_hisparse_benchmark_swaps_on_micro(tmp_path: Path) -> None:
    """HiSparse off vs on on micro: both modes decode every level, and with HiSparse on the hot
    set (8 entries, against prompts of 30 C4 entries) swaps entries in; plot_hisparse.py draws
    the result."""
    result = run_in_process("hisparse.py", "--preset", "micro", "--device", "cpu", "--prompt-len",
                             "120", "--output-len", "8", "--concurrency", "1,2", "--steps", "2",
                             "--kv-cache-memory-gb", "0.05", "--page-size", "16",
                             "--max-running-requests", "4", "--profile-steps", "1")
    off, on = result["modes"]
    assert [r["concurrency"] for r in off["levels"]] == [1, 2] == \
        [r["concurrency"] for r in on["levels"]], result
    # TPOT both as a server runs the steps (pipelined) and with a sync after each
    assert all(r["tpot_ms_p50"] > 0 and r["synced_tpot_ms_p50"] > 0
               for mode in (off, on) for r in mode["levels"]), result
    # the CPU has no kernels to sort into families: the profiled step's wall time only
    assert all(r["profile"]["steps"] == 1 and r["profile"]["wall_ms_per_step"] > 0
               and "families_ms" not in r["profile"]
               for mode in (off, on) for r in mode["levels"]), result
    assert all(r["hot_swapped"] > 0 and r["hot_overflow"] == 0 for r in on["levels"]), result
    (tmp_path / "r.json").write_text(json.dumps(result) + "\n")
    png = tmp_path / "r.png"
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "plot_hisparse.py"),
                    str(tmp_path / "r.json"), str(png)], check=True)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_hisparse_benchmark_sorts_kernels_into_families() -> None:
    """The profile's families match the engine's kernel names (first match wins), so its
    bottleneck table reads the right rows; a name no family claims is "other"."""
    family = load_benchmark("hisparse").kernel_family
    assert family("_swap_in_kernel") == family("_write_rows_kernel") == "hisparse copies"
    assert family("_hot_plan_kernel") == "hisparse plan"
    assert family("_index_scores_kernel") == "indexer scores"
    assert family("_hist_kernel") == family("_coop_kernel") == family("_pick_slots_kernel") \
        == "top-k"
    assert family("_gate_up_fma_kernel") == family("_down_kernel") == "experts"
    assert family("_combine_kernel") == "combines"
    assert family("nvjet_tst_128x64_64x8_2x1_v_bz_TNT") == family("_gemv_kernel") \
        == "projections"
    assert family("_mhc_post_kernel") == "mhc, norms, rope"
    assert family("void at::native::vectorized_elementwise_kernel<4>") == "other"


def test_hisparse_plot_draws_the_kernel_families(tmp_path: Path) -> None:
    """A `--profile-steps` result on a GPU carries each level's GPU ms by kernel family: the plot
    gets its third panel from them (a result without them keeps two: the test above)."""
    families = {"hisparse copies": 3.4, "experts": 9.2, "other": 1.9}
    level = {"concurrency": 16, "tok_s": 586.1, "tpot_ms_p50": 27.3,
             "profile": {"steps": 4, "families_ms": families}}
    result = {"preset": "flash-43l-e16", "dtype": "bfloat16", "prompt_len": 200000,
              "output_len": 2048, "kv_cache_memory_gb": 40.0,
              "modes": [{"mode": "off", "admitted": 17, "levels": [level]},
                        {"mode": "on", "admitted": 56, "levels": [level]}]}
    import matplotlib.pyplot as plt

    plot = load_benchmark("plot_hisparse")
    png = tmp_path / "r.png"
    before = set(plt.get_fignums())      # figures other tests in this process left open
    plot.plot(result, png)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    (new,) = set(plt.get_fignums()) - before
    assert len(plt.figure(new).axes) == 3
    plt.close(new)


def test_hisparse_benchmark_shared_prefix_fill_at_the_admitted_count() -> None:
    """`--fill shared-prefix`: every request after the first reads the prefilled prefix from the
    prefix cache; `max` is the mode's admitted count (from the plan, not from the fill)."""
    result = run_in_process("hisparse.py", "--preset", "micro", "--device", "cpu", "--prompt-len",
                             "120", "--output-len", "8", "--concurrency", "1,max", "--steps", "2",
                             "--kv-cache-memory-gb", "0.05", "--page-size", "16",
                             "--max-running-requests", "3", "--fill", "shared-prefix",
                             "--unique-len", "20")
    for mode in result["modes"]:
        assert [r["concurrency"] for r in mode["levels"]] == [1, mode["admitted"]], result
        assert mode["admitted"] == 3, result
        # whole pages of the 100-token prefix hit: 96 tokens per request (and the second
        # level's one-token request for the prefix)
        assert [r["cached_prompt_tokens"] for r in mode["levels"]] == [96, 4 * 96], result
    assert all(r["hot_swapped"] > 0 for r in result["modes"][1]["levels"]), result


def test_rl_drift_benchmark_reports_exact_zero_on_cpu() -> None:
    result = run_in_process("rl_drift.py", "--steps", "1", "--prompts", "2", "--group-size", "2",
                             "--modes", "true-on-policy")
    assert [r["replay"] for r in result["rows"]] == ["none", "routing", "routing,indexer"]
    assert all(r["step0_mean"] == 0.0 and r["step0_max"] == 0.0 for r in result["rows"]), result


def test_rl_drift_benchmark_random_preset_forward_only() -> None:
    """The flash-4l measurement's path (random weights, one rollout per mode, three replay
    settings, the sync timing) on the micro preset: fp32 drift at rounding level by default,
    exactly 0 in true on-policy mode."""
    result = run_in_process("rl_drift.py", "--preset", "micro", "--prompts", "2", "--group-size",
                             "2", "--prompt-len", "40", "--max-tokens", "4")
    rows = result["rows"]
    assert result["model"] == "micro" and len(rows) == 6, result
    assert [r["true_on_policy"] for r in rows] == [False] * 3 + [True] * 3, result
    assert all(0.0 <= r["step0_mean"] < 1e-4 and r["sync_s"] > 0 for r in rows[:3]), result
    assert all(r["step0_mean"] == 0.0 and r["step0_max"] == 0.0 for r in rows[3:]), result


def test_drift_sensitivity_benchmark_zero_at_eps_zero() -> None:
    """bf16 on CPU: the ref engine's sampling log-probs equal the trainer's bit for bit (eps 0),
    and a 1e-6 relative perturbation of one op before its bf16 rounding makes drift."""
    result = run_in_process("drift_sensitivity.py", "--eps", "0,1e-6", "--prompts", "2",
                             "--group-size", "4")
    zero, perturbed = result["rows"]
    assert zero["step0_mean"] == 0.0 and zero["step0_max"] == 0.0, result
    assert perturbed["step0_mean"] > 0.0, result


def test_drift_ablation_benchmark_swaps_one_op() -> None:
    """The ablation's cheap variants for one op run (interpreter, fp32): drift at rounding level.
    (The variants with every op on the interpreted kernels cost ~80 s of CI; they run on the
    GPU.)"""
    args = ("--device", "cpu", "--dtype", "float32", "--ops", "rms_norm", "--prompts", "1",
            "--group-size", "2", "--variants", "ref,ref +rms_norm")
    result = (run_in_process("drift_ablation.py", *args)
              if os.environ.get("TRITON_INTERPRET") == "1"
              else run_benchmark("drift_ablation.py", *args, TRITON_INTERPRET="1"))
    rows = {r["variant"]: r for r in result["rows"]}
    assert list(rows) == ["ref", "ref +rms_norm"], result
    assert all(r["step0_mean"] < 1e-4 for r in rows.values()), result


def test_spec_decode_benchmark_both_modes() -> None:
    """dsv4-tiny: speculation keeps the fp32 greedy tokens and accepts drafts; random micro
    weights: both step times measured."""
    tiny = run_in_process("spec_decode.py", "--batches", "2", "--output-len", "8")
    row = tiny["rows"][0]
    assert row["token_agreement"] == 1.0 and row["acceptance_length"] > 1.5, tiny
    micro = run_in_process("spec_decode.py", "--preset", "micro", "--batches", "2", "--steps", "2",
                            "--prompt-len", "20")
    row = micro["rows"][0]
    assert row["plain_step_ms"] > 0 and row["spec_step_ms"] > 0, micro
    # 2 x 4 tokens of micro's 8 experts (top-2) hit more experts than 2 tokens: more bytes
    assert 1.0 < row["floor_verify_ratio"] < 4.0 and row["extra_gb"] > 0, micro


def test_verify_floor_of_uniform_routing() -> None:
    """4 tokens of uniform 6-of-256 routing read ~23 experts per layer where one reads 6: the
    verify pass of flash-4l costs about 2x a plain step at the byte floor; sharing experts
    (a scale below 1) lowers it, and the ratio falls as the batch shares experts."""
    rows = run_in_process("verify_floor.py", "--batches", "1,32")["rows"]
    got = {(r["model"], r["weights"], r["batch"]): r["floor_ratio"] for r in rows}
    assert 1.9 < got[("flash-4l", "bf16", 1)] < 2.1, got
    assert got[("v4-flash", "checkpoint", 32)] < got[("v4-flash", "checkpoint", 1)], got
    shared = run_in_process("verify_floor.py", "--batches", "1", "--distinct-scale", "0.5")
    assert shared["rows"][0]["floor_ratio"] < got[("flash-4l", "bf16", 1)], shared


def test_hisparse_hit_rate_of_the_shipped_model() -> None:
    """The hot sets' decode hit rate on held-out text, trained weights and random ones: every
    decode pick is counted, and a hot set holding every visible entry misses none once warm."""
    result = run_in_process("hisparse_hit_rate.py", "--requests", "1", "--prompt-len", "640",
                             "--output-len", "4", "--hot-entries", "128,256")
    rows = {(r["weights"], r["hot_entries"]): r for r in result["rows"]}
    assert set(rows) == {(w, e) for w in ("trained", "random") for e in (128, 256)}, result
    for r in rows.values():   # 160 visible entries >= top-k: 3 C4 layers x 128 picks a token
        assert r["decode_tokens"] == 3 and r["picks_per_token"] == 3 * 128, r
        assert 0.0 <= r["hit_rate"] <= 1.0, r
    # 640 tokens: 160 entries per C4 layer fit E = 256 and are hot after the prefill's writes
    assert rows[("trained", 256)]["swapped"] <= rows[("trained", 128)]["swapped"], result


def test_host_profile_per_context() -> None:
    """profile_host_step.py: a per-context cProfile of decode steps, and the functions whose own
    time grew from the first context to the last."""
    result = run_in_process("profile_host_step.py", "--device", "cpu", "--preset", "micro",
                            "--dtype", "float32", "--contexts", "128,512", "--steps", "3",
                            "--warm-steps", "1", "--page-size", "128")
    assert [r["context"] for r in result["rows"]] == [128, 512], result
    assert all(r["ms_per_step"] > 0 and r["own_us_per_step"] for r in result["rows"]), result
    assert result["grown_us"], result


def test_routing_locality_of_the_shipped_model() -> None:
    """Consecutive tokens of the trained dsv4-tiny share routed experts: fewer distinct experts
    than uniform routing; one token's window hits exactly k."""
    result = run_in_process("routing_locality.py", "--prompts", "2", "--prompt-len", "64",
                             "--windows", "1,4")
    rows = {(r["window"], r["layers"]): r for r in result["rows"]}
    assert rows[(1, "routed")]["distinct"] == rows[(1, "routed")]["single"], result
    assert rows[(4, "routed")]["ratio"] < 1.0, result


def test_prefix_repeat_benchmark_reuses_the_shared_prompt() -> None:
    result = run_in_process("prefix_repeat.py", "--preset", "micro", "--device", "cpu",
                             "--prompt-len", "200", "--batch", "8")
    assert result["kernel_backend"] == "ref" and result["per_request"] == [0] + [192] * 7, result


def test_spec_acceptance_benchmark_predicts_and_measures() -> None:
    """Offline per-position accuracy and the engine's acceptance are both well above 1 token per
    pass on dsv4-tiny (arithmetic), and the greedy tokens are the plain engine's (asserted in the
    script)."""
    result = run_in_process("spec_acceptance.py", "--prompts", "4", "--output-len", "12",
                             "--steps", "3")
    row = result["rows"][0]
    assert row["N"] == 3 and row["positions"] > 10, result
    assert 1.5 < row["predicted"] <= 4 and 1.5 < row["measured"] <= 4, result


@pytest.mark.slow
def test_backend_rounding_benchmark_finds_no_systematic_rounding() -> None:
    """The reference rounds as the kernels do: no op differs by ~1 bf16 ulp (each op compared on
    its first two calls in the prefill and in the decode step)."""
    result = run_benchmark("backend_rounding.py", "--prompts", "1", "--max-tokens", "2",
                           "--calls-per-step", "2")
    assert result["ops"], result
    worst = max(r["mean_rel"] for r in result["ops"].values())
    assert worst < 1e-4, result


def test_backend_rounding_compares_masked_scores() -> None:
    """-inf (a missing candidate's score) on both sides at the same places is no difference; a
    -inf on one side only is an infinite one (inf - inf is NaN, which `max` would skip)."""
    rel = load_benchmark("backend_rounding")._rel
    a = torch.tensor([1.0, -math.inf, 2.0])
    assert rel(a, a.clone()) == 0.0
    # mean |difference| over the finite pair against their mean |value|
    assert rel(a, torch.tensor([1.0, -math.inf, 2.5])) == pytest.approx(0.25 / 1.5)
    assert rel(a, torch.tensor([1.0, 0.0, 2.0])) == math.inf
    assert rel(a, torch.tensor([1.0, math.inf, 2.0])) == math.inf


# bench_row_reads.py is GPU only
KERNEL_BENCHMARKS = sorted(p.name for p in (ROOT / "benchmarks" / "kernels").glob("bench_*.py")
                           if p.name not in ("bench_common.py", "bench_row_reads.py"))


def test_kernel_benchmarks_are_all_smoked() -> None:
    assert len(KERNEL_BENCHMARKS) == 23, KERNEL_BENCHMARKS


@pytest.mark.parametrize("script", KERNEL_BENCHMARKS)
def test_kernel_benchmark_cpu_smoke(script: str) -> None:
    result = run_in_process(f"kernels/{script}", "--cpu-smoke")
    assert result["device"] == "cpu-interpreter", result


def test_fp8_linear_stage_sweep_times_its_sets() -> None:
    """`--stage-sweep` times the FMA tile at 3 / 4 stages beside the default (without `--sweep`
    too: the caller, not `time_configs`, decides which knob sets run)."""
    result = run_in_process("kernels/bench_fp8_linear.py", "--cpu-smoke", "--stage-sweep",
                            "--m", "1")
    for row in result["results"]:
        assert set(row["sweep"]) == {"default", "num_stages=3", "num_stages=4"}, row["case"]


def _flat_keys(d: dict[str, Any]) -> list[str]:
    out = []
    for k, v in d.items():
        out.append(k)
        if isinstance(v, dict):
            out += _flat_keys(v)
    return out


def test_model_memory_counts_the_loader_tensors() -> None:
    """Checkpoint precision holds fewer bytes than bf16 (FP4 experts: 4.25 bits a weight; FP8
    attention projections), the embedding is the same; per GPU, DP attention + EP splits the
    routed and shared experts (bf16: at least half of each per rank at 2), TP + EP also the
    attention and vocabulary, and one rank holds the whole model."""
    result = run_in_process("model_memory.py", "--presets", "micro", "--ranks", "1,2")
    row = result["rows"][0]
    bf16, ckpt = row["bytes"]["bf16"], row["bytes"]["checkpoint"]
    assert ckpt["routed experts"] < bf16["routed experts"] / 3
    assert ckpt["attention"] < bf16["attention"] and ckpt["embedding"] == bf16["embedding"]
    dp, tp = row["per_gpu"]["dp_ep"], row["per_gpu"]["tp_ep"]
    for fmt in ("bf16", "checkpoint"):
        assert dp[fmt]["1"] == tp[fmt]["1"] == row["total"][fmt]
        assert tp[fmt]["2"] < dp[fmt]["2"] < dp[fmt]["1"]
    # the decoder's routed and shared experts halve (and so do the MTP block's)
    assert dp["bf16"]["1"] - dp["bf16"]["2"] > (bf16["routed experts"]
                                                + bf16["shared expert"]) / 2
