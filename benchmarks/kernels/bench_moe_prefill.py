"""Benchmark: prefill paths of the quantised routed experts against the op the engine runs.

At prefill every expert is hit and each reads its weights for many rows, so the codes' decode can
leave the GEMMs: decode the layer once, then run bf16 GEMMs. This measures whether that pays, per
fmt (fp4, fp8) and token count (V4-Flash experts: E 256, d 4096, I 2048, k 6, bf16 activations):
  kernel   the engine's op (`triton_routed_experts_quant_deterministic`) in its quantised loop
           (`dequant_chunk=0`: the codes decoded in registers, `moe_plan.py`'s default loop);
  chunksC  the same op through decoded chunks of C experts (`moe_dequant.py`: each chunk decoded
           on a side stream beside the bf16 loop's GEMMs on the previous one; --chunks, default
           16, 32, 64 and E: one chunk, no overlap; 3 under --cpu-smoke); "*" marks the plan's
           own choice at that N;
  dequant  the layer's w13 / w2 decoded into a bf16 scratch (`triton/dequant.py`), then the same
           op on the bf16 weights (fmt "bf16"); the decode is inside the time ("decode us" alone
           beside it);
  grouped  the same decode, then `ref/moe.py::routed_experts_grouped` (torch._grouped_mm: CUDA
           bf16 on Hopper; "-" where it cannot run).
Metrics: us (median of --iters eager calls, CUDA events; the scratch of ~13 GB makes CUDA-graph
sets pointless), TFLOP/s (6 N k I d / time), x kernel (the kernel's us / the path's), rel err
(norm-wise against the kernel's output; the kernel is held to the reference by
bench_moe_quant.py and tests/kernels/test_moe_quant.py). Prints a table, then ONE JSON line.

    PYTHONPATH=src python3 benchmarks/kernels/bench_moe_prefill.py --out FILE.json  # CUDA
    PYTHONPATH=src python3 benchmarks/kernels/bench_moe_prefill.py --cpu-smoke      # interpreter
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import time
from collections.abc import Callable
from typing import Any

import torch
from bench_common import base_parser, emit, print_table, record_header, select_device
from bench_common import time_eager_us as timed_us
from bench_moe_quant import FLASH, LIMIT, SMOKE, Shape, make_inputs, make_weights, norm_error

TOKENS = (2048, 4096, 8192)
SMOKE_TOKENS = (3,)


def _decoder(fmt: str, wts: tuple[Any, ...], inter: int
             ) -> tuple[Callable[[], None], torch.Tensor, torch.Tensor]:
    """(decode into the scratch, bf16 w13 scratch [E, 2I, d], bf16 w2 scratch [E, d, I])."""
    from dsv4.kernels.triton.dequant import triton_dequant_fp4_group, triton_dequant_fp8_block

    w13, s13, w2, s2 = wts
    fn = triton_dequant_fp4_group if fmt == "fp4" else triton_dequant_fp8_block
    if fmt == "fp8":
        assert inter % 128 == 0, "w13's FP8 blocks tile [2I, d] only when I is whole blocks"
    E = w13.shape[0]
    d = w2.shape[1]
    w13d = torch.empty(E, 2 * inter, d, dtype=torch.bfloat16, device=w13.device)
    w2d = torch.empty(E, d, inter, dtype=torch.bfloat16, device=w13.device)

    def decode() -> None:
        fn(w13, s13, torch.bfloat16, out=w13d)
        fn(w2, s2, torch.bfloat16, out=w2d)
    return decode, w13d, w2d


def bench_fmt(s: Shape, fmt: str, tokens: tuple[int, ...], args: argparse.Namespace,
              device: torch.device) -> list[dict[str, Any]]:
    smoke = [3]          # the interpreter: one chunk size, not a divisor of SMOKE's E
    chunk_sizes = [int(c) for c in args.chunks.split(",") if c] or (
        [16, 32, 64, s.E] if device.type == "cuda" else smoke)
    from dsv4.kernels.ref.moe import routed_experts_grouped
    from dsv4.kernels.triton.moe import triton_routed_experts_quant_deterministic as op
    from dsv4.kernels.triton.moe_plan import dequant_chunk

    cuda = device.type == "cuda"
    wts = make_weights(s, fmt, device, args.seed)
    decode, w13d, w2d = _decoder(fmt, wts, s.inter)
    t0 = time.perf_counter()
    decode()
    # the interpreter's one call is its time (meaningless there, the same as a rerun)
    decode_us = (timed_us(decode, args.iters, cuda, args.warmup) if cuda
                 else (time.perf_counter() - t0) * 1e6)
    rows = []
    for N in tokens:
        x, idx, rw = make_inputs(s, N, device, args.seed + N)
        flops = 6.0 * N * s.k * s.inter * s.d

        def chunks(chunk: int, x: torch.Tensor = x, idx: torch.Tensor = idx,
                   rw: torch.Tensor = rw) -> torch.Tensor:
            return op(x, *wts[:2], *wts[2:], idx, rw, LIMIT, fmt, dequant_chunk=chunk)

        # the decode inside the time; the interpreter's scratch holds the decode above (the
        # same bits: its times mean nothing, one decode there)
        def dequant(x: torch.Tensor = x, idx: torch.Tensor = idx,
                    rw: torch.Tensor = rw) -> torch.Tensor:
            if cuda:
                decode()
            return op(x, w13d, None, w2d, None, idx, rw, LIMIT, "bf16")

        def grouped(x: torch.Tensor = x, idx: torch.Tensor = idx,
                    rw: torch.Tensor = rw) -> torch.Tensor:
            if cuda:
                decode()
            return routed_experts_grouped(x, w13d[:, :s.inter], w2d, w13d[:, s.inter:], idx, rw,
                                          LIMIT)

        default = dequant_chunk(fmt, device, N * s.k, s.E, pinned=False)
        paths: list[tuple[str, Callable[[], torch.Tensor]]] = [
            ("kernel", functools.partial(chunks, 0))]
        paths += [(f"chunks{c}" + ("*" if c == default else ""), functools.partial(chunks, c))
                  for c in chunk_sizes if fmt == "fp4" or s.inter % 128 == 0]
        paths += [("dequant", dequant), ("grouped", grouped)]
        t0 = time.perf_counter()
        want = chunks(0)
        want_us = (time.perf_counter() - t0) * 1e6
        for name, fn in paths:
            try:
                t0 = time.perf_counter()
                # the interpreter runs the kernel path once: `want` is its output
                err = norm_error(fn() if cuda or name != "kernel" else want, want)
                # the interpreter's one call is its time (meaningless there, the same as a rerun)
                us = (timed_us(fn, args.iters, cuda, args.warmup) if cuda
                      else want_us if name == "kernel" else (time.perf_counter() - t0) * 1e6)
            except (RuntimeError, NotImplementedError) as exc:  # grouped off Hopper
                rows.append({"case": f"{fmt} N={N}", "fmt": fmt, "N": N, "path": name,
                             "us": None, "error": str(exc).splitlines()[0]})
                continue
            rows.append({"case": f"{fmt} N={N}", "fmt": fmt, "N": N, "path": name, "us": us,
                         "tflops": flops / us / 1e6, "decode_us": decode_us, "rel_err": err,
                         "error": ""})
        base = rows[-len(paths)]["us"]
        for r in rows[-len(paths):]:
            r["x_kernel"] = base / r["us"] if r["us"] and base else None
    return rows


TABLE = [("case", "{:<12}", "case"), ("path", "{:>8}", "path"), ("us_s", "{:>10}", "us"),
         ("tf_s", "{:>8}", "TFLOP/s"), ("xk_s", "{:>8}", "x kernel"),
         ("decode_s", "{:>10}", "decode us"), ("err_s", "{:>9}", "rel err")]


def _cell(v: float | None, fmt: str) -> str:
    return "-" if v is None else fmt.format(v)


def main() -> None:
    p = base_parser(__doc__.splitlines()[0], "(no sweep)")
    p.add_argument("--fmts", default="fp4,fp8", help="comma-separated, of fp4, fp8")
    p.add_argument("--tokens", default="", help="comma-separated N (default 2048,4096,8192)")
    p.add_argument("--chunks", default="", help="comma-separated experts per decoded chunk "
                   "(default 16,32,64,E)")
    args = p.parse_args()
    device = select_device(args.cpu_smoke)      # before the first `import triton` (done lazily)
    shape = SMOKE if args.cpu_smoke else FLASH
    tokens = tuple(int(n) for n in args.tokens.split(",") if n) or (
        SMOKE_TOKENS if args.cpu_smoke else TOKENS)
    args.iters, args.warmup = min(args.iters, 10), min(args.warmup, 2)
    header = record_header("moe_prefill", device)
    rows: list[dict[str, Any]] = []
    for fmt in [f for f in args.fmts.split(",") if f]:
        if fmt not in ("fp4", "fp8"):
            raise SystemExit(f"--fmts: {fmt!r}; allowed: fp4, fp8")
        rows += bench_fmt(shape, fmt, tokens, args, device)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    print_table([{**r, "us_s": _cell(r["us"], "{:.1f}"), "tf_s": _cell(r.get("tflops"), "{:.1f}"),
                  "xk_s": _cell(r.get("x_kernel"), "{:.2f}"),
                  "decode_s": _cell(r.get("decode_us"), "{:.1f}"),
                  "err_s": _cell(r.get("rel_err"), "{:.1e}")} for r in rows], TABLE)
    for r in rows:
        if r["error"]:
            print(f"{r['case']} {r['path']}: {r['error']}")
    emit({**header, "shape": dataclasses.asdict(shape),
          "results": rows}, args.out)


if __name__ == "__main__":
    main()
