"""Engine equivalence across kernel backends at real shapes: greedy generations with `ref` and `triton`.

Random weights for a preset (generated in memory), a few long prompts so the C4 layers have more
entries than index_topk (real top-k selection), greedy decoding with each backend; reports the
fraction of identical tokens and the largest log-prob difference, then one JSON line.

    python benchmarks/engine_backend_check.py --preset flash-4l --device cuda --dtype bfloat16
"""

from __future__ import annotations

import argparse
import json

import torch

from dsv4 import EngineConfig, SamplingParams
from dsv4.checkpoint.presets import get_preset
from dsv4.checkpoint.writer import random_model
from dsv4.engine.engine import LLMEngine
from dsv4.model.loader import resolve_device, resolve_dtype


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="micro")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--prompt-len", type=int, default=3000)
    p.add_argument("--num-prompts", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--page-size", type=int, default=256)
    args = p.parse_args()
    model = random_model(get_preset(args.preset), resolve_dtype(args.dtype), resolve_device(args.device))
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(2, model.config.vocab_size, (args.prompt_len + 37 * i,), generator=g).tolist()
               for i in range(args.num_prompts)]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    outs = {}
    for backend in ("ref", "triton"):
        config = EngineConfig(page_size=args.page_size, kernel_backend=backend, chunked_prefill_size=4096,
                              max_total_tokens=args.num_prompts * (args.prompt_len + 512) + 4096)
        engine = LLMEngine(model, config)
        reqs = [engine.add_request(pr, params) for pr in prompts]
        while engine.has_unfinished():
            engine.step()
        outs[backend] = reqs
    same = sum(a == b for r, t in zip(outs["ref"], outs["triton"], strict=True)
               for a, b in zip(r.output_ids, t.output_ids, strict=True))
    total = sum(len(r.output_ids) for r in outs["ref"])
    first_diff = [next((i for i, (a, b) in enumerate(zip(r.output_ids, t.output_ids, strict=True)) if a != b), None)
                  for r, t in zip(outs["ref"], outs["triton"], strict=True)]
    lp = max(abs(a - b) for r, t in zip(outs["ref"], outs["triton"], strict=True)
             for a, b, x, y in zip(r.logprobs, t.logprobs, r.output_ids, t.output_ids, strict=True) if x == y)
    print(f"identical tokens {same}/{total}; first divergence per request {first_diff}; max |dlogprob| {lp:.3e}")
    print(json.dumps({"check": "engine_backend", "preset": args.preset, "device": args.device, "dtype": args.dtype,
                      "prompt_len": args.prompt_len, "identical_tokens": same, "total_tokens": total,
                      "first_divergence": first_diff, "max_abs_logprob_diff": lp}))


if __name__ == "__main__":
    main()
