"""Benchmark: the indexer picks' entry ids and pool slots, one launch (`triton_pick_slots`) vs the
torch form (`ref/indexer.py::pick_slots`: gathers, masks, wheres).

Shapes: V4-Flash top-k (K = 512) at decode batches T = 1 / 32 / 128 over the candidates of a 4K
context (V = 1,024) and a 128K one (V = 32,768), and a prefill chunk (T = 8,192, V = 1,024).
Bytes the op must move (the floor): picks read, ids and slots written, one candidate read per
pick (T K 8 x 4). Each form timed as CUDA-graph replays; parity (bit-equal) checked first.
Prints a table, then ONE JSON line (also written to --out).

    PYTHONPATH=src python3 benchmarks/kernels/bench_pick_slots.py --out FILE.json   # CUDA
    PYTHONPATH=src python3 benchmarks/kernels/bench_pick_slots.py --cpu-smoke       # interpreter
"""

from __future__ import annotations

import argparse
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
    time_us,
)

SETS = 8             # input sets cycled inside one graph
K = 512


def make_inputs(T: int, V: int, k: int, device: torch.device,
                seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Candidates visible up to a per-row count; picks distinct visible columns, some -1."""
    g = torch.Generator(device).manual_seed(seed)
    visible = torch.randint(k, V + 1, (T, 1), generator=g, device=device)
    cols = torch.arange(V, device=device)[None, :]
    cand = torch.where(cols < visible, torch.randint(0, 1 << 30, (T, V), generator=g,
                                                     device=device), -1)
    picks = torch.rand(T, V, generator=g, device=device).masked_fill(cols >= visible, 2.0)
    picks = picks.topk(k, dim=1, largest=False).indices
    return picks, cand


def bench_case(c: tuple[int, int], args: argparse.Namespace,
               device: torch.device) -> dict[str, Any]:
    from dsv4.kernels.ref.indexer import pick_slots
    from dsv4.kernels.triton.pick_slots import triton_pick_slots

    T, V = c
    k = min(K, V)
    cuda = device.type == "cuda"
    sets = [make_inputs(T, V, k, device, args.seed + i) for i in range(SETS if cuda else 1)]
    for w, g in zip(pick_slots(*sets[0]), triton_pick_slots(*sets[0]), strict=True):
        assert torch.equal(w, g), "parity failed: triton_pick_slots != pick_slots"
    us, ref_us = time_us(triton_pick_slots, sets, args, cuda), time_us(pick_slots, sets, args,
                                                                         cuda)
    nbytes = T * k * 8 * 4
    return {"case": f"T={T},V={V}", "T": T, "V": V, "K": k, "us": us, "ref_us": ref_us,
            "speedup_vs_ref": ref_us / us, "bytes": nbytes,
            "floor_us": nbytes / HBM_BYTES_PER_S * 1e6}


TABLE = [("case", "{:<14}", "case"), ("bytes", "{:>10.3e}", "bytes"),
         ("floor_us", "{:>8.2f}", "floor us"), ("us", "{:>8.2f}", "us"),
         ("ref_us", "{:>8.2f}", "ref us"), ("speedup_vs_ref", "{:>6.1f}", "x ref")]


def main() -> None:
    args = base_parser(__doc__.splitlines()[0], "(no sweep)").parse_args()
    device = select_device(args.cpu_smoke)      # before the first `import triton` (done lazily)
    cases = ([(2, 16)] if args.cpu_smoke
             else [(1, 1024), (32, 1024), (128, 1024), (1, 32768), (32, 32768), (8192, 1024)])
    rows = bench_rows(cases, lambda c: bench_case(c, args, device), device)
    print_table(rows, TABLE)
    emit({**record_header("pick_slots", device), "results": rows}, args.out)


if __name__ == "__main__":
    main()
