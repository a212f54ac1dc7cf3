"""Profile engine steps (torch.profiler) on random weights: where does a prefill / decode step go?

Runs a warm-up, then profiles `--steps` engine steps of a batch of prompts and prints the top
operators by self CUDA time and by self CPU time (a table each), then one JSON line with the step
times.

    python benchmarks/profile_engine_step.py --preset flash-4l --device cuda --dtype bfloat16
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from torch.profiler import ProfilerActivity, profile

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
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=300)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--kernel-backend", default="ref")
    p.add_argument("--warm-steps", type=int, default=0,
                   help="steps of the profiled batch run before profiling "
                   "(e.g. its prefill: profile decode only)")
    args = p.parse_args()
    model = random_model(get_preset(args.preset), resolve_dtype(args.dtype),
                         resolve_device(args.device))
    engine = LLMEngine(model, EngineConfig(page_size=128, chunked_prefill_size=8192,
                                           kernel_backend=args.kernel_backend,
                                           max_total_tokens=args.num_prompts
                                           * (args.prompt_len + 512) + 4096))
    g = torch.Generator().manual_seed(0)
    params = SamplingParams(max_tokens=max(8, args.warm_steps + args.steps + 2), temperature=0.0,
                            ignore_eos=True)

    def add_batch() -> None:
        for _ in range(args.num_prompts):
            engine.add_request(torch.randint(2, model.config.vocab_size, (args.prompt_len,),
                                             generator=g).tolist(),
                               params)

    add_batch()
    while engine.has_unfinished():
        engine.step()
    add_batch()
    for _ in range(args.warm_steps):
        engine.step()
    cuda = args.device.startswith("cuda")
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    times = []
    with profile(activities=acts) as prof:
        for _ in range(args.steps):
            start = time.perf_counter()
            engine.step()
            if cuda:
                torch.cuda.synchronize()
            times.append(round(time.perf_counter() - start, 4))
    if cuda:
        print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=25))
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
    print(json.dumps({"profile": "engine_step", "preset": args.preset, "device": args.device,
                      "backend": args.kernel_backend, "num_prompts": args.num_prompts,
                      "prompt_len": args.prompt_len,
                      "warm_steps": args.warm_steps,
                      "step_s": times}))


if __name__ == "__main__":
    main()
