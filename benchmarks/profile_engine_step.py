"""Profile engine steps (torch.profiler) on random weights: where does a prefill / decode step go?

Runs a warm-up, then profiles `--steps` engine steps of a batch of prompts and prints the top
operators by self CUDA time and by self CPU time (a table each), then one JSON line with the step
times. The profiled batch's requests get enough `max_tokens` to outlast its prefill (chunked, so
its first requests decode while the last still prefill), the warm-up steps and the profiled ones:
with `--decode-only` every profiled step decodes the whole batch.

    python benchmarks/profile_engine_step.py --preset flash-4l --device cuda --dtype bfloat16
    python benchmarks/profile_engine_step.py ... --weight-format checkpoint   # FP4 / FP8 weights
"""

from __future__ import annotations

import argparse
import json
import math
import time

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from dsv4 import EngineConfig, SamplingParams
from dsv4.checkpoint.presets import get_preset
from dsv4.checkpoint.writer import random_model
from dsv4.engine.engine import LLMEngine
from dsv4.engine.request import Request
from dsv4.model.loader import resolve_device, resolve_dtype

CHUNK = 8192        # chunked prefill tokens per step


def batch_max_tokens(num_prompts: int, prompt_len: int, warm_steps: int, steps: int) -> int:
    """Output tokens each request of the profiled batch may make: no request finishes before the
    last profiled step. Its prefill takes ceil(prompts x len / CHUNK) steps, and a request may
    decode in each of them and in the up to `num_prompts` steps until every request has its first
    token (`--decode-only`); then the warm-up and profiled steps, and 2 to spare."""
    return (math.ceil(num_prompts * prompt_len / CHUNK) + num_prompts + warm_steps + steps + 2)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="micro")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=300)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--warm-prompt-len", type=int, default=None,
                   help="prompt length of the first (compiling) batch; default --prompt-len "
                   "(a short one spares a second long prefill: the long prompt's own prefill "
                   "and --warm-steps then build what it alone needs)")
    p.add_argument("--kernel-backend", default="ref")
    p.add_argument("--warm-steps", type=int, default=0,
                   help="steps of the profiled batch run before profiling "
                   "(e.g. its prefill: profile decode only)")
    p.add_argument("--rows", type=int, default=25, help="operators per table")
    p.add_argument("--trace", default=None,
                   help="CUDA: also write the profile as a Chrome trace (chrome://tracing)")
    p.add_argument("--decode-only", action="store_true",
                   help="step the batch until every request has its first token before the "
                   "warm-up steps: the profiled steps are decode steps whatever the prompt")
    p.add_argument("--enable-hisparse", action="store_true",
                   help="HiSparse on (C4 entries in host memory, hot sets on the device)")
    p.add_argument("--hot-entries", type=int, default=None,
                   help="hot entries per request and C4 layer (default: the engine's)")
    p.add_argument("--weight-format", default="bf16", choices=["bf16", "checkpoint"],
                   help="checkpoint: FP4 experts, FP8 linears, bf16 compressor projections")
    p.add_argument("--pdl-early-max-batch", type=int,
                   default=EngineConfig.pdl_early_max_batch,
                   help="decode graphs of batch <= this in PDL's EARLY mode (EngineConfig)")
    p.add_argument("--shared-expert-beside-max-tokens", type=int, default=None,
                   help="with multi-stream, forwards of up to this many tokens run the shared "
                   "expert beside the routed experts (EngineConfig)")
    p.add_argument("--index-cache-dtype", default=None, choices=["model", "fp8"],
                   help="the indexer-key pools (EngineConfig.index_cache_dtype; default: the "
                        "engine's, fp8 on CUDA with the triton backend, else model)")
    args = p.parse_args()
    model = random_model(get_preset(args.preset), resolve_dtype(args.dtype),
                         resolve_device(args.device), weight_format=args.weight_format)
    max_tokens = batch_max_tokens(args.num_prompts, args.prompt_len, args.warm_steps, args.steps)
    engine = LLMEngine(model, EngineConfig(page_size=128, chunked_prefill_size=CHUNK,
                                           kernel_backend=args.kernel_backend,
                                           max_total_tokens=args.num_prompts
                                           * (args.prompt_len + max(512, max_tokens)) + 4096,
                                           enable_hisparse=args.enable_hisparse,
                                           hisparse_device_entries=args.hot_entries,
                                           pdl_early_max_batch=args.pdl_early_max_batch,
                                           shared_expert_beside_max_tokens=(
                                               args.shared_expert_beside_max_tokens),
                                           index_cache_dtype=args.index_cache_dtype))
    g = torch.Generator().manual_seed(0)
    warm = SamplingParams(max_tokens=max(8, args.warm_steps + args.steps + 2), temperature=0.0,
                          ignore_eos=True)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)

    def add_batch(p: SamplingParams, length: int) -> list[Request]:
        return [engine.add_request(torch.randint(2, model.config.vocab_size, (length,),
                                                 generator=g).tolist(), p)
                for _ in range(args.num_prompts)]

    start = time.perf_counter()
    add_batch(warm, args.warm_prompt_len or args.prompt_len)   # compiles and warms the shapes
    while engine.has_unfinished():
        engine.step()
    warm_s = round(time.perf_counter() - start, 3)   # first batch: kernel compiles included
    reqs = add_batch(params, args.prompt_len)
    while args.decode_only and not all(r.output_ids for r in reqs):
        engine.step()
    for _ in range(args.warm_steps):
        engine.step()
    assert not any(r.is_finished for r in reqs), "a request finished before the profiled steps"
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
    averages = prof.key_averages()
    gpu: dict[str, float] = {}
    if cuda:
        print(averages.table(sort_by="self_cuda_time_total", row_limit=args.rows))
        kernels = [e for e in averages if e.device_type == DeviceType.CUDA]
        gpu = {"kernels_per_step": sum(e.count for e in kernels) / args.steps,
               "kernels": per_kernel(kernels, args.steps, args.rows),
               "gpu_ms_per_step": sum(e.self_device_time_total for e in kernels)
               / args.steps / 1e3, **busy(prof, args.steps)}
        if args.trace:
            prof.export_chrome_trace(args.trace)
    print(averages.table(sort_by="self_cpu_time_total", row_limit=args.rows))
    print(json.dumps({"profile": "engine_step", "preset": args.preset, "device": args.device,
                      "backend": args.kernel_backend, "weight_format": args.weight_format,
                      "num_prompts": args.num_prompts,
                      "prompt_len": args.prompt_len,
                      "warm_steps": args.warm_steps, "max_tokens": max_tokens,
                      "finished_in_profile": sum(r.is_finished for r in reqs),
                      "warm_s": warm_s, "step_s": times, **gpu}))


def per_kernel(kernels: list, steps: int, rows: int) -> list[tuple[str, float, float]]:
    """The `rows` kernels of most GPU time: (name cut to 80 characters, us per step, launches
    per step)."""
    top = sorted(kernels, key=lambda e: -e.self_device_time_total)[:rows]
    return [(e.key[:80], round(e.self_device_time_total / steps, 2), e.count / steps)
            for e in top]


def busy(prof: profile, steps: int) -> dict[str, float]:
    """GPU time per step with concurrent kernels counted once: the union of the kernels'
    intervals over every stream (`gpu_busy_ms_per_step`; below `gpu_ms_per_step`, the sum of
    their durations, when streams overlap, e.g. `EngineConfig.multi_stream`), and the number of
    streams that ran kernels."""
    spans = sorted((e.time_range.start, e.time_range.end) for e in prof.events()
                   if e.device_type == DeviceType.CUDA and e.time_range.end > e.time_range.start)
    total, end = 0.0, float("-inf")
    for a, b in spans:
        if a > end:
            total += b - a
        elif b > end:
            total += b - end
        end = max(end, b)
    streams = {getattr(e, "device_resource_id", 0) for e in prof.events()
               if e.device_type == DeviceType.CUDA}
    return {"gpu_busy_ms_per_step": total / steps / 1e3, "streams": len(streams)}


if __name__ == "__main__":
    main()
