"""Benchmark: a CSA layer's two compressors in one launch (`triton_compress_pair`) vs two launches.

Geometry V4-Flash / flash-4l: the attention compressor (ratio 4, overlap, Dc 512) and the indexer's
(Dc 128), rope 64, bf16 entries, fp32 projections and rings; the plans, request sets and byte
counts are bench_compressor.py's (the same seed gives both compressors the same engine plan, which
the pair shares). Per case:
  pair     the fused kernel (one launch; 2 / 4 / 8 warps with --sweep)
  singles  `triton_compress_cached` twice, back to back, at each geometry's default configuration
  ref      the reference pair op (`compress_cached_pair`), graph-timed
Bytes = the two compressors' bytes (bench_compressor.count_bytes) less the second's index rows
(read once). GB/s and %HBM against the measured H200 copy rate 4.275 TB/s. Parity with the
reference asserted first.

    PYTHONPATH=src python3 benchmarks/kernels/bench_compressor_pair.py --sweep --out FILE.json
    PYTHONPATH=src python3 benchmarks/kernels/bench_compressor_pair.py --cpu-smoke
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable

import torch
from bench_common import (
    HBM_BYTES_PER_S,
    base_parser,
    bench_rows,
    emit,
    print_table,
    record_header,
    select_device,
)
from bench_common import time_graph_us as graph_us
from bench_compressor import (
    FLASH,
    MAX_SETS,
    MICRO,
    ROTATE_BYTES,
    Case,
    build_sets,
    count_bytes,
    time_cpu_us,
)

# (first, second, index, eps, cos, sin): compress_cached_pair's arguments
Pair = tuple[object, ...]


def cases(smoke: bool) -> list[tuple[Case, Case]]:
    attn, idx = (MICRO[0], MICRO[0]) if smoke else (FLASH[0], FLASH[1])
    batches = (1, 4) if smoke else (64, 256, 1024, 4096)
    decode = [(Case(attn, "decode", B, 1), Case(idx, "decode", B, 1)) for B in batches]
    n = 64 if smoke else 8192
    return decode + [(Case(attn, "prefill", 1, n), Case(idx, "prefill", 1, n))]


def pair_sets(a: Case, b: Case, n_sets: int, device: torch.device, seed: int) -> list[Pair]:
    from dsv4.kernels.ref.compressor import CompressTarget

    sets_a, idx_a = build_sets(a, n_sets, device, seed)
    sets_b, idx_b = build_sets(b, n_sets, device, seed)
    out = []
    for x, y, ia, ib in zip(sets_a, sets_b, idx_a, idx_b, strict=True):
        assert all(torch.equal(u, v)
                   for u, v in zip(ia[:6], ib[:6], strict=True)), "plans differ"  # type: ignore
        # raw gate scores, each compressor's ape added per slot by the op (the serving form)
        ta, tb = (CompressTarget(s[0], s[1], s[2], s[3], s[5], s[9],  # type: ignore[arg-type]
                                 torch.randn(c.geo.ratio, c.geo.width, device=device))
                  for s, c in ((x, a), (y, b)))
        out.append((ta, tb, x[4], x[6], x[7], x[8]))
    return out


def pair_bytes(a: Case, b: Case, p: Pair) -> dict[str, float]:
    first, second, index, _, cos, sin = p
    one = [(c.kv, c.score, c.ring_kv, c.ring_score, index, c.norm_weight, 0.0, cos, sin, c.out)  # type: ignore
           for c in (first, second)]
    ca, cb = count_bytes(a, one[0]), count_bytes(b, one[1])
    shared = cb["entries"] * a.geo.S * 18 + cb["T"] * 16  # the second's index rows: read once
    return {"bytes": ca["bytes"] + cb["bytes"] - shared, "entries": ca["entries"], "T": ca["T"]}


def written_rows(p: Pair) -> tuple[torch.Tensor, torch.Tensor]:
    """(ring rows, entry rows) the step writes (trash rows excluded), shared by both compressors."""
    first, index = p[0], p[2]
    rw = index.ring_write[index.ring_write != first.ring_kv.shape[0] - 1]      # type: ignore[attr-defined]
    ws = index.write_slot[index.write_slot != first.out.shape[0] - 1]          # type: ignore[attr-defined]
    return rw, ws


def touched(p: Pair) -> list[torch.Tensor]:
    rw, ws = written_rows(p)
    return [t[r].clone() for c in (p[0], p[1])
            for t, r in ((c.ring_kv, rw), (c.ring_score, rw), (c.out, ws))]


def restore(p: Pair, saved: list[torch.Tensor]) -> None:
    rw, ws = written_rows(p)
    for i, c in enumerate((p[0], p[1])):
        c.ring_kv[rw], c.ring_score[rw], c.out[ws] = saved[3 * i: 3 * i + 3]    # type: ignore[attr-defined]


def check_parity(fn: Callable[..., None], ref_fn: Callable[..., None], p: Pair) -> float:
    """Fused kernel vs reference on the rows the step writes (saved and restored in between)."""
    saved = touched(p)
    fn(*p)
    got = touched(p)
    restore(p, saved)
    ref_fn(*p)
    want = touched(p)
    err = 0.0
    for i in range(2):
        assert (torch.equal(got[3 * i], want[3 * i])
                and torch.equal(got[3 * i + 1], want[3 * i + 1])), "ring rows"
        w = want[3 * i + 2].float()
        if w.numel():
            err = max(err, ((got[3 * i + 2].float() - w).abs().max()
                            / w.abs().max().clamp(min=1e-6)).item())
    assert err <= 1e-2, f"parity failed: entries max |diff| / max |ref| = {err:.3e}"
    return err


def bench_case(a: Case, b: Case, args: argparse.Namespace,
               device: torch.device) -> dict[str, object]:
    from dsv4.kernels.ref.compressor import compress_cached_pair
    from dsv4.kernels.triton.compressor import triton_compress_cached
    from dsv4.kernels.triton.compressor_pair import triton_compress_pair

    cuda = device.type == "cuda"
    probe = pair_sets(a, b, 1, device, args.seed)
    per_set = pair_bytes(a, b, probe[0])
    n_sets = min(MAX_SETS, math.ceil(ROTATE_BYTES / per_set["bytes"])) if cuda else 1
    sets = pair_sets(a, b, n_sets, device, args.seed) if n_sets > 1 else probe

    def timed(fn: Callable[..., None]) -> float:
        # the interpreter's times mean nothing: one call
        return graph_us(fn, sets, args.iters, args.warmup) if cuda else time_cpu_us(fn, sets[0], 1)

    def singles(first: object, second: object, index: object, eps: float, cos: object,
                sin: object) -> None:
        for c in (first, second):
            triton_compress_cached(c.kv, c.score, c.ring_kv, c.ring_score, index,  # type: ignore
                                   c.norm_weight, eps,  # type: ignore[attr-defined]
                                   cos, sin, c.out, ape=c.ape)  # type: ignore[attr-defined]

    pair_us: dict[str, float] = {}
    err = 0.0
    for warps in ((4, 2, 8) if args.sweep else (4,)):
        def fn(*x: object, w: int = warps) -> None:
            triton_compress_pair(*x, fuse=True, num_warps=w)  # type: ignore[arg-type]
        err = max(err, check_parity(fn, compress_cached_pair, sets[0]))
        pair_us[f"{warps} warps"] = timed(fn)
    err = max(err, check_parity(singles, compress_cached_pair, sets[0]))
    singles_us = timed(singles)
    ref_us = graph_us(compress_cached_pair, sets[:8], max(3, args.iters // 5), 1) if cuda \
        else time_cpu_us(compress_cached_pair, sets[0], 2)
    best = min(pair_us, key=lambda k: pair_us[k])
    us, nbytes = pair_us[best], per_set["bytes"]
    return {"case": f"c4-pair {a.phase} " + (f"B={a.B}" if a.phase == "decode" else f"T={a.n}"),
            "phase": a.phase, "B": a.B, "n": a.n, "us": us, "us_default": pair_us["4 warps"],
            "best_config": best, "configs_us": pair_us, "singles_us": singles_us,
            "x_singles": singles_us / us, "ref_us": ref_us, "speedup_vs_ref": ref_us / us,
            "gbps": nbytes / us / 1e3, "pct_hbm": nbytes / (us * 1e-6) / HBM_BYTES_PER_S * 100,
            "singles_pct_hbm": nbytes / (singles_us * 1e-6) / HBM_BYTES_PER_S * 100,
            "floor_us": nbytes / HBM_BYTES_PER_S * 1e6, "max_rel_err": err,
            "request_sets": len(sets), **per_set}


TABLE = [("case", "{:<24}", "case"), ("bytes", "{:>10.3e}", "bytes"), ("us", "{:>8.2f}", "pair us"),
         ("singles_us", "{:>10.2f}", "2x1 us"), ("x_singles", "{:>6.2f}", "x 2x1"),
         ("floor_us", "{:>8.2f}", "floor"), ("ref_us", "{:>9.1f}", "ref us"),
         ("speedup_vs_ref", "{:>6.1f}", "x ref"), ("gbps", "{:>7.0f}", "GB/s"),
         ("pct_hbm", "{:>6.1f}", "%HBM"), ("singles_pct_hbm", "{:>7.1f}", "2x1 %"),
         ("best_config", "{:>8}", "config"), ("max_rel_err", "{:>8.1e}", "rel err")]


def main() -> None:
    args = base_parser(__doc__.splitlines()[0], "also time 2 and 8 warps").parse_args()
    device = select_device(args.cpu_smoke)      # before the first `import triton` (done lazily)
    if args.cpu_smoke:
        args.iters = min(args.iters, 3)
    rows = bench_rows(cases(args.cpu_smoke), lambda ab: bench_case(*ab, args, device), device)
    print_table(rows, TABLE)
    emit({**record_header("compressor_pair", device), "results": rows}, args.out)


if __name__ == "__main__":
    main()
