"""Decode across ranks (issue 22): one GPU against TP / EP / DP-attention layouts of one model.

For each layout (`--layouts`: "1" one process, "tpN", "tpN-epN", "dpN", "dpN-epN") the model is
built once (`LLM`; `--model in-memory:<preset>` draws each rank's shard of the same random
weights, `distributed/dummy.py`, so every layout serves the same model), then:

- agreement, teacher-forced, against the first layout: one `--agree-tokens` prompt with
  `prompt_logprobs=1`; the share of positions whose top-1 token is the reference's, and the
  largest and mean |difference| of the prompt tokens' log-probs (fp32: identical tokens expected;
  bf16: summation-order noise);
- per (batch, context) point (`--points`, "batch:context"): the batch's random prompts prefilled,
  `--warmup-steps`, then `--steps` decode steps timed on rank 0 (CUDA events; every rank runs
  each step, so rank 0's time is the step's) and, over `--profile-steps` more, rank 0's
  collective time per step from `torch.profiler` (CUDA: NCCL kernels' device time; CPU: the
  gloo / c10d ops' host time);
- memory on rank 0: its weights and KV pools against `distributed.memory.plan_memory` for the
  layout, and `torch.cuda.memory_allocated` once built.

Prints a table, then exactly one JSON line (also to `--out`).

    python benchmarks/parallel_decode.py --model in-memory:flash-4l --layouts 1,tp2,tp2-ep2 \\
        --points 1:4096,32:4096,128:32768 --out parallel.json
    python benchmarks/parallel_decode.py --model in-memory:micro --device cpu --dtype float32 \\
        --layouts 1,tp2,dp2-ep2 --points 1:64,4:32 --steps 4 --agree-tokens 48
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Callable, Sequence
from itertools import chain
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

from dsv4 import LLM, SamplingParams
from dsv4.checkpoint.source import resolve_model_source
from dsv4.config.model import ModelConfig
from dsv4.distributed.memory import plan_memory
from dsv4.model.loader import resolve_dtype

sys.path.insert(0, str(Path(__file__).parent))
from decode_context_sweep import prompts_for, sync, timed  # noqa: E402

Row = dict[str, Any]
LAYOUT = re.compile(r"^(?:1|(tp|dp)(\d+)(?:-ep(\d+))?)$")
COLLECTIVE = re.compile(r"nccl|gloo|c10d::|all_reduce|allreduce|all_gather|allgather|broadcast",
                        re.IGNORECASE)


def parse_layout(text: str) -> dict[str, int]:
    """"1" | "tpN" | "tpN-epN" | "dpN" | "dpN-epN" -> LLM keyword arguments."""
    m = LAYOUT.match(text)
    if m is None:
        raise ValueError(f"layout {text!r} is invalid; allowed: 1, tpN, tpN-epN, dpN, dpN-epN")
    if m.group(1) is None:
        return {}
    size = int(m.group(2))
    kw = {"tensor_parallel_size" if m.group(1) == "tp" else "data_parallel_size": size}
    if m.group(3) is not None:
        kw["expert_parallel_size"] = int(m.group(3))
    return kw


def parse_points(text: str) -> list[tuple[int, int]]:
    return [(int(b), int(c)) for b, c in (p.split(":") for p in text.split(",") if p)]


def collective_ms(step: Callable[[], None], steps: int, device: torch.device) -> float:
    """Rank 0's collective time per step over `steps` profiled steps (module docstring)."""
    if steps <= 0:
        return float("nan")
    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    sync(device)
    with profile(activities=activities) as prof:
        for _ in range(steps):
            step()
        sync(device)
    total_us = 0.0
    for e in prof.key_averages():
        if not COLLECTIVE.search(e.key):
            continue
        if cuda and "nccl" in e.key.lower():
            total_us += e.self_device_time_total
        elif not cuda and e.self_cpu_time_total > 0:
            total_us += e.self_cpu_time_total
    return total_us / steps / 1e3


def decode_point(llm: LLM, args: argparse.Namespace, batch: int, context: int) -> Row:
    engine, device = llm.engine, llm.engine.runner.device
    vocab = llm.engine.runner.model.config.vocab_size
    need = args.warmup_steps + args.steps + args.profile_steps + 4
    params = SamplingParams(max_tokens=need + batch * context // args.chunk + batch,
                            temperature=0.0, ignore_eos=True)
    reqs = [engine.add_request(p, params) for p in prompts_for(batch, context, vocab, args.seed)]
    row: Row = {"batch": batch, "context": context}

    def steps(n: int) -> Callable[[], None]:
        def run() -> None:
            for _ in range(n):
                engine.step()
        return run

    try:
        row["prefill_s"] = round(timed(lambda: _prefill(engine, reqs), device), 3)
        timed(steps(args.warmup_steps), device)
        seconds = timed(steps(args.steps), device)
        row["ms_per_step"] = round(seconds / args.steps * 1e3, 4)
        row["tok_s"] = round(batch * args.steps / seconds, 1)
        row["collective_ms_per_step"] = round(
            collective_ms(steps(1), args.profile_steps, device), 4)
        row["status"] = "ok"
    except torch.OutOfMemoryError as e:
        row["status"] = f"oom: {str(e)[:120]}"
    finally:
        for r in reqs:
            if not r.is_finished:
                engine.finish(r.rid)
        while engine.has_unfinished():
            engine.step()
        for r in reqs:
            engine.pop(r.rid)
    return row


def _prefill(engine: Any, reqs: list[Any]) -> None:
    while not all(r.output_ids for r in reqs):
        engine.step()


def agreement(llm: LLM, prompt: list[int]) -> tuple[list[int | None], list[float | None]]:
    """(top-1 token, prompt token log-prob) at every prompt position, teacher-forced."""
    out = llm.generate(prompt_token_ids=[prompt], use_tqdm=False, sampling_params=SamplingParams(
        max_tokens=1, temperature=0.0, ignore_eos=True, prompt_logprobs=1))[0]
    assert out.prompt_top_logprobs is not None and out.prompt_logprobs is not None
    tops = [max(d, key=d.__getitem__) if d else None for d in out.prompt_top_logprobs]
    return tops, list(out.prompt_logprobs)


def compare(got: tuple[list[Any], list[Any]], want: tuple[list[Any], list[Any]]) -> Row:
    pairs = [(a, b) for a, b in zip(got[0], want[0], strict=True) if b is not None]
    diffs = [abs(a - b) for a, b in zip(got[1], want[1], strict=True) if b is not None]
    return {"top1_agreement": round(sum(a == b for a, b in pairs) / len(pairs), 5),
            "max_abs_logprob_diff": max(diffs), "mean_abs_logprob_diff": sum(diffs) / len(diffs)}


def memory(llm: LLM, args: argparse.Namespace, path: Path, kw: dict[str, int]) -> Row:
    """Rank 0's weights and KV pools, against the plan for the layout."""
    runner, model = llm.engine.runner, llm.engine.runner.model
    weights = sum(t.numel() * t.element_size() for t in chain(model.parameters(),
                                                              model.buffers()))
    plan = plan_memory(ModelConfig.from_hf(path), runner.config, resolve_dtype(args.dtype),
                       kw.get("tensor_parallel_size", 1), kw.get("expert_parallel_size", 1) > 1,
                       args.weight_format, kw.get("data_parallel_size", 1))[0]
    row = {"weights_gb": round(weights / 1e9, 4), "plan_weights_gb": round(plan.weights / 1e9, 4),
           "kv_gb": round(runner.pools.nbytes() / 1e9, 4), "plan_kv_gb": round(plan.kv / 1e9, 4)}
    if runner.device.type == "cuda":
        row["allocated_gb"] = round(torch.cuda.memory_allocated(runner.device) / 1e9, 4)
    return row


def run_layout(name: str, args: argparse.Namespace, reference: tuple[Any, Any] | None
               ) -> tuple[list[Row], tuple[Any, Any]]:
    kw = parse_layout(name)
    path, load_format = resolve_model_source(args.model, "auto")
    longest = max(b * (c + args.steps * 2 + 256) for b, c in args.points)
    with LLM(args.model, dtype=args.dtype, device=args.device, weight_format=args.weight_format,
             load_format=load_format, page_size=args.page_size, chunked_prefill_size=args.chunk,
             max_running_requests=max(b for b, _ in args.points), disable_prefix_cache=True,
             max_total_tokens=max(longest, args.agree_tokens * 2 + 256),
             seed=args.seed, **kw) as llm:  # type: ignore[arg-type]
        base: Row = {"layout": name, **memory(llm, args, path, kw)}
        vocab = llm.engine.runner.model.config.vocab_size
        prompt = prompts_for(1, args.agree_tokens, vocab, args.seed + 7)[0]
        mine = agreement(llm, prompt)
        if reference is not None:
            base.update(compare(mine, reference))
        rows = [{**base, **decode_point(llm, args, b, c)} for b, c in args.points]
    return rows, mine


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="in-memory:flash-4l")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--weight-format", default="bf16", choices=["bf16", "checkpoint"])
    p.add_argument("--layouts", default="1,tp2,tp2-ep2")
    p.add_argument("--points", type=parse_points, default=parse_points("1:4096,32:4096"))
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--warmup-steps", type=int, default=4)
    p.add_argument("--profile-steps", type=int, default=4)
    p.add_argument("--agree-tokens", type=int, default=512)
    p.add_argument("--page-size", type=int, default=256)
    p.add_argument("--chunk", type=int, default=8192, help="chunked prefill size")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    layouts = args.layouts.split(",")
    for name in layouts:
        parse_layout(name)                                   # refuse a bad name before any run
    rows: list[Row] = []
    reference = None
    for name in layouts:
        got, mine = run_layout(name, args, reference)
        reference = reference or mine
        rows += got
    _print_table(rows)
    result = {"bench": "parallel_decode", "model": args.model, "dtype": args.dtype,
              "weight_format": args.weight_format, "device": _device_name(args.device),
              "rows": rows}
    line = json.dumps(result)
    if args.out:
        Path(args.out).write_text(line + "\n")
    print(line)
    return result


def _device_name(device: str) -> str:
    if device.startswith("cuda") and torch.cuda.is_available():
        return f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}"
    return device


def _print_table(rows: list[Row]) -> None:
    cols = ("layout", "batch", "context", "ms_per_step", "tok_s", "collective_ms_per_step",
            "top1_agreement", "max_abs_logprob_diff", "weights_gb", "plan_weights_gb", "status")
    print(" | ".join(cols))
    for r in rows:
        print(" | ".join(str(r.get(c, "")) for c in cols))


if __name__ == "__main__":
    main()
