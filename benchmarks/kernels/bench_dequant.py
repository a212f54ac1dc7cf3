"""Benchmark: checkpoint weights decoded to bf16 (`triton/dequant.py`: FP4 groups, FP8 blocks)
against the HBM byte floor and the torch codec (`ref/quant.py`).

Cases: one V4-Flash MoE layer's FP4 experts (w13 256 x [4096, 4096] and w2 256 x [4096, 2048]: the
grouped-GEMM prefill path decodes these per call) and FP8 linears (wq_b-like 32768 x 1024, wo_b-like
4096 x 8192). Bytes the op must move (the floor): codes and scales read, bf16 written. Each case is
checked bit-equal against the codec on sampled matrices first (asserted), then timed as CUDA-graph
replays. `--sweep` also times the tiles in SWEEP. Prints a table, then ONE JSON line (also written
to --out).

    PYTHONPATH=src python3 benchmarks/kernels/bench_dequant.py --out FILE.json     # CUDA
    PYTHONPATH=src python3 benchmarks/kernels/bench_dequant.py --cpu-smoke         # interpreter
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
    time_configs,
    time_eager_us,
)

# (name, fmt, matrices, out, in)
CASES = [("fp4 w13 x256", "fp4", 256, 4096, 4096), ("fp4 w2 x256", "fp4", 256, 4096, 2048),
         ("fp8 32768x1024", "fp8", 1, 32768, 1024), ("fp8 4096x8192", "fp8", 1, 4096, 8192)]
SMOKE = [("fp4 smoke", "fp4", 2, 16, 128), ("fp8 smoke", "fp8", 1, 130, 256)]
SWEEP = [{"tile": t} for t in ((16, 256), (32, 128), (16, 512), (4, 1024), (64, 64))]


def _inputs(fmt: str, E: int, out: int, inp: int, device: torch.device
            ) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator(device).manual_seed(0)
    if fmt == "fp4":
        w = torch.randint(0, 256, (E, out, inp // 2), generator=g, device=device,
                          dtype=torch.uint8)
        s = torch.randint(120, 134, (E, out, inp // 32), generator=g, device=device,
                          dtype=torch.uint8)
        return w, s
    w = torch.randint(0, 0x7F, (E, out, inp), generator=g, device=device, dtype=torch.uint8)
    s = torch.randint(120, 134, (E, -(-out // 128), -(-inp // 128)), generator=g, device=device,
                      dtype=torch.uint8)
    return w.view(torch.float8_e4m3fn), s


def bench_case(case: tuple[str, str, int, int, int], args: argparse.Namespace,
               device: torch.device) -> dict[str, Any]:
    from dsv4.kernels.ref.quant import dequant_fp4_group, dequant_fp8_block
    from dsv4.kernels.triton.dequant import triton_dequant_fp4_group, triton_dequant_fp8_block

    name, fmt, E, out, inp = case
    cuda = device.type == "cuda"
    w, s = _inputs(fmt, E, out, inp, device)
    fn, ref = ((triton_dequant_fp4_group, dequant_fp4_group) if fmt == "fp4"
               else (triton_dequant_fp8_block, dequant_fp8_block))
    buf = torch.empty(E, out, inp, dtype=torch.bfloat16, device=device)
    fn(w, s, torch.bfloat16, out=buf)
    for e in sorted({0, E // 2, E - 1}):
        assert torch.equal(buf[e], ref(w[e], s[e], torch.bfloat16)), f"parity failed: {name}"
    ref_us = time_eager_us(lambda: ref(w[0], s[0], torch.bfloat16), 3, cuda) * E
    timed = time_configs(lambda w_, s_, **kw: fn(w_, s_, torch.bfloat16, out=buf, **kw),
                         [(w, s)], SWEEP if args.sweep else [], args, cuda)
    us = timed["default"]
    nbytes = w.numel() + s.numel() + buf.numel() * 2
    best = min(timed, key=lambda k: timed[k])
    return {"case": name, "fmt": fmt, "matrices": E, "out": out, "in": inp, "bytes": nbytes,
            "floor_us": nbytes / HBM_BYTES_PER_S * 1e6, "us": us, "x_floor":
            us / (nbytes / HBM_BYTES_PER_S * 1e6), "gb_per_s": nbytes / us / 1e3,
            "best": best, "best_us": timed[best], "configs_us": timed, "ref_us": ref_us,
            "speedup_vs_ref": ref_us / us, "bit_equal": True}


TABLE = [("case", "{:<15}", "case"), ("bytes", "{:>10.3e}", "bytes"),
         ("floor_us", "{:>9.1f}", "floor us"), ("us", "{:>9.1f}", "us"),
         ("x_floor", "{:>7.2f}", "x floor"), ("gb_per_s", "{:>8.1f}", "GB/s"),
         ("best", "{:>16}", "best"), ("best_us", "{:>9.1f}", "best us"),
         ("speedup_vs_ref", "{:>7.1f}", "x ref"), ("bit_equal", "{!s:>9}", "bit-equal")]


def main() -> None:
    args = base_parser(__doc__.splitlines()[0], "also time the tiles in SWEEP").parse_args()
    device = select_device(args.cpu_smoke)      # before the first `import triton` (done lazily)
    if device.type == "cuda":
        args.iters, args.warmup = min(args.iters, 20), min(args.warmup, 2)
    rows = bench_rows(SMOKE if args.cpu_smoke else CASES,
                      lambda c: bench_case(c, args, device), device)
    print_table(rows, TABLE)
    emit({**record_header("dequant", device), "results": rows}, args.out)


if __name__ == "__main__":
    main()
