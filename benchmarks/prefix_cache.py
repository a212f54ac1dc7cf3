"""Prefix-cache benchmark: multi-turn chat with the prefix cache on and off.

C conversations x T turns, each starting with the same `system_len`-token system prompt. Turn t of
every conversation is submitted together: its prompt is the whole conversation so far (system
prompt, earlier prompts and answers) plus `user_len` new tokens; the answer is `output_len` greedy
tokens. Reports the prefix hit rate (cached prompt tokens / prompt tokens), the mean and median
TTFT (arrival -> first token) and the total time, cache on vs off, then one JSON line. Weights: a
checkpoint directory (`--model`), or random weights generated in memory (`--preset`, any size;
nothing written to disk).

    python benchmarks/prefix_cache.py --preset micro --device cpu
    python benchmarks/prefix_cache.py --preset flash-4l --device cuda --dtype bfloat16 \
        --page-size 256
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import time

import torch

from dsv4 import EngineConfig, SamplingParams
from dsv4.checkpoint.presets import get_preset
from dsv4.checkpoint.writer import random_model
from dsv4.engine.engine import LLMEngine
from dsv4.model.deepseek_v4 import DeepSeekV4ForCausalLM
from dsv4.model.loader import load_model, resolve_device, resolve_dtype


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="micro")
    p.add_argument("--model", default=None)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--conversations", type=int, default=32)
    p.add_argument("--turns", type=int, default=8)
    p.add_argument("--system-len", type=int, default=0,
                   help="system prompt shared by every conversation")
    p.add_argument("--user-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--chunked-prefill-size", type=int, default=2048)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--kernel-backend", default="ref")
    return p.parse_args()


def build_model(args: argparse.Namespace) -> DeepSeekV4ForCausalLM:
    if args.model:
        return load_model(args.model, dtype=args.dtype, device=args.device)
    return random_model(get_preset(args.preset), resolve_dtype(args.dtype),
                        resolve_device(args.device), args.seed)


def run(model: DeepSeekV4ForCausalLM, args: argparse.Namespace, cache: bool) -> dict[str, float]:
    longest = args.system_len + args.turns * (args.user_len + args.output_len) + args.page_size
    config = EngineConfig(page_size=args.page_size, max_running_requests=args.conversations,
                          chunked_prefill_size=args.chunked_prefill_size,
                          disable_prefix_cache=not cache, kernel_backend=args.kernel_backend,
                          max_total_tokens=2 * args.conversations * longest,
                          context_length=longest + 1)
    engine = LLMEngine(model, config)
    g = torch.Generator().manual_seed(args.seed)
    vocab = model.config.vocab_size
    system = torch.randint(2, vocab, (args.system_len,), generator=g).tolist()
    history: list[list[int]] = [list(system) for _ in range(args.conversations)]
    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    ttft: list[float] = []
    start = time.perf_counter()
    for _turn in range(args.turns):
        reqs = []
        for c in range(args.conversations):
            history[c] = history[c] + torch.randint(2, vocab, (args.user_len,),
                                                    generator=g).tolist()
            reqs.append(engine.add_request(history[c], params))
        while engine.has_unfinished():
            engine.step()
        for c, req in enumerate(reqs):
            ttft.append(req.token_times[0] - req.arrival_time)
            history[c] = history[c] + req.output_ids
            engine.pop(req.rid)
    if model.embed.weight.is_cuda:
        torch.cuda.synchronize()
    total = time.perf_counter() - start
    engine.check_integrity()
    return {"hit_rate": round(engine.prefix_hit_rate(), 4),
            "ttft_mean_s": round(statistics.mean(ttft), 4),
            "ttft_median_s": round(statistics.median(ttft), 4), "total_s": round(total, 2),
            "steps": engine.steps, "prefill_tokens": engine.prefill_tokens}


def main() -> None:
    args = parse_args()
    model = build_model(args)
    # warm-up
    run(model, argparse.Namespace(**{**vars(args), "conversations": 2, "turns": 2}), cache=True)
    off = run(model, args, cache=False)
    on = run(model, args, cache=True)
    print(f"{'cache':<6}{'hit rate':>10}{'TTFT mean s':>14}{'TTFT median s':>15}{'total s':>10}"
          f"{'prefill tok':>13}")
    for name, r in (("off", off), ("on", on)):
        print(f"{name:<6}{r['hit_rate']:>10.3f}{r['ttft_mean_s']:>14.4f}{r['ttft_median_s']:>15.4f}"
              f"{r['total_s']:>10.2f}{r['prefill_tokens']:>13}")
    device = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    print(json.dumps({"benchmark": "prefix_cache", "preset": args.model or args.preset,
                      "device": device, "dtype": args.dtype,
                      "conversations": args.conversations, "turns": args.turns,
                      "system_len": args.system_len,
                      "chunked_prefill_size": args.chunked_prefill_size,
                      "kernel_backend": args.kernel_backend,
                      "user_len": args.user_len, "output_len": args.output_len,
                      "page_size": args.page_size, "cache_off": off, "cache_on": on,
                      "ttft_speedup": round(off["ttft_mean_s"] / on["ttft_mean_s"], 2),
                      "total_speedup": round(off["total_s"] / on["total_s"], 2),
                      "torch": torch.__version__, "commit": commit}))


if __name__ == "__main__":
    main()
