"""HiSparse off vs on: long requests admitted within one KV budget, and their decode speed.

With HiSparse (issue 25) the C4 attention entries of every request live in host memory and each
request keeps a small hot set of them per C4 layer on the device, so the same device budget
holds more tokens. For each mode, one engine on the same model and the same `--kv-cache-memory-gb`:

1. **admitted**: how many requests of `--prompt-len` + `--output-len` tokens the planned pools
   hold at once (the full pool's tokens over one request's pages, capped by the running-request
   limit): what the scheduler can admit without preempting;
2. **decode** at each `--concurrency` (at most what the mode admits): prefill that many prompts,
   then time `--steps` decode steps: output tokens/s, TPOT p50 / p99 (per step), and with HiSparse
   the hot set's counters (picks, entries swapped in, bytes swapped per output token).
HiSparse refuses CUDA graphs, so by default both modes decode eagerly (`--off-graphs` also times
HiSparse off with its CUDA graphs). Random weights built in memory (`random_model`). Prints a
table, then one JSON line.

    PYTHONPATH=src python3 benchmarks/hisparse.py --preset flash-43l-e16 --device cuda \\
        --kv-cache-memory-gb 40 --prompt-len 200000 --output-len 2048 --concurrency 1,4,16
    PYTHONPATH=src python3 benchmarks/hisparse.py --preset micro --device cpu \\
        --prompt-len 200 --output-len 16 --concurrency 1,2 --steps 4        # CPU smoke
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import torch

from dsv4 import EngineConfig, SamplingParams
from dsv4.checkpoint.presets import get_preset
from dsv4.checkpoint.writer import random_model
from dsv4.engine.engine import LLMEngine
from dsv4.model.deepseek_v4 import DeepSeekV4ForCausalLM
from dsv4.model.loader import resolve_device, resolve_dtype


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="flash-43l-e16")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default=None, help="default: bfloat16 on cuda, float32 on cpu")
    p.add_argument("--kernel-backend", default=None)
    p.add_argument("--kv-cache-memory-gb", type=float, default=40.0)
    p.add_argument("--prompt-len", type=int, default=200_000)
    p.add_argument("--output-len", type=int, default=2048)
    p.add_argument("--concurrency", default="1,4,16")
    p.add_argument("--max-running-requests", type=int, default=256,
                   help="the running-request limit (it also caps the full pool: keep it large)")
    p.add_argument("--hot-entries", type=int, default=None,
                   help="hisparse_device_entries (default: the engine's)")
    p.add_argument("--steps", type=int, default=32, help="timed decode steps per level")
    p.add_argument("--chunked-prefill-size", type=int, default=8192)
    p.add_argument("--page-size", type=int, default=256)
    p.add_argument("--off-graphs", action="store_true",
                   help="also time HiSparse off with CUDA graphs")
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
        kv_cache_memory_gb=args.kv_cache_memory_gb, disable_prefix_cache=True,
        context_length=args.prompt_len + args.output_len + 1, disable_cuda_graph=not graphs,
        enable_hisparse=hisparse, hisparse_device_entries=args.hot_entries if hisparse else None,
        warmup="none", seed=args.seed))


def admitted(engine: LLMEngine, args: argparse.Namespace) -> int:
    """Requests of prompt + output tokens the planned full pool holds at once (whole pages)."""
    P = args.page_size
    pages = -(-(args.prompt_len + args.output_len) // P)
    return min(engine.max_total_tokens // (pages * P), args.max_running_requests)


def decode_level(engine: LLMEngine, args: argparse.Namespace, c: int) -> dict[str, Any]:
    """Prefill `c` prompts, then time `args.steps` decode steps one by one."""
    device, vocab = engine.runner.device, engine.runner.model.config.vocab_size
    g = torch.Generator().manual_seed(args.seed + c)
    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    reqs = [engine.add_request(torch.randint(2, vocab, (args.prompt_len,), generator=g).tolist(),
                               params) for _ in range(c)]
    start = time.perf_counter()
    while not all(r.output_ids for r in reqs):
        engine.step()
    sync(device)
    prefill_s = time.perf_counter() - start
    hot = engine.runner.pools.hot
    before = {k: int(v) for k, v in hot.stats().items()} if hot is not None else {}
    steps = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        engine.step()
        sync(device)
        steps.append(time.perf_counter() - t0)
    row: dict[str, Any] = {
        "concurrency": c, "prefill_s": round(prefill_s, 3),
        "running": engine.num_running, "tok_s": round(c * len(steps) / sum(steps), 1),
        "tpot_ms_p50": round(1000 * statistics.median(steps), 3),
        "tpot_ms_p99": round(1000 * sorted(steps)[int(0.99 * (len(steps) - 1))], 3)}
    if hot is not None:
        after = {k: int(v) for k, v in hot.stats().items()}
        delta = {k.split("/")[1]: after[k] - before[k] for k in after}
        row_bytes = hot.device_pool.shape[-1] * hot.device_pool.element_size()
        tokens = c * len(steps)
        row.update({f"hot_{k}": v for k, v in delta.items()},
                   hit_rate=round(1 - delta["swapped"] / max(1, delta["picked"]), 4),
                   swapped_bytes_per_token=round(delta["swapped"] * row_bytes / tokens))
    for r in reqs:
        engine.abort(r.rid)
    return row


def run_mode(model: DeepSeekV4ForCausalLM, args: argparse.Namespace, name: str, hisparse: bool,
             graphs: bool, levels: list[int]) -> dict[str, Any]:
    engine = make_engine(model, args, hisparse, graphs)
    fit = admitted(engine, args)
    print(f"{name}: {engine.max_total_tokens} tokens in the full pool, {fit} requests admitted",
          flush=True)
    rows = []
    for c in [c for c in levels if c <= fit]:
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
    levels = [int(c) for c in args.concurrency.split(",")]
    modes = [("off", False, False), ("on", True, False)]
    if args.off_graphs:
        modes.append(("off+graphs", False, True))
    results = [run_mode(model, args, *m, levels) for m in modes]
    off, on = results[0], results[1]
    print(f"{'mode':<11}{'admitted':>9}{'c':>5}{'tok/s':>10}{'TPOT p50':>10}{'TPOT p99':>10}"
          f"{'hit rate':>10}{'swap B/tok':>12}")
    for res in results:
        for r in res["levels"] or [{}]:
            print(f"{res['mode']:<11}{res['admitted']:>9}{r.get('concurrency', '-'):>5}"
                  f"{r.get('tok_s', '-'):>10}{r.get('tpot_ms_p50', '-'):>10}"
                  f"{r.get('tpot_ms_p99', '-'):>10}{r.get('hit_rate', '-'):>10}"
                  f"{r.get('swapped_bytes_per_token', '-'):>12}")
    best = {res["mode"]: max((r["tok_s"] for r in res["levels"]), default=0.0)
            for res in results}
    print(json.dumps({
        "benchmark": "hisparse", "preset": args.preset, "device": str(device),
        "dtype": str(dtype).removeprefix("torch."), "kv_cache_memory_gb": args.kv_cache_memory_gb,
        "prompt_len": args.prompt_len, "output_len": args.output_len, "modes": results,
        "admitted_ratio": round(on["admitted"] / max(1, off["admitted"]), 3),
        "best_tok_s_ratio": round(best["on"] / best["off"], 3) if best["off"] else None,
        "torch": torch.__version__}))


if __name__ == "__main__":
    main()
