"""Benchmark: the compressors' gate-score position embedding, one launch (`triton_add_ape`) vs
the torch form (`ref/compressor.py::add_ape`: remainder, row gather, add).

Shapes: V4-Flash score widths (C4 attention 1,024, the C4 indexer 256, C128 512; ratios 4 and
128) at decode batches T = 1 / 32 / 128 and a prefill chunk (T = 8,192). Bytes the op must move
(the floor): the scores read and written (T W 4 x 2), one ape row read per token (T W 4) and the
positions (T 8). Each form timed as CUDA-graph replays (in place: each replay adds again, which
changes no timing); parity (bit-equal) checked first. Prints a table, then ONE JSON line (also
written to --out).

    PYTHONPATH=src python3 benchmarks/kernels/bench_add_ape.py --out FILE.json   # CUDA
    PYTHONPATH=src python3 benchmarks/kernels/bench_add_ape.py --cpu-smoke       # interpreter
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
WIDTHS = ((1024, 4), (256, 4), (512, 128))     # (score width, ratio)


def make_inputs(T: int, W: int, ratio: int, device: torch.device,
                seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    g = torch.Generator(device).manual_seed(seed)
    return (torch.randn(T, W, generator=g, device=device),
            torch.randn(ratio, W, generator=g, device=device),
            torch.randint(0, 1 << 20, (T,), generator=g, device=device), ratio)


def bench_case(c: tuple[int, int, int], args: argparse.Namespace,
               device: torch.device) -> dict[str, Any]:
    from dsv4.kernels.ref.compressor import add_ape
    from dsv4.kernels.triton.add_ape import triton_add_ape

    T, W, ratio = c
    cuda = device.type == "cuda"
    sets = [make_inputs(T, W, ratio, device, args.seed + i) for i in range(SETS if cuda else 1)]
    score, ape, pos, _ = sets[0]
    want, got = score.clone(), score.clone()
    add_ape(want, ape, pos, ratio)
    triton_add_ape(got, ape, pos, ratio)
    assert torch.equal(want, got), "parity failed: triton_add_ape != add_ape"
    us, ref_us = time_us(triton_add_ape, sets, args, cuda), time_us(add_ape, sets, args, cuda)
    nbytes = T * W * 4 * 3 + T * 8
    return {"case": f"T={T},W={W},m={ratio}", "T": T, "W": W, "ratio": ratio, "us": us,
            "ref_us": ref_us, "speedup_vs_ref": ref_us / us, "bytes": nbytes,
            "floor_us": nbytes / HBM_BYTES_PER_S * 1e6}


TABLE = [("case", "{:<22}", "case"), ("bytes", "{:>10.3e}", "bytes"),
         ("floor_us", "{:>8.2f}", "floor us"), ("us", "{:>8.2f}", "us"),
         ("ref_us", "{:>8.2f}", "ref us"), ("speedup_vs_ref", "{:>6.1f}", "x ref")]


def main() -> None:
    args = base_parser(__doc__.splitlines()[0], "(no sweep)").parse_args()
    device = select_device(args.cpu_smoke)      # before the first `import triton` (done lazily)
    cases = ([(3, 24, 4)] if args.cpu_smoke
             else [(T, W, m) for W, m in WIDTHS for T in (1, 32, 128, 8192)])
    rows = bench_rows(cases, lambda c: bench_case(c, args, device), device)
    print_table(rows, TABLE)
    emit({**record_header("add_ape", device), "results": rows}, args.out)


if __name__ == "__main__":
    main()
