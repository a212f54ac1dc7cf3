"""Benchmark: batch-invariant Triton GEMM and row reductions vs torch (cuBLAS / torch's reductions).

What true on-policy RL pays for `batch_invariant()` on CUDA (kernels/triton/batch_invariant.py):
  mm        bi_mm vs torch.mm, bf16, K = N = 4096 (a hidden-size linear), M in {1, 16, 64, 512,
            4096} rows (decode batch .. prefill / trainer sequence); us and TFLOP/s (2 M N K /
            time) for both, and x torch. The fixed config (`mm_config`) serves every M, so small M
            run a mostly empty 128-row tile: the price of invariance.
  row sum   sum_dim(x, [-1]) vs torch.sum(x, -1): bf16 [4096, 4096] (hidden rows), fp32 [64, 129280]
            and [1, 129280] (vocab-wide logits); us and GB/s (bytes read / time).
  log_softmax  over fp32 [64, 129280] logits (the log-prob of a decode step), ours vs torch.
Timing: parity with torch is asserted first (bf16 GEMM 2^-7, fp32 1e-5 of max |ref|); then the
median of CUDA-event-timed CUDA-graph replays, each graph cycling through input copies of >= 256 MB
(defeats the 50 MB L2), after warm-up. `--sweep` also times SWEEP_CONFIGS for the GEMM (a
different config gives different bits: engine and trainer must use one).
Prints a table, then ONE JSON line (also written to --out).

    PYTHONPATH=src python3 benchmarks/kernels/bench_batch_invariant.py --out FILE.json  # CUDA
    PYTHONPATH=src python3 benchmarks/kernels/bench_batch_invariant.py --sweep
    PYTHONPATH=src python3 benchmarks/kernels/bench_batch_invariant.py --cpu-smoke  # interpreter
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from typing import Any

import torch
from bench_common import (
    base_parser,
    bench_rows,
    emit,
    print_table,
    record_header,
    select_device,
    time_eager_us,
    time_graph_us,
)

ROTATE_BYTES = 256 << 20         # >= 5x the H200's 50 MB L2: input copies cycled inside one graph
MAX_SETS = 16
# (block_m, block_n, block_k, num_warps, num_stages)
SWEEP_CONFIGS = [(128, 128, 64, 8, 3), (128, 64, 64, 8, 4), (64, 64, 64, 4, 4),
                 (64, 128, 64, 4, 3), (128, 256, 64, 8, 3), (128, 64, 128, 4, 3)]
Case = tuple[str, int, int, int, torch.dtype]          # (kind, rows, K or N, N, dtype)


def cuda_cases() -> list[Case]:
    mm = [("mm", M, 4096, 4096, torch.bfloat16) for M in (1, 16, 64, 512, 4096)]
    sums = [("sum", 4096, 4096, 0, torch.bfloat16), ("sum", 64, 129280, 0, torch.float32),
            ("sum", 1, 129280, 0, torch.float32)]
    return mm + sums + [("log_softmax", 64, 129280, 0, torch.float32)]


def smoke_cases() -> list[Case]:
    mm = [("mm", M, 64, 48, torch.float32) for M in (1, 16, 40)]
    return mm + [("sum", 8, 300, 0, torch.float32), ("log_softmax", 4, 500, 0, torch.float32)]


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref.double()).abs().max() / ref.double().abs().max().clamp(1e-30))


def input_sets(make: Callable[[int], tuple[torch.Tensor, ...]], cuda: bool,
               seed: int) -> list[tuple[torch.Tensor, ...]]:
    first = make(seed)
    per_set = sum(t.numel() * t.element_size() for t in first)
    n = min(MAX_SETS, math.ceil(ROTATE_BYTES / per_set)) if cuda else 1
    return [first] + [make(seed + i) for i in range(1, n)]


def time_us(fn: Callable[..., Any], sets: list[tuple[torch.Tensor, ...]],
            args: argparse.Namespace, cuda: bool) -> float:
    if cuda:
        return time_graph_us(fn, sets, args.iters, args.warmup)
    return time_eager_us(lambda: fn(*sets[0]), 2, cuda)


def bench_mm(case: Case, args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    from dsv4.kernels.triton.batch_invariant import MMConfig, bi_mm, mm_config

    _, M, K, N, dtype = case
    cuda = device.type == "cuda"

    def make(seed: int) -> tuple[torch.Tensor, ...]:
        g = torch.Generator(device).manual_seed(seed)
        return (torch.randn(M, K, generator=g, device=device, dtype=dtype),
                torch.randn(N, K, generator=g, device=device, dtype=dtype).t())  # F.linear's w
    sets = input_sets(make, cuda, args.seed)
    ref = torch.mm(*sets[0])
    default = mm_config(N, K, dtype)
    configs = [default] + ([MMConfig(*c) for c in SWEEP_CONFIGS] if args.sweep else [])
    timed, failed, err = {}, {}, 0.0
    for i, cfg in enumerate(configs):
        key = f"{cfg.block_m}/{cfg.block_n}/{cfg.block_k}/{cfg.num_warps}/{cfg.num_stages}"
        try:
            out = bi_mm(*sets[0], config=cfg)
            err = max(err, rel_error(out, ref))
            assert err <= (2 ** -7 if dtype != torch.float32 else 1e-5), f"{key}: {err:.2e}"
            timed[key] = time_us(lambda a, w, c=cfg: bi_mm(a, w, config=c), sets, args, cuda)
        except Exception as e:
            if i == 0:           # NOTE: a sweep config may not compile (shared memory)
                raise
            failed[key] = f"{type(e).__name__}: {str(e)[:200]}"
    torch_us = time_us(torch.mm, sets, args, cuda)
    dflt = next(iter(timed))
    best = min(timed, key=lambda k: timed[k])
    flops = 2.0 * M * N * K
    return {"case": f"mm {str(dtype)[6:]} M={M} K={K} N={N}", "us": timed[dflt],
            "torch_us": torch_us, "x_torch": timed[dflt] / torch_us,
            "tflops": flops / timed[dflt] / 1e6, "torch_tflops": flops / torch_us / 1e6,
            "gbps": 0.0, "torch_gbps": 0.0, "best_config": best, "best_us": timed[best],
            "configs_us": timed, "configs_failed": failed, "max_rel_err": err,
            "input_sets": len(sets)}


def bench_rows_op(case: Case, args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    from dsv4.kernels.triton.batch_invariant import log_softmax, sum_dim

    kind, R, N, _, dtype = case
    cuda = device.type == "cuda"

    def make(seed: int) -> tuple[torch.Tensor, ...]:
        g = torch.Generator(device).manual_seed(seed)
        return (torch.randn(R, N, generator=g, device=device, dtype=dtype),)
    sets = input_sets(make, cuda, args.seed)
    ours: Callable[[torch.Tensor], torch.Tensor]
    if kind == "sum":
        ours, theirs = (lambda x: sum_dim(x, [-1])), (lambda x: torch.sum(x, -1))
    else:
        ours, theirs = (lambda x: log_softmax(x, -1)), (lambda x: torch.log_softmax(x, -1))
    err = rel_error(ours(*sets[0]), theirs(sets[0][0].double()))
    assert err <= (2 ** -7 if dtype != torch.float32 else 1e-5), f"{kind}: {err:.2e}"
    us, torch_us = time_us(ours, sets, args, cuda), time_us(theirs, sets, args, cuda)
    nbytes = R * N * sets[0][0].element_size()
    return {"case": f"{kind} {str(dtype)[6:]} [{R}, {N}]", "us": us, "torch_us": torch_us,
            "x_torch": us / torch_us, "tflops": 0.0, "torch_tflops": 0.0,
            "gbps": nbytes / us / 1e3, "torch_gbps": nbytes / torch_us / 1e3,
            "best_config": "-", "max_rel_err": err, "input_sets": len(sets)}


TABLE = [("case", "{:<36}", "case"),
         ("us", "{:>9.1f}", "us"),
         ("torch_us", "{:>9.1f}", "torch us"),
         ("x_torch", "{:>7.2f}", "x torch"),
         ("tflops", "{:>7.1f}", "TFLOP/s"),
         ("torch_tflops", "{:>7.1f}", "torch TF"),
         ("gbps", "{:>7.0f}", "GB/s"),
         ("torch_gbps", "{:>8.0f}", "torch GB/s"),
         ("best_config", "{:>16}", "best m/n/k/w/st"),
         ("max_rel_err", "{:>8.1e}", "rel err")]


def main() -> None:
    args = base_parser(__doc__.splitlines()[0], "also time SWEEP_CONFIGS for the GEMM").parse_args()
    device = select_device(args.cpu_smoke)      # before the first `import triton` (done lazily)
    cases = smoke_cases() if args.cpu_smoke else cuda_cases()
    rows = bench_rows(cases, lambda c: (bench_mm if c[0] == "mm" else bench_rows_op)(c, args,
                                                                                      device),
                      device)
    print_table(rows, TABLE)
    emit({**record_header("batch_invariant", device), "results": rows}, args.out)


if __name__ == "__main__":
    main()
