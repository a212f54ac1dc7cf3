"""Routing locality: how many distinct experts do W consecutive tokens of a trained model hit?

    PYTHONPATH=src python benchmarks/routing_locality.py [--prompts 32 --output-len 64]

A verify pass of N + 1 tokens reads every expert any of its tokens routes to, so its weight bytes
(and its cost at the HBM floor) grow with the number of distinct experts that N + 1 consecutive
tokens hit. Random weights route uniformly, an upper bound: E (1 - (1 - k/E)^W) distinct experts
for W tokens, k of E each. A trained model's consecutive tokens may share experts. This measures
it on a checkpoint (default the shipped dsv4-tiny) with routing capture on, over `--source`:
`heldout` (default; windows of the checkpoint's `heldout.bin`, held-out text then tasks, run as
prompts) or `arithmetic` (held-out arithmetic prompts decoded greedily): every window of W
consecutive positions (prompt and output) per routed MoE layer, the mean distinct experts against
the uniform expectation. Hash layers route by token
id and are reported apart. Prints a table per W, then one JSON line (also written to --out).
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dsv4 import LLM, SamplingParams
from dsv4.assets import default_model_path
from dsv4.rl.rewards import ArithmeticTask


def uniform_distinct(experts: int, k: int, window: int) -> float:
    return experts * (1 - (1 - k / experts) ** window)


def mean_distinct(routes: list[torch.Tensor], layer: int, window: int) -> float:
    """Mean distinct experts over every window of `window` consecutive positions of each
    sequence. routes: per sequence [positions, layers, k]."""
    counts = []
    for r in routes:
        picks = r[:, layer]                                           # [positions, k]
        for s in range(picks.shape[0] - window + 1):
            counts.append(picks[s:s + window].unique().numel())
    return sum(counts) / len(counts)


def measure(llm: LLM, routes: list[torch.Tensor], windows: list[int]) -> list[dict[str, Any]]:
    cfg = llm.model.config
    rows = []
    for w in windows:
        for kind in ("routed", "hash"):
            layers = [i for i, t in enumerate(cfg.moe_types) if t == kind]
            if not layers:
                continue
            got = sum(mean_distinct(routes, i, w) for i in layers) / len(layers)
            uni = uniform_distinct(cfg.n_routed_experts, cfg.num_experts_per_tok, w)
            rows.append({"window": w, "layers": kind, "distinct": got, "uniform": uni,
                         "ratio": got / uni, "single": float(cfg.num_experts_per_tok),
                         "bytes_vs_one_token": got / cfg.num_experts_per_tok,
                         "uniform_bytes_vs_one_token": uni / cfg.num_experts_per_tok})
    return rows


def heldout_prompts(model: Path, count: int, length: int) -> list[list[int]]:
    """`count` windows of `length` tokens spread evenly over the checkpoint's held-out tokens."""
    tokens = np.fromfile(model / "heldout.bin", dtype=np.uint16)
    starts = np.linspace(0, len(tokens) - length, count).astype(np.int64)
    return [tokens[s:s + length].astype(np.int64).tolist() for s in starts]


def routes_of(llm: LLM, args: argparse.Namespace) -> list[torch.Tensor]:
    """Per sequence [positions, layers, k] routed experts."""
    if args.source == "heldout":
        prompts = heldout_prompts(Path(args.model), args.prompts, args.prompt_len)
        outs = llm.generate(prompt_token_ids=prompts,
                            sampling_params=SamplingParams(max_tokens=1, temperature=0.0),
                            use_tqdm=False)
    else:
        task = ArithmeticTask((3, 4, 5, 6))
        held = task.heldout_prompts(-(-args.prompts // 4), seed=args.seed)
        random.Random(args.seed).shuffle(held)
        params = SamplingParams(max_tokens=args.output_len, temperature=0.0)
        outs = llm.generate([pr.text for pr in held[:args.prompts]], params, use_tqdm=False)
    routes = [o.routing["experts"] for o in outs if o.routing is not None]
    assert routes, "no routing captured"
    return routes


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=str(default_model_path()))
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--source", choices=("heldout", "arithmetic"), default="heldout")
    p.add_argument("--prompt-len", type=int, default=512, help="with --source heldout")
    p.add_argument("--output-len", type=int, default=64, help="with --source arithmetic")
    p.add_argument("--windows", default="2,4,5")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads() - 1))
    llm = LLM(args.model, dtype="float32", capture_routing=True)
    routes = routes_of(llm, args)
    rows = measure(llm, routes, [int(w) for w in args.windows.split(",")])
    print(f"{'W':>3} {'layers':>7} {'distinct':>9} {'uniform':>8} {'ratio':>6}")
    for r in rows:
        print(f"{r['window']:>3} {r['layers']:>7} {r['distinct']:>9.3f} {r['uniform']:>8.3f} "
              f"{r['ratio']:>6.3f}")
    cfg = llm.model.config
    result = {"bench": "routing_locality", "model": args.model, "source": args.source,
              "experts": cfg.n_routed_experts, "k": cfg.num_experts_per_tok,
              "sequences": len(routes), "positions": sum(r.shape[0] for r in routes),
              "rows": rows}
    print(json.dumps(result))
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
