"""Benchmark: the routed experts' tile map (`triton_tile_map`: one launch, or two over chunks of
slots) vs torch ops (`tile_map_ref`, ~30 launches).

Shapes: V4-Flash routing (E 256 experts, k 6, block_m 16) at N = 1 .. 682 tokens (decode batches)
and 4,096 / 8,192 (prefill chunks: the chunked form alone). The work is a few KB of integers, so
there is no useful byte floor: the figure of merit is the time per MoE layer, each form timed as
CUDA-graph replays (what a decode step pays): each form forced ("one us": one program, up to
4,096 slots; "chunk us": the chunked form), "us" the one the default picks, to place its
threshold. Each form's parity with the reference (bit-equal) is checked before it is timed.
Prints a table, then ONE JSON line (also written to --out).

    PYTHONPATH=src python3 benchmarks/kernels/bench_moe_tile_map.py --out FILE.json   # CUDA
    PYTHONPATH=src python3 benchmarks/kernels/bench_moe_tile_map.py --cpu-smoke       # interpreter
"""

from __future__ import annotations

import argparse
from typing import Any

import torch
from bench_common import (
    base_parser,
    bench_rows,
    emit,
    print_table,
    record_header,
    select_device,
    time_us,
)

SETS = 8             # routings cycled inside one graph
E, K, BLOCK_M = 256, 6, 16


def make_routing(n: int, device: torch.device, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(n)]).to(device)


def bench_case(n: int, args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    from dsv4.kernels.triton.moe_tile_map import (
        MAX_ONE_CTA_SLOTS,
        SPLIT_MIN_SLOTS,
        tile_map_ref,
        triton_tile_map,
    )

    cuda = device.type == "cuda"
    sets = [(make_routing(n, device, args.seed + i),) for i in range(SETS if cuda else 1)]
    want = tile_map_ref(sets[0][0], E, BLOCK_M)
    timed = {}
    # each form the kernel has, forced, checked against the reference before it is timed
    for name, chunked in (("one", False), ("chunked", True)):
        if not chunked and n * K > MAX_ONE_CTA_SLOTS:
            continue
        got = triton_tile_map(sets[0][0], E, BLOCK_M, chunked=chunked)
        for w, g in zip(want, got, strict=True):
            assert torch.equal(w, g), f"parity failed: {name} triton_tile_map != tile_map_ref"

        def form(idx: torch.Tensor, chunked: bool = chunked) -> None:
            triton_tile_map(idx, E, BLOCK_M, chunked=chunked)

        timed[name] = time_us(form, sets, args, cuda)

    def ref(idx: torch.Tensor) -> None:
        tile_map_ref(idx, E, BLOCK_M)

    ref_us = time_us(ref, sets, args, cuda)
    us = timed["chunked" if n * K >= SPLIT_MIN_SLOTS else "one"]    # the default's form
    return {"case": f"N={n}", "n": n, "slots": n * K, "us": us, "ref_us": ref_us,
            "one_us": timed.get("one", float("nan")), "chunked_us": timed["chunked"],
            "speedup_vs_ref": ref_us / us, "saved_us": ref_us - us}


TABLE = [("case", "{:<8}", "case"), ("slots", "{:>6}", "slots"), ("us", "{:>8.2f}", "us"),
         ("one_us", "{:>8.2f}", "one us"), ("chunked_us", "{:>8.2f}", "chunk us"),
         ("ref_us", "{:>8.2f}", "ref us"), ("speedup_vs_ref", "{:>6.1f}", "x ref"),
         ("saved_us", "{:>8.2f}", "saved us")]


def main() -> None:
    args = base_parser(__doc__.splitlines()[0], "(no sweep)").parse_args()
    device = select_device(args.cpu_smoke)      # before the first `import triton` (done lazily)
    cases = [1, 4] if args.cpu_smoke else [1, 8, 32, 64, 128, 512, 682, 4096, 8192]
    rows = bench_rows(cases, lambda n: bench_case(n, args, device), device)
    print_table(rows, TABLE)
    emit({**record_header("moe_tile_map", device), "experts": E, "topk": K, "block_m": BLOCK_M,
          "results": rows}, args.out)


if __name__ == "__main__":
    main()
