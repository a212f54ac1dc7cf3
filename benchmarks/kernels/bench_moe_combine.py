"""Benchmark: the MoE layer's combine in one launch (`triton_moe_combine`: the routed experts' k
slots summed in fixed order, the shared expert's output added, one cast) vs the torch glue it
replaced (`parts.sum(dim=1)`, `shared.float()`, the add, `.to(bf16)`: four launches).

Shapes: V4-Flash (d = 4096, k = 6; slots fp32, shared expert and output bf16) at N = 1, 8, 32,
128, 512 tokens. Bytes the op must move (the floor): the slots read, shared read, out written
(N k d 4 + N d 2 + N d 2). Each form timed as CUDA-graph replays cycling input sets; parity
first: the kernel bit-equal to `ref/moe.py::moe_combine` with an fp32 output (asserted), the bf16
output's bit-equality recorded (true on the GPU; the interpreter's bf16 cast truncates) and its max
|diff| to the torch glue (torch's k-sum order is its own). Prints a table, then ONE JSON line
(also written to --out).

    PYTHONPATH=src python3 benchmarks/kernels/bench_moe_combine.py --out FILE.json   # CUDA
    PYTHONPATH=src python3 benchmarks/kernels/bench_moe_combine.py --cpu-smoke       # interpreter
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
D, K = 4096, 6


def inputs(N: int, k: int, d: int, device: torch.device,
           seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.dtype]:
    g = torch.Generator(device).manual_seed(seed)
    return (torch.randn(N, k, d, generator=g, device=device),
            torch.randn(N, d, generator=g, device=device).bfloat16(), torch.bfloat16)


def glue(parts: torch.Tensor, shared: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """The torch ops the combine replaced (the k-sum of the routed op, then `MoE.forward`'s)."""
    return (parts.sum(dim=1) + shared.float()).to(out_dtype)


def bench_case(N: int, args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    from dsv4.kernels.ref.moe import moe_combine
    from dsv4.kernels.triton.moe_combine import triton_moe_combine

    cuda = device.type == "cuda"
    k, d = (K, D) if cuda else (3, 256)
    sets = [inputs(N, k, d, device, args.seed + i) for i in range(SETS if cuda else 1)]
    parts, shared, _ = sets[0]
    assert torch.equal(triton_moe_combine(parts, shared, torch.float32),
                       moe_combine(parts, shared, torch.float32)), f"parity failed at N={N}"
    got = triton_moe_combine(*sets[0])
    diff = float((got.float() - glue(*sets[0]).float()).abs().max()) if N else 0.0
    nbytes = N * k * d * 4 + N * d * 2 * 2
    us = time_us(triton_moe_combine, sets, args, cuda)
    glue_us = time_us(glue, sets, args, cuda)
    return {"case": f"N={N}", "N": N, "us": us, "glue_us": glue_us,
            "speedup_vs_glue": glue_us / us, "bytes": nbytes,
            "floor_us": nbytes / HBM_BYTES_PER_S * 1e6, "gb_per_s": nbytes / us / 1e3,
            "bit_equal": bool(torch.equal(got, moe_combine(*sets[0]))),
            "max_abs_diff_vs_glue": diff}


TABLE = [("case", "{:<8}", "case"), ("bytes", "{:>10.3e}", "bytes"),
         ("floor_us", "{:>8.2f}", "floor us"), ("us", "{:>8.2f}", "us"),
         ("gb_per_s", "{:>8.1f}", "GB/s"), ("glue_us", "{:>8.2f}", "glue us"),
         ("speedup_vs_glue", "{:>7.1f}", "x glue"),
         ("bit_equal", "{!s:>9}", "bit-equal")]


def main() -> None:
    args = base_parser(__doc__.splitlines()[0], "(no sweep)").parse_args()
    device = select_device(args.cpu_smoke)      # before the first `import triton` (done lazily)
    sizes = [3] if args.cpu_smoke else [1, 8, 32, 128, 512]
    rows = bench_rows(sizes, lambda n: bench_case(n, args, device), device)
    print_table(rows, TABLE)
    emit({**record_header("moe_combine", device), "results": rows}, args.out)


if __name__ == "__main__":
    main()
