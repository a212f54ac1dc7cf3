"""Benchmark: fused mHC (`triton_mhc_pre`, `_post`, `_head`, `_post_pre`) vs references, HBM.

Shapes: V4-Flash, n = 4 streams of d = 4096, bf16 x / f / h, fp32 fn / scale / base / post / comb,
20 Sinkhorn iterations; T in {1, 8, 32, 128, 1024, 8192} tokens (decode batch sizes up to a
prefill chunk).
Bytes each op must move (the floor; counted from the shapes):
  pre    x read (T n d 2) + fn read (24 n d 4 = 1.5 MB) + h written (T d 2) + post, comb written
         (T (n + n²) 4)
  post   x read (T n d 2) + f read (T d 2) + post, comb read + x' written (T n d 2)
  head   x read + fn_head read (n n d 4) + y written (T d 2)
  post_pre  post's bytes + fn read + h written + post', comb' written (X' is written once and
         read back by the finish: not in the floor)
GB/s and %HBM are those bytes over the time, against the measured H200 copy bandwidth 4.275 TB/s.
NOTE: pre and head read x twice (projection, then the weighted sum; kernels/triton/mhc.py), so at
large T their %HBM tops out near 40/72 of the floor's; at small T they are bound by reading fn
(pre) and by launch latency.
Timing: parity with the reference first (h, x', y to 1e-2 relative; post / comb to 1e-4); then the
median of CUDA-event-timed CUDA-graph replays, each graph cycling through enough input sets
(distinct x AND distinct fn, as the 86 mHC sites of a forward are: fn stays cold in L2) to exceed
L2. The reference (~25 small torch ops plus 2 per Sinkhorn iteration) is timed the same way
(graph: its launch gaps shrink to the GPU's) and eagerly (CUDA events, one call); "x ref" is the
speed-up over the graph-replayed reference.
One launch vs two (split-K pre / head, `kernels/triton/mhc_split.py`): at T in LAUNCH_T (and in
--cpu-smoke) every pre / head case also times `one_launch=True`, `one_launch=False` (today's
two-launch plan), `one_launch=False, d_spans=1` (the two-launch form with the one-launch form's
finish tiles: the same bits) and `one_launch=False, weights_apart=False` (the finish without its
post / comb programs, `mhc_split.plan_apart`: the same bits); columns "1-launch" / "2-launch" /
"together", all in "configs_us"; "path" ends in 1L / 2L (the launches of the best config).
Post + pre (`mhc_post_pre.py`, T in {1, 2, 8, 32}): every case also times `fuse=True`,
`fuse=False` (the post kernel, then the two pre launches) and `fuse=True, weights_apart=False`
(column "together"); `--sweep` adds BLOCK_D 32 / 64 / 128.
Its parity bound on the fp32 outputs is 1e-2 (post' / comb' come from a bf16 X' that may sit a
rounding away from the reference's; tests/kernels/test_mhc_post_pre.py checks them at fp32
accuracy against the reference pre on the kernel's X').
Prints a table, then ONE JSON line (also written to --out).

    PYTHONPATH=src python3 benchmarks/kernels/bench_mhc.py --out FILE.json     # CUDA
    PYTHONPATH=src python3 benchmarks/kernels/bench_mhc.py --sweep             # + tile/split/warps
    PYTHONPATH=src python3 benchmarks/kernels/bench_mhc.py --cpu-smoke         # interpreter, tiny
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from collections.abc import Callable
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
    time_graph_us,
)

ROTATE_BYTES = 256 << 20         # >= 5x the H200's 50 MB L2: input sets cycled inside one graph
MAX_SETS = 64
ITERS, HC_EPS, NORM_EPS = 20, 1e-6, 1e-6
PRE_SWEEP: list[dict[str, int]] = [
    {"block_t": 16}, {"block_t": 32}, {"block_t": 128, "num_warps": 8}, {"block_k": 128},
    {"num_warps": 8}, {"num_stages": 4}, {"splits": 1}, {"block_t": 32, "splits": 1},
    {"splits": 32}, {"splits": 128}]
LAUNCH_T = (1, 2, 8, 32)        # pre / head: one launch vs two launches timed at these T
LAUNCH_KNOBS: list[dict[str, int]] = [{"one_launch": True}, {"one_launch": False},
                                      {"one_launch": False, "d_spans": 1}]
APART_KNOBS: list[dict[str, int]] = [{"one_launch": False, "weights_apart": False}]  # pre only
POST_PRE_KNOBS: list[dict[str, int]] = [{"fuse": True}, {"fuse": False},
                                        {"fuse": True, "weights_apart": False}]
POST_PRE_SWEEP: list[dict[str, int]] = [{"fuse": True, "block_d": bd} for bd in (32, 64, 128)]
POST_SWEEP: list[dict[str, int]] = [{"block_d": 256}, {"block_d": 512}, {"block_d": 1024},
                                    {"block_d": 2048, "num_warps": 8},
                                    {"block_d": 1024, "num_warps": 8}]
Inputs = tuple[torch.Tensor, ...]


@dataclass(frozen=True)
class Case:
    op: str               # "pre" | "post" | "head" | "post_pre"
    T: int
    n: int = 4
    d: int = 4096

    @property
    def name(self) -> str:
        return f"{self.op} T={self.T}"


def cuda_cases() -> list[Case]:
    return [*(Case(op, T) for op in ("pre", "post", "head")
              for T in (1, 2, 8, 32, 128, 1024, 8192) if T != 2 or op != "post"),
            *(Case("post_pre", T) for T in (1, 2, 8, 32))]


def smoke_cases() -> list[Case]:
    return [Case(op, T, 4, 64) for op in ("pre", "post", "head", "post_pre") for T in (1, 8, 64)]


def make_set(case: Case, device: torch.device, seed: int) -> Inputs:
    """One input set in the op's argument order (pre / head: x, fn, scale, base; post: f, x, post,
    comb; post_pre: both)."""
    g = torch.Generator(device).manual_seed(seed)
    n, d, T = case.n, case.d, case.T
    x = torch.randn(T, n, d, generator=g, device=device).bfloat16()
    if case.op in ("post", "post_pre"):
        f = torch.randn(T, d, generator=g, device=device).bfloat16()
        post = 2 * torch.rand(T, n, generator=g, device=device)
        comb = torch.softmax(torch.randn(T, n, n, generator=g, device=device), dim=-2).contiguous()
        if case.op == "post":
            return f, x, post, comb
        return f, x, post, comb, *make_set(Case("pre", T, n, d), device, seed + 1)[1:]
    rows = (2 + n) * n if case.op == "pre" else n
    fn = torch.randn(rows, n * d, generator=g, device=device) * 2 * (n * d) ** -0.5
    base = torch.randn(rows, generator=g, device=device) * 0.5
    scale = 0.5 + torch.rand(3 if case.op == "pre" else 1, generator=g, device=device)
    return x, fn, scale, base


def count_bytes(case: Case) -> dict[str, int]:
    """The floor's bytes (module docstring)."""
    n, d, T = case.n, case.d, case.T
    x, row = T * n * d * 2, T * d * 2
    if case.op == "post":
        parts = {"bytes_x": x, "bytes_f": row, "bytes_weights": T * (n + n * n) * 4, "bytes_out": x}
    elif case.op == "post_pre":
        parts = {"bytes_x": x, "bytes_f": row, "bytes_fn": (2 + n) * n * n * d * 4,
                 "bytes_weights": 2 * T * (n + n * n) * 4, "bytes_out": x + row}
    else:
        rows = (2 + n) * n if case.op == "pre" else n
        weights = T * (n + n * n) * 4 if case.op == "pre" else 0
        parts = {"bytes_x": x, "bytes_fn": rows * n * d * 4, "bytes_weights": weights,
                 "bytes_out": row}
    return {**parts, "bytes": sum(parts.values())}


def ops(case: Case, knobs: dict[str, int]) -> tuple[Callable[..., Any], Callable[..., Any]]:
    """(kernel, reference) as functions of an input set."""
    from dsv4.kernels.ref.mhc import mhc_head, mhc_post, mhc_post_pre, mhc_pre
    from dsv4.kernels.triton.mhc import triton_mhc_head, triton_mhc_pre
    from dsv4.kernels.triton.mhc_post import triton_mhc_post
    from dsv4.kernels.triton.mhc_post_pre import triton_mhc_post_pre

    n = case.n
    if case.op == "pre":
        return (lambda x, fn, s, b: triton_mhc_pre(x, fn, s, b, n, ITERS, HC_EPS, NORM_EPS,
                                                   **knobs),
                lambda x, fn, s, b: mhc_pre(x, fn, s, b, n, ITERS, HC_EPS, NORM_EPS))
    if case.op == "head":
        return (lambda x, fn, s, b: triton_mhc_head(x, fn, s, b, HC_EPS, NORM_EPS, **knobs),
                lambda x, fn, s, b: mhc_head(x, fn, s, b, HC_EPS, NORM_EPS))
    if case.op == "post_pre":
        return (lambda *a: triton_mhc_post_pre(*a, n, ITERS, HC_EPS, NORM_EPS, **knobs),
                lambda *a: mhc_post_pre(*a, n, ITERS, HC_EPS, NORM_EPS))
    return lambda *a: triton_mhc_post(*a, **knobs), mhc_post


def check_parity(fn: Callable[..., Any], ref_fn: Callable[..., Any], inputs: Inputs,
                 chain: bool = False) -> float:
    """Max relative error over the outputs (max |diff| / max |ref| each); asserts the bounds
    (`chain`: post_pre, 1e-2 on every output, the module docstring)."""
    got, want = fn(*inputs), ref_fn(*inputs)
    got, want = (got, want) if isinstance(got, tuple) else ((got,), (want,))
    worst = 0.0
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        err = ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp(min=1e-6)).item()
        limit = 1e-2 if a.dtype == torch.bfloat16 or chain else 1e-4
        assert err <= limit, \
            f"parity failed on output {i}: max |diff| / max |ref| = {err:.3e} > {limit:.0e}"
        worst = max(worst, err)
    return worst


def time_eager_us(fn: Callable[..., Any], sets: list[Inputs], iters: int, cuda: bool) -> float:
    """Median of single eager calls (CUDA events on CUDA, perf_counter on CPU), cycling through
    `sets`."""
    fn(*sets[0])
    times = []
    for i in range(iters):
        s = sets[i % len(sets)]
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn(*s)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e3)
        else:
            t0 = time.perf_counter()
            fn(*s)
            times.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(times)


def path_of(case: Case, knobs: dict[str, int], device: torch.device) -> str:
    if case.op == "post_pre":
        from dsv4.kernels.triton.mhc_post_pre import POST_PRE_MAX_T, plan_post_pre

        fused = knobs.get("fuse", case.T <= POST_PRE_MAX_T)
        bd = knobs.get("block_d") or plan_post_pre(case.T, case.d)
        return f"fused bd{bd}" if fused else "post + pre"
    if case.op == "post":
        from dsv4.kernels.triton.mhc_post import default_post_block_d

        return f"bd{knobs.get('block_d') or default_post_block_d(case.T, case.d, device)}"
    from dsv4.kernels.triton.mhc import plan_one_launch, plan_pre

    bt, splits, _ = plan_pre(case.T, case.n * case.d, device, knobs.get("block_t"),
                             knobs.get("block_k", 64), knobs.get("splits"))
    if splits == 1:
        return f"bt{bt} fused"
    np_ = max(4, 1 << (case.n - 1).bit_length())
    one = plan_one_launch(case.T, case.d, np_, splits, knobs.get("num_warps", 4), device,
                          one_launch=None if "one_launch" not in knobs else
                          bool(knobs["one_launch"])) is not None
    return f"bt{bt} split{splits}" + (" 1L" if one else " 2L")


def bench_case(case: Case, args: argparse.Namespace, device: torch.device) -> dict[str, object]:
    cuda = device.type == "cuda"
    parts = count_bytes(case)
    per_set = parts["bytes"]
    n_sets = max(1, min(MAX_SETS, math.ceil(ROTATE_BYTES / per_set))) if cuda else 1
    sets = [make_set(case, device, args.seed + i) for i in range(n_sets)]
    sweep = {"post": POST_SWEEP, "post_pre": POST_PRE_SWEEP}.get(case.op, PRE_SWEEP) \
        if args.sweep else []
    if case.op == "post_pre":
        sweep = [*POST_PRE_KNOBS, *sweep]
    elif case.op != "post" and (case.T in LAUNCH_T or not cuda):
        sweep = [*LAUNCH_KNOBS, *(APART_KNOBS if case.op == "pre" else []), *sweep]
    timed: dict[str, float] = {}
    paths: dict[str, str] = {}
    err = 0.0
    for knobs in [{}, *sweep]:
        fn, ref_fn = ops(case, knobs)
        key = ",".join(f"{k}={v}" for k, v in knobs.items()) or "default"
        t0 = time.perf_counter()
        err = max(err, check_parity(fn, ref_fn, sets[0], case.op == "post_pre"))
        # the interpreter's times mean nothing: the parity call's wall clock stands in
        timed[key] = (time_graph_us(fn, sets, args.iters, args.warmup) if cuda
                      else (time.perf_counter() - t0) * 1e6)
        paths[key] = path_of(case, knobs, device)
    best = min(timed, key=lambda k: timed[k])
    us = timed[best]
    _, ref_fn = ops(case, {})
    ref_sets = sets[:max(1, min(len(sets), 8))]
    ref_us = (time_graph_us(ref_fn, ref_sets, max(3, args.iters // 5), 1) if cuda
              else time_eager_us(ref_fn, sets, 2, cuda))
    ref_eager_us = time_eager_us(ref_fn, ref_sets, max(3, args.iters // 5), cuda)
    return {"case": case.name, "op": case.op, "T": case.T, "n": case.n, "d": case.d, "us": us,
            "us_default": timed["default"],
            "us_one_launch": timed.get("one_launch=True", math.nan),
            "us_two_launch": timed.get("one_launch=False", math.nan),
            "us_fused": timed.get("fuse=True", math.nan),
            "us_unfused": timed.get("fuse=False", math.nan),
            "us_weights_together": timed.get("one_launch=False,weights_apart=False",
                                             timed.get("fuse=True,weights_apart=False", math.nan)),
            "best_config": best, "path": paths[best],
            "configs_us": timed,
            "ref_us": ref_us, "ref_eager_us": ref_eager_us, "speedup_vs_ref": ref_us / us,
            "speedup_vs_ref_eager": ref_eager_us / us, "gbps": per_set / us / 1e3,
            "pct_hbm": per_set / (us * 1e-6) / HBM_BYTES_PER_S * 100,
            "floor_us": per_set / HBM_BYTES_PER_S * 1e6,
            "max_rel_err": err, "input_sets": n_sets, **parts}


TABLE = [("case", "{:<12}", "case"), ("path", "{:>13}", "path"), ("bytes", "{:>10.3e}", "bytes"),
         ("floor_us", "{:>8.2f}", "floor us"), ("us", "{:>8.2f}", "us"),
         ("us_one_launch", "{:>8.2f}", "1-launch"), ("us_two_launch", "{:>8.2f}", "2-launch"),
         ("us_fused", "{:>8.2f}", "fused"), ("us_unfused", "{:>8.2f}", "unfused"),
         ("us_weights_together", "{:>8.2f}", "together"),
         ("ref_us", "{:>9.1f}", "ref us"), ("ref_eager_us", "{:>9.1f}", "eager us"),
         ("speedup_vs_ref", "{:>7.1f}", "x ref"), ("gbps", "{:>7.0f}", "GB/s"),
         ("pct_hbm", "{:>6.1f}", "%HBM"), ("best_config", "{:>22}", "config"),
         ("max_rel_err", "{:>8.1e}", "rel err")]


def parse_args() -> argparse.Namespace:
    p = base_parser(__doc__.splitlines()[0], "also time PRE_SWEEP / POST_SWEEP and report the best")
    p.add_argument("--ops", default="pre,post,head",
                   help="comma-separated subset of pre,post,head,post_pre")
    return p.parse_args()


def main() -> None:
    args = parse_args()
    device = select_device(args.cpu_smoke)      # before the first `import triton` (done lazily)
    cases = smoke_cases() if args.cpu_smoke else cuda_cases()

    wanted = set(args.ops.split(","))
    if unknown := wanted - {"pre", "post", "head", "post_pre"}:
        raise SystemExit(f"--ops: unknown {sorted(unknown)}; allowed: pre, post, head, post_pre")
    rows = bench_rows((c for c in cases if c.op in wanted),
                      lambda case: bench_case(case, args, device), device)
    print_table(rows, TABLE)
    emit({**record_header("mhc", device), "sinkhorn_iters": ITERS, "results": rows}, args.out)


if __name__ == "__main__":
    main()
