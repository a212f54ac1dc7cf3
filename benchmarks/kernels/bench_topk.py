"""Lightning TopK benchmark: Triton radix select vs `torch.topk` vs the reference `topk_ragged`.

For each (B, N, k) it checks that `lightning_topk` equals the reference (`topk_ragged`, a stable
sort) exactly, then times the three ops (CUDA events, median over many reps after warm-up; by
default each timed sample replays a CUDA graph of `--inner` calls, so launch overhead is the GPU's,
not Python's: at ~10 us per call it would dominate). Reports us per call, achieved GB/s (bytes =
B*N*4 scores read once + B*4 lengths + B*k*8 output) and its share of the H200 device-copy anchor
4.275 TB/s (docs/DESIGN.md §3), and the speed-up over torch.topk; `path` is the plan's name (row |
coop | compact-bound | compact-exact; the coop path timed with a held workspace, `triton_fresh`
with a fresh one per call). Prints a table, then ONE JSON line. `--sweep` also times `TopKConfig`
variants (one knob changed at a time from the default; Lightning TopK only; the two target cases)
to tune the thresholds, printing each as it finishes (a run cut by a time limit keeps what it has).

    PYTHONPATH=src python3 benchmarks/kernels/bench_topk.py                # CUDA (H200)
    PYTHONPATH=src python3 benchmarks/kernels/bench_topk.py --sweep        # + TopKConfig sweep
    PYTHONPATH=src python3 benchmarks/kernels/bench_topk.py --cpu-smoke    # tiny, interpreter
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

COPY_GBPS = 4275.0                                   # H200 device copy, docs/DESIGN.md §3
GPU_CASES = [(1, 262144, 512), (64, 262144, 512), (1, 65536, 1024), (8, 262144, 2048),
             (2, 262144, 512), (4, 262144, 512)]
TARGET_US = {(1, 262144, 512): 15.0, (64, 262144, 512): 60.0}
SWEEP: list[dict[str, int]] = [  # one knob at a time, around the default TopKConfig
    {"exact_max": 0}, {"exact_max": 1 << 40}, {"group": 8}, {"group": 2}, {"target_programs": 264},
    {"target_programs": 1056}, {"compact_block": 512}, {"compact_block": 2048},
    {"tail_block": 1024}, {"tail_block": 4096}, {"compact_warps": 4}, {"narrow_warps": 4},
    {"wide_programs": 0}, {"max_chunk": 4096}, {"max_chunk": 16384}, {"max_hist_splits": 32},
    {"max_hist_splits": 128}, {"block": 2048}, {"block": 8192}, {"chunk_tile": 8192},
    {"chunk_tile": 4096}, {"sample": 4}, {"sample": 8}, {"sample": 4, "chunk_tile": 4096},
]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cpu-smoke", action="store_true",
                   help="tiny shapes on CPU under TRITON_INTERPRET=1")
    p.add_argument("--reps", type=int, default=200,
                   help="timed samples per op (the reference gets 1/10)")
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--inner", type=int, default=10, help="calls per CUDA-graph replay")
    p.add_argument("--eager", action="store_true", help="time eager calls instead of graph replays")
    p.add_argument("--sweep", action="store_true", help="also time TopKConfig variants (see SWEEP)")
    p.add_argument("--knobs", type=json.loads, default=None,
                   help="the sweep's overrides as a JSON list of "
                   "objects (default: SWEEP), e.g. "
                   "'[{\"sample\": 4}, {\"sample\": 8, \"chunk_tile\": 4096}]'")
    p.add_argument("--cases",
                   type=lambda v: [tuple(map(int, c.split("x"))) for c in v.split(",")],
                   default=None,
                   help="time these (B, N, k) instead of GPU_CASES, e.g. "
                   "1x262144x512,2x262144x512")
    p.add_argument("--config", type=json.loads, default={},
                   help="TopKConfig overrides for the main cases as a JSON "
                   "object, e.g. '{\"coop_programs\": 65536}'")
    p.add_argument("--profile", action="store_true",
                   help="also split each case's time per kernel (torch.profiler "
                   "over eager calls: kernel time only, no launch gaps)")
    p.add_argument("--probe", action="store_true",
                   help="also time each phase of the compact path's second kernel "
                   "(the GPU's global timer stamped at phase boundaries: `launch_compact(probe=)`)")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


def load_ops(cpu_smoke: bool) -> dict[str, Any]:
    """Import the ops; on CPU the interpreter flag must be set before triton sees any
    `@triton.jit`."""
    if cpu_smoke:
        os.environ["TRITON_INTERPRET"] = "1"
    import triton

    from dsv4.kernels.ref.topk import topk_ragged
    from dsv4.kernels.triton.topk import (
        TopKConfig,
        device_sms,
        lightning_topk,
        plan_topk,
        topk_workspace_numel,
    )
    return dict(triton=triton, topk_ragged=topk_ragged, TopKConfig=TopKConfig,
                lightning_topk=lightning_topk, plan_topk=plan_topk, device_sms=device_sms,
                topk_workspace_numel=topk_workspace_numel)


def time_cpu(fn: Callable[[], Any], reps: int) -> float:
    fn()
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(samples)


def time_cuda(fn: Callable[[], Any], reps: int, warmup: int, inner: int, eager: bool) -> float:
    """Median us per call: events around one eager call, or around one replay of a graph of `inner`
    calls."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    # compile + allocator warm-up off the capture stream
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    step, per_step = fn, 1
    if not eager:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(inner):
                fn()
        step, per_step = graph.replay, inner
    for _ in range(warmup):
        step()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    samples = []
    for _ in range(reps):
        start.record()
        step()
        end.record()
        end.synchronize()                            # NOTE: benchmark-only sync point
        samples.append(start.elapsed_time(end) * 1e3 / per_step)
    return statistics.median(samples)


def run_case(ops: dict[str, Any], B: int, N: int, k: int, args: argparse.Namespace, device: str,
             config: Any, only_triton: bool = False) -> dict[str, Any]:
    g = torch.Generator().manual_seed(args.seed + B + N + k)
    scores = torch.randn(B, N, generator=g).to(device)
    lengths = torch.full((B,), N, dtype=torch.int32, device=device)
    sms = ops["device_sms"](scores.device)
    plan = ops["plan_topk"](B, N, config, sms)
    # NOTE: the coop path is timed with a workspace held across calls, as a serving engine holds one
    # (it must be zero once; every call leaves it so); `triton_fresh` is the same call taking a
    # fresh zeroed one (a memset)
    held = None if plan.coop is None else \
        torch.zeros(ops["topk_workspace_numel"](B, N, k, config, sms), dtype=torch.int32,
                    device=device)
    fast = lambda: ops["lightning_topk"](scores, lengths, k, config=config, workspace=held)  # noqa: E731
    ref = lambda: ops["topk_ragged"](scores, lengths, k)                     # noqa: E731
    if not torch.equal(fast(), ref()):
        raise AssertionError(f"lightning_topk != topk_ragged at B={B} N={N} k={k}")
    fns = {"triton": fast, "torch_topk": lambda: torch.topk(scores, k, dim=-1), "ref": ref}
    if only_triton:
        fns = {"triton": fast}
    if held is not None:
        fns["triton_fresh"] = lambda: ops["lightning_topk"](scores, lengths, k, config=config)
    us: dict[str, float | None] = {"torch_topk": None, "ref": None, "triton_fresh": None}
    for name, fn in fns.items():
        reps = args.reps if name != "ref" else max(3, args.reps // 10)
        if device == "cpu":
            us[name] = time_cpu(fn, reps)
        else:
            us[name] = time_cuda(fn, reps, args.warmup, args.inner, args.eager)
    fast_us, topk_us, ref_us = us["triton"], us["torch_topk"], us["ref"]
    assert fast_us is not None
    gbps = (B * N * 4 + B * 4 + B * k * 8) / 1e9 / (fast_us * 1e-6)
    target = TARGET_US.get((B, N, k))
    compact = plan.compact
    return dict(B=B, N=N, k=k, path=plan.name, splits=plan.splits,
                hist_splits=compact.hist_splits if compact else 1,
                config={f: getattr(config, f) for f in config.__dataclass_fields__},
                triton_us=round(fast_us, 2),
                torch_topk_us=None if topk_us is None else round(topk_us, 2),
                ref_us=None if ref_us is None else round(ref_us, 2), gbps=round(gbps, 1),
                triton_fresh_us=(None if us["triton_fresh"] is None
                                 else round(us["triton_fresh"], 2)),
                pct_copy=round(100 * gbps / COPY_GBPS, 2),
                speedup_vs_topk=None if topk_us is None else round(topk_us / fast_us, 2),
                target_us=target, meets_target=None if target is None else fast_us <= target)


def kernel_times(fn: Callable[[], Any], reps: int = 20) -> dict[str, float]:
    """Mean GPU time per call of each kernel `fn` launches, by kernel name (us)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    out: dict[str, float] = {}
    for event in prof.key_averages():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            out[event.key] = round(event.device_time_total / reps, 2)
    return out


def probe_phases(B: int, N: int, k: int, config: Any, device: str) -> dict[str, Any]:
    """Median ns per phase of one call: K2's phases (per program) and the tail's (per row) on the
    compact path (`launch_compact(probe=)`), each program's steps between barriers on the coop path
    (`launch_coop(probe=)`)."""
    from dsv4.kernels.triton.topk import device_sms, plan_topk

    scores = torch.randn(B, N, device=device)
    lengths = torch.full((B,), N, dtype=torch.int32, device=device)
    out = torch.empty((B, k), dtype=torch.int64, device=device)
    plan = plan_topk(B, N, config, device_sms(scores.device))
    if plan.coop is not None:
        return _probe_coop(scores, lengths, out, plan.coop)
    if plan.compact is None:
        return {}
    from dsv4.kernels.triton.topk_compact import launch_compact

    probe = torch.zeros((B * plan.compact.splits, 16), dtype=torch.int64, device=device)
    # compile, then warm caches; the last call's stamps are read
    for _ in range(3):
        probe.zero_()
        launch_compact(scores, lengths, out, plan.compact, probe=probe)
    torch.cuda.synchronize()
    t = probe.cpu().double()                          # NOTE: benchmark-only sync point
    t0 = t[:, 0].min()
    tails = t[t[:, 9] > 0]
    med = lambda x: round(float(x.median()), 0)       # noqa: E731
    names = ["bin0", "compact", "cand_hists", "done_atomic"]
    phases = {f"k2_{n}_ns": med(t[:, j + 1] - t[:, j]) for j, n in enumerate(names)}
    tail_names = ["start", "bin1", "scratch", "select", "pad"]
    phases.update({f"tail_{n}_ns": med(tails[:, j + 5] - tails[:, j + 4])
                   for j, n in enumerate(tail_names)})
    phases.update(k2_start_spread_ns=round(float(t[:, 0].max() - t0)), tails=len(tails),
                  tail_start_after_k2_start_ns=med(tails[:, 5] - t0),
                  k2_end_ns=round(float(t[:, 9].max() - t0)),
                  last_done_ns=round(float(t[:, 4].max() - t0)), scratch_len=med(tails[:, 10]),
                  candidates=med(tails[:, 11]))
    return phases


def _probe_coop(scores: torch.Tensor, lengths: torch.Tensor, out: torch.Tensor,
                plan: Any) -> dict[str, Any]:
    """Coop path: per program, ns from its start to each stamp (median over programs), and the start
    spread."""
    from dsv4.kernels.triton.topk_coop import coop_workspace_numel, launch_coop

    B = scores.shape[0]
    workspace = torch.zeros(coop_workspace_numel(B, plan), dtype=torch.int32, device=scores.device)
    probe = torch.zeros((B * plan.programs, 8), dtype=torch.int64, device=scores.device)
    for _ in range(3):
        probe.zero_()
        launch_coop(scores, lengths, out, plan, workspace, probe=probe)
    torch.cuda.synchronize()
    t = probe.cpu().double()                          # NOTE: benchmark-only sync point
    t0 = t[:, 0].min()
    names = ["loaded_hist0", "barrier1", "barrier2", "barrier3", "barrier4", "written"]
    phases: dict[str, Any] = {f"coop_{n}_ns": round(float((t[:, j + 1] - t0).median()), 0)
                              for j, n in enumerate(names) if bool((t[:, j + 1] > 0).all())}
    phases.update(coop_start_spread_ns=round(float(t[:, 0].max() - t0)),
                  coop_end_ns=round(float(t[:, 6].max() - t0)), programs=plan.programs,
                  chunk=plan.chunk)
    return phases


def print_table(rows: list[dict[str, Any]], extra: tuple[str, ...] = ()) -> None:
    head = ("B", "N", "k", "path", "splits", "hist_splits", "triton_us", "triton_fresh_us",
            "torch_topk_us", "ref_us", "gbps", "pct_copy", "speedup_vs_topk", "target_us",
            "meets_target") + extra
    print(" | ".join(f"{h:>13}" for h in head))
    for row in rows:
        print(" | ".join(f"{row[h]!s:>13}" for h in head))


def main() -> None:
    args = parse_args()
    ops = load_ops(args.cpu_smoke)
    if args.cpu_smoke:
        device, cases = "cpu", [(1, 2000, 16), (2, 300, 8), (4, 200, 8)]
        # shrunken thresholds so the interpreter also walks the compact path (several chunks per
        # row), in bound mode for the first case and exact mode for the second
        config = ops["TopKConfig"](row_max=256, block=256, compact_block=64, small_block=64,
                                   target_programs=8, max_chunk=512, exact_max=1000)
        args.reps = min(args.reps, 1)          # the interpreter's times mean nothing
    elif torch.cuda.is_available():
        device, cases, config = "cuda", args.cases or GPU_CASES, ops["TopKConfig"](**args.config)
    else:
        raise SystemExit("no CUDA device: run with --cpu-smoke")
    rows = [run_case(ops, B, N, k, args, device, config) for B, N, k in cases]
    print_table(rows)
    if args.profile and device == "cuda":
        for row in rows:
            B, N, k = row["B"], row["N"], row["k"]
            scores = torch.randn(B, N, device=device)
            lengths = torch.full((B,), N, dtype=torch.int32, device=device)
            call = functools.partial(ops["lightning_topk"], scores, lengths, k, config=config)
            row["kernel_us"] = kernel_times(call)
            print(f"per kernel, B={B} N={N} k={k}: {row['kernel_us']}")
    if args.probe and device == "cuda":
        for row in rows:
            row["probe"] = probe_phases(row["B"], row["N"], row["k"], config, device)
            print(f"probe, B={row['B']} N={row['N']} k={row['k']}: {row['probe']}")
    sweep = []
    if args.sweep and device == "cuda":
        # the two targets: ~4 minutes
        for B, N, k in (c for c in cases if c in TARGET_US):
            for override in args.knobs or SWEEP:
                cfg = ops["TopKConfig"](**{**args.config, **override})
                row = run_case(ops, B, N, k, args, device, cfg, only_triton=True)
                print(f"sweep B={B} N={N} k={k} {override}: {row['triton_us']} us", flush=True)
                sweep.append(dict(row, override=override))
        print("\nsweep (one TopKConfig knob changed from the default, see `override`):")
        print_table(sorted(sweep, key=lambda r: (r["B"], r["N"], r["k"], r["triton_us"])),
                    extra=("override",))
    timing = "cpu-perf-counter" if device == "cpu" else "eager" if args.eager else "cuda-graph"
    print(json.dumps(dict(
        bench="lightning_topk",
        device=torch.cuda.get_device_name() if device == "cuda" else "cpu-interpreter",
        torch=torch.__version__, triton=ops["triton"].__version__, timing=timing, inner=args.inner,
        reps=args.reps, copy_gbps=COPY_GBPS, results=rows, sweep=sweep)))


if __name__ == "__main__":
    main()
