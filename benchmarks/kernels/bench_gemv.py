"""Benchmark: the decode projections' skinny GEMM (`triton_linear`, one launch) vs `F.linear`
(cuBLAS: split-K + a reduce kernel at these shapes) and the byte floor.

Shapes: every weight GEMM of a V4-Flash layer at decode (out x in; bf16, and the fp32 compressor /
gate projections), at M = 1, 8, 32 tokens. Bytes the op must move (the floor): the weight once,
x and y once, at the measured H200 copy rate 4.275 TB/s.
Timing: parity first (x @ w.T in float64: fp32 within 2e-6 of max |y|, 16-bit outputs within half
an output ulp + that; a whole ulp under the interpreter, whose bf16 cast truncates); then the
median of CUDA-event-timed CUDA-graph replays, each graph cycling through weight copies of 512 MB
in all (at most 256 copies: >= 128 MB, 2.5x the H200's 50 MB L2); F.linear is timed on the same
sets. `--sweep` also times plan knobs around the default (tile widths, K
block, warps, stages, splits; the FMA / tl.dot path at M = 8; tf32x3 for fp32) and prints the best
per case, the input for `kernels/triton/gemv.py::plan_gemv`'s defaults. `--m` / `--shapes` pick
a subset (a full sweep compiles a few hundred variants).
SwiGLU rows (`--swiglu-m`, default M = 1, 4; "" skips them): the shared expert's SwiGLU + w2 at
V4-Flash's decode shape (I 2048 -> d 4096, bf16; gate / up the column halves of one [M, 4096]
w1 | w3 output), `triton_swiglu_linear` (one launch, the SwiGLU computed in the GEMV's x loads)
vs `triton_swiglu` then `triton_decode_linear` (the two launches it replaces; bit-equal, asserted)
and vs `triton_swiglu` then `F.linear`; floor: the weight, gate / up and y once.
Prints a table (two with the SwiGLU rows), then ONE JSON line (also written to --out).

    PYTHONPATH=src python3 benchmarks/kernels/bench_gemv.py --out FILE.json            # CUDA
    PYTHONPATH=src python3 benchmarks/kernels/bench_gemv.py --sweep --out FILE.json    # + knobs
    PYTHONPATH=src python3 benchmarks/kernels/bench_gemv.py --cpu-smoke [--sweep]      # interpreter
"""

from __future__ import annotations

import argparse
import math
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.nn.functional as F
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

ROTATE_BYTES = 512e6        # weight bytes cycled inside one graph (~10x the H200's L2)
MAX_SETS = 256
BF16, F32 = torch.bfloat16, torch.float32
# (out, in, dtype): the decode projections (benchmarks/decode_gemms.py)
SHAPES: list[tuple[int, int, torch.dtype]] = [
    (1024, 4096, BF16), (1536, 4096, BF16), (4096, 4096, BF16), (4096, 2048, BF16),
    (8192, 1024, BF16), (4096, 8192, BF16), (32768, 1024, BF16), (64, 4096, BF16),
    (2560, 4096, F32), (256, 4096, F32)]
# --cpu-smoke: a partial N tile; a K tail and (planned for one SM) two K splits
SMOKE_SHAPES: list[tuple[int, int, torch.dtype]] = [(40, 96, BF16), (24, 300, F32)]
# the shared expert's w2 (d, I) at decode; --cpu-smoke: a partial N tile, two K splits, a K tail
SWIGLU_SHAPE, SWIGLU_SMOKE_SHAPE = (4096, 2048), (40, 1100)
SWIGLU_LIMIT = 10.0         # V4-Flash's swiglu_limit


@dataclass(frozen=True)
class Case:
    m: int
    n: int
    k: int
    dtype: torch.dtype

    @property
    def name(self) -> str:
        return f"{str(self.dtype)[6:]} {self.n}x{self.k} M={self.m}"


def sweep_knobs(case: Case, num_sms: int) -> list[dict[str, Any]]:
    """Knob sets around the default plan: one knob changed at a time (splits re-planned for a
    new tile width), a few pairs."""
    from dsv4.kernels.triton.gemv import FMA_LIMIT_M, plan_gemv

    p = plan_gemv(case.m, case.n, case.k, case.dtype, case.dtype, num_sms)
    knobs: list[dict[str, Any]] = []
    widths = (4, 8, 32, 64) if not p.dot else (16, 32, 64, 128)
    knobs += [{"block_n": b} for b in widths if b != p.block_n]
    knobs += [{"block_k": b} for b in (p.block_k // 2, p.block_k * 2) if b >= 16]
    knobs += [{"num_warps": w} for w in (2, 4, 8) if w != p.num_warps]
    knobs += [{"num_stages": s} for s in (1, 2, 3, 4, 6) if s != p.num_stages]
    knobs += [{"split_k": s} for s in sorted({1, max(1, p.split_k // 2), p.split_k * 2})
              if s != p.split_k]
    if p.dot and case.m <= FMA_LIMIT_M // 4:
        knobs += [{"dot": False}, {"dot": False, "block_n": 32}]
    if not p.dot:
        knobs += [{"dot": True}, {"block_n": 32, "num_warps": 8}]
    if case.dtype == F32 and p.dot:
        knobs += [{"precision": "tf32x3"}, {"precision": "tf32x3", "block_k": 64}]
    return knobs


def make_sets(case: Case, device: torch.device, seed: int) -> list[tuple[torch.Tensor, ...]]:
    w_bytes = case.n * case.k * case.dtype.itemsize
    n = min(MAX_SETS, max(2, math.ceil(ROTATE_BYTES / w_bytes))) if device.type == "cuda" else 1
    g = torch.Generator(device).manual_seed(seed)
    return [(torch.randn(case.m, case.k, generator=g, device=device).to(case.dtype),
             (torch.randn(case.n, case.k, generator=g, device=device) / case.k**0.5)
             .to(case.dtype)) for _ in range(n)]


def max_error(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> float:
    """max |y - ref| / max |ref|; asserts the tests' tolerance (tests/kernels/test_gemv.py; on
    the CPU a whole bf16 ulp: the interpreter's fp32 -> bf16 cast truncates)."""
    ref = F.linear(x.double(), w.double())
    scale = float(ref.abs().max().clamp_min(1e-30))
    half_ulp = {BF16: 2.0**-8, torch.float16: 2.0**-11}.get(y.dtype, 0.0)
    half_ulp *= 2 if y.device.type == "cpu" else 1
    err = (y.double() - ref).abs()
    assert bool((err <= half_ulp * ref.abs() + 2e-6 * scale).all()), \
        f"parity failed: max err {float(err.max()):.3e} of {scale:.3e}"
    return float(err.max()) / scale


def bench_case(case: Case, args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    from dsv4.kernels.triton.gemv import GemvCounters, plan_gemv, triton_linear
    from dsv4.kernels.triton.launch import sms

    cuda = device.type == "cuda"
    sets = make_sets(case, device, args.seed)
    num_sms = sms(device)
    plan = plan_gemv(case.m, case.n, case.k, case.dtype, case.dtype, num_sms)
    timed: dict[str, float] = {}
    failed: dict[str, str] = {}
    err = 0.0
    held = GemvCounters().get(device)    # held across calls, as a serving engine would
    for knobs in [{}, *(sweep_knobs(case, num_sms) if args.sweep else [])]:
        key = ",".join(f"{k}={v}" for k, v in knobs.items()) or "default"
        knobs = {**knobs, "counters": held}
        try:
            err = max(err, max_error(triton_linear(*sets[0], **knobs), *sets[0]))
            timed[key] = time_us(lambda x, w, kw=knobs: triton_linear(x, w, **kw), sets, args,
                                 cuda)
        except Exception as e:
            if not knobs:
                raise
            failed[key] = f"{type(e).__name__}: {str(e)[:200]}"   # e.g. out of shared memory
    cublas_us = time_us(F.linear, sets, args, cuda)
    us = timed["default"]
    best = min(timed, key=lambda k: timed[k])
    nbytes = (case.n * case.k + case.m * (case.k + case.n)) * case.dtype.itemsize
    floor_us = nbytes / HBM_BYTES_PER_S * 1e6
    return {"case": case.name, "m": case.m, "n": case.n, "k": case.k,
            "dtype": str(case.dtype)[6:], "bytes": nbytes, "floor_us": floor_us, "us": us,
            "cublas_us": cublas_us, "x_floor": us / floor_us,
            "cublas_x_floor": cublas_us / floor_us,
            "speedup_vs_cublas": cublas_us / us, "gbps": nbytes / us / 1e3,
            "plan": asdict(plan), "best_config": best, "best_us": timed[best],
            "best_x_floor": timed[best] / floor_us, "configs_us": timed,
            "configs_failed": failed, "max_rel_err": err, "weight_sets": len(sets)}


def swiglu_sets(m: int, d: int, inter: int, device: torch.device, seed: int
                ) -> list[tuple[torch.Tensor, ...]]:
    """(gate, up, w) sets: gate / up the column halves of one [m, 2 inter] bf16 tensor (~6 N(0, 1),
    some beyond the clamp), w [d, inter] bf16; as many weight copies as `make_sets` takes."""
    n = min(MAX_SETS, max(2, math.ceil(ROTATE_BYTES / (d * inter * 2)))) if device.type == "cuda" \
        else 1
    g = torch.Generator(device).manual_seed(seed)
    sets = []
    for _ in range(n):
        both = (torch.randn(m, 2 * inter, generator=g, device=device) * 6).to(BF16)
        w = (torch.randn(d, inter, generator=g, device=device) / inter**0.5).to(BF16)
        sets.append((both[:, :inter], both[:, inter:], w))
    return sets


def bench_swiglu(m: int, args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    """The shared expert's SwiGLU + w2 at M = m: one launch vs the two it replaces (bit-equal)
    vs the SwiGLU launch and cuBLAS."""
    from dsv4.kernels.ops import DECODE_BLOCK_N
    from dsv4.kernels.triton.gemv import triton_decode_linear
    from dsv4.kernels.triton.swiglu import triton_swiglu
    from dsv4.kernels.triton.swiglu_linear import triton_swiglu_linear

    cuda = device.type == "cuda"
    d, inter = SWIGLU_SHAPE if cuda else SWIGLU_SMOKE_SHAPE
    sets = swiglu_sets(m, d, inter, device, args.seed)
    held = torch.zeros(-(-d // DECODE_BLOCK_N), dtype=torch.int32, device=device)
    lim = SWIGLU_LIMIT

    def fused(g: torch.Tensor, u: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return triton_swiglu_linear(g, u, lim, w, counters=held)

    def two(g: torch.Tensor, u: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return triton_decode_linear(triton_swiglu(g, u, lim), w, counters=held)

    def cublas(g: torch.Tensor, u: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return F.linear(triton_swiglu(g, u, lim), w)

    assert torch.equal(fused(*sets[0]), two(*sets[0])), "fused bits differ from the two launches"
    gate, up, w = sets[0]
    err = max_error(fused(gate, up, w), triton_swiglu(gate, up, lim), w)   # h @ w.T in float64
    us, two_us, cublas_us = (time_us(f, sets, args, cuda) for f in (fused, two, cublas))
    nbytes = (d * inter + m * (2 * inter + d)) * 2
    floor_us = nbytes / HBM_BYTES_PER_S * 1e6
    return {"case": f"swiglu+w2 bf16 {d}x{inter} M={m}", "m": m, "n": d, "k": inter,
            "bytes": nbytes, "floor_us": floor_us, "us": us, "two_launch_us": two_us,
            "cublas_us": cublas_us, "x_floor": us / floor_us, "saved_us": two_us - us,
            "max_rel_err": err, "weight_sets": len(sets)}


SWIGLU_TABLE = [("case", "{:<30}", "case"), ("floor_us", "{:>8.2f}", "floor us"),
                ("us", "{:>8.2f}", "fused us"), ("x_floor", "{:>6.2f}", "x floor"),
                ("two_launch_us", "{:>14.2f}", "swiglu+gemv us"),
                ("saved_us", "{:>8.2f}", "saved us"),
                ("cublas_us", "{:>16.2f}", "swiglu+cuBLAS us"),
                ("max_rel_err", "{:>8.1e}", "rel err")]


TABLE = [("case", "{:<24}", "case"), ("floor_us", "{:>8.2f}", "floor us"),
         ("us", "{:>8.2f}", "us"), ("x_floor", "{:>6.2f}", "x floor"),
         ("cublas_us", "{:>9.2f}", "cuBLAS us"), ("cublas_x_floor", "{:>7.2f}", "x floor"),
         ("speedup_vs_cublas", "{:>6.2f}", "x cuBLAS"), ("gbps", "{:>7.0f}", "GB/s"),
         ("max_rel_err", "{:>8.1e}", "rel err")]


def best_line(r: dict[str, Any]) -> str:
    return (f"  {r['case']:<24} {r['best_config']:<36} {r['best_us']:8.2f} "
            f"{r['best_x_floor']:6.2f}x  (default {r['us']:.2f}, cuBLAS {r['cublas_us']:.2f})")


def main() -> None:
    p = base_parser(__doc__.splitlines()[0], "also time knob sets around the default plan "
                    "and print the best per case")
    p.add_argument("--m", default=None,
                   help="token counts, comma-separated (default 1,8,32; --cpu-smoke 1,3,8)")
    p.add_argument("--shapes", default="",
                   help="indices into SHAPES, comma-separated (default: all)")
    p.add_argument("--swiglu-m", default=None,
                   help="token counts of the SwiGLU + w2 rows (default 1,4; --cpu-smoke 1,3; "
                   "'' skips them)")
    args = p.parse_args()
    device = select_device(args.cpu_smoke)      # before the first `import triton` (done lazily)
    shapes = SMOKE_SHAPES if args.cpu_smoke else SHAPES
    if args.shapes:
        shapes = [shapes[int(i)] for i in args.shapes.split(",")]
    ms = [int(m) for m in (args.m or ("1,3,8" if args.cpu_smoke else "1,8,32")).split(",")]
    cases = [Case(m, n, k, dt) for m in ms for n, k, dt in shapes]

    def run(case: Case) -> dict[str, Any]:
        row = bench_case(case, args, device)
        if args.sweep:          # as it comes: a sweep cut short by a timeout keeps its cases
            print(best_line(row), flush=True)
        return row

    rows = bench_rows(cases, run, device)
    print_table(rows, TABLE)
    if args.sweep:
        print("\nbest config per case (us, x floor; default plan's us):")
        for r in rows:
            print(best_line(r))
    swiglu_m = args.swiglu_m if args.swiglu_m is not None else \
        ("1,3" if args.cpu_smoke else "1,4")
    swiglu_rows = bench_rows([int(m) for m in swiglu_m.split(",") if m],
                             lambda m: bench_swiglu(m, args, device), device)
    if swiglu_rows:
        print()
        print_table(swiglu_rows, SWIGLU_TABLE)
    emit({**record_header("gemv", device), "results": rows, "swiglu": swiglu_rows}, args.out)


if __name__ == "__main__":
    main()
