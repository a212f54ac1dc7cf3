"""Benchmark: HiSparse swap-in (`triton_swap_in`) vs the reference `swap_in_ref`, device to device.

Shapes: V4-Flash C4 entries, D = 512 bf16 (1 KB a row); n rows in {512, 4096, 16384, 65536} (the
misses of one C4 layer's select: up to batch x top_k = 128 x 512), 1/8 of them skipped (dst -1),
out of a 256K-row host pool into a 64K-row hot pool, both on the GPU: this times the gather /
scatter kernel, not the host -> device transfer (the copy engine's job; the kernel refuses a CPU
host pool, kernels/triton/hisparse.py).
Bytes the op must move (the floor): kept rows read + written (2 n_kept D 2) + the indices read
(n 16). GB/s and %HBM are those bytes over the time, against the measured H200 copy bandwidth
4.275 TB/s.
Timing: parity with the reference first (bit-equal but the trash row); then the median of
CUDA-event-timed CUDA-graph replays, each graph cycling through distinct index sets; the reference
(torch.where + gather + index_copy_) is timed the same way.
Prints a table, then ONE JSON line (also written to --out).

    PYTHONPATH=src python3 benchmarks/kernels/bench_hisparse_swap.py --out FILE.json   # CUDA
    PYTHONPATH=src python3 benchmarks/kernels/bench_hisparse_swap.py --sweep           # + block_d
    PYTHONPATH=src python3 benchmarks/kernels/bench_hisparse_swap.py --cpu-smoke       # interpreter
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

SKIP = 1 / 8                 # share of rows with dst -1
SETS = 8                     # index sets cycled inside one graph
SWEEP: list[dict[str, int]] = [{"block_d": 128}, {"block_d": 256}, {"num_warps": 1},
                               {"num_warps": 4}, {"num_warps": 8}]


@dataclass(frozen=True)
class Case:
    n: int
    d: int = 512
    host_rows: int = 1 << 18
    dev_rows: int = 1 << 16

    @property
    def name(self) -> str:
        return f"n={self.n}"


def cuda_cases() -> list[Case]:
    return [Case(n) for n in (512, 4096, 16384, 65536)]


def smoke_cases() -> list[Case]:
    return [Case(8, 64, 32, 16)]


def make_pools(case: Case, device: torch.device, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator(device).manual_seed(seed)
    host = torch.randn(case.host_rows, case.d, generator=g, device=device).bfloat16()
    dev = torch.zeros(case.dev_rows + 1, case.d, dtype=torch.bfloat16, device=device)
    return host, dev


def make_indices(case: Case, device: torch.device, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """src with repeats; dst distinct hot rows, SKIP of them -1."""
    g = torch.Generator(device).manual_seed(seed)
    src = torch.randint(0, case.host_rows, (case.n,), generator=g, device=device)
    dst = torch.randperm(case.dev_rows, generator=g, device=device)[:case.n]
    skip = torch.rand(case.n, generator=g, device=device) < SKIP
    return src, torch.where(skip, -1, dst)


def count_bytes(case: Case, kept: int) -> dict[str, int]:
    parts = {"bytes_rows": 2 * kept * case.d * 2, "bytes_indices": case.n * 16}
    return {**parts, "bytes": sum(parts.values())}


def bench_case(case: Case, args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    from dsv4.kernels.ref.hisparse import swap_in_ref
    from dsv4.kernels.triton.hisparse import default_block_d, triton_swap_in

    cuda = device.type == "cuda"
    host, dev = make_pools(case, device, args.seed)
    sets = [(host, dev, *make_indices(case, device, args.seed + 1 + i))
            for i in range(SETS if cuda else 1)]
    got, want = dev.clone(), dev.clone()
    triton_swap_in(host, got, *sets[0][2:])
    swap_in_ref(host, want, *sets[0][2:])
    assert torch.equal(got[:-1], want[:-1]), "parity failed: kernel != swap_in_ref"
    kept = int((sets[0][3] >= 0).sum())
    parts = count_bytes(case, kept)
    timed = time_configs(triton_swap_in, sets, SWEEP, args, cuda)
    best = min(timed, key=lambda k: timed[k])
    us = timed[best]
    ref_us = time_us(swap_in_ref, sets, args, cuda)
    return {"case": case.name, "n": case.n, "kept": kept, "d": case.d, "dtype": "bfloat16",
            "us": us, "us_default": timed["default"], "best_config": best,
            "block_d": default_block_d(case.d), "configs_us": timed, "ref_us": ref_us,
            "speedup_vs_ref": ref_us / us, "gbps": parts["bytes"] / us / 1e3,
            "pct_hbm": parts["bytes"] / (us * 1e-6) / HBM_BYTES_PER_S * 100,
            "floor_us": parts["bytes"] / HBM_BYTES_PER_S * 1e6, "index_sets": len(sets), **parts}


TABLE = [("case", "{:<8}", "case"), ("kept", "{:>6}", "kept"), ("bytes", "{:>10.3e}", "bytes"),
         ("floor_us", "{:>8.2f}", "floor us"), ("us", "{:>8.2f}", "us"),
         ("ref_us", "{:>8.2f}", "ref us"), ("speedup_vs_ref", "{:>6.1f}", "x ref"),
         ("gbps", "{:>7.0f}", "GB/s"), ("pct_hbm", "{:>6.1f}", "%HBM"),
         ("best_config", "{:>12}", "config")]


def main() -> None:
    args = base_parser(__doc__.splitlines()[0], "also time SWEEP (block_d, warps)").parse_args()
    device = select_device(args.cpu_smoke)      # before the first `import triton` (done lazily)
    cases = smoke_cases() if args.cpu_smoke else cuda_cases()
    rows = bench_rows(cases, lambda case: bench_case(case, args, device), device)
    print_table(rows, TABLE)
    emit({**record_header("hisparse_swap", device), "skip_share": SKIP, "results": rows}, args.out)


if __name__ == "__main__":
    main()
