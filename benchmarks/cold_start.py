"""Cold start (issue 20): the first long request in a fresh process against a warm one.

    PYTHONPATH=src python benchmarks/cold_start.py --device cuda --prompt-len 131072 \
        --warmup fast --fresh-triton-cache --out cold.json

Random weights of `--preset` (default flash-4l, bf16; `--weight-format checkpoint`: FP4 experts
and FP8 linears) generated in memory. One engine warms up
as `--warmup` says (`engine/warmup.py`; timed), then serves two requests one after the other,
each `--prompt-len` random tokens with `--decode` greedy tokens: the first pays whatever the
warmup left (Triton compiles of shapes it did not cover, graph captures), the second is warm.
Per request: TTFT (add -> first token) and every decode step's time; reported: the warmup
seconds, both TTFTs and their ratio (target <= 1.2), the slowest decode step of the first
request against the median warm step (target <= 2x). `--fresh-triton-cache` points
TRITON_CACHE_DIR at an empty directory first (a machine that never compiled these kernels);
without it the persistent cache of earlier runs applies. Every Triton specialisation built in
the process is logged with its phase (warmup, first, warm), kernel, seconds and key
(`compile_times.py`; `compiles` in the JSON: what the warmup missed; `slowest_compiles`: the five
slowest builds with their constexprs). Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).parent))
from compile_times import CompileLog  # noqa: E402


def serve_one(engine: Any, prompt: list[int], decode: int) -> dict[str, Any]:
    """TTFT and decode step times (s) of one request run alone to completion."""
    from dsv4 import SamplingParams

    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    params = SamplingParams(max_tokens=decode, temperature=0.0, ignore_eos=True)
    sync()
    t0 = time.perf_counter()
    req = engine.add_request(prompt, params)
    while not req.output_ids:
        engine.step()
    sync()
    ttft = time.perf_counter() - t0
    steps = []
    while not req.is_finished:
        t = time.perf_counter()
        engine.step()
        sync()
        steps.append(time.perf_counter() - t)
    engine.pop(req.rid)
    return {"ttft_s": ttft, "decode_steps_s": steps}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="flash-4l")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--weight-format", default="bf16", choices=["bf16", "checkpoint"],
                   help="checkpoint: routed experts in FP4 and linears in FP8, as the official "
                        "checkpoint stores them (random values)")
    p.add_argument("--prompt-len", type=int, default=131072)
    p.add_argument("--decode", type=int, default=32)
    p.add_argument("--warmup", default="fast", choices=["none", "fast", "full"])
    p.add_argument("--chunked-prefill-size", type=int, default=8192)
    p.add_argument("--fresh-triton-cache", action="store_true")
    p.add_argument("--triton-cache", type=Path, default=None,
                   help="TRITON_CACHE_DIR for this process (e.g. the one an earlier run filled: "
                        "a fresh process on a machine that has compiled before)")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    if args.fresh_triton_cache and args.triton_cache is not None:
        p.error("--fresh-triton-cache and --triton-cache exclude each other")
    if args.fresh_triton_cache:           # before anything imports triton
        os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="triton-cold-")
    elif args.triton_cache is not None:
        args.triton_cache.mkdir(parents=True, exist_ok=True)
        os.environ["TRITON_CACHE_DIR"] = str(args.triton_cache)

    from dsv4.checkpoint.presets import get_preset
    from dsv4.checkpoint.writer import random_model
    from dsv4.config.engine import EngineConfig
    from dsv4.engine.engine import LLMEngine
    from dsv4.engine.warmup import warm_up
    from dsv4.model.loader import resolve_device, resolve_dtype

    config = get_preset(args.preset)
    model = random_model(config, resolve_dtype(args.dtype), resolve_device(args.device), 0,
                         args.weight_format)
    longest = args.prompt_len + args.decode
    engine = LLMEngine(model, EngineConfig(
        page_size=256, max_running_requests=8, chunked_prefill_size=args.chunked_prefill_size,
        max_total_tokens=2 * (longest + 256), context_length=longest + 1,
        disable_prefix_cache=True, warmup=args.warmup))
    compiles = CompileLog() if args.device.startswith("cuda") else None
    gen = torch.Generator().manual_seed(0)
    runs = []
    with compiles or contextlib.nullcontext():
        warmup_s = warm_up(engine)
        for phase in ("first", "warm"):
            if compiles is not None:
                compiles.phase = phase
            runs.append(serve_one(engine, torch.randint(2, config.vocab_size, (args.prompt_len,),
                                                        generator=gen).tolist(), args.decode))
    cold, warm = runs
    warm_step = statistics.median(warm["decode_steps_s"])
    row = {"warmup": args.warmup, "warmup_s": warmup_s, "first_ttft_s": cold["ttft_s"],
           "warm_ttft_s": warm["ttft_s"], "ttft_ratio": cold["ttft_s"] / warm["ttft_s"],
           "first_max_step_ms": 1e3 * max(cold["decode_steps_s"]),
           "warm_median_step_ms": 1e3 * warm_step,
           "step_ratio": max(cold["decode_steps_s"]) / warm_step}
    print(f"{'warmup':>6} {'warmup s':>9} {'first TTFT':>11} {'warm TTFT':>10} {'ratio':>6} "
          f"{'first max ms':>13} {'warm ms':>8} {'ratio':>6}")
    print(f"{args.warmup:>6} {warmup_s:9.2f} {row['first_ttft_s']:11.3f} "
          f"{row['warm_ttft_s']:10.3f} {row['ttft_ratio']:6.2f} "
          f"{row['first_max_step_ms']:13.2f} {row['warm_median_step_ms']:8.2f} "
          f"{row['step_ratio']:6.2f}")
    line = {"preset": args.preset, "device": args.device, "dtype": args.dtype,
            "weight_format": args.weight_format,
            "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
            "torch": torch.__version__, "prompt_len": args.prompt_len,
            "fresh_triton_cache": args.fresh_triton_cache,
            "triton_cache": os.environ.get("TRITON_CACHE_DIR"), "row": row, "runs": runs,
            "compile_summary": compiles.summary() if compiles else None,
            "slowest_compiles": compiles.slowest() if compiles else None,
            "compiles": [r for r in compiles.records if r["phase"] != "warmup"]
            if compiles else None}
    print(json.dumps(line))
    if args.out is not None:
        args.out.write_text(json.dumps(line, indent=2) + "\n")


if __name__ == "__main__":
    main()
