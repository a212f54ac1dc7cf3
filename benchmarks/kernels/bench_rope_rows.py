"""Benchmark: a serving step's RoPE-row gathers, one launch (`triton_rope_rows`) vs the four
`index_select`s of the reference (`ref/rope_rows.py::rope_rows`, what `RotaryEmbedding.lookup`
launches per table lookup).

Shapes: V4-Flash's tables (rd / 2 = 32 fp32 cos and sin per position) cached over P = 1M
positions; a step's four lookups: the main and the compress table at the step's T positions, the
compress table at the C4 and C128 plans' entry positions (max(p - ratio + 1, 0)). T = 1 and 64
(decode batches) and 8,192 (a prefill chunk); positions random in [0, P). Bytes the op must move
(the floor): four lookups of T rows, each cos + sin read and written (T 32 4 x 2 x 2) and its
positions read (T 8). Each form timed as CUDA-graph replays cycling input sets; parity (bit-equal)
checked first. Prints a table, then ONE JSON line (also written to --out).

    PYTHONPATH=src python3 benchmarks/kernels/bench_rope_rows.py --out FILE.json   # CUDA
    PYTHONPATH=src python3 benchmarks/kernels/bench_rope_rows.py --cpu-smoke       # interpreter
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

SETS = 8                 # position sets cycled inside one graph
RATIOS = (4, 128)        # the plans' compress ratios (C4, C128)
R = 32                   # rope_head_dim / 2


def make_positions(T: int, P: int, device: torch.device, seed: int) -> list[torch.Tensor]:
    """The step's positions [T] and the two plans' entry positions."""
    g = torch.Generator(device).manual_seed(seed)
    pos = torch.randint(0, P, (T,), generator=g, device=device)
    return [pos, *((pos - r + 1).clamp(min=0) for r in RATIOS)]


def step_pairs(main: torch.Tensor, comp: torch.Tensor, pos: torch.Tensor, e4: torch.Tensor,
               e128: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(main, pos), (comp, pos), (comp, e4), (comp, e128)]


def bench_case(T: int, P: int, caches: tuple[torch.Tensor, torch.Tensor],
               args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    from dsv4.kernels.ref.rope_rows import rope_rows
    from dsv4.kernels.triton.rope_rows import triton_rope_rows

    cuda = device.type == "cuda"
    sets = [(*caches, *make_positions(T, P, device, args.seed + i))
            for i in range(SETS if cuda else 1)]
    want, got = rope_rows(step_pairs(*sets[0])), triton_rope_rows(step_pairs(*sets[0]))
    assert all(torch.equal(a, b) for w, g in zip(want, got, strict=True)
               for a, b in zip(w, g, strict=True)), "parity failed: triton_rope_rows != rope_rows"

    def one_launch(*s: torch.Tensor) -> Any:
        return triton_rope_rows(step_pairs(*s))

    def gathers(*s: torch.Tensor) -> Any:
        return rope_rows(step_pairs(*s))

    us, ref_us = time_us(one_launch, sets, args, cuda), time_us(gathers, sets, args, cuda)
    nbytes = 4 * (T * R * 4 * 2 * 2 + T * 8)
    return {"case": f"T={T},P={P}", "T": T, "P": P, "us": us, "ref_us": ref_us,
            "speedup_vs_ref": ref_us / us, "bytes": nbytes,
            "floor_us": nbytes / HBM_BYTES_PER_S * 1e6}


TABLE = [("case", "{:<20}", "case"), ("bytes", "{:>10.3e}", "bytes"),
         ("floor_us", "{:>8.2f}", "floor us"), ("us", "{:>11.2f}", "1 launch us"),
         ("ref_us", "{:>12.2f}", "4 gathers us"), ("speedup_vs_ref", "{:>6.2f}", "x ref")]


def main() -> None:
    args = base_parser(__doc__.splitlines()[0], "(no sweep)").parse_args()
    device = select_device(args.cpu_smoke)      # before the first `import triton` (done lazily)
    P = 4096 if args.cpu_smoke else 1 << 20
    g = torch.Generator(device).manual_seed(args.seed)
    # the main and compress tables' caches, [2, P, R] fp32 (random values: the copy is the same)
    caches = (torch.randn(2, P, R, generator=g, device=device),
              torch.randn(2, P, R, generator=g, device=device))
    cases = [3] if args.cpu_smoke else [1, 64, 8192]
    rows = bench_rows(cases, lambda T: bench_case(T, P, caches, args, device), device)
    print_table(rows, TABLE)
    emit({**record_header("rope_rows", device), "results": rows}, args.out)


if __name__ == "__main__":
    main()
