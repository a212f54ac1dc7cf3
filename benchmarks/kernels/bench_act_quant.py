"""Benchmark: FP8 activation quantisation (`triton_act_quant`, per token per 128 channels, e4m3
codes and power-of-two scales) vs its torch reference (`ref/act_quant.py::act_quant`).

Shapes: V4-Flash activations (d = 4096, bf16) at N = 1, 64, 512, 2048, 8192 tokens: the input of
the W8A8 expert kernels (`moe_w8a8.py`) and of every FP8 linear of the reference model. Bytes the
op must move (the floor): x read, codes and scales written (N d 2 + N d + N d / 128 * 4). Each
form timed as CUDA-graph replays cycling input sets; parity first (the kernel's codes and scales
bit-equal to the reference's, asserted). Prints a table, then ONE JSON line (also written to
--out).

    PYTHONPATH=src python3 benchmarks/kernels/bench_act_quant.py --out FILE.json   # CUDA
    PYTHONPATH=src python3 benchmarks/kernels/bench_act_quant.py --cpu-smoke       # interpreter
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

SETS = 4             # input sets cycled inside one graph
D = 4096


def bench_case(N: int, args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    from dsv4.kernels.ref.act_quant import act_quant
    from dsv4.kernels.triton.act_quant import triton_act_quant

    cuda = device.type == "cuda"
    d = D if cuda else 256
    g = torch.Generator(device).manual_seed(args.seed)
    sets = [((torch.randn(N, d, generator=g, device=device) * 4).bfloat16(),)
            for _ in range(SETS if cuda else 1)]
    codes, scale = triton_act_quant(*sets[0])
    ref_codes, ref_scale = act_quant(*sets[0])
    assert torch.equal(scale, ref_scale) and torch.equal(
        codes.view(torch.uint8), ref_codes.view(torch.uint8)), f"parity failed at N={N}"
    nbytes = N * d * 3 + N * (d // 128) * 4
    us = time_us(triton_act_quant, sets, args, cuda)
    ref_us = time_us(act_quant, sets, args, cuda)
    return {"case": f"N={N}", "N": N, "d": d, "us": us, "ref_us": ref_us,
            "speedup_vs_ref": ref_us / us, "bytes": nbytes,
            "floor_us": nbytes / HBM_BYTES_PER_S * 1e6, "gb_per_s": nbytes / us / 1e3,
            "bit_equal": True}


TABLE = [("case", "{:<8}", "case"), ("bytes", "{:>10.3e}", "bytes"),
         ("floor_us", "{:>8.2f}", "floor us"), ("us", "{:>8.2f}", "us"),
         ("gb_per_s", "{:>8.1f}", "GB/s"), ("ref_us", "{:>8.2f}", "ref us"),
         ("speedup_vs_ref", "{:>7.1f}", "x ref"), ("bit_equal", "{!s:>9}", "bit-equal")]


def main() -> None:
    args = base_parser(__doc__.splitlines()[0], "(no sweep)").parse_args()
    device = select_device(args.cpu_smoke)      # before the first `import triton` (done lazily)
    sizes = [3] if args.cpu_smoke else [1, 64, 512, 2048, 8192]
    rows = bench_rows(sizes, lambda n: bench_case(n, args, device), device)
    print_table(rows, TABLE)
    emit({**record_header("act_quant", device), "results": rows}, args.out)


if __name__ == "__main__":
    main()
