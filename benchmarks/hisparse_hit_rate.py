"""HiSparse hot-set hit rate at decode: trained weights against random ones of the same geometry.

The bytes HiSparse copies over PCIe per output token are (1 - hit rate) x top-k entries per C4
layer. On random weights (`benchmarks/hisparse.py` on the H200) the indexer's top-k changes almost
entirely from one token to the next and the hit rate is ~3%. This measures it where the indexer
was trained: the shipped dsv4-tiny (`dsv4.assets`, index_topk 128, 4:1 C4, 2,048 positions) on
held-out text (`heldout.bin`: documents the model did not train on), against the same geometry
with random weights (`load_format="dummy"`) on the same prompts.

For each weights x `--hot-entries` E (hot entries per request and C4 layer): one engine with
HiSparse on, `--requests` prompts of `--prompt-len` held-out tokens each (consecutive windows),
greedy decode of `--output-len` tokens. Decode steps only: the HotSet counters after the
prefill are subtracted (prefill chunks stage their picks, outside the hot set). Hit rate =
1 - entries swapped in / valid picks; bytes per token = entries swapped x entry bytes (at the
model's element size: the C4 entry width x 2 for bf16) / output tokens.

Prints a table, then one JSON line (also to `--out`).

    PYTHONPATH=src python3 benchmarks/hisparse_hit_rate.py --out hit_rate.json
    PYTHONPATH=src python3 benchmarks/hisparse_hit_rate.py --requests 1 --prompt-len 600 \\
        --output-len 8 --hot-entries 128                                   # CPU smoke
"""

from __future__ import annotations

import argparse
import json
import subprocess
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dsv4 import LLM, SamplingParams
from dsv4.assets import default_model_path


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="checkpoint dir (default: the shipped tiny)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--requests", type=int, default=4)
    p.add_argument("--prompt-len", type=int, default=1536)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--hot-entries", default="128,256,384",
                   help="comma-separated hot entries per request and C4 layer (>= index_topk)")
    p.add_argument("--page-size", type=int, default=128)
    p.add_argument("--out", default=None)
    return p.parse_args()


def heldout_prompts(model_dir: Path, n: int, length: int) -> list[list[int]]:
    """n consecutive windows of `length` tokens from the start of the held-out text."""
    tokens = np.fromfile(model_dir / "heldout.bin", dtype=np.uint16)
    assert len(tokens) >= n * length, f"heldout.bin holds {len(tokens)} tokens, need {n * length}"
    return [tokens[i * length:(i + 1) * length].astype(np.int64).tolist() for i in range(n)]


def counters(llm: LLM) -> dict[str, int]:
    hot = llm.engine.runner.pools.hot
    assert hot is not None, "HiSparse is off"
    return {k: int(v) for k, v in hot.stats().items()}


def measure(args: argparse.Namespace, model_dir: Path, load_format: str, entries: int,
            prompts: list[list[int]]) -> dict[str, Any]:
    """One engine: prefill every prompt, snapshot the counters, decode, difference."""
    llm = LLM(model_dir, dtype=args.dtype, device=args.device, load_format=load_format,
              enable_hisparse=True, hisparse_device_entries=entries, page_size=args.page_size,
              max_running_requests=len(prompts), disable_prefix_cache=True,
              max_total_tokens=len(prompts) * (args.prompt_len + args.output_len + args.page_size),
              seed=0)
    engine, cfg = llm.engine, llm.engine.runner.model.config
    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    reqs = [engine.add_request(p, params) for p in prompts]
    while not all(r.output_ids for r in reqs):
        engine.step()
    before, t0 = counters(llm), time.perf_counter()
    while engine.has_unfinished():
        engine.step()
    after, seconds = counters(llm), time.perf_counter() - t0
    picked = after["hisparse/picked"] - before["hisparse/picked"]
    swapped = after["hisparse/swapped"] - before["hisparse/swapped"]
    tokens = sum(len(r.output_ids) - 1 for r in reqs)
    entry_bytes = cfg.head_dim * 2                  # the C4 entry at bf16, as served on a GPU
    assert after["hisparse/overflow"] == 0, "a select overflowed the hot set"
    return {"weights": "trained" if load_format == "auto" else "random", "hot_entries": entries,
            "index_topk": cfg.index_topk, "decode_tokens": tokens, "picked": picked,
            "swapped": swapped, "hit_rate": round(1 - swapped / picked, 4) if picked else None,
            "bytes_per_token": round(swapped * entry_bytes / tokens, 1) if tokens else None,
            "picks_per_token": round(picked / tokens, 1) if tokens else None,
            "decode_s": round(seconds, 2)}


def main() -> None:
    args = parse_args()
    torch.set_num_threads(max(1, (torch.get_num_threads() or 2) - 1))
    model_dir = Path(args.model) if args.model else default_model_path()
    prompts = heldout_prompts(model_dir, args.requests, args.prompt_len)
    rows = [measure(args, model_dir, fmt, int(e), prompts)
            for fmt in ("auto", "dummy") for e in args.hot_entries.split(",")]
    print(f"{'weights':>8} {'E':>5} {'hit rate':>9} {'swapped/tok':>12} {'bytes/tok':>10}")
    for r in rows:
        per_tok = r["swapped"] / r["decode_tokens"] if r["decode_tokens"] else float("nan")
        print(f"{r['weights']:>8} {r['hot_entries']:>5} {r['hit_rate']!s:>9} {per_tok:>12.1f} "
              f"{r['bytes_per_token']!s:>10}")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True, check=False).stdout.strip()
    out = {"bench": "hisparse_hit_rate", "model": str(model_dir), "device": args.device,
           "dtype": args.dtype, "requests": args.requests, "prompt_len": args.prompt_len,
           "output_len": args.output_len, "commit": commit, "torch": torch.__version__,
           "rows": rows}
    line = json.dumps(out)
    print(line)
    if args.out:
        Path(args.out).write_text(line + "\n")


if __name__ == "__main__":
    main()
