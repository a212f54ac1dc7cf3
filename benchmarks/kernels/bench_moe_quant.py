"""Benchmark: weight-only quantised routed experts (`triton_routed_experts_quant`) vs the reference.

Cases (V4-Flash routed experts: E = 256, d = 4096, I = 2048, k = 6, bf16 activations, limit 10):
  N in {1, 8, 32, 128, 512, 2048} tokens (`--tokens`) x fmt in {fp4 (checkpoint layout), fp8
  (128x128 blocks), bf16} (`--fmts`) x inner loop (`--variants`, default all: split, scaled,
  dot_scaled, words, fma, planes, w8a8, frag; FP8 runs its distinct loops, scaled, dot_scaled, fma,
  frag (e4m3 into mma.sync fragments) and w8a8, the FP8-tensor-core loop with FP8 activations
  (FP4 too: its codes decoded to e4m3), checked against the reference with act_quant; bf16
  weights have one loop, shown as "-"; `--cpu-smoke` leaves frag out by default). The
  fma loop (CUDA cores) has its own SWEEP kinds "fp4/fma" / "fp8/fma" and `--fma-block-m`; the
  frag loop (FP4 into mma.sync fragments, the plan's FP4 default while N*k <= E) "fp4/frag".
  `--kernels`: each kernel's device us per call at the default config (the gate/up and down
  launches, the activation copy, the tile map, the combine; CUDA only).
Metrics:
  weight bytes = distinct experts hit x one expert's bytes (w1, w3, w2 and their scales): what the
      kernel has to read at least once (averaged over the input sets); floor us = weight bytes /
      4.275 TB/s; x_floor = time / floor (decode is weight-bound, so x_floor is the number to drive
      towards 1);
  TFLOP/s = 6 N k I d / time (three GEMMs of N k rows);
  best = the fastest of the plan's default config and, with `--sweep`, SWEEP[kind] (block_n /
      block_k / num_warps / num_stages; "-" = the plan's choice), or with `--prefill-sweep`,
      PREFILL_SWEEP[kind] (the same plus BLOCK_M 64 / 128: wgmma tiles for N >= 2048);
  x ref = reference time / kernel time; the reference is `routed_experts_quant` (dequantises every
      expert, then one dense matmul per expert with a host sync), timed eagerly once per (fmt, N);
      "grouped us" (CUDA) is `routed_experts_grouped` (torch._grouped_mm) on weights dequantised
      once to bf16, the non-quantised device-grouped baseline (same weight bytes as fmt bf16).
Timing: every (variant, config) is checked against the reference first (a failure is reported in
its row, "rel err" = inf, and the run goes on; "rel err" is max |diff| / max |ref|, for w8a8
||diff|| / ||ref||); then the median of CUDA-event-timed CUDA-graph
replays, cycling through 4 routings (different experts hit) after warm-up.
Prints a table, then ONE JSON line.

    PYTHONPATH=src python3 benchmarks/kernels/bench_moe_quant.py              # CUDA
    PYTHONPATH=src python3 benchmarks/kernels/bench_moe_quant.py --sweep      # + tile/warp/stage
    PYTHONPATH=src python3 benchmarks/kernels/bench_moe_quant.py --variants scaled --tokens 1,8
    PYTHONPATH=src python3 benchmarks/kernels/bench_moe_quant.py --fmts fp4,fp8 \
        --variants fma,words,scaled --tokens 1,8,32,128 --sweep
    PYTHONPATH=src python3 benchmarks/kernels/bench_moe_quant.py --fmts bf16,fp8,fp4 \
        --variants planes,scaled --tokens 2048,8192 --prefill-sweep
    PYTHONPATH=src python3 benchmarks/kernels/bench_moe_quant.py --cpu-smoke  # interpreter, tiny
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from bench_common import (
    HBM_BYTES_PER_S,
    base_parser,
    emit,
    print_table,
    record_header,
    select_device,
    time_eager_us,
    time_graph_us,
)

LIMIT = 10.0
N_SETS = 4
MAX_REL_ERR = 1e-2
# w8a8: norm-wise, as its max error moves with the e4m3 steps of h it flips (tests/kernels/
# test_moe_w8a8.py; FP8 wgmma measured 2.3e-3 norm-wise, 1.5e-2 max at N = 2048)
MAX_NORM_ERR_W8A8 = 5e-3
# block_n, block_k, warps, stages, prefetch (the fma loop's register prefetch; None elsewhere)
# [, block_m (PREFILL_SWEEP's; else the plan's, or --fma-block-m) [, max_regs ("w8a8")]]
Config = (tuple[int | None, int | None, int | None, int | None, bool | None]
          | tuple[int | None, int | None, int | None, int | None, bool | None, int]
          | tuple[int | None, int | None, int | None, int | None, bool | None, int, int])
DEFAULT_CONFIG: Config = (None, None, None, None, None)         # the plan's (moe_plan.py)
# per kind (fmt, or fmt/variant for FP4): the old default first, then tiles around the plan's
SWEEP: dict[str, list[Config]] = {
    "fp4/split": [(64, 64, 4, 3, None), (32, 64, 4, 3, None), (64, 128, 4, 3, None),
                  (128, 64, 8, 3, None)],
    "fp4": [(64, 64, 4, 3, None), (64, 128, 4, 3, None), (32, 256, 4, 3, None),
            (64, 256, 4, 3, None), (64, 256, 8, 3, None), (32, 128, 4, 4, None),
            (16, 256, 1, 3, None), (128, 256, 8, 3, None)],
    "fp8": [(64, 64, 4, 3, None), (64, 128, 4, 3, None), (32, 128, 4, 3, None),
            (64, 128, 8, 3, None), (64, 128, 4, 4, None), (16, 128, 1, 3, None),
            (128, 128, 8, 3, None)],
    "bf16": [(64, 64, 4, 3, None), (32, 64, 4, 3, None), (64, 128, 4, 3, None),
             (128, 64, 8, 3, None), (64, 64, 4, 4, None)],
    # the fma loop (no tl.dot): stages = the K loop's cp.async pipelining (1: none); prefetch =
    # the next step's words loaded into registers before this step's decode
    "fp4/fma": [(32, 256, 2, 1, True), (64, 256, 4, 1, False), (64, 256, 4, 1, True),
                (128, 256, 8, 1, True), (32, 256, 4, 1, True), (32, 256, 4, 1, False),
                (16, 256, 4, 1, True), (64, 256, 8, 1, True), (32, 512, 4, 1, True),
                (64, 128, 4, 1, True)],
    # the frag loop (FP4 into mma.sync fragments): block_n = 16 x warps across N, the other
    # 2 or 4 warps split K; the 6th entry block_m 8 / 16 (a tile map, up to 8 rows of an expert
    # per MMA, one or two MMAs per A fragment)
    "fp4/frag": [(16, None, 2, None, None), (16, None, 4, None, None), (32, None, 4, None, None),
                 (32, None, 8, None, None), (64, None, 8, None, None), (64, None, 16, None, None),
                 (16, None, 2, None, None, 8), (16, None, 4, None, None, 8),
                 (32, None, 4, None, None, 8), (32, None, 8, None, None, 8),
                 (16, None, 2, None, None, 16), (16, None, 4, None, None, 16),
                 (32, None, 4, None, None, 16), (32, None, 8, None, None, 16)],
    "fp8/fma": [(32, 128, 4, 1, True), (64, 128, 4, 1, True), (64, 128, 8, 1, True),
                (32, 128, 2, 1, True), (128, 128, 8, 1, True), (64, 64, 4, 1, True)],
}
# `--prefill-sweep`: tiles for N >= 2048 (wgmma from BLOCK_M 64), the 6th entry BLOCK_M
PREFILL_SWEEP: dict[str, list[Config]] = {
    "bf16": [(64, 64, 4, 3, None, 64), (128, 64, 8, 4, None, 128), (128, 64, 4, 3, None, 64),
             (128, 64, 8, 3, None, 128)],
    "fp8": [(64, 128, 4, 3, None, 64), (128, 128, 8, 3, None, 128), (128, 64, 8, 3, None, 128),
            (128, 128, 4, 3, None, 64)],
    "fp4/planes": [(128, 128, 4, 3, None, 64), (128, 128, 8, 3, None, 128),
                   (64, 128, 4, 3, None, 64)],
    # block_n is the down launch's (gate/up's is 128); warps pin both launches
    # the 7th entry caps registers per thread: 128 lets two 8-warp CTAs share an SM
    "fp8/w8a8": [(128, 128, 8, 4, None, 64), (128, 128, 8, 3, None, 64, 128),
                 (128, 128, 8, 2, None, 64, 128), (128, 128, 8, 3, None, 64, 168),
                 (128, 128, 8, 3, None, 128), (128, 128, 8, 2, None, 128),
                 (128, 128, 4, 2, None, 64)],
    "fp4/w8a8": [(128, 128, 8, 3, None, 64), (128, 128, 8, 3, None, 128),
                 (64, 128, 8, 2, None, 128)],
}
FMTS = ("fp4", "fp8", "bf16")
VARIANTS = ("split", "scaled", "dot_scaled", "words", "fma", "planes", "w8a8", "frag")
# FP8's "split" and "words" are its "scaled" loop; "w8a8" (FP8 only) quantises the activations
FP8_LOOPS = ("scaled", "dot_scaled", "fma", "w8a8", "frag")
FP4_LOOPS = VARIANTS

Weights = tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor | None]
Inputs = tuple[torch.Tensor, torch.Tensor, torch.Tensor]      # (x, indices, weights)


@dataclass(frozen=True)
class Shape:
    E: int
    d: int
    inter: int
    k: int
    tokens: tuple[int, ...]


FLASH = Shape(256, 4096, 2048, 6, (1, 8, 32, 128, 512, 2048))
# --cpu-smoke: one token count (the script runs no other code at another N; the kernels'
# multi-token tiles are tests/kernels/test_moe_quant.py's, N = 3 bench_moe_prefill.py's smoke)
SMOKE = Shape(8, 128, 128, 2, (1,))


def _codes(w: torch.Tensor, fmt: str,
           g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Checkpoint-format codes for an [E, out, in] weight of std ~ in^-1/2 (random, not fitted)."""
    E, n_out, n_in = w.shape
    if fmt == "bf16":
        return w.to(torch.bfloat16), None
    if fmt == "fp4":
        packed = torch.randint(0, 256, (E, n_out, n_in // 2), generator=g, device=w.device,
                               dtype=torch.uint8)
        base = 125 - round(0.5 * torch.log2(torch.tensor(float(n_in))).item())
        codes = torch.randint(base - 1, base + 2, (E, n_out, n_in // 32), generator=g,
                              device=w.device)
        return packed, codes.to(torch.uint8).view(torch.float8_e8m0fnu)
    codes = torch.full((E, -(-n_out // 128), -(-n_in // 128)), 123, device=w.device)
    return ((w * 16).clamp(-448, 448).to(torch.float8_e4m3fn),
            codes.to(torch.uint8).view(torch.float8_e8m0fnu))


def make_weights(s: Shape, fmt: str, device: torch.device, seed: int) -> Weights:
    from dsv4.kernels.ref.moe import pack_w13

    g = torch.Generator(device).manual_seed(seed)
    mats = []
    for n_out, n_in in ((s.inter, s.d), (s.inter, s.d), (s.d, s.inter)):
        w = torch.randn(s.E, n_out, n_in, generator=g, device=device,
                        dtype=torch.bfloat16) * n_in ** -0.5
        mats.append(_codes(w, fmt, g))
        del w
    w13, s13 = pack_w13(mats[0][0], mats[0][1], mats[1][0], mats[1][1])
    return w13, s13, mats[2][0], mats[2][1]


def make_inputs(s: Shape, N: int, device: torch.device, seed: int) -> Inputs:
    g = torch.Generator(device).manual_seed(seed)
    x = torch.randn(N, s.d, generator=g, device=device).to(torch.bfloat16)
    idx = torch.rand(N, s.E, generator=g, device=device).argsort(dim=1)[:, :s.k].contiguous()
    w = torch.rand(N, s.k, generator=g, device=device) + 0.1
    return x, idx, (w / w.sum(dim=1, keepdim=True) * 1.5).contiguous()


def expert_bytes(wts: Weights) -> float:
    return sum(t.numel() * t.element_size() for t in wts if t is not None) / wts[0].shape[0]


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out - ref).abs().max() / ref.abs().max().clamp(min=1e-6)).item()


def norm_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out - ref).norm() / ref.norm().clamp(min=1e-6)).item()


def grouped_us(wts: Weights, fmt: str, sets: list[list[Inputs]],
               args: argparse.Namespace) -> list[float | None]:
    """`routed_experts_grouped` on bf16 weights dequantised once, per token count (None where it
    cannot run)."""
    from dsv4.kernels.ref.moe import dequant_experts, routed_experts_grouped

    w1, w3, w2 = dequant_experts(*wts, fmt, torch.bfloat16)

    def fn(x: torch.Tensor, idx: torch.Tensor, rw: torch.Tensor) -> torch.Tensor:
        return routed_experts_grouped(x, w1, w2, w3, idx, rw, LIMIT)

    times: list[float | None] = []
    for inputs in sets:
        try:
            times.append(time_graph_us(fn, inputs, args.iters, args.warmup))
        except (RuntimeError, NotImplementedError):
            # NOTE: torch._grouped_mm needs CUDA bf16 on sm90+
            times.append(None)
    return times


def config_name(cfg: Config) -> str:
    """bn/bk/w/st/pf[/m<block_m>[/r<max_regs>]], "-" for the plan's choice (pf: "pf" with the
    prefetch, else "-")."""
    tiles, pf = cfg[:4], cfg[4]
    tail = [f"{p}{v}" for p, v in zip(("m", "r"), cfg[5:], strict=False)]
    return "/".join(["-" if v is None else str(v) for v in tiles] + ["pf" if pf else "-"] + tail)


def reference(s: Shape, wts: Weights, fmt: str, inputs: Inputs,
              act_quant: bool = False) -> torch.Tensor:
    """`routed_experts_quant` on fp32 x (with `act_quant`: on x as is, whose dtype h is rounded
    to), restricted to the experts hit (same result, less memory)."""
    from dsv4.kernels.ref.moe import routed_experts_quant

    x, idx, rw = inputs
    hit = idx.unique()
    sub = [t[hit] if t is not None else None for t in wts]
    return routed_experts_quant(x if act_quant else x.float(), sub[0], sub[1], sub[2],
                                sub[3], torch.searchsorted(hit, idx), rw, LIMIT,  # type: ignore[arg-type]
                                fmt, act_quant=act_quant)


def time_variant(wts: Weights, fmt: str, variant: str | None, sets: list[Inputs],
                 ref: torch.Tensor, args: argparse.Namespace,
                 cuda: bool) -> tuple[dict[str, float], float, str]:
    """({config: us}, max rel err, first error) of one inner loop over its configs; a config that
    is refused or fails parity is skipped (its error kept)."""
    from dsv4.kernels.triton.moe import triton_routed_experts_quant

    kind = (f"{fmt}/{variant}" if (fmt, variant) in (("fp4", "split"), ("fp4", "fma"),
                                                      ("fp8", "fma"), ("fp4", "planes"),
                                                      ("fp8", "w8a8"), ("fp4", "w8a8"),
                                                      ("fp4", "frag"), ("fp8", "frag"))
            else fmt)
    sweep = PREFILL_SWEEP if args.prefill_sweep else SWEEP if args.sweep else {}
    timed: dict[str, float] = {}
    err, error = 0.0, ""
    for cfg in [DEFAULT_CONFIG] + sweep.get(kind, []):
        bn, bk, nw, ns, pf = cfg[:5]
        bm = cfg[5] if len(cfg) > 5 else args.fma_block_m if variant == "fma" else None
        regs = cfg[6] if len(cfg) > 6 else None

        def fn(x: torch.Tensor, idx: torch.Tensor, rw: torch.Tensor, bn: int | None = bn,
               bk: int | None = bk, nw: int | None = nw, ns: int | None = ns,
               pf: bool | None = pf, block_m: int | None = bm,
               max_regs: int | None = regs) -> torch.Tensor:
            return triton_routed_experts_quant(x, wts[0], wts[1], wts[2], wts[3], idx, rw, LIMIT,
                                               fmt, variant=variant, block_m=block_m,
                                               block_n=bn, block_k=bk, num_warps=nw,
                                               num_stages=ns, prefetch=pf,
                                               act_quant=variant == "w8a8",
                                               max_regs=max_regs, **frag_caching(args, variant),
                                               deterministic=args.deterministic)
        measure, limit = ((norm_error, MAX_NORM_ERR_W8A8) if variant == "w8a8"
                          else (rel_error, MAX_REL_ERR))
        try:
            t0 = time.perf_counter()
            e = measure(fn(*sets[0]), ref)
            parity_us = (time.perf_counter() - t0) * 1e6
        except Exception as exc:  # noqa: BLE001 — a refused or failing config is reported, not fatal
            first = str(exc).splitlines()[0] if str(exc) else repr(exc)
            error = error or f"{config_name(cfg)}: {first}"
            continue
        if not e <= limit:
            error = error or f"{config_name(cfg)}: parity failed, rel err {e:.3e}"
            err = float("inf")
            continue
        err = max(err, e)
        # the interpreter's times mean nothing: the parity call's wall clock stands in
        timed[config_name(cfg)] = (time_graph_us(fn, sets, args.iters, args.warmup) if cuda
                                   else parity_us)
    return timed, err, error


def frag_caching(args: argparse.Namespace, variant: str | None) -> dict[str, bool]:
    """`--frag-stream-weights` as the frag loop's knob (`moe_plan.plan_moe`: its weights' loads
    skip L1), for that variant only (given explicitly)."""
    return {"stream_weights": True} if variant == "frag" and args.frag_stream_weights else {}


def kernel_us(wts: Weights, fmt: str, variant: str | None, block_m: int | None,
              sets: list[Inputs], deterministic: bool, caching: dict[str, bool],
              calls: int = 20) -> dict[str, float]:
    """Device us per call of each kernel the plan's default config launches (with the frag
    loop's `caching` knob; torch.profiler over `calls` eager calls cycling `sets`; kernel names
    cut to 40 characters). CUDA only."""
    from torch.profiler import ProfilerActivity, profile

    from dsv4.kernels.triton.moe import triton_routed_experts_quant

    def fn(i: int) -> torch.Tensor:
        x, idx, rw = sets[i % len(sets)]
        return triton_routed_experts_quant(x, wts[0], wts[1], wts[2], wts[3], idx, rw, LIMIT, fmt,
                                           variant=variant, block_m=block_m,
                                           act_quant=variant == "w8a8", **caching,
                                           deterministic=deterministic)

    fn(0)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for i in range(calls):
            fn(i)
        torch.cuda.synchronize()
    return {e.key[:40]: e.device_time_total / calls for e in prof.key_averages()
            if e.device_type.name == "CUDA" and e.count}


def bench_fmt(s: Shape, fmt: str, args: argparse.Namespace,
              device: torch.device) -> list[dict[str, Any]]:
    from dsv4.kernels.ref.moe import routed_experts_quant

    cuda = device.type == "cuda"
    wts = make_weights(s, fmt, device, args.seed)
    per_expert = expert_bytes(wts)
    variants: list[str | None] = ([None] if fmt == "bf16" else
                                  [v for v in args.variants
                                   if v in (FP8_LOOPS if fmt == "fp8" else FP4_LOOPS)])
    rows, all_sets = [], []
    for N in args.tokens or s.tokens:
        all_sets.append(sets := [make_inputs(s, N, device, args.seed + i)
                                 for i in range(N_SETS if cuda else 1)])
        # NOTE: host sync, untimed
        hit = statistics.mean(int(idx.unique().numel()) for _, idx, _ in sets)
        ref = reference(s, wts, fmt, sets[0])
        x0, idx0, rw0 = sets[0]
        ref_us = time_eager_us(partial(routed_experts_quant, x0, wts[0], wts[1], wts[2], wts[3],
                                       idx0, rw0, LIMIT, fmt),
                               max(2, args.iters // 20), cuda)
        wbytes = hit * per_expert
        floor_us = wbytes / HBM_BYTES_PER_S * 1e6
        flops = 6.0 * N * s.k * s.inter * s.d
        for variant in variants:
            want = reference(s, wts, fmt, sets[0], act_quant=True) if variant == "w8a8" else ref
            timed, err, error = time_variant(wts, fmt, variant, sets, want, args, cuda)
            default = timed.get(config_name(DEFAULT_CONFIG), float("nan"))
            best = min(timed, key=lambda c: timed[c]) if timed else "-"
            best_us = timed.get(best, float("nan"))
            kernels = (kernel_us(wts, fmt, variant, args.fma_block_m if variant == "fma"
                                 else None, sets, args.deterministic,
                                 frag_caching(args, variant))
                       if args.kernels and cuda and timed else {})
            rows.append({"case": f"{fmt} N={N}", "fmt": fmt, "N": N, "variant": variant or "-",
                         "kernels_us": kernels,
                         "E": s.E, "d": s.d, "I": s.inter, "k": s.k, "us": default,
                         "x_floor": default / floor_us, "tflops": flops / default / 1e6,
                         "best_config": best, "best_us": best_us,
                         "best_x_floor": best_us / floor_us, "best_tflops": flops / best_us / 1e6,
                         "configs_us": timed, "experts_hit": hit, "weight_bytes": wbytes,
                         "floor_us": floor_us, "gbps": wbytes / best_us / 1e3, "ref_us": ref_us,
                         "speedup_vs_ref": ref_us / best_us, "grouped_us": None,
                         "max_rel_err": err, "error": error})
    if cuda:
        times = grouped_us(wts, fmt, all_sets, args)
        for r in rows:
            r["grouped_us"] = times[list(args.tokens or s.tokens).index(r["N"])]
    return rows


TABLE = [("case", "{:<12}", "case"), ("variant", "{:>10}", "variant"), ("us", "{:>9.1f}", "us"),
         ("x_floor", "{:>7.2f}", "x_floor"), ("tflops", "{:>7.1f}", "TFLOP/s"),
         ("best_config", "{:>14}", "best bn/bk/w/st/pf"), ("best_us", "{:>9.1f}", "best us"),
         ("best_x_floor", "{:>7.2f}", "best xf"), ("best_tflops", "{:>7.1f}", "best TF"),
         ("ref_us", "{:>11.1f}", "ref us"), ("speedup_vs_ref", "{:>7.1f}", "x ref"),
         ("grouped", "{:>10}", "grouped us"), ("experts_hit", "{:>6.1f}", "hit"),
         ("floor_us", "{:>9.1f}", "floor us"), ("max_rel_err", "{:>9.1e}", "rel err")]


def main() -> None:
    p = base_parser(__doc__.splitlines()[0], "also time SWEEP[kind] and report the best")
    p.add_argument("--variants", default="",
                   help=f"comma-separated inner loops of fp4 / fp8, of {VARIANTS} (default: all; "
                        "under --cpu-smoke all but frag, whose emulated fragment MMAs are the "
                        "interpreter's slowest loop; tests/kernels/test_moe_frag.py checks it)")
    p.add_argument("--fmts", default=",".join(FMTS), help=f"comma-separated, of {FMTS}")
    p.add_argument("--frag-stream-weights", action="store_true",
                   help="variant frag: the weights' loads skip L1 (plan_moe's stream_weights)")
    p.add_argument("--tokens", default="", help="comma-separated N (default: the shape's)")
    p.add_argument("--fma-block-m", type=int, default=None, choices=(1, 2, 4),
                   help="BLOCK_M of the fma loop (default: the plan's, 1)")
    p.add_argument("--prefill-sweep", action="store_true",
                   help="time PREFILL_SWEEP[kind] (BLOCK_M 64 / 128 tiles; N >= 2048) instead "
                        "of SWEEP")
    p.add_argument("--deterministic", action="store_true",
                   help="the fixed-order epilogue the model runs (per-(token, k) rows, then the "
                        "combine) instead of the atomic one")
    p.add_argument("--kernels", action="store_true",
                   help="also each kernel's device us per call at the plan's default config "
                        "(torch.profiler; CUDA only), printed after the table")
    args = p.parse_args()
    args.variants = [v for v in args.variants.split(",") if v] or [
        v for v in VARIANTS if not (args.cpu_smoke and v == "frag")]
    args.tokens = [int(n) for n in args.tokens.split(",") if n]
    fmts = [f for f in args.fmts.split(",") if f]
    if not set(args.variants) <= set(VARIANTS) or not set(fmts) <= set(FMTS):
        raise SystemExit(f"--variants must be of {VARIANTS} and --fmts of {FMTS}")
    device = select_device(args.cpu_smoke)      # before the first `import triton` (done lazily)
    shape = SMOKE if args.cpu_smoke else FLASH
    if args.cpu_smoke:
        args.iters = min(args.iters, 2)
    header = record_header("moe_quant", device)
    rows = []
    for fmt in fmts:
        rows += bench_fmt(shape, fmt, args, device)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    table = [{**r, "grouped": "-" if r["grouped_us"] is None else f"{r['grouped_us']:.1f}"}
             for r in rows]
    print_table(table, TABLE)
    for r in rows:
        if r["error"]:
            print(f"{r['case']} {r['variant']}: {r['error']}")
        if r["kernels_us"]:
            print(f"{r['case']} {r['variant']} kernels us: "
                  + ", ".join(f"{k} {v:.1f}" for k, v in r["kernels_us"].items()))
    emit({**header, "variants": args.variants, "sweep": args.sweep,
          "frag_stream_weights": args.frag_stream_weights,
          "deterministic": args.deterministic,
          "prefill_sweep": args.prefill_sweep, "results": rows}, args.out)


if __name__ == "__main__":
    main()
