"""Which kernel ops give a token's row a result that depends on the rest of the call (issue 18).

    PYTHONPATH=src python3 benchmarks/kernel_invariance.py --device cuda [--preset flash-4l] \
        [--invariant-plans]

Runs a short generation (prefill, then decode at the batch size of `--prompts`) with one kernel
backend (default `triton`), eager. Every call of a token-wise op is run again on the GPU in three
other shapes and its rows compared bit for bit with the original call's rows:

    alone   each of the first rows as a call of one token
    big     the call's rows repeated until the call has at least `--big` tokens
    pad     (sparse_attention only) every index row with 256 trailing -1 columns

A row that differs means the op's value for a token depends on the batch around it (a split
chosen from the token count, a tile size chosen from the rows per expert, ...): the trainer's
full-sequence forward, whose calls have other shapes than the engine's steps, then cannot
reproduce the engine's value even through the same kernel. Prints one line per op and variant
(rows compared, rows that differ, max |difference|), then one JSON line.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import os
import random
from collections.abc import Callable
from typing import Any

import torch

from dsv4.kernels import registry

# op -> positions of the token-indexed arguments (dim 0 = tokens); sparse_attention's source
# index rows are handled separately.
TOKEN_ARGS: dict[str, tuple[int, ...]] = {
    "sparse_attention": (0,), "mhc_pre": (0,), "mhc_post": (0, 1, 2, 3), "mhc_head": (0,),
    "routed_experts": (0, 4, 5), "routed_experts_quant": (0, 5, 6), "rms_norm": (0,),
    "q_norm_rope": (0, 1, 2), "qkv_norm_rope": (0, 2, 5, 6, 8), "index_scores": (0, 1, 3),
    "topk": (0, 1), "rope": (0, 1, 2), "rope_fp8": (0, 1, 2), "moe_gate_logits": (0,),
}
Stats = dict[str, list[float]]


def _take(args: tuple[Any, ...], name: str, rows: torch.Tensor) -> tuple[Any, ...]:
    """The call's arguments restricted (or repeated) to token rows `rows`."""
    out = list(args)
    for i in TOKEN_ARGS[name]:
        out[i] = args[i][rows]
    if name == "sparse_attention":
        out[1] = [(kv, idx[rows]) for kv, idx in args[1]]
    return tuple(out)


def _padded(args: tuple[Any, ...]) -> tuple[Any, ...]:
    sources = [(kv, torch.nn.functional.pad(idx, (0, 256), value=-1)) for kv, idx in args[1]]
    return (args[0], sources, *args[2:])


def _first(out: Any) -> torch.Tensor:
    return out[0] if isinstance(out, tuple) else out


def _compare(stats: Stats, key: str, ref: torch.Tensor, got: torch.Tensor) -> None:
    """Appends (rows, rows that differ, max |diff|) for rows of ref vs got."""
    a, b = ref.reshape(ref.shape[0], -1).float(), got.reshape(got.shape[0], -1).float()
    same = (a == b) | (torch.isnan(a) & torch.isnan(b))
    diff = (a - b).nan_to_num(0.0).abs().max().item() if a.numel() else 0.0
    stats[key] += [float(a.shape[0]), float((~same.all(dim=1)).sum().item()), diff]


def _take_kw(kwargs: dict[str, Any], rows: torch.Tensor) -> dict[str, Any]:
    """Keyword arguments restricted to token rows `rows`: the routed experts' `shared` addend and
    the attention's `inverse_rope` tables (the stream join `wait_shared` is the probed call's
    alone)."""
    out = {k: v for k, v in kwargs.items() if k != "wait_shared"}
    if out.get("shared") is not None:
        out["shared"] = out["shared"][rows]
    if out.get("inverse_rope") is not None:
        out["inverse_rope"] = tuple(t[rows] for t in out["inverse_rope"])
    return out


def probe(name: str, fn: Callable[..., Any], stats: Stats, big: int) -> Callable[..., Any]:
    def op(*args: Any, **kwargs: Any) -> Any:
        if name == "rms_norm":
            shape = args[0].shape
            out = fn(args[0].reshape(-1, shape[-1]), *args[1:])
            rows_out = out
            args = (args[0].reshape(-1, shape[-1]), *args[1:])
            out = out.view(shape)
        else:
            out = fn(*args, **kwargs)
            rows_out = _first(out)
        T = args[0].shape[0]
        if T == 0:
            return out
        dev = args[0].device
        for r in range(min(T, 4)):
            one = torch.tensor([r], device=dev)
            got = _first(fn(*_take(args, name, one), **_take_kw(kwargs, one)))
            _compare(stats, f"{name}:alone", rows_out[r:r + 1], got)
        reps = -(-big // T)
        many = torch.arange(T, device=dev).repeat(reps)
        got = _first(fn(*_take(args, name, many), **_take_kw(kwargs, many)))
        _compare(stats, f"{name}:big", rows_out, got[:T])
        if name == "sparse_attention":
            _compare(stats, f"{name}:pad", rows_out, _first(fn(*_padded(args), **kwargs)))
        return out
    return op


def probe_ops(ops: registry.KernelOps, stats: Stats, big: int) -> registry.KernelOps:
    fields = {f.name: getattr(ops, f.name) for f in dataclasses.fields(ops) if f.name != "name"}
    wrapped = {n: probe(n, f, stats, big) if n in TOKEN_ARGS else f for n, f in fields.items()}
    return registry.KernelOps(ops.name, **wrapped)


def build_llm(args: argparse.Namespace) -> Any:
    from dsv4.engine.llm import LLM
    if args.preset is None:
        from dsv4.assets import default_model_path
        return LLM(default_model_path(), dtype=args.dtype, device=args.device,
                   kernel_backend=args.kernel_backend, page_size=256, max_total_tokens=16384,
                   disable_prefix_cache=True, disable_cuda_graph=True,
                   invariant_plans=args.invariant_plans)
    from dsv4.checkpoint.presets import get_preset
    from dsv4.checkpoint.writer import random_model
    from dsv4.config.engine import EngineConfig
    from dsv4.engine.engine import LLMEngine
    from dsv4.model.loader import resolve_dtype
    model = random_model(get_preset(args.preset), resolve_dtype(args.dtype),
                         torch.device(args.device), seed=0)
    engine = LLMEngine(model, EngineConfig(
        page_size=256, max_running_requests=args.prompts, max_total_tokens=16384,
        kernel_backend=args.kernel_backend, disable_prefix_cache=True, disable_cuda_graph=True,
        capture_routing=True, invariant_plans=args.invariant_plans))
    return engine


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--kernel-backend", default="triton")
    p.add_argument("--preset", default=None, help="random weights of this preset (flash-4l)")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=3)
    p.add_argument("--big", type=int, default=4096)
    p.add_argument("--invariant-plans", action="store_true",
                   help="the backend's token-count-invariant launch plans")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    torch.set_num_threads(max(1, (os.cpu_count() or 2) - 1))
    from dsv4.engine.sampling_params import SamplingParams
    stats: Stats = collections.defaultdict(list)
    llm = build_llm(args)
    engine = llm.engine if hasattr(llm, "engine") else llm
    engine.runner.ops = probe_ops(engine.runner.ops, stats, args.big)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=1.0, seed=0)
    if args.preset is None:
        from dsv4.rl.rewards import ArithmeticTask
        prompts = [q.text for q in
                   ArithmeticTask((4,)).train_prompts(random.Random(0), args.prompts)]
        llm.generate(prompts, params, use_tqdm=False)
    else:
        from dsv4.rl.rollout import sample_token_ids
        gen = torch.Generator().manual_seed(0)
        vocab = engine.runner.model.config.vocab_size
        ids = [torch.randint(2, vocab, (96,), generator=gen).tolist() for _ in range(args.prompts)]
        sample_token_ids(engine, ids, 1, 1.0, args.max_tokens, seed=0)
    rows = {}
    for key, v in sorted(stats.items()):
        n, bad, top = sum(v[0::3]), sum(v[1::3]), max(v[2::3])
        rows[key] = {"rows": int(n), "differ": int(bad), "max_abs": top}
        print(f"{key:30} rows {int(n):7d}  differ {int(bad):7d}  max |diff| {top:.3e}")
    record = {"preset": args.preset or "dsv4-tiny", "dtype": args.dtype,
              "backend": args.kernel_backend, "invariant_plans": args.invariant_plans,
              "prompts": args.prompts, "ops": rows}
    print(json.dumps(record))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()
