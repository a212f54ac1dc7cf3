"""Shared pieces of the kernel benchmarks: the H200 copy-rate anchor, CUDA-graph timing, the table,
the JSON line.

Imported by the `bench_*.py` scripts of this folder (run as
`python3 benchmarks/kernels/bench_X.py`, so this folder is on sys.path).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import torch

HBM_BYTES_PER_S = 4.275e12       # measured device copy on the H200 (docs/DESIGN.md §3)


def time_graph_us(fn: Callable[..., Any], sets: Sequence[Sequence[Any]], iters: int,
                  warmup: int) -> float:
    """Median per-call time of CUDA-graph replays; each graph cycles through `sets` (defeats L2
    reuse)."""
    calls = max(len(sets), 8)
    for _ in range(warmup):
        for s in sets:
            fn(*s)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):           # NOTE: warm the allocator on the capture stream
        for s in sets:
            fn(*s)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fn(*sets[i % len(sets)])
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(iters):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    return statistics.median(times)


def time_eager_us(fn: Callable[[], object], iters: int, cuda: bool, warmup: int = 1) -> float:
    """Median time of eager calls (CUDA events on the GPU), after `warmup` calls. On the CPU (the
    `--cpu-smoke` interpreter, whose times mean nothing) the wall clock of one call."""
    if not cuda:
        iters, warmup = 1, 0
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(times)


def time_us(fn: Callable[..., Any], sets: Sequence[Sequence[Any]], args: Any,
            cuda: bool) -> float:
    """`fn`'s per-call time: CUDA-graph replays cycling `sets` on the GPU (`time_graph_us`),
    one eager call on the CPU (the interpreter's smoke run)."""
    if cuda:
        return time_graph_us(fn, sets, args.iters, args.warmup)
    return time_eager_us(lambda: fn(*sets[0]), 1, cuda)


def time_configs(fn: Callable[..., Any], sets: Sequence[Sequence[Any]],
                 sweep: Sequence[dict[str, int]], args: Any, cuda: bool) -> dict[str, float]:
    """`time_us` of `fn(*set, **knobs)` for the default knobs ("default") and, with `--sweep`,
    each of `sweep` (keyed "name=value,...")."""
    timed: dict[str, float] = {}
    for knobs in [{}, *(sweep if args.sweep else [])]:
        key = ",".join(f"{k}={v}" for k, v in knobs.items()) or "default"

        def call(*a: Any, knobs: dict[str, int] = knobs) -> Any:
            return fn(*a, **knobs)

        timed[key] = time_us(call, sets, args, cuda)
    return timed


def bench_rows(cases: Iterable[Any], bench: Callable[[Any], dict[str, Any]], device: torch.device
               ) -> list[dict[str, Any]]:
    """One result row per case; on CUDA the caching allocator is emptied between cases (each case
    allocates its own input sets of >= 256 MB, which would otherwise accumulate)."""
    rows = []
    for case in cases:
        rows.append(bench(case))
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def print_table(rows: Sequence[dict[str, Any]], cols: Sequence[tuple[str, str, str]]) -> None:
    """`cols`: (row key, format, heading); the first column is left-aligned."""
    widths = [len(fmt.format(rows[0][key])) if rows else 8 for key, fmt, _ in cols]
    print(" ".join(h.rjust(w) if i else h.ljust(w)
                   for i, ((_, _, h), w) in enumerate(zip(cols, widths, strict=True))))
    for r in rows:
        print(" ".join(fmt.format(r[key]) for key, fmt, _ in cols))


def emit(record: dict[str, Any], out: Path | None) -> None:
    """The benchmark's one JSON line: printed last, and written to `out` when given."""
    line = json.dumps(record)
    if out is not None:
        out.write_text(line + "\n")
    print(line)


def base_parser(description: str,
                sweep_help: str = "also time the sweep configurations and report the best"
                ) -> argparse.ArgumentParser:
    """The flags every kernel benchmark takes: `--cpu-smoke`, `--sweep`, `--iters`, `--warmup`,
    `--seed`, `--out`."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--cpu-smoke", action="store_true",
                   help="tiny shapes under TRITON_INTERPRET=1 (no timing value)")
    p.add_argument("--sweep", action="store_true", help=sweep_help)
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=None, help="also write the JSON line to this file")
    return p


def select_device(cpu_smoke: bool) -> torch.device:
    """CUDA, or the CPU under the Triton interpreter for `--cpu-smoke` (set before the first
    `import triton`)."""
    if cpu_smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")
        from dsv4.utils.triton_interpreter import skip_nested_interpreter_patching

        skip_nested_interpreter_patching()
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run with --cpu-smoke")
    return torch.device("cuda")


def record_header(bench: str, device: torch.device) -> dict[str, Any]:
    """The JSON line's identification: benchmark, device, versions, the copy-rate anchor."""
    import triton

    if device.type == "cpu":
        print("cpu smoke (interpreter): times and bandwidths are meaningless here")
    return {"bench": bench,
            "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu-interpreter",
            "torch": torch.__version__, "triton": triton.__version__,
            "hbm_bytes_per_s": HBM_BYTES_PER_S}
