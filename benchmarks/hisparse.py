"""HiSparse off vs on: long requests admitted within one KV budget, and their decode speed.

With HiSparse (issue 25) the C4 attention entries of every request live in host memory and each
request keeps a small hot set of them per C4 layer on the device, so the same device budget
holds more tokens. For each mode, one engine on the same model and the same `--kv-cache-memory-gb`:

1. **admitted**: how many requests of `--prompt-len` + `--output-len` tokens the planned pools
   hold at once (the full pool's tokens over one request's pages, capped by the running-request
   limit): what the scheduler can admit without preempting;
2. **decode** at each `--concurrency` (at most what the mode admits; `max`: exactly that): fill
   that many requests' caches, run `--warm-steps` decode steps (the CUDA graph of that batch is
   captured there), then time `--steps` decode steps as a server runs them (no sync between
   steps, so overlap scheduling hides the host's preparation): output tokens/s, TPOT p50 / p99
   (the intervals between steps); then `--steps` more, each followed by a device sync (the
   `synced_*` figures: every step's host work exposed, this benchmark's first protocol); and
   with HiSparse the hot set's counters (picks, entries swapped in, bytes swapped
   per output token); with `--profile-steps N`, N more steps under `torch.profiler`: the GPU
   time per step by kernel family (`KERNEL_FAMILIES`: the HiSparse copies and plan, the
   indexer, top-k, attention, experts, ...) and the top kernels, which is where a missed target's
   bottleneck is read.
Both modes decode through the CUDA graphs on a GPU (HiSparse's copies read and write the pinned
mirror in place); `--eager` runs both eagerly.

Filling the caches. `--fill prefill` (default) prefills every request's own random prompt: the
honest fill, but a 200K-token prompt costs tens of seconds on one GPU, so dozens of them do not
fit one device call. `--fill shared-prefix` prefills one random prompt of `--prompt-len` -
`--unique-len` tokens once and gives every request that prefix (a prefix-cache hit) plus its own
`--unique-len` random tokens: each request then decodes over a `--prompt-len` context with its
own queries, picks and (HiSparse) hot set, at the cost of one long prefill. The shared pages cost
no memory per request, so the admitted counts come from the plan (1.), never from what the shared
fill happens to hold; HiSparse off reads the shared C4 entries from one pool, which can only help
its caches (a conservative comparison for HiSparse on).

Random weights built in memory (`random_model`). Prints a table, then one JSON line.

    PYTHONPATH=src python3 benchmarks/hisparse.py --preset flash-43l-e16 --device cuda \\
        --kv-cache-memory-gb 40 --prompt-len 200000 --output-len 2048 --concurrency 1,16,max \\
        --fill shared-prefix
    PYTHONPATH=src python3 benchmarks/hisparse.py --preset micro --device cpu \\
        --prompt-len 200 --output-len 16 --concurrency 1,2 --steps 4        # CPU smoke
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import time
from typing import Any

import torch
from profile_engine_step import busy  # a sibling script
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from dsv4 import EngineConfig, SamplingParams
from dsv4.checkpoint.presets import get_preset
from dsv4.checkpoint.writer import random_model
from dsv4.engine.engine import LLMEngine
from dsv4.model.deepseek_v4 import DeepSeekV4ForCausalLM
from dsv4.model.loader import resolve_device, resolve_dtype

# kernel families of a decode step, first match wins (a kernel's name against each pattern);
# `_combine_kernel` is both the experts' sum over k and sparse attention's split merge
KERNEL_FAMILIES = (
    ("hisparse copies", r"_swap_in_|_write_rows_"),
    ("hisparse plan", r"_hot_plan_"),
    ("indexer scores", r"_index_scores_"),
    ("top-k", r"_coop_|_hist_|_compact_|_tail_|_topk_|_pick_slots_"),
    ("sparse attention", r"_sparse_attention_"),
    ("compressors", r"_compress|_ring_write_"),
    ("experts", r"_gate_up|_down_|_tile_map_|_gate_select_|_swiglu_"),
    ("combines", r"_combine_"),
    ("projections", r"_gemv_|_mm_kernel|_fp8_linear|gemm|nvjet|cutlass|xmma|sm90_"),
    ("mhc, norms, rope", r"_mhc_|_post_project_|_norm_rope_|_rope_rows_"),
)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="flash-43l-e16")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default=None, help="default: bfloat16 on cuda, float32 on cpu")
    p.add_argument("--kernel-backend", default=None)
    p.add_argument("--kv-cache-memory-gb", type=float, default=40.0)
    p.add_argument("--prompt-len", type=int, default=200_000)
    p.add_argument("--output-len", type=int, default=2048)
    p.add_argument("--concurrency", default="1,4,16",
                   help="comma-separated request counts; 'max': the mode's admitted count")
    p.add_argument("--max-running-requests", type=int, default=256,
                   help="the running-request limit (it also caps the full pool: keep it large)")
    p.add_argument("--hot-entries", type=int, default=None,
                   help="hisparse_device_entries (default: the engine's)")
    p.add_argument("--steps", type=int, default=32, help="timed decode steps per level")
    p.add_argument("--warm-steps", type=int, default=2,
                   help="untimed decode steps first (the batch's CUDA graph is captured there)")
    p.add_argument("--chunked-prefill-size", type=int, default=8192)
    p.add_argument("--page-size", type=int, default=256)
    p.add_argument("--eager", action="store_true", help="both modes without CUDA graphs")
    p.add_argument("--fill", choices=("prefill", "shared-prefix"), default="prefill",
                   help="how each level's caches are filled (module docstring)")
    p.add_argument("--unique-len", type=int, default=256,
                   help="--fill shared-prefix: each request's own tokens after the shared prefix")
    p.add_argument("--profile-steps", type=int, default=0,
                   help="after the timed steps of each level, profile this many more: GPU ms "
                   "per step by kernel family and the top kernels (0: no profile)")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def make_engine(model: DeepSeekV4ForCausalLM, args: argparse.Namespace, hisparse: bool,
                graphs: bool) -> LLMEngine:
    return LLMEngine(model, EngineConfig(
        page_size=args.page_size, chunked_prefill_size=args.chunked_prefill_size,
        max_running_requests=args.max_running_requests, kernel_backend=args.kernel_backend,
        kv_cache_memory_gb=args.kv_cache_memory_gb,
        disable_prefix_cache=args.fill != "shared-prefix",
        context_length=args.prompt_len + args.output_len + 1, disable_cuda_graph=not graphs,
        enable_hisparse=hisparse, hisparse_device_entries=args.hot_entries if hisparse else None,
        warmup="none", seed=args.seed))


def admitted(engine: LLMEngine, args: argparse.Namespace) -> int:
    """Requests of prompt + output tokens the planned full pool holds at once (whole pages)."""
    P = args.page_size
    pages = -(-(args.prompt_len + args.output_len) // P)
    return min(engine.max_total_tokens // (pages * P), args.max_running_requests)


def prompts(engine: LLMEngine, args: argparse.Namespace, c: int) -> list[list[int]]:
    """`c` random prompts of `args.prompt_len` tokens; with `--fill shared-prefix`, one shared
    prefix (the same at every level; a one-token request puts it in the prefix cache, prefilled
    at the first level and a cache hit after) and a random tail of `args.unique_len` tokens
    each."""
    vocab = engine.runner.model.config.vocab_size
    g = torch.Generator().manual_seed(args.seed + c)

    def rand(n: int, gen: torch.Generator = g) -> list[int]:
        return torch.randint(2, vocab, (n,), generator=gen).tolist()

    if args.fill == "prefill":
        return [rand(args.prompt_len) for _ in range(c)]
    if not 0 < args.unique_len < args.prompt_len:
        raise ValueError(f"--unique-len={args.unique_len} is invalid; allowed: 1 .. "
                         f"--prompt-len - 1 = {args.prompt_len - 1}")
    prefix = rand(args.prompt_len - args.unique_len, torch.Generator().manual_seed(args.seed))
    seed = engine.add_request(prefix, SamplingParams(max_tokens=1, temperature=0.0))
    while engine.has_unfinished():
        engine.step()
    assert seed.output_ids, "the shared prefix's request finished without a token"
    return [prefix + rand(args.unique_len) for _ in range(c)]


def pipelined_steps(engine: LLMEngine, n: int) -> tuple[list[float], float]:
    """n decode steps as a server runs them (no sync between them: under overlap scheduling the
    host prepares step i + 1 while the device runs step i): (the intervals between the steps'
    returns, each one output token per request, the TPOT a client sees; the seconds from the
    first launch to the device finishing the last step)."""
    device = engine.runner.device
    sync(device)
    start = prev = time.perf_counter()
    intervals = []
    for _ in range(n):
        engine.step()
        now = time.perf_counter()
        intervals.append(now - prev)
        prev = now
    sync(device)
    return intervals, time.perf_counter() - start


def synced_steps(engine: LLMEngine, n: int) -> list[float]:
    """n decode steps each followed by a device sync (the host's preparation of every step
    exposed: the earlier protocol of this benchmark, kept beside the pipelined one)."""
    device = engine.runner.device
    steps = []
    for _ in range(n):
        t0 = time.perf_counter()
        engine.step()
        sync(device)
        steps.append(time.perf_counter() - t0)
    return steps


def _ms(seconds: float) -> float:
    return round(1000 * seconds, 3)


def _p99_ms(steps: list[float]) -> float:
    return _ms(sorted(steps)[int(0.99 * (len(steps) - 1))])


def decode_level(engine: LLMEngine, args: argparse.Namespace, c: int) -> dict[str, Any]:
    """Fill `c` requests' caches (`prompts`, then their prefills), then time `args.steps` decode
    steps as a server runs them and `args.steps` more each synced (`pipelined_steps`,
    `synced_steps`); with `--profile-steps`, profile more (`profile_steps`)."""
    device = engine.runner.device
    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    cached = engine.scheduler.cached_prompt_tokens
    reqs = [engine.add_request(p, params) for p in prompts(engine, args, c)]
    while not all(r.output_ids for r in reqs):
        engine.step()
    sync(device)
    prefill_s = time.perf_counter() - start
    cached = engine.scheduler.cached_prompt_tokens - cached
    for _ in range(args.warm_steps):
        engine.step()
    sync(device)
    hot = engine.runner.pools.hot
    before = {k: int(v) for k, v in hot.stats().items()} if hot is not None else {}
    steps, total = pipelined_steps(engine, args.steps)
    synced = synced_steps(engine, args.steps)
    row: dict[str, Any] = {
        "concurrency": c, "fill": args.fill, "fill_s": round(prefill_s, 3),
        "cached_prompt_tokens": cached,
        "running": engine.num_running, "tok_s": round(c * len(steps) / total, 1),
        "tpot_ms_p50": _ms(statistics.median(steps)), "tpot_ms_p99": _p99_ms(steps),
        "synced_tok_s": round(c * len(synced) / sum(synced), 1),
        "synced_tpot_ms_p50": _ms(statistics.median(synced)),
        "synced_tpot_ms_p99": _p99_ms(synced)}
    if hot is not None:
        after = {k: int(v) for k, v in hot.stats().items()}
        delta = {k.split("/")[1]: after[k] - before[k] for k in after}
        row_bytes = hot.device_pool.shape[-1] * hot.device_pool.element_size()
        tokens = c * (len(steps) + len(synced))   # the steps both loops ran
        row.update({f"hot_{k}": v for k, v in delta.items()},
                   hit_rate=round(1 - delta["swapped"] / max(1, delta["picked"]), 4),
                   swapped_bytes_per_token=round(delta["swapped"] * row_bytes / tokens))
    if args.profile_steps:
        row["profile"] = profile_steps(engine, args.profile_steps)
    for r in reqs:
        engine.abort(r.rid)
    while engine.has_unfinished():      # a step still in flight (overlap scheduling)
        engine.step()
    return row


def kernel_family(kernel: str) -> str:
    """The `KERNEL_FAMILIES` name of a kernel (its profiler name), or "other"."""
    return next((name for name, pat in KERNEL_FAMILIES if re.search(pat, kernel)), "other")


def profile_steps(engine: LLMEngine, steps: int, top: int = 12) -> dict[str, Any]:
    """`steps` more decode steps under `torch.profiler`: GPU ms per step (the kernels' summed
    durations, and their union over the streams), by `KERNEL_FAMILIES` ("other": the rest) and
    the `top` kernels. On the CPU there are no kernels: the step's wall ms only."""
    device = engine.runner.device
    cuda = device.type == "cuda"
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    start = time.perf_counter()
    with profile(activities=acts) as prof:
        for _ in range(steps):
            engine.step()
            sync(device)
    out: dict[str, Any] = {"steps": steps,
                           "wall_ms_per_step": round(1e3 * (time.perf_counter() - start) / steps,
                                                     3)}
    kernels = [e for e in prof.key_averages() if e.device_type == DeviceType.CUDA]
    if not kernels:
        return out
    ms = {e.key: e.self_device_time_total / steps / 1e3 for e in kernels}
    families = {name: 0.0 for name, _ in KERNEL_FAMILIES} | {"other": 0.0}
    for key, t in ms.items():
        families[kernel_family(key)] += t
    out.update({"gpu_ms_per_step": round(sum(ms.values()), 3),
                "kernels_per_step": sum(e.count for e in kernels) / steps,
                **{k: round(v, 3) for k, v in busy(prof, steps).items()},
                "families_ms": {k: round(v, 3) for k, v in families.items()},
                "top_ms": [[k[:80], round(t, 3)] for k, t in
                           sorted(ms.items(), key=lambda kv: -kv[1])[:top]]})
    return out


def run_mode(model: DeepSeekV4ForCausalLM, args: argparse.Namespace, name: str, hisparse: bool,
             graphs: bool, levels: list[str]) -> dict[str, Any]:
    engine = make_engine(model, args, hisparse, graphs)
    fit = admitted(engine, args)
    print(f"{name}: {engine.max_total_tokens} tokens in the full pool, {fit} requests admitted",
          flush=True)
    rows = []
    wanted = sorted({fit if c == "max" else int(c) for c in levels})
    for c in [c for c in wanted if c <= fit]:
        rows.append(decode_level(engine, args, c))
        print(f"  {name} level: {json.dumps(rows[-1])}", flush=True)  # kept if a later one dies
    engine.check_integrity()
    return {"mode": name, "hisparse": hisparse, "cuda_graphs": graphs,
            "max_total_tokens": engine.max_total_tokens, "admitted": fit, "levels": rows}


def main() -> None:
    args = parse_args()
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    model = random_model(get_preset(args.preset), dtype, device, args.seed)
    levels = args.concurrency.split(",")
    for c in levels:
        if c != "max" and not (c.isdigit() and int(c) > 0):
            raise ValueError(f"--concurrency level {c!r} is invalid; allowed: integers >= 1 "
                             "or 'max'")
    graphs = device.type == "cuda" and not args.eager
    results = [run_mode(model, args, name, on, graphs, levels)
               for name, on in (("off", False), ("on", True))]
    off, on = results[0], results[1]
    print(f"{'mode':<11}{'admitted':>9}{'c':>5}{'tok/s':>10}{'TPOT p50':>10}{'TPOT p99':>10}"
          f"{'synced p50':>11}{'hit rate':>10}{'swap B/tok':>12}")
    for res in results:
        for r in res["levels"] or [{}]:
            print(f"{res['mode']:<11}{res['admitted']:>9}{r.get('concurrency', '-'):>5}"
                  f"{r.get('tok_s', '-'):>10}{r.get('tpot_ms_p50', '-'):>10}"
                  f"{r.get('tpot_ms_p99', '-'):>10}{r.get('synced_tpot_ms_p50', '-'):>11}"
                  f"{r.get('hit_rate', '-'):>10}{r.get('swapped_bytes_per_token', '-'):>12}")
    for res in results:
        for r in res["levels"]:
            fams = r.get("profile", {}).get("families_ms")
            if fams:
                print(f"{res['mode']} c={r['concurrency']} GPU ms/step by family: "
                      + ", ".join(f"{k} {v}" for k, v in fams.items() if v))
    best = {res["mode"]: max((r["tok_s"] for r in res["levels"]), default=0.0)
            for res in results}
    print(json.dumps({
        "benchmark": "hisparse", "preset": args.preset, "device": str(device),
        "dtype": str(dtype).removeprefix("torch."), "kv_cache_memory_gb": args.kv_cache_memory_gb,
        "prompt_len": args.prompt_len, "output_len": args.output_len, "fill": args.fill,
        "unique_len": args.unique_len if args.fill == "shared-prefix" else None,
        "cuda_graphs": graphs, "modes": results,
        "admitted_ratio": round(on["admitted"] / max(1, off["admitted"]), 3),
        "best_tok_s_ratio": round(best["on"] / best["off"], 3) if best["off"] else None,
        "torch": torch.__version__}))


if __name__ == "__main__":
    main()
