"""Where a decode step's host time goes, per context length (issue 20: host work O(batch)).

One engine (random weights of `--preset`, built in memory) serves one request per `--contexts`
entry in turn: prefill, `--warm-steps` decode steps, then `--steps` decode steps under cProfile
with overlap scheduling off (so the host's own work is not hidden behind the device's; the time
blocked on the device shows up under the sync it happens in). Prints, per context, ms per step and
the top `--rows` functions by own time per step, then the functions whose own time per step grew
most from the first context to the last, then one JSON line (also to `--out`).

    PYTHONPATH=src python3 benchmarks/profile_host_step.py --device cuda --preset flash-4l \\
        --contexts 4096,921600 --chunked-prefill-size 4096
    PYTHONPATH=src python3 benchmarks/profile_host_step.py --device cpu --preset micro \\
        --dtype float32 --contexts 256,2048 --steps 8                       # CPU smoke
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import time
from pathlib import Path
from typing import Any

import torch

from dsv4 import EngineConfig, SamplingParams
from dsv4.checkpoint.presets import get_preset
from dsv4.checkpoint.writer import random_model
from dsv4.engine.engine import LLMEngine
from dsv4.model.loader import resolve_dtype


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="flash-4l")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--kernel-backend", default=None)
    p.add_argument("--contexts", default="4096,921600")
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--warm-steps", type=int, default=8)
    p.add_argument("--page-size", type=int, default=256)
    p.add_argument("--chunked-prefill-size", type=int, default=8192)
    p.add_argument("--rows", type=int, default=25)
    p.add_argument("--out", default=None)
    return p.parse_args()


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def per_step(stats: pstats.Stats, steps: int) -> dict[str, float]:
    """Own time per step (us) of every function, keyed file:line(name)."""
    out = {}
    for (file, line, name), (_, _, tottime, _, _) in stats.stats.items():  # type: ignore[attr-defined]
        out[f"{Path(file).name}:{line}({name})"] = tottime / steps * 1e6
    return out


def profile_context(engine: LLMEngine, args: argparse.Namespace, context: int
                    ) -> dict[str, Any]:
    device, vocab = engine.runner.device, engine.runner.model.config.vocab_size
    g = torch.Generator().manual_seed(context)
    prompt = torch.randint(0, vocab, (context,), generator=g).tolist()
    params = SamplingParams(max_tokens=args.warm_steps + args.steps + 8, temperature=0.0,
                            ignore_eos=True)
    req = engine.add_request(prompt, params)
    t0 = time.perf_counter()
    while not req.output_ids:
        engine.step()
    sync(device)
    prefill_s = time.perf_counter() - t0
    for _ in range(args.warm_steps):
        engine.step()
    sync(device)
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    for _ in range(args.steps):
        engine.step()
    sync(device)
    prof.disable()
    ms = (time.perf_counter() - t0) / args.steps * 1e3
    engine.abort(req.rid)
    while engine.has_unfinished():
        engine.step()
    own = per_step(pstats.Stats(prof), args.steps)
    return {"context": context, "prefill_s": round(prefill_s, 2), "ms_per_step": round(ms, 4),
            "own_us_per_step": own}


def main() -> None:
    args = parse_args()
    device, contexts = torch.device(args.device), [int(c) for c in args.contexts.split(",")]
    if device.type == "cpu":
        torch.set_num_threads(max(1, torch.get_num_threads() - 1))
    model = random_model(get_preset(args.preset), resolve_dtype(args.dtype), device)
    longest = max(contexts) + args.warm_steps + args.steps + 16
    config = EngineConfig(page_size=args.page_size, max_running_requests=1,
                          chunked_prefill_size=args.chunked_prefill_size,
                          kernel_backend=args.kernel_backend,
                          max_total_tokens=longest + args.page_size, context_length=longest + 1,
                          disable_prefix_cache=True, overlap_schedule=False, seed=0)
    engine = LLMEngine(model, config)
    rows = [profile_context(engine, args, c) for c in contexts]
    for r in rows:
        top = sorted(r["own_us_per_step"].items(), key=lambda kv: -kv[1])[:args.rows]
        print(f"context {r['context']}: {r['ms_per_step']} ms / step (prefill {r['prefill_s']} s)")
        for name, us in top:
            print(f"  {us:9.1f} us  {name}")
    first, last = rows[0]["own_us_per_step"], rows[-1]["own_us_per_step"]
    grew = sorted(((last.get(k, 0.0) - first.get(k, 0.0), k) for k in set(first) | set(last)),
                  reverse=True)[:args.rows]
    print(f"own time per step grown from context {contexts[0]} to {contexts[-1]}:")
    for delta, name in grew:
        print(f"  {delta:+9.1f} us  {name}")
    for r in rows:      # the JSON keeps the top functions only
        r["own_us_per_step"] = {k: round(v, 1) for k, v in sorted(
            r["own_us_per_step"].items(), key=lambda kv: -kv[1])[:60]}
    out = {"benchmark": "profile_host_step", "preset": args.preset, "device": args.device,
           "dtype": args.dtype, "steps": args.steps, "page_size": args.page_size,
           "rows": rows, "grown_us": [[round(d, 1), k] for d, k in grew]}
    line = json.dumps(out)
    print(line)
    if args.out:
        Path(args.out).write_text(line + "\n")


if __name__ == "__main__":
    main()
