"""Census of the launches in one decode step: which line of dsv4 launches what, and how often.

A decode step under a CUDA graph replays every kernel its eager run launched; at batch 1 most of
them are small element-wise glue that costs 1-3 µs each on the GPU whatever its size. This tool
runs the graph's forward (`DecodeGraphs._forward`: device metadata + the model's serving path) once
on padding rows, on the CPU, and counts every aten operator that launches a kernel (views and
metadata-only operators excluded) and every Triton launch, each attributed to the dsv4 source line
that issued it. The counts do not depend on the device; they depend on the geometry only through
code paths (a scaled-down geometry keeps flash-4l's paths: `--experts`, `--vocab`).

    TRITON_INTERPRET=1 python benchmarks/op_census.py --preset flash-4l --experts 8 --vocab 512

`--sample` also counts the sampling of the forward's logits, which runs eagerly after the graph
(`engine/sampler.py::sample` with the backend's ops: greedy rows, log-probs only with
`--logprobs K`), and reports it apart (`sample` in the JSON line).

Prints a table of the busiest source lines, then one JSON line with the totals.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import os
import sys
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from dsv4 import EngineConfig
from dsv4.checkpoint.presets import get_preset
from dsv4.checkpoint.writer import random_model
from dsv4.engine.cuda_graph import DecodeGraphs, GraphKey
from dsv4.engine.engine import LLMEngine
from dsv4.engine.sampler import SamplingBatch, sample
from dsv4.engine.sampling_params import SamplingParams

SRC = os.path.join("src", "dsv4") + os.sep
# Operators that launch no kernel (views, metadata).
_FREE = {"view", "_unsafe_view", "reshape", "expand", "unsqueeze", "squeeze", "select", "slice",
         "permute", "transpose", "t", "alias", "as_strided", "detach", "split", "split_with_sizes",
         "unbind", "chunk", "narrow", "view_as_real", "view_as_complex", "lift_fresh", "empty",
         "empty_like", "empty_strided", "new_empty", "new_empty_strided", "unfold", "diagonal",
         "_reshape_alias", "sym_size", "sym_stride", "sym_numel", "is_same_size", "movedim",
         "flatten", "unflatten", "expand_as", "view_as", "real", "imag", "contiguous"}


def _site() -> str:
    """The innermost dsv4 source line on the Python stack (file:line function)."""
    f = sys._getframe(2)
    while f is not None:
        name = f.f_code.co_filename
        if SRC in name and "kernels" + os.sep + "triton" + os.sep + "launch" not in name:
            short = name[name.index(SRC) + len(SRC):]
            return f"{short}:{f.f_lineno} {f.f_code.co_name}"
        f = f.f_back
    return "?"


class Census(TorchDispatchMode):
    """Counts kernel-launching aten operators per dsv4 source line."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter[tuple[str, str]] = collections.Counter()
        self.paused = False

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        name = func.overloadpacket.__name__.rstrip("_")
        if name not in _FREE and not self.paused:
            self.ops[(_site(), name)] += 1
        return func(*args, **(kwargs or {}))


def _count_triton(counter: collections.Counter[tuple[str, str]],
                  census: Census) -> Callable[[], None]:
    """Counts interpreted Triton launches per source line (the aten operators the interpreter
    runs inside a launch are not counted); returns the undo."""
    from triton.runtime import interpreter

    original = interpreter.GridExecutor.__call__

    def counted(self: Any, *args: Any, **kwargs: Any) -> Any:
        counter[(_site(), "triton:" + self.fn.__name__)] += 1
        census.paused = True
        try:
            return original(self, *args, **kwargs)
        finally:
            census.paused = False

    interpreter.GridExecutor.__call__ = counted  # type: ignore[method-assign]
    return lambda: setattr(interpreter.GridExecutor, "__call__", original)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="flash-4l")
    p.add_argument("--experts", type=int, default=8, help="routed experts (scaled down)")
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--kernel-backend", default="triton")
    p.add_argument("--rows", type=int, default=40)
    p.add_argument("--sample", action="store_true",
                   help="also count the sampling of the step's logits (greedy rows)")
    p.add_argument("--logprobs", type=int, default=None,
                   help="with --sample: the rows ask for the sampled token's log-prob and top K")
    p.add_argument("--weight-format", default="bf16", choices=["bf16", "checkpoint"],
                   help="checkpoint: FP4 experts, FP8 linears (their own code paths)")
    args = p.parse_args()
    if args.kernel_backend == "triton" and os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("run with TRITON_INTERPRET=1 (the census runs on the CPU)")
    torch.set_num_threads(max(1, (os.cpu_count() or 2) - 1))
    config = dataclasses.replace(get_preset(args.preset), n_routed_experts=args.experts,
                                 vocab_size=args.vocab, num_mtp_layers=0)
    model = random_model(config, torch.bfloat16, torch.device("cpu"),
                         weight_format=args.weight_format)
    engine = LLMEngine(model, EngineConfig(kernel_backend=args.kernel_backend,
                                           max_total_tokens=2 * args.context + 4096,
                                           max_running_requests=max(args.batch, 2),
                                           disable_cuda_graph=True, warmup="none"))
    runner = engine.runner
    graphs = DecodeGraphs(model, runner.table, runner.pools, runner.ops, args.batch,
                          capture=False)
    key = GraphKey(args.batch, 1, 1, args.context, False)
    step = graphs._build(key)
    out: list[torch.Tensor] = []
    counter = _count(lambda: out.append(graphs._forward(step.inputs, step.consts, key)[0]), args)
    logits = out[0]
    by_site: collections.Counter[str] = collections.Counter()
    for (site, _), n in counter.items():
        by_site[site] += n
    print(f"{'launches':>8}  source line: operators")
    for site, n in by_site.most_common(args.rows):
        names = ", ".join(f"{op}x{c}" if c > 1 else op
                          for (s, op), c in counter.most_common() if s == site)
        print(f"{n:8d}  {site}: {names}")
    by_file: collections.Counter[str] = collections.Counter()
    for (site, _), n in counter.items():
        by_file[site.split(":")[0]] += n
    triton = sum(n for (_, op), n in counter.items() if op.startswith("triton:"))
    sampled = _sample_census(logits, runner.ops.argmax, args) if args.sample else None
    print(json.dumps({"preset": args.preset, "weight_format": args.weight_format,
                      "batch": args.batch, "context": args.context,
                      "launches": sum(counter.values()), "triton": triton,
                      "by_file": dict(by_file.most_common()),
                      **({} if sampled is None else {"sample": sampled})}))


def _count(fn: Any, args: argparse.Namespace) -> collections.Counter[tuple[str, str]]:
    """Launches of `fn()` (no grad) per (source line, operator): aten ops that launch a kernel,
    and with the triton backend the interpreted Triton launches."""
    counter: collections.Counter[tuple[str, str]] = collections.Counter()
    census = Census()
    undo = (_count_triton(counter, census) if args.kernel_backend == "triton"
            else (lambda: None))
    try:
        with torch.no_grad(), census:
            fn()
    finally:
        undo()
    counter.update(census.ops)
    return counter


def _sample_census(logits: torch.Tensor, argmax: Any, args: argparse.Namespace
                   ) -> dict[str, Any]:
    """Launches of `sample` on the step's logits, greedy rows (`--logprobs`: asking for them):
    printed per source line; returns the totals and the per-line counts."""
    params = [SamplingParams(temperature=0.0, logprobs=args.logprobs)] * logits.shape[0]
    batch = SamplingBatch.build(params, [0] * len(params), [0] * len(params), logits.device,
                                vocab_size=logits.shape[-1])
    logits = logits.float()                             # the model's logits are fp32 already
    counter = _count(lambda: sample(logits, batch, argmax=argmax), args)
    by_site: collections.Counter[str] = collections.Counter()
    for (site, _), n in counter.items():
        by_site[site] += n
    print(f"sampling ({'logprobs=' + str(args.logprobs) if args.logprobs is not None else 'no'}"
          f" logprobs): {sum(counter.values())} launches")
    for site, n in by_site.most_common():
        names = ", ".join(f"{op}x{c}" if c > 1 else op
                          for (s, op), c in counter.most_common() if s == site)
        print(f"{n:8d}  {site}: {names}")
    return {"logprobs": args.logprobs, "launches": sum(counter.values()),
            "triton": sum(n for (_, op), n in counter.items() if op.startswith("triton:")),
            "by_site": dict(by_site.most_common())}


if __name__ == "__main__":
    main()
