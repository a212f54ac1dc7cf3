"""Benchmark: the weight-only FP8 linear (`triton_fp8_linear`, e4m3 codes + 128x128 UE8M0 block
scales decoded in registers) vs `F.linear` on the dequantised bf16 weight, and the byte floor.

Shapes: flash-4l's FP8 linears (out x in: wq_a, wkv, wq_b, the indexer's wq_b, one wo_a group,
wo_b, shared w1 / w3, shared w2), bf16 activations, at M = 1, 8, 32, 512, 2048 tokens. Bytes the
op must move (the floor): the codes and scales once, x and y once (bf16), at the measured H200
copy rate (bench_common.HBM_BYTES_PER_S); F.linear's floor is its bf16 weight's (twice the codes).
TFLOP/s: 2 M N K / time, for both. Parity first (against F.linear on the dequantised weight in
float64: within half a bf16 ulp + 2e-6 of max |y|; a whole ulp under the interpreter), then the
median of CUDA-graph replays cycling weight copies of 512 MB (bench_common.time_us). From M =
A8_MIN_M the W8A8 linear on FP8 tensor cores (`triton_fp8_linear_a8`: act_quant(x) included) is
timed too: "a8 us", its TFLOP/s and x bf16, checked norm-wise against `fp8_linear_a8` (<= 5e-4).
For the shared expert's w2 (4096 x 2048) at M <= 4 the SwiGLU mode (`up=`: h = swiglu(gate, up)
computed as the kernel loads x, one launch) is timed against its two launches (`triton_swiglu`,
then the product), bit-equal: "swiglu us" and "2-launch us" (gate and up: the same tensor;
--cpu-smoke: on its first shape).
From M = DEQUANT_MIN_M the default path ("path") decodes the weight and runs F.linear; the tiles
the plan would run there are timed too, pinned ("tiles us").
`--sweep` (M <= 4, the FMA path): every knob set of `fma_sweep` (rows per program 4..32 with and
without a K split, 1 / 2 / 4 scale blocks a step, 1 / 2 stages; and the frag path at 16 / 32
rows), each checked for parity, then
timed; a row's "sweep" holds each set's us and "best" the fastest ("default" is the plan's); on
the SwiGLU shape the same sets in the SwiGLU mode ("swiglu_sweep", "swiglu_best"), each checked
bit-equal to its two launches. `--stage-sweep`: only the frag sets and the plan's FMA tile at 3 / 4
stages (Triton copies loads S - 1 steps ahead; at 2 stages it has one buffer, so nothing overlaps).
Prints a table, then ONE JSON line (also written to --out).

    PYTHONPATH=src python3 benchmarks/kernels/bench_fp8_linear.py --out FILE.json   # CUDA
    PYTHONPATH=src python3 benchmarks/kernels/bench_fp8_linear.py --cpu-smoke       # interpreter
"""

from __future__ import annotations

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
    time_configs,
    time_us,
)

ROTATE_BYTES = 512e6
MAX_SETS = 256
BF16 = torch.bfloat16
SHAPES = [(1024, 4096), (512, 4096), (32768, 1024), (8192, 1024), (1024, 4096), (4096, 8192),
          (2048, 4096), (4096, 2048)]
SMOKE_SHAPES = [(200, 300), (64, 129)]
A8_MIN_M = 128               # prefill: the W8A8 linear's rows
SWIGLU_SHAPE = (4096, 2048)  # the shared expert's w2 (out x in)
SWIGLU_LIMIT = 10.0
A8_MAX_NORM_ERR = 1.5e-3     # bf16 out: QGMMA's sums flip bf16 roundings (tests/kernels/
                             # test_fp8_linear_a8.py; H200: 6.9e-4)


@dataclass(frozen=True)
class Case:
    m: int
    n: int
    k: int

    @property
    def name(self) -> str:
        return f"{self.n}x{self.k} M={self.m}"


def make_sets(case: Case, device: torch.device,
              seed: int) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]:
    """(x, codes, scale, dequantised bf16 weight) per weight copy."""
    from dsv4.kernels.ref import quant

    n = (min(MAX_SETS, max(2, math.ceil(ROTATE_BYTES / (case.n * case.k * 3))))
         if device.type == "cuda" else 1)
    g = torch.Generator(device).manual_seed(seed)
    sets = []
    for _ in range(n):
        w = torch.randn(case.n, case.k, generator=g, device=device) / case.k**0.5
        codes, scale = quant.quant_fp8_block(w)
        sets.append((torch.randn(case.m, case.k, generator=g, device=device).to(BF16), codes,
                     scale.view(torch.uint8), quant.dequant_fp8_block(codes, scale, BF16)))
    return sets


def max_error(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> float:
    ref = F.linear(x.double(), w.double())
    scale = float(ref.abs().max().clamp_min(1e-30))
    half_ulp = 2.0**-8 * (2 if y.device.type == "cpu" else 1)
    err = (y.double() - ref).abs()
    assert bool((err <= half_ulp * ref.abs() + 2e-6 * scale).all()), \
        f"parity failed: max err {float(err.max()):.3e} of {scale:.3e}"
    return float(err.max()) / scale


def a8_row(sets: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]], args: Any,
           cuda: bool, flops: float) -> dict[str, Any]:
    """The W8A8 linear's time, TFLOP/s and norm-wise error against its reference."""
    from dsv4.kernels.ref.fp8_linear import fp8_linear_a8
    from dsv4.kernels.triton.fp8_linear_a8 import triton_fp8_linear_a8

    x, codes, scale, _ = sets[0]
    ref = fp8_linear_a8(x, codes, scale).float()
    err = float((triton_fp8_linear_a8(x, codes, scale).float() - ref).norm() / ref.norm())
    assert err <= A8_MAX_NORM_ERR, f"a8 parity failed: norm-wise err {err:.3e}"
    us = time_us(lambda x_, c, s, _w: triton_fp8_linear_a8(x_, c, s), sets, args, cuda)
    return {"a8_us": us, "a8_tflops": flops / us / 1e6, "a8_norm_err": err}


def swiglu_row(sets: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]],
               args: Any, cuda: bool) -> dict[str, Any]:
    """The SwiGLU mode's time against its two launches (bit-equal, checked first)."""
    from dsv4.kernels.triton.fp8_linear import triton_fp8_linear
    from dsv4.kernels.triton.swiglu import triton_swiglu

    def fused(x: torch.Tensor, c: torch.Tensor, s: torch.Tensor, _w: torch.Tensor) -> Any:
        return triton_fp8_linear(x, c, s, up=x, limit=SWIGLU_LIMIT)

    def two(x: torch.Tensor, c: torch.Tensor, s: torch.Tensor, _w: torch.Tensor) -> Any:
        return triton_fp8_linear(triton_swiglu(x, x, SWIGLU_LIMIT), c, s)

    assert torch.equal(fused(*sets[0]), two(*sets[0])), "SwiGLU mode parity failed"
    return {"swiglu_us": time_us(fused, sets, args, cuda),
            "swiglu_two_us": time_us(two, sets, args, cuda)}


def fma_sweep(frag: bool = False) -> list[dict[str, int]]:
    """The FMA path's knob sets: rows per program 4..32, the plan's K split or none (small tiles
    reach the SMs without the split's reduction), scale blocks per step, pipeline stages; with
    `frag`, also the tensor-core decode path at 16 / 32 rows."""
    sets: list[dict[str, int]] = []
    if frag:
        sets += [{"frag": True, "block_n": bn} for bn in (16, 32)]
    for block_n in (4, 8, 16, 32):
        for kb in (1, 2, 4):
            for stages in (1, 2):
                for split in ({}, {"split_k": 1}):
                    sets.append({"dot": False, "block_n": block_n, "kb": kb,
                                 "num_stages": stages, **split})
    return sets


def sweep_row(sets: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]],
              args: Any, cuda: bool) -> dict[str, Any]:
    """Each `fma_sweep` set checked against the reference, then timed (`time_configs`)."""
    from dsv4.kernels.triton.fp8_linear import triton_fp8_linear

    x, codes, scale, dense = sets[0]
    knob_sets = fma_sweep(frag=x.dtype == BF16 and x.shape[-1] % 128 == 0)
    if args.stage_sweep:        # the frag sets, and the plan's FMA tile with 3 / 4 stages
        knob_sets = [k for k in knob_sets if k.get("frag")] + [{"num_stages": 3},
                                                               {"num_stages": 4}]
    for knobs in knob_sets:
        max_error(triton_fp8_linear(x, codes, scale, **knobs), x, dense)
    timed = time_configs(lambda x_, c, s, _w, **k: triton_fp8_linear(x_, c, s, **k), sets,
                         knob_sets, args, cuda)
    best = min(timed, key=timed.__getitem__)
    return {"sweep": timed, "best": best, "best_us": timed[best]}


def swiglu_sweep_row(sets: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]],
                     args: Any, cuda: bool) -> dict[str, Any]:
    """The SwiGLU mode (x as gate and up) under each `fma_sweep` set, each checked bit-equal to
    `triton_swiglu` then the plain call with the same knobs, then timed."""
    from dsv4.kernels.triton.fp8_linear import triton_fp8_linear
    from dsv4.kernels.triton.swiglu import triton_swiglu

    x, codes, scale, _ = sets[0]
    knob_sets = fma_sweep()
    for knobs in knob_sets:
        two = triton_fp8_linear(triton_swiglu(x, x, SWIGLU_LIMIT), codes, scale, **knobs)
        fused = triton_fp8_linear(x, codes, scale, up=x, limit=SWIGLU_LIMIT, **knobs)
        assert torch.equal(fused, two), f"SwiGLU mode parity failed at {knobs}"
    timed = time_configs(lambda x_, c, s, _w, **k: triton_fp8_linear(
        x_, c, s, up=x_, limit=SWIGLU_LIMIT, **k), sets, knob_sets, args, cuda)
    best = min(timed, key=timed.__getitem__)
    return {"swiglu_sweep": timed, "swiglu_best": best, "swiglu_best_us": timed[best]}


def bench_case(case: Case, args: Any, device: torch.device) -> dict[str, Any]:
    from dsv4.kernels.triton.fp8_linear import (
        DEQUANT_MIN_M,
        plan_fp8_linear,
        triton_fp8_linear,
    )
    from dsv4.kernels.triton.gemv import FMA_MAX_M
    from dsv4.kernels.triton.launch import sms

    cuda = device.type == "cuda"
    sets = make_sets(case, device, args.seed)
    x, codes, scale, dense = sets[0]
    err = max_error(triton_fp8_linear(x, codes, scale), x, dense)
    us = time_us(lambda x_, c, s, _w: triton_fp8_linear(x_, c, s), sets, args, cuda)
    bf16_us = time_us(lambda x_, _c, _s, w: F.linear(x_, w), sets, args, cuda)
    path = "dequant" if case.m >= DEQUANT_MIN_M else "tiles"
    # from DEQUANT_MIN_M: the tiles the plan would run, pinned, beside the default
    tiles = {} if path == "tiles" else {"tiles_us": time_us(
        lambda x_, c, s, _w: triton_fp8_linear(x_, c, s, dot=True), sets, args, cuda)}
    act = case.m * (case.k + case.n) * 2
    nbytes = case.n * case.k + scale.numel() + act
    floor_us = nbytes / HBM_BYTES_PER_S * 1e6
    bf16_floor_us = (2 * case.n * case.k + act) / HBM_BYTES_PER_S * 1e6
    flops = 2 * case.m * case.n * case.k
    a8 = a8_row(sets, args, cuda, flops) if case.m >= A8_MIN_M else {}
    swiglu_shape = SMOKE_SHAPES[0] if args.cpu_smoke else SWIGLU_SHAPE
    if (case.n, case.k) == swiglu_shape and case.m <= FMA_MAX_M:
        a8 = {**a8, **swiglu_row(sets, args, cuda)}
    if (args.sweep or args.stage_sweep) and case.m <= FMA_MAX_M:
        a8 = {**a8, **sweep_row(sets, args, cuda)}
        if args.sweep and (case.n, case.k) == swiglu_shape:
            a8 = {**a8, **swiglu_sweep_row(sets, args, cuda)}
    return {**a8, **tiles, "path": path, "case": case.name, "m": case.m, "n": case.n,
            "k": case.k, "bytes": nbytes,
            "floor_us": floor_us, "us": us, "x_floor": us / floor_us, "bf16_us": bf16_us,
            "bf16_x_floor": bf16_us / bf16_floor_us, "speedup_vs_bf16": bf16_us / us,
            "tflops": flops / us / 1e6, "bf16_tflops": flops / bf16_us / 1e6,
            "plan": asdict(plan_fp8_linear(case.m, case.n, case.k, sms(device))),
            "max_rel_err": err, "weight_sets": len(sets)}


TABLE = [("case", "{:<20}", "case"), ("floor_us", "{:>8.2f}", "floor us"),
         ("us", "{:>8.2f}", "us"), ("x_floor", "{:>6.2f}", "x floor"),
         ("tflops", "{:>7.1f}", "TFLOP/s"), ("bf16_us", "{:>8.2f}", "bf16 us"),
         ("bf16_x_floor", "{:>7.2f}", "x floor"), ("bf16_tflops", "{:>7.1f}", "TFLOP/s"),
         ("speedup_vs_bf16", "{:>6.2f}", "x bf16"), ("max_rel_err", "{:>8.1e}", "rel err"),
         ("a8", "{:>9}", "a8 us"), ("a8_tf", "{:>7}", "a8 TF"), ("a8_x", "{:>7}", "a8 x bf16"),
         ("sw", "{:>9}", "swiglu us"), ("sw2", "{:>10}", "2-launch us"),
         ("path", "{:>8}", "path"), ("tiles", "{:>9}", "tiles us")]


def main() -> None:
    p = base_parser(__doc__.splitlines()[0], "at M <= 4: time every FMA knob set (fma_sweep)")
    p.add_argument("--m", default=None,
                   help="token counts, comma-separated (default 1,8,32,512,2048; --cpu-smoke "
                        "1,3,17,200)")
    p.add_argument("--stage-sweep", action="store_true",
                   help="at M <= 4: time the plan's FMA tile at 3 / 4 pipeline stages and the "
                        "frag path's sets only")
    args = p.parse_args()
    device = select_device(args.cpu_smoke)
    shapes = SMOKE_SHAPES if args.cpu_smoke else SHAPES
    ms = [int(m) for m in (args.m or ("1,3,17,200" if args.cpu_smoke
                                      else "1,8,32,512,2048")).split(",")]
    cases = [Case(m, n, k) for m in ms for n, k in dict.fromkeys(shapes)]
    rows = bench_rows(cases, lambda c: bench_case(c, args, device), device)
    print_table([{**r, "a8": f"{r['a8_us']:.2f}" if "a8_us" in r else "-",
                  "a8_tf": f"{r['a8_tflops']:.1f}" if "a8_us" in r else "-",
                  "a8_x": f"{r['bf16_us'] / r['a8_us']:.2f}" if "a8_us" in r else "-",
                  "sw": f"{r['swiglu_us']:.2f}" if "swiglu_us" in r else "-",
                  "sw2": f"{r['swiglu_two_us']:.2f}" if "swiglu_us" in r else "-",
                  "tiles": f"{r['tiles_us']:.2f}" if "tiles_us" in r else "-"}
                 for r in rows], TABLE)
    for r in rows:
        if "best" in r:
            print(f"{r['case']:<20} best {r['best_us']:8.2f} us ({r['us']:.2f} default): "
                  f"{r['best']}")
        if "swiglu_best" in r:
            print(f"{r['case']:<20} SwiGLU best {r['swiglu_best_us']:8.2f} us "
                  f"({r['swiglu_us']:.2f} default): {r['swiglu_best']}")
    emit({**record_header("fp8_linear", device), "results": rows}, args.out)


if __name__ == "__main__":
    main()
