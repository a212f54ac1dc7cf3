"""Benchmark: weight-only quantised routed experts (`triton_routed_experts_quant`) vs the reference.

Cases (V4-Flash routed experts: E = 256, d = 4096, I = 2048, k = 6, bf16 activations, limit 10):
  N in {1, 8, 32, 128, 512, 2048} tokens x fmt in {fp4 (checkpoint layout), fp8 (128x128 blocks),
  bf16}.
Metrics:
  weight bytes = distinct experts hit x one expert's bytes (w1, w3, w2 and their scales): what the
      kernel has to read at least once (averaged over the input sets); floor us = weight bytes /
      4.275 TB/s; x_floor = time / floor (decode is weight-bound, so x_floor is the number to drive
      towards 1);
  TFLOP/s = 6 N k I d / time (three GEMMs of N k rows);
  x ref = reference time / kernel time; the reference is `routed_experts_quant` (dequantises every
      expert, then one dense matmul per expert with a host sync), timed eagerly; "grouped us" (CUDA)
      is `routed_experts_grouped` (torch._grouped_mm) on weights dequantised once to bf16, the
      non-quantised device-grouped baseline (same weight bytes as fmt bf16).
Timing: parity with the reference is asserted first; then the median of CUDA-event-timed CUDA-graph
replays, cycling through 4 routings (different experts hit) after warm-up.
Prints a table, then ONE JSON line.

    PYTHONPATH=src python3 benchmarks/kernels/bench_moe_quant.py              # CUDA
    PYTHONPATH=src python3 benchmarks/kernels/bench_moe_quant.py --sweep      # + tile/warp/stage
    PYTHONPATH=src python3 benchmarks/kernels/bench_moe_quant.py --cpu-smoke  # interpreter, tiny
"""

from __future__ import annotations

import argparse
import statistics
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
# (block_n, block_k, num_warps, num_stages): the wrapper's defaults
DEFAULT_CONFIG = (64, 64, 4, 3)
SWEEP_CONFIGS = [(128, 64, 4, 3), (64, 128, 4, 3), (128, 128, 8, 3), (64, 64, 4, 4),
                 (32, 128, 4, 3)]
FMTS = ("fp4", "fp8", "bf16")

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
SMOKE = Shape(8, 128, 128, 2, (1, 5, 33))


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


def bench_fmt(s: Shape, fmt: str, args: argparse.Namespace,
              device: torch.device) -> list[dict[str, Any]]:
    from dsv4.kernels.ref.moe import routed_experts_quant
    from dsv4.kernels.triton.moe import triton_routed_experts_quant

    cuda = device.type == "cuda"
    wts = make_weights(s, fmt, device, args.seed)
    per_expert = expert_bytes(wts)
    rows, all_sets = [], []
    for N in s.tokens:
        all_sets.append(sets := [make_inputs(s, N, device, args.seed + i)
                                 for i in range(N_SETS if cuda else 1)])
        # NOTE: host sync, untimed
        hit = statistics.mean(int(idx.unique().numel()) for _, idx, _ in sets)
        x0, idx0, rw0 = sets[0]
        # parity reference: fp32 x, the experts hit only (same result, less memory)
        hit_ids = idx0.unique()
        sub = [t[hit_ids] if t is not None else None for t in wts]
        ref = routed_experts_quant(x0.float(), sub[0], sub[1], sub[2], sub[3],  # type: ignore[arg-type]
                                   torch.searchsorted(hit_ids, idx0), rw0, LIMIT, fmt)
        timed: dict[str, float] = {}
        err = 0.0
        for bn, bk, nw, ns in [DEFAULT_CONFIG] + (SWEEP_CONFIGS if args.sweep else []):
            def fn(x: torch.Tensor, idx: torch.Tensor, rw: torch.Tensor, bn: int = bn, bk: int = bk,
                   nw: int = nw, ns: int = ns) -> torch.Tensor:
                return triton_routed_experts_quant(x, wts[0], wts[1], wts[2], wts[3], idx, rw,
                                                   LIMIT, fmt, block_n=bn, block_k=bk,
                                                   num_warps=nw, num_stages=ns)
            err = max(err, rel_error(fn(*sets[0]), ref))
            assert err <= 1e-2, f"{fmt} N={N} {bn}/{bk}/{nw}/{ns}: parity failed, rel err {err:.3e}"
            key = f"{bn}/{bk}/{nw}/{ns}"
            timed[key] = time_graph_us(fn, sets, args.iters, args.warmup) if cuda else \
                time_eager_us(lambda fn=fn: fn(*sets[0]), args.iters, cuda)
        best = min(timed, key=lambda c: timed[c])
        us = timed[best]
        ref_us = time_eager_us(partial(routed_experts_quant, x0, wts[0], wts[1], wts[2], wts[3],
                                       idx0, rw0, LIMIT, fmt),
                               max(2, args.iters // 20), cuda)
        wbytes = hit * per_expert
        flops = 6.0 * N * s.k * s.inter * s.d
        rows.append({"case": f"{fmt} N={N}", "fmt": fmt, "N": N, "E": s.E, "d": s.d, "I": s.inter,
                     "k": s.k, "us": us, "us_default": timed["/".join(map(str, DEFAULT_CONFIG))],
                     "best_config": best, "configs_us": timed, "experts_hit": hit,
                     "weight_bytes": wbytes, "floor_us": wbytes / HBM_BYTES_PER_S * 1e6,
                     "x_floor": us / (wbytes / HBM_BYTES_PER_S * 1e6),
                     "gbps": wbytes / us / 1e3, "tflops": flops / us / 1e6, "ref_us": ref_us,
                     "speedup_vs_ref": ref_us / us, "grouped_us": None, "max_rel_err": err})
    if cuda:
        for r, g_us in zip(rows, grouped_us(wts, fmt, all_sets, args), strict=True):
            r["grouped_us"] = g_us
    return rows


TABLE = [("case", "{:<12}", "case"), ("us", "{:>9.1f}", "us"), ("ref_us", "{:>11.1f}", "ref us"),
         ("speedup_vs_ref", "{:>7.1f}", "x ref"),
         ("grouped", "{:>10}", "grouped us"), ("experts_hit", "{:>6.1f}", "hit"),
         ("weight_bytes", "{:>12.3e}", "weight B"), ("floor_us", "{:>9.1f}", "floor us"),
         ("x_floor", "{:>7.2f}", "x_floor"), ("gbps", "{:>7.0f}", "GB/s"),
         ("tflops", "{:>7.1f}", "TFLOP/s"),
         ("best_config", "{:>12}", "bn/bk/w/st"), ("max_rel_err", "{:>9.1e}", "rel err")]


def main() -> None:
    args = base_parser(__doc__.splitlines()[0],
                       "also time SWEEP_CONFIGS and report the best").parse_args()
    device = select_device(args.cpu_smoke)      # before the first `import triton` (done lazily)
    shape = SMOKE if args.cpu_smoke else FLASH
    if args.cpu_smoke:
        args.iters = min(args.iters, 2)
    header = record_header("moe_quant", device)
    rows = [r for fmt in FMTS for r in bench_fmt(shape, fmt, args, device)]
    table = [{**r, "grouped": "-" if r["grouped_us"] is None else f"{r['grouped_us']:.1f}"}
             for r in rows]
    print_table(table, TABLE)
    emit({**header, "results": rows}, args.out)


if __name__ == "__main__":
    main()
