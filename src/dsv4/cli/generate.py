"""`dsv4 generate [--model PATH] "prompt" ...`: offline completion of one or more prompts, printed
to stdout.

`--speculative-num-steps N` generates with MTP speculative decoding (greedy text unchanged) and logs
the drafts accepted. `--enable-hisparse` (`--hisparse-device-entries N`) keeps the C4 attention
entries in host memory with a hot set per request on the device (greedy text unchanged). A
checkpoint without an MTP block, like any invalid flag, exits with 2 and a message naming the
flag."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from dsv4.cli.serve import (
    add_hisparse_args,
    add_overlap_arg,
    add_speculative_arg,
    add_warmup_arg,
    check_speculative,
)
from dsv4.config.engine import WEIGHT_FORMATS
from dsv4.engine.llm import LLM
from dsv4.engine.sampling_params import SamplingParams
from dsv4.utils.logging import init_logger

logger = init_logger(__name__)


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="complete prompts with a checkpoint (offline engine)")
    p.add_argument("prompts", nargs="+", help="prompt text(s)")
    p.add_argument("--model", default=None,
                   help="checkpoint directory (official or transformers layout); "
                        "default: the embedded dsv4-tiny")
    p.add_argument("--dtype", default=None, choices=["bfloat16", "float32"])
    p.add_argument("--device", default=None, choices=["cpu", "cuda"])
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=-1)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--page-size", type=int, default=None,
                   help="KV page size (default: 256; 128 on CPU)")
    p.add_argument("--weight-format", default="bf16", choices=WEIGHT_FORMATS,
                   help="bf16: dequantise FP4/FP8 weights at load; "
                        "checkpoint: keep routed experts in FP4 and the FP8 linears in FP8")
    add_speculative_arg(p, default=0)
    add_overlap_arg(p)
    add_warmup_arg(p)
    add_hisparse_args(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from dsv4.assets import default_model_path

    model = Path(args.model) if args.model else default_model_path()
    try:
        check_speculative(model, args.speculative_num_steps)
    except ValueError as e:
        logger.error("%s", e)
        return 2
    engine_args: dict[str, Any] = {"page_size": args.page_size} if args.page_size else {}
    if args.overlap_schedule is not None:
        engine_args["overlap_schedule"] = args.overlap_schedule
    if args.multi_stream is not None:
        engine_args["multi_stream"] = args.multi_stream
    if args.warmup is not None:
        engine_args["warmup"] = args.warmup
    if args.enable_hisparse:
        engine_args["enable_hisparse"] = True
    if args.hisparse_device_entries is not None:
        engine_args["hisparse_device_entries"] = args.hisparse_device_entries
    if args.device == "cpu" or args.device is None and not _has_cuda():
        engine_args.setdefault("page_size", 128)
        engine_args["kv_cache_memory_gb"] = 0.5
    try:
        llm = LLM(model, dtype=args.dtype, device=args.device, weight_format=args.weight_format,
                  speculative_num_steps=args.speculative_num_steps, **engine_args)
    except ValueError as e:        # an invalid engine flag (e.g. --hisparse-device-entries)
        logger.error("%s", e)
        return 2
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                            top_p=args.top_p, top_k=args.top_k, seed=args.seed)
    for out in llm.generate(args.prompts, params, use_tqdm=len(args.prompts) > 1):
        sys.stdout.write(out.text + "\n")
    if args.speculative_num_steps:
        eng = llm.engine
        logger.info("speculative decoding: %d of %d drafts accepted, %.2f tokens per verify pass",
                    eng.spec_accepted_tokens, eng.spec_draft_tokens,
                    eng.mean_acceptance_length() or 0.0)
    return 0


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()
