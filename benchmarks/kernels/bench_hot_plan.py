"""Benchmark: HiSparse's plan of one C4 layer (`triton_hot_plan`, one launch) vs `hot_plan_ref`
(~50 torch ops), at the decode shapes the engine runs inside its CUDA graphs.

Shapes: V4-Flash at a 200K context: k = 512 picks per request (index_topk), M = 50,000 entries,
E = 1024 hot slots per request (two picks' worth), T in {1, 16, 64} requests, one row each; and
k = 1 at T in {1, 16} (a decode step's new entries placed hot: the min-key victim, no sort). Each
index set draws every request's picks from a window of 1,536 entries around a moving centre, so
a call hits about two thirds of its picks and swaps the rest, as decode does once a hot set is
warm. Parity first: both implementations from the same state must give the same maps, rows and
copies. Timing: the median of CUDA-event-timed CUDA-graph replays cycling 8 index sets (the
maps evolve across replays, as in decode); the metric is us per call (a latency: the op moves
~T * k * 20 bytes of maps, far from any bandwidth bound). `--sweep` also times the kernel at
2, 4, 8 and 16 warps (`us_by_warps`).
Prints a table, then ONE JSON line (also written to --out).

    PYTHONPATH=src python3 benchmarks/kernels/bench_hot_plan.py --out FILE.json   # CUDA
    PYTHONPATH=src python3 benchmarks/kernels/bench_hot_plan.py --cpu-smoke       # interpreter
"""

from __future__ import annotations

import argparse
import functools
from collections.abc import Callable
from dataclasses import dataclass
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

SETS = 8
WINDOW = 1536
SWEEP_WARPS = (2, 4, 8, 16)


@dataclass(frozen=True)
class Case:
    T: int
    k: int = 512
    E: int = 1024
    M: int = 50_000
    pe: int = 64

    @property
    def name(self) -> str:
        return f"T={self.T} k={self.k} E={self.E}"


def cuda_cases() -> list[Case]:
    # k = 1: a decode step's new entries placed hot (`write_entries(hot=True)`)
    return [Case(1), Case(16), Case(64), Case(1, k=1), Case(16, k=1)]


def smoke_cases() -> list[Case]:
    return [Case(2, k=8, E=16, M=64, pe=4)]


def make_state(case: Case, device: torch.device) -> dict[str, torch.Tensor]:
    R, pages = case.T, -(-case.M // case.pe)
    return {"e2s": torch.full((R + 1, case.M + 1), -1, dtype=torch.int32, device=device),
            "s2e": torch.full((R + 1, case.E + 1), -1, dtype=torch.int32, device=device),
            "stamp": torch.full((R + 1, case.E + 1), -1, dtype=torch.int64, device=device),
            "clock": torch.zeros((), dtype=torch.int64, device=device),
            "page_table": torch.arange((R + 1) * pages, device=device).view(R + 1, pages),
            "counters": torch.zeros(3, dtype=torch.int64, device=device)}


def make_sets(case: Case, state: dict[str, torch.Tensor], device: torch.device, seed: int
              ) -> list[tuple[Any, ...]]:
    """Argument tuples of the op; set i draws from a window centred a little further on."""
    slots = torch.randperm(case.T, generator=torch.Generator().manual_seed(seed)).to(device)
    window = min(WINDOW, case.M)
    sets = []
    for i in range(SETS):
        g = torch.Generator().manual_seed(seed + 1 + i)
        start = min(i * window // 8, case.M - window)
        picks = torch.stack([start + torch.randperm(window, generator=g)[:case.k]
                             for _ in range(case.T)]).to(device)
        sets.append((state["e2s"], state["s2e"], state["stamp"], state["clock"], slots, picks,
                     state["page_table"], case.pe, state["counters"], True))
    return sets


def check_parity(case: Case, device: torch.device, seed: int,
                 kernel: Callable[..., Any] | None = None) -> float:
    """The reference and `kernel` (default `triton_hot_plan`) through every set from one state;
    returns the hit share."""
    from dsv4.kernels.ref.hot_plan import hot_plan_ref
    from dsv4.kernels.triton.hot_plan import triton_hot_plan

    states = [make_state(case, device) for _ in range(2)]
    sets = [make_sets(case, s, device, seed) for s in states]
    for a, b in zip(*sets, strict=True):
        rows = [fn(*args)[0] for fn, args in ((hot_plan_ref, a), (kernel or triton_hot_plan, b))]
        assert torch.equal(rows[0], rows[1]), f"{case.name}: rows differ"
    for name in ("e2s", "s2e", "stamp", "clock", "counters"):
        assert torch.equal(states[0][name], states[1][name]), f"{case.name}: {name} differs"
    picked, swapped, _ = states[0]["counters"].tolist()
    return 1 - swapped / picked


def bench_case(case: Case, args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    from dsv4.kernels.ref.hot_plan import hot_plan_ref
    from dsv4.kernels.triton.hot_plan import plan_warps, triton_hot_plan

    cuda = device.type == "cuda"
    hit = check_parity(case, device, args.seed)
    default = plan_warps(case.E, case.k == 1)
    fns: dict[str, Callable[..., Any]] = {"kernel": triton_hot_plan, "ref": hot_plan_ref}
    if args.sweep:      # the same kernel at other warp counts, each checked first
        fns.update({f"w{w}": functools.partial(triton_hot_plan, num_warps=w)
                    for w in SWEEP_WARPS if w != default})
        for name, fn in fns.items():
            if name.startswith("w"):
                check_parity(case, device, args.seed, fn)
    timed = {}
    for name, fn in fns.items():
        sets = make_sets(case, make_state(case, device), device, args.seed)
        timed[name] = time_us(fn, sets if cuda else sets[:1], args, cuda)
    sweep = {name: us for name, us in timed.items() if name.startswith("w")}
    return {"case": case.name, "T": case.T, "k": case.k, "E": case.E, "M": case.M,
            "hit_share": hit, "us": timed["kernel"], "ref_us": timed["ref"],
            "speedup_vs_ref": timed["ref"] / timed["kernel"], "index_sets": SETS,
            "warps": default, **({"us_by_warps": sweep} if sweep else {})}


TABLE = [("case", "{:<22}", "case"), ("hit_share", "{:>6.2f}", "hits"), ("us", "{:>8.2f}", "us"),
         ("ref_us", "{:>9.2f}", "ref us"), ("speedup_vs_ref", "{:>6.1f}", "x ref")]


def main() -> None:
    args = base_parser(__doc__.splitlines()[0],
                       f"also the kernel at num_warps in {SWEEP_WARPS}").parse_args()
    device = select_device(args.cpu_smoke)      # before the first `import triton` (done lazily)
    cases = smoke_cases() if args.cpu_smoke else cuda_cases()
    rows = bench_rows(cases, lambda case: bench_case(case, args, device), device)
    print_table(rows, TABLE)
    for r in rows:
        if "us_by_warps" in r:
            print(f"{r['case']}: {r['warps']} warps (default) {r['us']:.2f} us; " + ", ".join(
                f"{k[1:]} warps {v:.2f}" for k, v in r["us_by_warps"].items()))
    emit({**record_header("hot_plan", device), "window": WINDOW, "results": rows}, args.out)


if __name__ == "__main__":
    main()
