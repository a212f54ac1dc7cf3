"""Per-op rounding of the `triton` kernel backend against `ref`, on `ref`'s own inputs.

    TRITON_INTERPRET=1 PYTHONPATH=src python3 benchmarks/backend_rounding.py [--dtype bfloat16]
    PYTHONPATH=src python3 benchmarks/backend_rounding.py --device cuda   # compiled kernels

Runs a short greedy + sampled generation of the shipped dsv4-tiny on CPU with the `ref` backend.
Every op call (or, with `--calls-per-step K`, the first K calls of each op in each engine step)
also runs the Triton kernel under the interpreter on cloned inputs and records the mean relative
difference of each output (in-place outputs: the rows the op wrote, the trash row
excluded). A systematic rounding difference (one side rounds an intermediate to bf16, the other
keeps fp32) shows up as ~1e-3 (about one bf16 ulp on most elements); a pure summation-order
difference as ~1e-7. The interpreter's fp32 -> bf16 cast truncates, where the GPU rounds to
nearest even, so the script patches it to round-to-nearest-even first (otherwise every bf16
store differs). The interpreter runs 16-bit `tl.dot` in fp32: roundings that exist only in a
kernel's compiled 16-bit dot path are not visible there; `--device cuda` compares the compiled
kernels on the GPU instead (eager, no CUDA graphs: the comparison syncs).

Prints one line per op (mean and max relative difference over its calls), then one JSON line.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import math
import os
import random
import sys
from typing import Any

CUDA = "cuda" in sys.argv[sys.argv.index("--device") + 1:][:1] if "--device" in sys.argv else False
if not CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402
import triton.language as tl  # noqa: E402
import triton.runtime.interpreter as interpreter  # noqa: E402

from dsv4.assets import default_model_path  # noqa: E402
from dsv4.engine.llm import LLM  # noqa: E402
from dsv4.engine.sampling_params import SamplingParams  # noqa: E402
from dsv4.kernels import registry  # noqa: E402
from dsv4.rl.rewards import ArithmeticTask  # noqa: E402
from dsv4.utils.triton_interpreter import speed_up_interpreter  # noqa: E402

_truncating_convert = interpreter._convert_float


def _rne_convert(data: Any, src: Any, dst: Any, rounding_mode: Any) -> Any:
    if src == tl.float32 and dst == tl.bfloat16:
        t = torch.from_numpy(np.ascontiguousarray(data).view(np.float32).copy())
        return t.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    return _truncating_convert(data, src, dst, rounding_mode)


def _clone(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return x.clone()
    if isinstance(x, tuple) and hasattr(x, "_fields"):
        return type(x)(*[_clone(v) for v in x])
    if isinstance(x, (list, tuple)):
        return type(x)(_clone(v) for v in x)
    return x


def _tensors(x: Any) -> list[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (list, tuple)):
        return [t for v in x for t in _tensors(v)]
    return []


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    if a.numel() == 0:          # e.g. the candidate columns of a step before any entry exists
        return 0.0
    if not a.is_floating_point():
        return float((a != b).float().mean())
    a, b = a.float(), b.float()
    # non-finite entries (the scores' -inf where a candidate is missing) must match exactly, in
    # place and value; the relative difference is over the finite rest (inf - inf is NaN, and a
    # NaN mean would hide every other difference of the op)
    finite = torch.isfinite(a)
    if not (torch.equal(finite, torch.isfinite(b))
            and torch.equal(a[~finite].nan_to_num(nan=0.0), b[~finite].nan_to_num(nan=0.0))):
        return math.inf
    if not finite.any():
        return 0.0
    a, b = a[finite], b[finite]
    return float((a - b).abs().mean() / a.abs().mean().clamp(min=1e-12))


def shadow_ops(stats: dict[str, list[float]], step_calls: dict[str, int],
               calls_per_step: int | None) -> registry.KernelOps:
    """`ref`'s ops, each call also run through `triton` on cloned inputs and compared (at most
    `calls_per_step` calls of an op per engine step, counted in `step_calls`, which the caller
    clears at each step; None: every call)."""
    ref, tri = registry.create_kernels("ref"), registry.create_kernels("triton")

    def wrap(name: str) -> Any:
        fr, ft = getattr(ref, name), getattr(tri, name)

        def op(*args: Any, **kwargs: Any) -> Any:
            step_calls[name] = step_calls.get(name, 0) + 1
            if calls_per_step is not None and step_calls[name] > calls_per_step:
                return fr(*args, **kwargs)
            copies = _clone(args)
            before = [t.clone() for t in _tensors(args)]
            # keyword arguments (the routed experts' combine: shared addend, out dtype, stream
            # join) are read, not written: both forms take them as they are
            out_r, out_t = fr(*args, **kwargs), ft(*copies, **kwargs)
            for a, b in zip(_tensors(out_r), _tensors(out_t), strict=False):
                if a.shape == b.shape:
                    stats[f"{name}:out"].append(_rel(a, b))
            for i, (b0, a, b) in enumerate(zip(before, _tensors(args), _tensors(copies),
                                                strict=True)):
                if a.is_floating_point() and not torch.equal(b0, a):      # written in place
                    rows = (b0 != a) & torch.isfinite(a)
                    rows[-1] = False                                      # the trash row
                    if rows.any():
                        stats[f"{name}:arg{i}"].append(_rel(a[rows], b[rows]))
            return out_r
        return op

    names = [f.name for f in dataclasses.fields(ref) if f.name != "name"]
    return registry.KernelOps("ref", **{n: wrap(n) for n in names})


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--prompts", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=4)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                   help="cpu: kernels under the interpreter; cuda: compiled")
    p.add_argument("--calls-per-step", type=int, default=None,
                   help="compare only the first K calls of each op in each engine step (its "
                        "first K layers that call it; default: every call)")
    args = p.parse_args()
    torch.set_num_threads(max(1, (os.cpu_count() or 2) - 1))
    if not CUDA:
        interpreter._convert_float = _rne_convert
        speed_up_interpreter()
    stats: dict[str, list[float]] = collections.defaultdict(list)
    llm = LLM(default_model_path(), dtype=args.dtype, device=args.device,
              page_size=128 if args.device == "cpu" else 256, max_total_tokens=8192,
              disable_prefix_cache=True, disable_cuda_graph=True)
    step_calls: dict[str, int] = {}
    llm.engine.runner.ops = shadow_ops(stats, step_calls, args.calls_per_step)
    engine_step = llm.engine.step

    def step() -> Any:
        step_calls.clear()
        return engine_step()

    llm.engine.step = step  # type: ignore[method-assign]
    prompts = [q.text for q in ArithmeticTask((4,)).train_prompts(random.Random(0), args.prompts)]
    llm.generate(prompts, SamplingParams(max_tokens=args.max_tokens, temperature=1.0, seed=0),
                 use_tqdm=False)
    rows = {k: {"calls": len(v), "mean_rel": sum(v) / len(v), "max_rel": max(v)}
            for k, v in stats.items()}
    for k, r in sorted(rows.items(), key=lambda kv: -kv[1]["mean_rel"]):
        print(f"{k:26} calls {r['calls']:4d}  mean rel {r['mean_rel']:.2e}  "
              f"max rel {r['max_rel']:.2e}")
    print(json.dumps({"dtype": args.dtype, "device": args.device, "ops": rows}))


if __name__ == "__main__":
    main()
