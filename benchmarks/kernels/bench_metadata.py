"""Benchmark: a step's index metadata (`triton_step_metadata`) vs the reference `step_metadata`.

Shapes: V4-Flash decode steps (page size 256, window 128, a C4 plan with overlap and ring 8, a C128
plan with ring 128): B requests of one new token each, B in {1, 32, 128}, every request at context
C in {4K, 128K, 1M} (V = C / 4 candidate columns for C4, C / 128 for C128; the [B, V] candidate
rows dominate the bytes at long contexts). Random page tables and full -> SWA maps over a pool of
B x C / 256 full pages; the request rows are strided columns of one input tensor, as in the decode
graph (engine/cuda_graph.py).
Bytes the op must move (the floor): its outputs written (int64, bools 1 byte) + the request rows
and the page-table rows it reads (decode: each request's row, B x C / 256 x 8). GB/s and %HBM are
those bytes over the time, against the measured H200 copy bandwidth 4.275 TB/s.
Timing: parity with the reference first (every field bit-equal); then the median of
CUDA-event-timed CUDA-graph replays of each, each graph cycling through distinct request rows (a
decode step replays a graph, so the reference's ~100 launches are timed as replayed). "x ref" is
the reference's time over the kernel's.
Prints a table, then ONE JSON line (also written to --out).

    PYTHONPATH=src python3 benchmarks/kernels/bench_metadata.py --out FILE.json   # CUDA
    PYTHONPATH=src python3 benchmarks/kernels/bench_metadata.py --sweep           # + tiles, warps
    PYTHONPATH=src python3 benchmarks/kernels/bench_metadata.py --cpu-smoke       # interpreter
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any

import torch
from bench_common import (
    HBM_BYTES_PER_S,
    base_parser,
    bench_rows,
    emit,
    print_table,
    record_header,
    select_device,
    time_configs,
    time_us,
)

SETS = 4                     # request-row sets cycled inside one graph
SWEEP: list[dict[str, int]] = [{"block_t": 1}, {"block_t": 4}, {"block_t": 16},
                               {"block_v": 256}, {"block_v": 1024}, {"block_v": 2048},
                               {"num_warps": 2}, {"num_warps": 8}]


@dataclass(frozen=True)
class Case:
    B: int
    context: int
    page: int = 256
    window: int = 128
    c4: int = 4
    c128: int = 128

    @property
    def name(self) -> str:
        c = self.context
        return f"B={self.B} C={c // 1024}K" if c >= 1024 else f"B={self.B} C={c}"


def cuda_cases() -> list[Case]:
    return [Case(b, c) for c in (1 << 12, 1 << 17, 1 << 20) for b in (1, 32, 128)]


def smoke_cases() -> list[Case]:
    return [Case(3, 256, page=16, window=8, c4=4, c128=16)]


def make_specs(case: Case) -> list[Any]:
    """The engine's two plans (`engine/metadata.py::compress_specs`): C4 then C128."""
    from dsv4.kernels.ops import CompressSpec

    pages = case.B * case.context // case.page
    return [CompressSpec(case.c4, True, 2 * case.c4, pages * 2 * case.c4, pages * 64,
                         case.context // case.c4),
            CompressSpec(case.c128, False, case.c128, pages * case.c128, pages * 2,
                         case.context // case.c128)]


def make_inputs(case: Case, device: torch.device, seed: int) -> list[tuple[Any, ...]]:
    """SETS argument tuples of the op: fresh request rows (random slots and positions near the
    context's end) over one shared page table and full -> SWA map."""
    g = torch.Generator(device).manual_seed(seed)
    max_pages = case.context // case.page
    pages = case.B * max_pages
    table = torch.randperm(pages, generator=g, device=device).view(case.B, max_pages)
    table = torch.cat([table, table.new_zeros(1, max_pages)])          # + the pad slot's row
    full_to_swa = torch.randint(0, pages, (pages,), generator=g, device=device)
    sets = []
    for _ in range(SETS):
        rows = torch.zeros(case.B, 4, dtype=torch.int64, device=device)
        rows[:, 1] = torch.randperm(case.B, generator=g, device=device)
        rows[:, 2] = case.context - 1 - torch.randint(0, case.page, (case.B,), generator=g,
                                                      device=device)
        rows[:, 3] = 1
        sets.append((rows[:, 1], rows[:, 2], rows[:, 3], table, full_to_swa, case.page, case.B,
                     case.window, make_specs(case)))
    return sets


def count_bytes(case: Case, out: Any) -> dict[str, int]:
    tensors = [out.positions, out.swa_write, out.window, *(t for p in out.plans for t in p)]
    written = sum(t.numel() * t.element_size() for t in tensors)
    read = case.B * (3 * 8 + case.context // case.page * 8)
    return {"bytes_written": written, "bytes_read": read, "bytes": written + read}


def assert_parity(got: Any, want: Any) -> None:
    pairs = [(got.positions, want.positions), (got.swa_write, want.swa_write),
             (got.window, want.window)]
    pairs += [(a, b) for p, q in zip(got.plans, want.plans, strict=True)
              for a, b in zip(p, q, strict=True)]
    for a, b in pairs:
        assert a.dtype == b.dtype and torch.equal(a, b), "parity failed: kernel != step_metadata"


def bench_case(case: Case, args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    from dsv4.kernels.ref.metadata import step_metadata
    from dsv4.kernels.triton.metadata import BLOCK_T, BLOCK_V, triton_step_metadata

    cuda = device.type == "cuda"
    sets = make_inputs(case, device, args.seed)
    out = triton_step_metadata(*sets[0])
    assert_parity(out, step_metadata(*sets[0]))
    parts = count_bytes(case, out)
    timed = time_configs(triton_step_metadata, sets, SWEEP if args.sweep else [], args, cuda)
    best = min(timed, key=lambda k: timed[k])
    us = timed[best]
    ref_us = time_us(step_metadata, sets, args, cuda)
    return {"case": case.name, "B": case.B, "context": case.context, "T": case.B,
            "v_c4": case.context // case.c4, "v_c128": case.context // case.c128, "us": us,
            "us_default": timed["default"], "best_config": best,
            "defaults": {"block_t": BLOCK_T, "block_v": BLOCK_V}, "configs_us": timed,
            "ref_us": ref_us, "speedup_vs_ref": ref_us / us, "gbps": parts["bytes"] / us / 1e3,
            "pct_hbm": parts["bytes"] / (us * 1e-6) / HBM_BYTES_PER_S * 100,
            "floor_us": parts["bytes"] / HBM_BYTES_PER_S * 1e6, "index_sets": len(sets), **parts}


TABLE = [("case", "{:<13}", "case"), ("bytes", "{:>10.3e}", "bytes"),
         ("floor_us", "{:>8.2f}", "floor us"), ("us", "{:>8.2f}", "us"),
         ("ref_us", "{:>8.2f}", "ref us"), ("speedup_vs_ref", "{:>6.1f}", "x ref"),
         ("gbps", "{:>7.0f}", "GB/s"), ("pct_hbm", "{:>6.1f}", "%HBM"),
         ("best_config", "{:>12}", "config")]


def main() -> None:
    args = base_parser(__doc__.splitlines()[0], "also time SWEEP (tiles, warps)").parse_args()
    device = select_device(args.cpu_smoke)      # before the first `import triton` (done lazily)
    cases = smoke_cases() if args.cpu_smoke else cuda_cases()
    rows = bench_rows(cases, lambda case: bench_case(case, args, device), device)
    print_table(rows, TABLE)
    emit({**record_header("metadata", device), "plans": "c4 overlap + c128", "results": rows},
         args.out)


if __name__ == "__main__":
    main()
