"""Benchmark: the greedy sampler's row argmax, two split-row launches (`triton_argmax`) vs
`torch.argmax(x, dim=-1)` (`ref/argmax.py::argmax`, one CTA per row).

Shapes: V4's vocabulary (V = 129,280) at decode batches B = 1 / 8 / 32 / 128, fp32 logits. Bytes
the op must move (the floor): the logits read once, B V 4. Each form timed as CUDA-graph replays;
parity (bit-equal, ties and a NaN row included) checked first. Prints a table, then ONE JSON line
(also written to --out).

    PYTHONPATH=src python3 benchmarks/kernels/bench_argmax.py --out FILE.json   # CUDA
    PYTHONPATH=src python3 benchmarks/kernels/bench_argmax.py --cpu-smoke       # interpreter
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
VOCAB = 129_280


def make_inputs(B: int, V: int, device: torch.device, seed: int) -> tuple[torch.Tensor]:
    """Logits-like rows; row 0 has its maximum twice (the first must win), row 1 a NaN."""
    g = torch.Generator(device).manual_seed(seed)
    x = torch.randn(B, V, generator=g, device=device) * 4
    x[0, [V // 3, V - 1]] = 100.0
    if B > 1:
        x[1, V // 2] = float("nan")
    return (x,)


def bench_case(c: tuple[int, int], args: argparse.Namespace,
               device: torch.device) -> dict[str, Any]:
    from dsv4.kernels.ref.argmax import argmax
    from dsv4.kernels.triton.argmax import triton_argmax

    B, V = c
    cuda = device.type == "cuda"
    sets = [make_inputs(B, V, device, args.seed + i) for i in range(SETS if cuda else 1)]
    assert torch.equal(argmax(*sets[0]), triton_argmax(*sets[0])), \
        "parity failed: triton_argmax != torch.argmax"
    us, ref_us = time_us(triton_argmax, sets, args, cuda), time_us(argmax, sets, args, cuda)
    nbytes = B * V * 4
    return {"case": f"B={B},V={V}", "B": B, "V": V, "us": us, "ref_us": ref_us,
            "speedup_vs_ref": ref_us / us, "bytes": nbytes,
            "floor_us": nbytes / HBM_BYTES_PER_S * 1e6, "gbps": nbytes / us / 1e3}


TABLE = [("case", "{:<16}", "case"), ("bytes", "{:>10.3e}", "bytes"),
         ("floor_us", "{:>8.2f}", "floor us"), ("us", "{:>8.2f}", "us"),
         ("ref_us", "{:>8.2f}", "ref us"), ("speedup_vs_ref", "{:>6.1f}", "x ref"),
         ("gbps", "{:>8.1f}", "GB/s")]


def main() -> None:
    args = base_parser(__doc__.splitlines()[0], "(no sweep)").parse_args()
    device = select_device(args.cpu_smoke)      # before the first `import triton` (done lazily)
    cases = [(2, 5000)] if args.cpu_smoke else [(1, VOCAB), (8, VOCAB), (32, VOCAB), (128, VOCAB)]
    rows = bench_rows(cases, lambda c: bench_case(c, args, device), device)
    print_table(rows, TABLE)
    emit({**record_header("argmax", device), "results": rows}, args.out)


if __name__ == "__main__":
    main()
