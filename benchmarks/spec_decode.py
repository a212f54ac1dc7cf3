"""MTP speculative decoding: decode speed with and without it, and the cost of a verify step.

    PYTHONPATH=src python benchmarks/spec_decode.py --device cuda --dtype bfloat16 \
        --kernel-backend triton                                   # dsv4-tiny, batch 1 / 8 / 32
    PYTHONPATH=src python benchmarks/spec_decode.py --preset flash-4l --device cuda \
        --dtype bfloat16 --kernel-backend triton --batches 1,32   # random weights: step cost

Model mode (a checkpoint, default the shipped dsv4-tiny): per batch size B, B arithmetic prompts
decoded greedily for `--output-len` tokens (ignore_eos) by the plain engine and by the engine with
`--num-steps` drafts; decode tokens/s (output tokens / wall time after a warm-up run of the same
workload, prefill included), the speed-up, the mean acceptance length (tokens per verify pass)
and the fraction of output tokens equal to the plain engine's (1.0 in fp32; bf16 verify passes
round differently from single-token steps): free-running, and teacher-forced
(`teacher_forced_agreement`: every position on the plain engine's prefix).
Preset mode (random weights, so drafts are almost never accepted): per batch size, the time of a
steady-state decode step of the plain engine and of the speculative engine (a verify pass of
N + 1 tokens per request, the MTP pass and the draft chain), each the median over `--steps`
CUDA-synchronised steps; the ratio, and the speed-up that acceptance length L would give
(L / ratio) for L = 2.5.
With CUDA graphs it also times the parts of a step alone: the target forward (graph replay) of
the plain step and of the verify step (`verify_ratio`: N + 1 tokens against 1), and the drafting
graph (the MTP pass + chain). Against the byte floor (`decode_context_sweep.weight_bytes`, uniform
routing: random weights): `floor_verify_ratio` = the weight bytes of N + 1 tokens per request over
those of one (what the verify / plain ratio is at the floor), and `extra_gbps` = the extra bytes
of the verify forward over its extra time (how close the increment runs to the copy bandwidth).
Prints a table, then one JSON line (also written to --out).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from decode_context_sweep import expected_experts, weight_bytes  # a sibling script

from dsv4 import LLM, SamplingParams
from dsv4.assets import default_model_path
from dsv4.rl.rewards import ArithmeticTask


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    page = 256 if args.device.startswith("cuda") else 128
    return dict(dtype=args.dtype, device=args.device, kernel_backend=args.kernel_backend,
                page_size=page, max_running_requests=max(args.batch_list),
                max_total_tokens=max(args.batch_list) * 4 * page)


def teacher_forced_agreement(llm: LLM, texts: list[str], params: SamplingParams,
                             truth: list[list[int]]) -> float:
    """Fraction of positions where the speculative engine's greedy token equals the plain
    engine's, teacher-forced: its drafts are always the plain engine's continuation, and a token
    that differs is counted and overwritten with the plain one before it is fed, so every
    position is computed on the plain engine's prefix."""
    engine = llm.engine
    by_rid: dict[str, list[int]] = {}
    counts = [0, 0]                                          # differing, all
    original = engine._process

    def process(result: Any) -> Any:
        before = {r.rid: len(r.output_ids) for r in result.requests}
        updated = original(result)
        for req in result.requests:
            want = by_rid[req.rid]
            for i in range(before[req.rid], len(req.output_ids)):
                counts[1] += 1
                if req.output_ids[i] != want[i]:
                    counts[0] += 1
                    req.overwrite_output(i, want[i])
            if req.draft_ids:
                n = len(req.output_ids)
                cont = want[n:n + len(req.draft_ids)]
                req.draft_ids = cont + [0] * (len(req.draft_ids) - len(cont))
        return updated
    engine._process = process  # type: ignore[method-assign]
    try:
        for text, want in zip(texts, truth, strict=True):
            req = engine.add_request(llm.encode(text), params)
            by_rid[req.rid] = want
        while engine.has_unfinished():
            engine.step()
    finally:
        engine._process = original  # type: ignore[method-assign]
    return 1 - counts[0] / max(1, counts[1])


def model_mode(args: argparse.Namespace) -> list[dict[str, Any]]:
    kw = engine_kwargs(args)
    llms = {n: LLM(args.model, speculative_num_steps=n, **kw) for n in (0, args.num_steps)}
    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    rows = []
    for B in args.batch_list:
        texts = [q.text for q in ArithmeticTask((3, 4, 5)).train_prompts(random.Random(B), B)]
        out: dict[int, Any] = {}
        for n, llm in llms.items():
            llm.generate(texts, params, use_tqdm=False)                 # warm-up: graphs, compile
            before = list(llm.engine.spec_accept_hist), llm.engine.spec_accepted_tokens
            sync(args.device)
            t0 = time.perf_counter()
            got = llm.generate(texts, params, use_tqdm=False)
            sync(args.device)
            wall = time.perf_counter() - t0
            passes = sum(llm.engine.spec_accept_hist) - sum(before[0])
            accepted = llm.engine.spec_accepted_tokens - before[1]
            out[n] = (got, wall, 1 + accepted / passes if passes else None)
        plain, spec = out[0], out[args.num_steps]
        tokens = sum(len(o.token_ids) for o in plain[0])
        same = sum(a == b for p, s in zip(plain[0], spec[0], strict=True)
                   for a, b in zip(p.token_ids, s.token_ids, strict=True))
        forced = teacher_forced_agreement(llms[args.num_steps], texts, params,
                                          [o.token_ids for o in plain[0]])
        rows.append({"batch": B, "plain_tok_s": tokens / plain[1], "spec_tok_s": tokens / spec[1],
                     "speedup": plain[1] / spec[1], "acceptance_length": spec[2],
                     "token_agreement": same / tokens, "teacher_forced_agreement": forced})
    return rows


def step_times(llm: LLM, B: int, prompt_len: int, steps: int,
               device: str) -> tuple[list[float], dict[str, float]]:
    """Seconds per steady-state decode step of B requests (all past prefill), and the step's
    parts (`component_times`)."""
    engine = llm.engine
    gen = torch.Generator().manual_seed(B)
    vocab = llm.model.config.vocab_size
    params = SamplingParams(max_tokens=steps * 8 + 16, temperature=0.0, ignore_eos=True)
    reqs = [engine.add_request(torch.randint(2, vocab, (prompt_len,), generator=gen).tolist(),
                                params) for _ in range(B)]
    while any(r.num_pending != 1 or len(r.output_ids) < 2 for r in reqs):
        engine.step()
    for _ in range(3):                                                  # graphs, compile
        engine.step()
    times = []
    for _ in range(steps):
        sync(device)
        t0 = time.perf_counter()
        engine.step()
        sync(device)
        times.append(time.perf_counter() - t0)
    parts = component_times(engine, steps, device)
    for r in reqs:
        engine.abort(r.rid)
    return times, parts


def component_times(engine: Any, steps: int, device: str) -> dict[str, float]:
    """Median seconds of the next step's target forward alone (its graph replayed) and, under
    speculation, of its drafting graph alone (the MTP pass + chain). The step is scheduled but
    never finished: the caller aborts every request afterwards."""
    graphs = engine.runner.graphs
    step = engine.scheduler.schedule()
    if graphs is None or step is None or not graphs.fits(step.shape):
        return {}
    n = step.shape.lens[0]

    def timed(fn: Any) -> float:
        fn()
        out = []
        for _ in range(steps):
            sync(device)
            t0 = time.perf_counter()
            fn()
            sync(device)
            out.append(time.perf_counter() - t0)
        return statistics.median(out)

    parts = {"forward": timed(lambda: graphs.run_streams(step.input_ids, step.shape, False))}
    if engine.spec_steps:
        b = len(step.shape.lens)
        nxt = torch.zeros(b * n, dtype=torch.int64, device=device)
        first = torch.arange(b, device=device) * n
        parts["draft"] = timed(lambda: graphs.draft_after(nxt, first, engine.spec_steps))
    return parts


def _ms(parts: dict[str, float], key: str) -> float | None:
    return parts[key] * 1e3 if key in parts else None


def preset_mode(args: argparse.Namespace) -> list[dict[str, Any]]:
    from dsv4.checkpoint.presets import get_preset
    from dsv4.checkpoint.writer import random_model
    from dsv4.config.engine import EngineConfig
    from dsv4.engine.engine import LLMEngine
    from dsv4.model.loader import resolve_device, resolve_dtype

    model = random_model(get_preset(args.preset), resolve_dtype(args.dtype),
                         resolve_device(args.device), seed=0)
    kw = engine_kwargs(args)
    rows = []
    for B in args.batch_list:
        med, parts = {}, {}
        for n in (0, args.num_steps):
            config = EngineConfig(page_size=kw["page_size"], max_running_requests=B,
                                  max_total_tokens=kw["max_total_tokens"],
                                  kernel_backend=args.kernel_backend, disable_prefix_cache=True,
                                  speculative_num_steps=n)
            llm = LLM.__new__(LLM)
            llm.model, llm.engine = model, LLMEngine(model, config)
            times, parts[n] = step_times(llm, B, args.prompt_len, args.steps, args.device)
            med[n] = statistics.median(times)
            llm.engine.release_memory()
        ratio = med[args.num_steps] / med[0]
        spec = parts[args.num_steps]
        rows.append({"batch": B, "plain_step_ms": med[0] * 1e3,
                     "spec_step_ms": med[args.num_steps] * 1e3, "ratio": ratio,
                     "speedup_at_2_5": 2.5 / ratio,
                     "plain_forward_ms": _ms(parts[0], "forward"),
                     "verify_forward_ms": _ms(spec, "forward"), "draft_ms": _ms(spec, "draft"),
                     "verify_ratio": (spec["forward"] / parts[0]["forward"]
                                      if "forward" in spec and "forward" in parts[0] else None),
                     **floor_terms(model, B, args.num_steps, parts[0], spec)})
    return rows


def floor_terms(model: Any, B: int, n: int, plain: dict[str, float],
                spec: dict[str, float]) -> dict[str, float | None]:
    """The verify pass against the byte floor (module docstring); uniform routing."""
    cfg = model.config
    one = weight_bytes(model, B, expected_experts(cfg, B))
    many = weight_bytes(model, B * (n + 1), expected_experts(cfg, B * (n + 1)))
    extra_s = spec.get("forward", 0.0) - plain.get("forward", 0.0)
    return {"floor_verify_ratio": many / one, "extra_gb": (many - one) / 1e9,
            "extra_gbps": (many - one) / 1e9 / extra_s if extra_s > 0 else None}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=str(default_model_path()))
    p.add_argument("--preset", default=None, help="random weights of this preset (step cost)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--kernel-backend", default="ref")
    p.add_argument("--num-steps", type=int, default=3)
    p.add_argument("--batches", default="1,8,32")
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=128, help="with --preset")
    p.add_argument("--steps", type=int, default=20, help="timed decode steps, with --preset")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    args.batch_list = [int(b) for b in args.batches.split(",")]
    torch.set_num_threads(max(1, torch.get_num_threads() - 1))
    rows = preset_mode(args) if args.preset else model_mode(args)
    keys = list(rows[0])
    print(" ".join(f"{k:>17}" for k in keys))
    for r in rows:
        print(" ".join(f"{r[k]:>17.4g}" if isinstance(r[k], float) else f"{r[k]!s:>17}"
                       for k in keys))
    result = {"bench": "spec_decode", "device": args.device,
              "gpu": torch.cuda.get_device_name() if args.device.startswith("cuda") else None,
              "torch": torch.__version__, "dtype": args.dtype,
              "kernel_backend": args.kernel_backend, "model": args.preset or args.model,
              "num_steps": args.num_steps, "rows": rows}
    print(json.dumps(result))
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
