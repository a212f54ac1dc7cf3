"""Overlap scheduling on vs off (issue 20): decode step time and identical outputs.

    PYTHONPATH=src python benchmarks/overlap_schedule.py --device cuda --dtype bfloat16 \
        --batches 1,32 --out overlap.json

One engine per setting (`overlap_schedule` False / True, CUDA graphs and warmup at their
defaults) on a checkpoint (default: the embedded dsv4-tiny). Per batch size B: B random prompts
of `--prompt-len` tokens run greedy to `--short` and to `--short + --output-len` tokens; the
decode step time is the difference of the two wall times over `--output-len` steps (prefill and
the first steps cancel). Each timing is the median of `--repeats` runs. The outputs of both
settings must be token-for-token equal. Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
from pathlib import Path

import torch

from dsv4 import LLM, SamplingParams
from dsv4.assets import default_model_path


def timed(llm: LLM, prompts: list[list[int]], tokens: int) -> tuple[float, list[list[int]]]:
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - t0, [o.token_ids for o in outs]


def measure(llm: LLM, prompts: list[list[int]], args: argparse.Namespace
            ) -> tuple[float, list[list[int]]]:
    """(decode ms per step, the long run's outputs) for one batch of prompts."""
    timed(llm, prompts, args.short + args.output_len)               # graphs, allocator warm
    short, long = [], []
    out: list[list[int]] = []
    for _ in range(args.repeats):
        short.append(timed(llm, prompts, args.short)[0])
        t, out = timed(llm, prompts, args.short + args.output_len)
        long.append(t)
    return 1e3 * (statistics.median(long) - statistics.median(short)) / args.output_len, out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=str(default_model_path()))
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--kernel-backend", default=None, help="default: the engine's resolution")
    p.add_argument("--batches", default="1,32")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--short", type=int, default=8)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--load-format", default="auto", choices=("auto", "dummy"),
                   help="dummy: random weights from the model directory's config.json")
    p.add_argument("--warmup", default=None, help="the engine's warmup mode (default: its own)")
    p.add_argument("--kv-cache-memory-gb", type=float, default=None)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    gen = torch.Generator().manual_seed(0)
    extra = {k: v for k, v in (("kernel_backend", args.kernel_backend), ("warmup", args.warmup),
                                ("kv_cache_memory_gb", args.kv_cache_memory_gb)) if v is not None}
    rows: dict[int, dict[str, float]] = {b: {} for b in batches}
    outputs: dict[bool, dict[int, list[list[int]]]] = {}
    prompts = {}
    for overlap in (False, True):
        llm = LLM(args.model, dtype=args.dtype, device=args.device, overlap_schedule=overlap,
                  load_format=args.load_format, **extra)  # type: ignore[arg-type]
        vocab = llm.model.config.vocab_size
        outputs[overlap] = {}
        for b in batches:
            prompts.setdefault(b, torch.randint(2, vocab, (b, args.prompt_len),
                                                generator=gen).tolist())
            ms, out = measure(llm, prompts[b], args)
            rows[b]["on" if overlap else "off"] = ms
            outputs[overlap][b] = out
        del llm
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()    # the next engine sizes its KV budget from free memory
    print(f"{'batch':>5} {'off ms/step':>12} {'on ms/step':>11} {'removed ms':>11} {'same':>5}")
    result = []
    for b in batches:
        off, on = rows[b]["off"], rows[b]["on"]
        same = outputs[False][b] == outputs[True][b]
        print(f"{b:5d} {off:12.3f} {on:11.3f} {off - on:11.3f} {same!s:>5}")
        result.append({"batch": b, "off_ms": off, "on_ms": on, "removed_ms": off - on,
                       "removed_frac": (off - on) / off, "outputs_equal": same})
    line = {"model": args.model, "device": args.device, "dtype": args.dtype,
            "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
            "torch": torch.__version__, "prompt_len": args.prompt_len,
            "output_len": args.output_len, "rows": result}
    print(json.dumps(line))
    if args.out is not None:
        args.out.write_text(json.dumps(line, indent=2) + "\n")


if __name__ == "__main__":
    main()
