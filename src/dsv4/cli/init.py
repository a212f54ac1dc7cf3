"""`dsv4 init`: write a randomly initialised checkpoint in the official layout (weights +
tokenizer)."""

from __future__ import annotations

import argparse
from pathlib import Path

from dsv4.checkpoint.presets import PRESETS, get_preset
from dsv4.checkpoint.writer import write_checkpoint
from dsv4.config.model import WEIGHT_QUANTS


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("init",
                       help="write a random-weight checkpoint for a preset (official layout)")
    p.add_argument("--preset", required=True, choices=sorted(PRESETS))
    p.add_argument("--out", required=True, type=Path, help="output directory")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quant", default="none", choices=list(WEIGHT_QUANTS),
                   help="fp8: FP8 e4m3 linears; fp8+fp4: also FP4 e2m1 routed experts")
    p.add_argument("--shard-size-gb", type=float, default=4.0)
    p.add_argument("--no-weights", action="store_true",
                   help="config.json and tokenizer only: for `dsv4 serve --load-format dummy`")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    write_checkpoint(get_preset(args.preset), args.out, seed=args.seed, weight_quant=args.quant,
                     shard_bytes=int(args.shard_size_gb * (1 << 30)), weights=not args.no_weights)
    return 0
