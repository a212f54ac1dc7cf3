"""Shared pieces of the kernel benchmarks: the device's copy-rate anchor, CUDA-graph timing, the
table, the JSON line.

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

# Measured device-to-device copy rates (read + write), the byte floors' anchor, by device name:
# the H200's (docs/DESIGN.md §3) and the H100 SXM's (decode_context_sweep.py's copy_gb_s on the
# H100 80GB HBM3, 2026-12-05). A floor against another GPU's rate misstates every ratio.
COPY_RATES = {"H200": 4.275e12, "H100 80GB HBM3": 3.022e12}


def measure_copy_rate(device: torch.device, gib: float = 1.0, reps: int = 10) -> float:
    """Bytes/s of a device-to-device copy of `gib` GiB on `device`, counting read + write: `reps`
    copies timed together (CUDA events on a GPU, the wall clock on the CPU)."""
    src = torch.empty(int(gib * (1 << 30)), dtype=torch.uint8, device=device).random_()
    dst = torch.empty_like(src)
    dst.copy_(src)
    nbytes = 2 * src.numel() * reps
    if device.type != "cuda":
        start = time.perf_counter()
        for _ in range(reps):
            dst.copy_(src)
        return nbytes / (time.perf_counter() - start)
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize(device)
    begin.record()
    for _ in range(reps):
        dst.copy_(src)
    end.record()
    end.synchronize()
    return nbytes / (begin.elapsed_time(end) * 1e-3)


def copy_rate() -> float:
    """The byte floors' anchor for this process's device: `COPY_RATES` by the CUDA device's name,
    measured where the name is not listed; the H200's without CUDA (interpreter smoke runs)."""
    if not torch.cuda.is_available():
        return COPY_RATES["H200"]
    name = torch.cuda.get_device_name()
    rate = next((r for key, r in COPY_RATES.items() if key in name), None)
    if rate is None:
        rate = measure_copy_rate(torch.device("cuda"))
        print(f"{name}: no listed copy rate; measured {rate / 1e12:.3f} TB/s")
    return rate


HBM_BYTES_PER_S = copy_rate()    # the device's copy rate: every floor and % of HBM divides by it


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
    """`time_us` of `fn(*set, **knobs)` for the default knobs ("default") and each of `sweep`
    (keyed "name=value,..."; the caller passes an empty one where no sweep is asked for)."""
    timed: dict[str, float] = {}
    for knobs in [{}, *sweep]:
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
        from dsv4.utils.triton_interpreter import speed_up_interpreter

        speed_up_interpreter()
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
