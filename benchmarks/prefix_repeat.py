"""Prefix-cache reuse of one prompt repeated by a batch of concurrent requests, default settings.

    PYTHONPATH=src python benchmarks/prefix_repeat.py --preset flash-4l --device cuda
    PYTHONPATH=src python benchmarks/prefix_repeat.py --preset micro --device cpu \
        --prompt-len 200 --batch 8                                   # CPU smoke

Random weights of `--preset`, an engine with default settings except `max_running_requests =
--batch` (so on CUDA: the triton backend, CUDA graphs and a KV budget of `mem_fraction_static`),
`--batch` requests of the same random `--prompt-len`-token prompt added at once, greedy,
`--max-tokens` each. Reports the prompt tokens served from the prefix cache over all prompt
tokens (at most (batch - 1) / batch x (whole pages short of the prompt's end) / prompt length:
the first request finds nothing, and a request always computes its prompt's last token), the
wall time (cold: Triton compilation included on a fresh process), steps and preemptions. Prints
one line, then one JSON line (also written to --out).

`--distinct`: `--batch` different prompts, run once and then again (both rounds at batch
`--batch`); reported is the second round's reuse (at most (whole pages short of the prompt's
end) / prompt length: e.g. 15 of 16 pages at 4,096 tokens, page 256). This is the workload whose
prompts' cached pages outgrow the SWA pool (docs/cache.md: anchors).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from dsv4.checkpoint.presets import get_preset
from dsv4.checkpoint.writer import random_model
from dsv4.config.engine import EngineConfig
from dsv4.engine.engine import LLMEngine
from dsv4.engine.sampling_params import SamplingParams
from dsv4.model.loader import resolve_device, resolve_dtype


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="flash-4l")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default=None, help="default: bfloat16 on cuda, float32 on cpu")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=4096)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--distinct", action="store_true",
                   help="distinct prompts, run twice; the second round's reuse")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    device = resolve_device(args.device)
    dtype = args.dtype or ("bfloat16" if device.type == "cuda" else "float32")
    config = get_preset(args.preset)
    model = random_model(config, resolve_dtype(dtype), device, seed=0)
    engine = LLMEngine(model, EngineConfig(max_running_requests=args.batch,
                                           **({} if device.type == "cuda" else
                                              {"page_size": 16})))
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(2, config.vocab_size, (args.prompt_len,), generator=gen).tolist()
               for _ in range(args.batch if args.distinct else 1)]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    for _ in range(2 if args.distinct else 1):
        reqs = [engine.add_request(prompts[i % len(prompts)], params) for i in range(args.batch)]
        t0 = time.perf_counter()
        while engine.has_unfinished():
            engine.step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    hits = [r.cached_tokens for r in reqs]
    r = engine.runner
    result = {"bench": "prefix_repeat", "distinct": args.distinct, "preset": args.preset,
              "device": str(device),
              "gpu": torch.cuda.get_device_name() if device.type == "cuda" else None,
              "torch": torch.__version__, "batch": args.batch, "prompt_len": args.prompt_len,
              "cached_tokens": sum(hits), "prompt_tokens": args.batch * args.prompt_len,
              "reuse": sum(hits) / (args.batch * args.prompt_len), "per_request": hits,
              "wall_s": wall, "steps": engine.steps,
              "preemptions": engine.scheduler.num_preemptions,
              "kernel_backend": r.config.kernel_backend,
              "kv_budget_gb": r.config.kv_cache_memory_gb,
              "full_pages": r.layout.num_full_pages, "swa_pages": r.layout.num_swa_pages,
              "page_size": r.layout.page_size}
    print(f"reuse {result['reuse']:.4f} ({sum(hits)} of {result['prompt_tokens']} prompt tokens), "
          f"{wall:.2f} s, {engine.steps} steps, {result['preemptions']} preemptions, "
          f"{r.config.kernel_backend}, KV {r.config.kv_cache_memory_gb:.1f} GB")
    print(json.dumps(result))
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
