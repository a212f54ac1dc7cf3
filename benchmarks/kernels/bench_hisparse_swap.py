"""Benchmark: HiSparse's copies (`triton_swap_in`, `triton_write_rows`) vs their references, with
the host mirror on the device or in pinned host memory (UVA: the kernels read / write it in place).

Shapes: V4-Flash C4 entries, D = 512 bf16 (1 KB a row), a 256K-row mirror and a 64K-row hot
pool. Cases:
- swap n in {512, 4096, 16384, 65536} (the misses of one C4 layer's select: up to batch x top_k =
  128 x 512), 1/8 of them skipped (dst -1): mirror rows -> hot rows;
- write n in {32, 256, 2048} (the entries one C4 layer completes in a decode step: batch / 4):
  values on the device -> mirror rows;
each with the mirror on the device ("device": the gather / scatter kernel alone, against HBM)
and in pinned host memory ("pinned": every row crosses PCIe / NVLink-C2C inside the kernel).
Bytes the op must move (the floor): the kept rows read + written + the indices (n 8 per index
tensor); "link bytes" are the rows that cross to or from the host. Device cases are set against
the measured H200 copy bandwidth (4.275 TB/s); pinned cases against the copy engine's rate over
the same link, measured here (a 256 MB pinned <-> device `copy_`, host -> device for the swap,
device -> host for the write): "%link" is the kernel's link bytes / time over that rate.
Timing: parity with the reference first (bit-equal but the trash row); then the median of
CUDA-event-timed CUDA-graph replays, each graph cycling through distinct index sets. The
references are timed the same way on the device; with a pinned mirror they copy through the host
(blocking, not capturable) and are timed eagerly.
Prints a table, then ONE JSON line (also written to --out).

    PYTHONPATH=src python3 benchmarks/kernels/bench_hisparse_swap.py --out FILE.json   # CUDA
    PYTHONPATH=src python3 benchmarks/kernels/bench_hisparse_swap.py --sweep           # + block_d
    PYTHONPATH=src python3 benchmarks/kernels/bench_hisparse_swap.py --cpu-smoke       # interpreter
"""

from __future__ import annotations

import argparse
import statistics
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
    time_eager_us,
    time_us,
)

SKIP = 1 / 8                 # share of swap rows with dst -1
SETS = 8                     # index sets cycled inside one graph
LINK_PROBE_BYTES = 256 << 20
SWEEP: list[dict[str, int]] = [{"block_d": 128}, {"block_d": 256}, {"num_warps": 1},
                               {"num_warps": 4}, {"num_warps": 8}]


@dataclass(frozen=True)
class Case:
    op: str                  # "swap" (mirror -> hot rows) or "write" (values -> mirror)
    n: int
    host: str                # where the mirror lives: "device" or "pinned"
    d: int = 512
    host_rows: int = 1 << 18
    dev_rows: int = 1 << 16

    @property
    def name(self) -> str:
        return f"{self.op} n={self.n} {self.host}"


def cuda_cases() -> list[Case]:
    return [Case(op, n, host) for host in ("device", "pinned")
            for op, ns in (("swap", (512, 4096, 16384, 65536)), ("write", (32, 256, 2048)))
            for n in ns]


def smoke_cases() -> list[Case]:
    return [Case("swap", 8, "device", 64, 32, 16), Case("write", 8, "device", 64, 32, 16)]


def link_rates(device: torch.device) -> dict[str, float]:
    """Bytes/s of the copy engine between pinned host memory and `device` (median of 5); none
    without CUDA (no pinned memory, no pinned cases)."""
    if device.type != "cuda":
        return {}
    host = torch.empty(LINK_PROBE_BYTES, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(LINK_PROBE_BYTES, dtype=torch.uint8, device=device)
    rates = {}
    for name, dst, src in (("h2d", dev, host), ("d2h", host, dev)):
        times = []
        for _ in range(6):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dst.copy_(src, non_blocking=True)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e-3)
        rates[name] = LINK_PROBE_BYTES / statistics.median(times[1:])
    return rates


def make_mirror(case: Case, device: torch.device, seed: int) -> torch.Tensor:
    g = torch.Generator(device).manual_seed(seed)
    mirror = torch.randn(case.host_rows, case.d, generator=g, device=device).bfloat16()
    return mirror.cpu().pin_memory() if case.host == "pinned" else mirror


def make_sets(case: Case, mirror: torch.Tensor, device: torch.device, seed: int,
              count: int) -> list[tuple[torch.Tensor, ...]]:
    """Argument tuples of the op: swap (mirror, hot, src, dst), write (mirror, rows, values)."""
    hot = torch.zeros(case.dev_rows + 1, case.d, dtype=torch.bfloat16, device=device)
    sets: list[tuple[torch.Tensor, ...]] = []
    for i in range(count):
        g = torch.Generator(device).manual_seed(seed + 1 + i)
        if case.op == "swap":
            src = torch.randint(0, case.host_rows, (case.n,), generator=g, device=device)
            dst = torch.randperm(case.dev_rows, generator=g, device=device)[:case.n]
            skip = torch.rand(case.n, generator=g, device=device) < SKIP
            sets.append((mirror, hot, src, torch.where(skip, -1, dst)))
        else:
            rows = torch.randperm(case.host_rows - 1, generator=g, device=device)[:case.n]
            values = torch.randn(case.n, case.d, generator=g, device=device).bfloat16()
            sets.append((mirror, rows, values))
    return sets


def check_parity(case: Case, ops: tuple[Any, Any], args: tuple[torch.Tensor, ...]) -> int:
    """Kernel vs reference on clones of the written pool; returns the rows kept."""
    kernel, ref = ops
    target = 1 if case.op == "swap" else 0            # the pool the op writes
    outs = []
    for fn in (kernel, ref):
        pool = args[target].clone()
        if case.host == "pinned" and case.op == "write":
            pool = pool.pin_memory()
        call = list(args)
        call[target] = pool
        fn(*call)
        outs.append(pool)
    if outs[0].is_cuda:
        torch.cuda.synchronize()
    assert torch.equal(outs[0][:-1].cpu(), outs[1][:-1].cpu()), f"{case.name}: kernel != ref"
    return int((args[3] >= 0).sum()) if case.op == "swap" else case.n


def bench_case(case: Case, args: argparse.Namespace, device: torch.device,
               rates: dict[str, float]) -> dict[str, Any]:
    from dsv4.kernels.ref.hisparse import swap_in_ref, write_rows_ref
    from dsv4.kernels.triton.hisparse import triton_swap_in, triton_write_rows

    cuda = device.type == "cuda"
    ops = (triton_swap_in, swap_in_ref) if case.op == "swap" else (triton_write_rows,
                                                                    write_rows_ref)
    mirror = make_mirror(case, device, args.seed)
    sets = make_sets(case, mirror, device, args.seed, SETS if cuda else 1)
    kept = check_parity(case, ops, sets[0])
    link_bytes = kept * case.d * 2
    total = 2 * link_bytes + case.n * 8 * (2 if case.op == "swap" else 1)
    timed = time_configs(ops[0], sets, SWEEP if args.sweep else [], args, cuda)
    best = min(timed, key=lambda k: timed[k])
    us = timed[best]
    if case.host == "pinned":          # the reference copies through the host: not capturable
        ref_us = time_eager_us(lambda: ops[1](*sets[0]), args.iters, cuda)
        rate = rates["h2d" if case.op == "swap" else "d2h"]
        floor_us, pct = link_bytes / rate * 1e6, link_bytes / (us * 1e-6) / rate * 100
    else:
        ref_us = time_us(ops[1], sets, args, cuda)
        floor_us, pct = total / HBM_BYTES_PER_S * 1e6, total / (us * 1e-6) / HBM_BYTES_PER_S * 100
    return {"case": case.name, "op": case.op, "n": case.n, "host": case.host, "kept": kept,
            "d": case.d, "dtype": "bfloat16", "us": us, "us_default": timed["default"],
            "best_config": best, "configs_us": timed, "ref_us": ref_us,
            "speedup_vs_ref": ref_us / us, "bytes": total, "link_bytes": link_bytes,
            "gbps": (link_bytes if case.host == "pinned" else total) / us / 1e3,
            "floor_us": floor_us, "pct_of_rate": pct, "index_sets": len(sets)}


TABLE = [("case", "{:<20}", "case"), ("kept", "{:>6}", "kept"), ("bytes", "{:>10.3e}", "bytes"),
         ("floor_us", "{:>8.2f}", "floor us"), ("us", "{:>8.2f}", "us"),
         ("ref_us", "{:>9.2f}", "ref us"), ("speedup_vs_ref", "{:>6.1f}", "x ref"),
         ("gbps", "{:>7.1f}", "GB/s"), ("pct_of_rate", "{:>6.1f}", "%rate"),
         ("best_config", "{:>12}", "config")]


def main() -> None:
    args = base_parser(__doc__.splitlines()[0], "also time SWEEP (block_d, warps)").parse_args()
    device = select_device(args.cpu_smoke)      # before the first `import triton` (done lazily)
    cases = smoke_cases() if args.cpu_smoke else cuda_cases()
    rates = link_rates(device)
    rows = bench_rows(cases, lambda case: bench_case(case, args, device, rates), device)
    print_table(rows, TABLE)
    if rates:
        print(f"copy engine: host -> device {rates['h2d'] / 1e9:.1f} GB/s, device -> host "
              f"{rates['d2h'] / 1e9:.1f} GB/s; %rate: device cases of "
              f"{HBM_BYTES_PER_S / 1e12} TB/s HBM, pinned cases of the copy engine's rate")
    emit({**record_header("hisparse_swap", device), "skip_share": SKIP,
          "copy_engine_bytes_per_s": rates, "results": rows}, args.out)


if __name__ == "__main__":
    main()
