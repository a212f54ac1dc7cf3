"""Benchmark: RoPE alone on the indexer's queries, one launch (`triton_rope`) vs the torch form
(`ref/rope_norm.py::rope`: cast, pair split, four multiplies, subtract, add, stack, cast, cat).

Shapes: the V4-Flash indexer (Ih = 64 heads of Id = 128, rope on the trailing rd = 64) in bf16 at
decode batches T = 1 / 32 / 128 and a prefill chunk (T = 8,192). Bytes the op must move (the
floor): q read and written (T Ih Id 2 x 2) and the cos / sin rows read (T rd/2 4 x 2). Each form
timed as CUDA-graph replays; parity (bit-equal) checked first. Prints a table, then ONE JSON line
(also written to --out). `--fp8`: `triton_rope_fp8` against `ref/rope_norm.py::rope_fp8` instead
(the queries over FP8 indexer keys: each head also quantised to e4m3 codes and a power-of-two
scale; bytes: q read, codes written (1 B each) and a 4-byte scale per head).

    PYTHONPATH=src python3 benchmarks/kernels/bench_rope.py --out FILE.json   # CUDA
    PYTHONPATH=src python3 benchmarks/kernels/bench_rope.py --fp8             # rope_fp8
    PYTHONPATH=src python3 benchmarks/kernels/bench_rope.py --cpu-smoke       # interpreter
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
HEADS, HEAD_DIM, ROPE_DIM = 64, 128, 64


def make_inputs(T: int, H: int, D: int, rd: int, device: torch.device,
                seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """bf16 queries and the fp32 cos / sin rows of random positions below 1M."""
    g = torch.Generator(device).manual_seed(seed)
    pos = torch.randint(0, 1 << 20, (T, 1), generator=g, device=device).float()
    angles = pos / (10000.0 ** (torch.arange(0, rd, 2, device=device).float() / rd))
    x = torch.randn(T, H, D, generator=g, device=device).to(torch.bfloat16)
    return x, angles.cos(), angles.sin()


def flat(out: torch.Tensor | tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """An op's output as one fp32 vector: rope's values, or rope_fp8's code bytes then scales."""
    if isinstance(out, torch.Tensor):
        return out.float().flatten()
    return torch.cat([out[0].view(torch.uint8).float().flatten(), out[1].flatten()])


def bench_case(c: tuple[int, int, int, int], args: argparse.Namespace,
               device: torch.device) -> dict[str, Any]:
    from dsv4.kernels.ref.rope_norm import rope, rope_fp8
    from dsv4.kernels.triton.rope_fp8 import triton_rope_fp8
    from dsv4.kernels.triton.rope_norm import triton_rope

    T, H, D, rd = c
    cuda = device.type == "cuda"
    sets = [make_inputs(T, H, D, rd, device, args.seed + i) for i in range(SETS if cuda else 1)]
    op, ref = (triton_rope_fp8, rope_fp8) if args.fp8 else (triton_rope, rope)
    if cuda:   # the interpreter casts to bf16 toward zero (tests/kernels/test_rope.py)
        assert torch.equal(flat(op(*sets[0])), flat(ref(*sets[0]))), "parity failed"
    us, ref_us = time_us(op, sets, args, cuda), time_us(ref, sets, args, cuda)
    out_bytes = T * H * (D + 4) if args.fp8 else T * H * D * 2
    nbytes = T * H * D * 2 + out_bytes + T * rd // 2 * 4 * 2
    return {"case": f"T={T}", "T": T, "H": H, "D": D, "rd": rd, "us": us, "ref_us": ref_us,
            "speedup_vs_ref": ref_us / us, "bytes": nbytes,
            "floor_us": nbytes / HBM_BYTES_PER_S * 1e6}


TABLE = [("case", "{:<8}", "case"), ("bytes", "{:>10.3e}", "bytes"),
         ("floor_us", "{:>8.2f}", "floor us"), ("us", "{:>8.2f}", "us"),
         ("ref_us", "{:>8.2f}", "ref us"), ("speedup_vs_ref", "{:>6.1f}", "x ref")]


def main() -> None:
    p = base_parser(__doc__.splitlines()[0], "(no sweep)")
    p.add_argument("--fp8", action="store_true", help="time rope_fp8 (RoPE + FP8 per head)")
    args = p.parse_args()
    device = select_device(args.cpu_smoke)      # before the first `import triton` (done lazily)
    cases = ([(2, 4, 32, 16)] if args.cpu_smoke
             else [(T, HEADS, HEAD_DIM, ROPE_DIM) for T in (1, 32, 128, 8192)])
    rows = bench_rows(cases, lambda c: bench_case(c, args, device), device)
    print_table(rows, TABLE)
    emit({**record_header("rope_fp8" if args.fp8 else "rope", device), "results": rows},
         args.out)


if __name__ == "__main__":
    main()
