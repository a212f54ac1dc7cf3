"""What a speculative verify pass costs at the HBM byte floor, relative to a plain decode step.

    PYTHONPATH=src python benchmarks/verify_floor.py [--drafts 3 --batches 1,8,32]

A decode step at batch B reads the dense weights once and every routed expert that one of its
B tokens routes to; a verify pass of N drafts reads them for B * (N + 1) tokens. With uniform
routing (random weights: an upper bound) a token hits k of E experts, so W tokens hit
E (1 - (1 - k/E)^W) (`decode_context_sweep.expected_experts`). `--distinct-scale` scales the
experts the extra tokens add (e.g. a trained model's measured locality,
`routing_locality.py`). For each geometry (flash-4l, and the full V4-Flash: 43 layers of 256
experts, built on the meta device) and weight format (bf16; the checkpoint's FP4 experts and
FP8 linears, `--weight-format checkpoint` bytes: 0.53 B / 1 B per parameter) it prints the
bytes of both and their ratio: the verify / plain ratio of a kernel at the floor, and the
speed-up at acceptance length L = 2.5 that this ratio allows (L / ratio; drafting not counted).
Computed from parameter counts: no device, no timing. Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import torch
from decode_context_sweep import expected_experts  # a sibling script

from dsv4.checkpoint.presets import _flash, flash_4l
from dsv4.config.model import ModelConfig
from dsv4.model.deepseek_v4 import DeepSeekV4ForCausalLM

FP4_BYTES = 0.5 + 1 / 32           # e2m1 code + one UE8M0 scale per 32
FP8_BYTES = 1.0 + 1 / (128 * 128)  # e4m3 code + one scale per 128 x 128 block


def v4_flash() -> ModelConfig:
    attn = ("swa", "swa") + ("csa", "hca") * 20 + ("csa",)
    return _flash(43, attn, ("hash",) * 3 + ("routed",) * 40, 256)


def param_split(cfg: ModelConfig) -> tuple[float, float, float]:
    """(dense parameters read per step except the embedding, parameters per routed expert and
    layer, embedding row width) of the target model (no MTP)."""
    with torch.device("meta"):
        model = DeepSeekV4ForCausalLM(cfg)
    dense = experts = 0
    for name, p in model.named_parameters():
        if name.startswith("mtp.") or name.startswith("embed."):
            continue
        if ".ffn.experts." in name:
            experts += p.numel()
        else:
            dense += p.numel()
    return float(dense), experts / cfg.num_layers / cfg.n_routed_experts, float(cfg.hidden_size)


def step_bytes(cfg: ModelConfig, tokens: int, fmt: str, scale: float, base: int) -> float:
    """Weight bytes of a step of `tokens` tokens; experts beyond those of `base` tokens scaled
    by `scale`."""
    dense, per_expert, width = param_split(cfg)
    dense_b, expert_b = (2.0, 2.0) if fmt == "bf16" else (FP8_BYTES, FP4_BYTES)
    hit = expected_experts(cfg, tokens)[0]
    if tokens > base:
        first = expected_experts(cfg, base)[0]
        hit = first + scale * (hit - first)
    return (dense * dense_b + cfg.num_layers * hit * per_expert * expert_b
            + tokens * width * 2.0)


def rows(drafts: int, batches: list[int], scale: float) -> list[dict[str, Any]]:
    out = []
    for name, cfg in (("flash-4l", flash_4l()), ("v4-flash", v4_flash())):
        for fmt in ("bf16", "checkpoint"):
            for b in batches:
                plain = step_bytes(cfg, b, fmt, scale, b)
                verify = step_bytes(cfg, b * (drafts + 1), fmt, scale, b)
                out.append({"model": name, "weights": fmt, "batch": b,
                            "plain_gb": plain / 1e9, "verify_gb": verify / 1e9,
                            "floor_ratio": verify / plain,
                            "speedup_at_2_5": 2.5 / (verify / plain)})
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--drafts", type=int, default=3)
    p.add_argument("--batches", default="1,8,32")
    p.add_argument("--distinct-scale", type=float, default=1.0,
                   help="scale on the experts the draft tokens add (1: uniform routing)")
    args = p.parse_args()
    table = rows(args.drafts, [int(b) for b in args.batches.split(",")], args.distinct_scale)
    print(f"{'model':>9} {'weights':>10} {'batch':>5} {'plain GB':>9} {'verify GB':>10} "
          f"{'ratio':>6} {'x at L=2.5':>10}")
    for r in table:
        print(f"{r['model']:>9} {r['weights']:>10} {r['batch']:>5} {r['plain_gb']:>9.2f} "
              f"{r['verify_gb']:>10.2f} {r['floor_ratio']:>6.3f} {r['speedup_at_2_5']:>10.2f}")
    print(json.dumps({"bench": "verify_floor", "drafts": args.drafts,
                      "distinct_scale": args.distinct_scale, "rows": table}))


if __name__ == "__main__":
    main()
