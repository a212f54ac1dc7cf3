"""Benchmark: lightning-indexer scores (`triton_index_scores`) vs the reference and the HBM floor.

Cases (V4-Flash indexer: Ih = 64, Id = 128, bf16 q and keys, fp32 weights):
  decode   T in {1, 64, 256} x V in {65,536, 262,144}: one query per request, so every query
           gathers its own V keys (distinct pool slots, permuted within the request);
  prefill  T = 2048, V = 8192: one request, the last 2048 tokens of a 32K context; all rows share
           one slot order and see a causal prefix of it (7680..8192 entries).

`--keys fp8`: the key pool as FP8 codes with a power-of-two scale per key
(`kernels/ref/index_keys.py`): 128 + 4 bytes a key, against 256 in bf16; `--keys fp8q`: the
queries are FP8 too (codes and a scale per head, as `rope_fp8` writes them in the engine:
`q_scales`), so the dot runs on FP8 tensor cores.

Floors (H200 copy 4.275 TB/s and bf16 matmul 680 TFLOP/s, docs/DESIGN.md §3):
  per-query-gather bytes = valid candidates x Id x 2 (keys) + q + weights + candidates (int64) +
      scores (fp32); the kernel's own traffic when no two queries share keys; "GB/s" and "%HBM" are
      this over the time (for prefill the shared keys come from L2, so it can exceed HBM);
  read-once bytes = each DISTINCT key once + q + weights + candidates + scores: the "read keys and
      queries once" floor; x_once = time / (read-once bytes / 4.275 TB/s). Decode: equal to
      per-query-gather (target <= 1.5x, issue 6). Prefill: far below the FLOP floor (2 Ih Id per
      pair), so x_roof = time / max(memory floor, FLOP floor) is the meaningful ratio there.
  copy us = a device copy (`copy_`) moving the read-once bytes (half read, half written), timed the
      same way; x_copy = time / copy us: what one launch of this size gets from HBM, which small
      steps (T = 1, ~17 MB) cannot get to 4.275 TB/s.
Timing: parity with the reference is asserted first; then the median of CUDA-event-timed CUDA-graph
replays (each graph holds several calls, cycling through enough input copies to defeat L2 reuse
across calls) after warm-up. The reference (which materialises [T, V, Id] fp32) is timed eagerly
on as many rows as fit a memory budget and scaled to T when it cannot take them all ("ref rows"
column).
Prints a table, then ONE JSON line.

    PYTHONPATH=src python3 benchmarks/kernels/bench_index_scores.py  # CUDA
    PYTHONPATH=src python3 benchmarks/kernels/bench_index_scores.py --sweep  # + tile/warp/stage
    PYTHONPATH=src python3 benchmarks/kernels/bench_index_scores.py --keys fp8 --only "T=1 "
    PYTHONPATH=src python3 benchmarks/kernels/bench_index_scores.py --cpu-smoke  # interpreter
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch
from bench_common import (
    HBM_BYTES_PER_S,
    base_parser,
    bench_rows,
    print_table,
    record_header,
    select_device,
    time_eager_us,
    time_graph_us,
)

BF16_FLOP_PER_S = 680e12         # measured bf16 matmul on the H200
ROTATE_BYTES = 256 << 20         # >= 5x the H200's 50 MB L2: input copies cycled inside one graph
REF_BUDGET_BYTES = 8 << 30       # the reference's [rows, V, Id] fp32 gather + [rows, Ih, V] dots
DEFAULT_CONFIG = (64, 4, 2)      # (block_v, num_warps, num_stages): the wrapper's defaults
FP8_Q_DEFAULT_CONFIG = (64, 4, 3)    # ... with FP8 queries (`--keys fp8q`)
SWEEP_CONFIGS = [(32, 4, 3), (64, 4, 2), (64, 4, 4), (64, 8, 3), (128, 4, 2), (128, 4, 3),
                 (128, 4, 4), (128, 8, 2), (128, 8, 3), (256, 8, 2), (256, 8, 3)]

# (q, weights, keys, candidates), then with FP8 keys (`--keys fp8`) their scales
Inputs = tuple[torch.Tensor, ...]


@dataclass(frozen=True)
class Case:
    name: str
    T: int
    V: int
    shared: bool          # all rows are one request (prefill) vs one request per row (decode)
    Ih: int = 64
    Id: int = 128


def cuda_cases() -> list[Case]:
    short = [Case(f"decode T=1 V={V}", 1, V, False) for V in (1024, 8192)]  # 4K, 32K context
    decode = [Case(f"decode T={T} V={V}", T, V, False)
              for T in (1, 64, 256) for V in (65536, 262144)]
    return short + decode + [Case("prefill T=2048 V=8192", 2048, 8192, True)]


def smoke_cases() -> list[Case]:
    return [Case("decode T=1 V=64", 1, 64, False, 8, 32),
            Case("decode T=4 V=100", 4, 100, False, 8, 32),
            Case("prefill T=8 V=64", 8, 64, True, 8, 32)]


def make_inputs(case: Case, dtype: torch.dtype, device: torch.device, seed: int,
                keys_format: str = "model") -> Inputs:
    """(q, weights, keys, candidates) as the engine builds them (see the module docstring);
    `keys_format` "fp8" / "fp8q": the keys as FP8 codes, their scales appended
    (`kernels/ref/index_keys.py`); "fp8q": q as FP8 codes too, its [T, Ih] scales last."""
    g = torch.Generator(device).manual_seed(seed)
    T, V, Ih, Id = case.T, case.V, case.Ih, case.Id
    q = torch.randn(T, Ih, Id, generator=g, device=device, dtype=dtype)
    weights = torch.randn(T, Ih, generator=g, device=device) * (Ih * Id) ** -0.5
    if case.shared:
        keys = torch.randn(V, Id, generator=g, device=device, dtype=dtype)
        order = torch.randperm(V, generator=g, device=device)
        pos = 4 * V - T + torch.arange(T, device=device)  # causal: entry i < (pos+1)//4
        visible = torch.arange(V, device=device)[None, :] < ((pos + 1) // 4)[:, None]
        candidates = torch.where(visible, order.expand(T, V), -1)
    else:
        keys = torch.randn(T * V, Id, generator=g, device=device, dtype=dtype)
        # each request: its own V slots
        perm = torch.rand(T, V, generator=g, device=device).argsort(dim=1)
        candidates = perm + V * torch.arange(T, device=device)[:, None]
    if keys_format != "model":
        from dsv4.kernels.ref.index_keys import quantize_index_keys
        parts = [quantize_index_keys(k) for k in keys.split(1 << 20)]  # bounded fp32 temporaries
        codes, scales = torch.cat([c for c, _ in parts]), torch.cat([s for _, s in parts])
        if keys_format == "fp8q":
            qc, qs = quantize_index_keys(q)
            return qc, weights, codes, candidates.contiguous(), scales, qs
        return q, weights, codes, candidates.contiguous(), scales
    return q, weights, keys, candidates.contiguous()


def floors(case: Case, inputs: Inputs) -> dict[str, float]:
    q, weights, keys, candidates = inputs[:4]
    n_valid = int((candidates >= 0).sum())        # NOTE: host sync, outside any timed region
    distinct = case.V if case.shared else n_valid
    io = q.numel() * q.element_size() + weights.numel() * 4 + candidates.numel() * (8 + 4)
    key_row = case.Id * keys.element_size() + 4 * (len(inputs) > 4)   # + an FP8 key's scale
    gather, once = n_valid * key_row + io, distinct * key_row + io
    flops = 2.0 * case.Ih * case.Id * n_valid
    return {"bytes_gather": gather, "bytes_once": once, "flops": flops,
            "floor_gather_us": gather / HBM_BYTES_PER_S * 1e6,
            "floor_once_us": once / HBM_BYTES_PER_S * 1e6,
            "floor_flop_us": flops / BF16_FLOP_PER_S * 1e6}


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert torch.equal(torch.isneginf(out), torch.isneginf(ref)), \
        "-inf pattern differs from the reference"
    finite = torch.isfinite(ref)
    if not finite.any():
        return 0.0
    return ((out[finite] - ref[finite]).abs().max()
            / ref[finite].abs().max().clamp(min=1e-6)).item()


def check_parity(fn: Callable[..., torch.Tensor], ref_fn: Callable[..., torch.Tensor],
                 inputs: Inputs, rows: int = 16) -> float:
    """Compare on up to `rows` evenly spaced query rows (the full test lives in tests/kernels)."""
    q, weights, keys, candidates = inputs[:4]
    out = fn(*inputs)
    pick = torch.linspace(0, q.shape[0] - 1, min(rows, q.shape[0]),
                          device=q.device).round().long().unique()
    extra = inputs[4:5] + tuple(x[pick] for x in inputs[5:])        # key scales; q's, picked
    err = rel_error(out[pick], ref_fn(q[pick], weights[pick], keys, candidates[pick], *extra))
    # bf16 MMA, or with FP8 q Hopper's FP8 MMA, which sums with fewer mantissa bits than fp32
    limit = 1e-2 if q.dtype in (torch.bfloat16, torch.float8_e4m3fn) else 1e-5
    assert err <= limit, f"parity failed: max |diff| / max |ref| = {err:.3e} > {limit:.0e}"
    return err


def copy_same_bytes_us(moved: int, n_sets: int, args: argparse.Namespace) -> float:
    """A device copy moving the same bytes (reads + writes = `moved`), timed as the kernel is: what
    HBM gives a single launch of this size, next to the asymptotic 4.275 TB/s floor (small steps
    never reach it)."""
    half = moved // 2
    sets = [(torch.empty(half, dtype=torch.uint8, device="cuda"),
             torch.empty(half, dtype=torch.uint8, device="cuda"))
            for _ in range(n_sets)]
    return time_graph_us(lambda dst, src: dst.copy_(src), sets, args.iters, args.warmup)


def time_reference_us(ref_fn: Callable[..., torch.Tensor], case: Case, inputs: Inputs, iters: int,
                      cuda: bool) -> tuple[float, int]:
    """Reference time for all T rows, measured on the largest row prefix that fits
    `REF_BUDGET_BYTES`."""
    q, weights, keys, candidates = inputs[:4]
    rows = max(1, min(case.T, REF_BUDGET_BYTES // (case.V * (case.Id + case.Ih) * 4 * 2)))
    sub = (q[:rows], weights[:rows], keys, candidates[:rows], *inputs[4:])
    us = time_eager_us(lambda: ref_fn(*sub), iters, cuda)
    return us * case.T / rows, rows


def bench_case(case: Case, args: argparse.Namespace, device: torch.device) -> dict[str, object]:
    from dsv4.kernels.ref.indexer import paged_index_scores
    from dsv4.kernels.triton.index_scores import triton_index_scores

    cuda = device.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    first = make_inputs(case, dtype, device, args.seed, args.keys)
    fl = floors(case, first)
    n_sets = min(16, math.ceil(ROTATE_BYTES / fl["bytes_once"])) if cuda else 1
    sets = [first] + [make_inputs(case, dtype, device, args.seed + i, args.keys)
                      for i in range(1, n_sets)]
    default = FP8_Q_DEFAULT_CONFIG if args.keys == "fp8q" else DEFAULT_CONFIG
    configs: list[tuple[int, ...]] = [default] + (args.configs
                                                         or (SWEEP_CONFIGS if args.sweep else []))

    def ref(*x: torch.Tensor) -> torch.Tensor:
        return paged_index_scores(*x[:4], key_scales=x[4] if len(x) > 4 else None,
                                  q_scales=x[5] if len(x) > 5 else None)
    timed: dict[str, float] = {}
    err = 0.0
    for cfg in configs:
        block_v, warps, stages = cfg[:3]
        # blocks per program (None: the wrapper's heuristic)
        bpp = cfg[3] if len(cfg) > 3 else None

        def fn(*x: torch.Tensor, bv: int = block_v, nw: int = warps, ns: int = stages,
               b: int | None = bpp) -> torch.Tensor:
            return triton_index_scores(*x[:4], key_scales=x[4] if len(x) > 4 else None,
                                       q_scales=x[5] if len(x) > 5 else None, block_v=bv,
                                       num_warps=nw, num_stages=ns, blocks_per_program=b)
        err = max(err, check_parity(fn, ref, first))
        name = "/".join(map(str, cfg))
        if cuda:
            timed[name] = time_graph_us(fn, sets, args.iters, args.warmup)
        else:
            timed[name] = time_eager_us(partial(fn, *first), args.iters, cuda)
    best = min(timed, key=lambda k: timed[k])
    us = timed[best]
    copy_us = copy_same_bytes_us(int(fl["bytes_once"]), n_sets, args) if cuda else float("nan")
    ref_us, ref_rows = time_reference_us(ref, case, first, max(3, args.iters // 10), cuda)
    return {"case": case.name, "T": case.T, "V": case.V, "Ih": case.Ih, "Id": case.Id,
            "dtype": str(dtype)[6:], "keys": args.keys, "us": us,
            "us_default": timed["/".join(map(str, default))], "best_config": best,
            "configs_us": timed, "ref_us": ref_us, "ref_rows": ref_rows,
            "speedup_vs_ref": ref_us / us,
            "gbps_gather": fl["bytes_gather"] / us / 1e3,
            "pct_hbm": fl["bytes_gather"] / (us * 1e-6) / HBM_BYTES_PER_S * 100,
            "x_gather": us / fl["floor_gather_us"], "x_once": us / fl["floor_once_us"],
            "x_roof": us / max(fl["floor_once_us"], fl["floor_flop_us"]), "copy_us": copy_us,
            "x_copy": us / copy_us,
            "max_rel_err": err, "input_sets": n_sets,
            **fl}


TABLE = [("case", "{:<22}", "case"), ("us", "{:>9.1f}", "us"), ("ref_us", "{:>11.1f}", "ref us"),
         ("ref_rows", "{:>8}", "ref rows"), ("speedup_vs_ref", "{:>8.1f}", "x ref"),
         ("gbps_gather", "{:>8.0f}", "GB/s"),
         ("pct_hbm", "{:>6.1f}", "%HBM"), ("floor_gather_us", "{:>10.1f}", "gather us"),
         ("floor_once_us", "{:>10.1f}", "once us"), ("floor_flop_us", "{:>9.1f}", "flop us"),
         ("x_once", "{:>7.2f}", "x_once"), ("x_roof", "{:>7.2f}", "x_roof"),
         ("copy_us", "{:>8.1f}", "copy us"),
         ("x_copy", "{:>7.2f}", "x_copy"), ("best_config", "{:>9}", "bv/w/st"),
         ("max_rel_err", "{:>9.1e}", "rel err")]


def parse_args() -> argparse.Namespace:
    p = base_parser(__doc__.splitlines()[0], "also time SWEEP_CONFIGS and report the best")
    p.add_argument("--only", default="",
                   help="run only the cases whose name contains this text (e.g. 'T=1 ')")
    p.add_argument("--configs",
                   type=lambda v: [tuple(map(int, c.split("/"))) for c in v.split(",")],
                   default=None,
                   help="time these instead of SWEEP_CONFIGS: "
                        "block_v/warps/stages[/blocks_per_program], comma-separated")
    p.add_argument("--keys", choices=("model", "fp8", "fp8q"), default="model",
                   help="the key pool's format: the model dtype (bf16 on CUDA), or FP8 codes "
                        "with a power-of-two scale per key (`kernels/ref/index_keys.py`); fp8q: "
                        "the queries too (one scale per head), an FP8 dot")
    return p.parse_args()


def main() -> None:
    args = parse_args()
    device = select_device(args.cpu_smoke)      # before the first `import triton` (done lazily)
    cases = [c for c in (smoke_cases() if args.cpu_smoke else cuda_cases()) if args.only in c.name]
    if args.cpu_smoke:
        args.iters = min(args.iters, 3)

    rows = bench_rows(cases, lambda case: bench_case(case, args, device), device)
    print_table(rows, TABLE)
    print(json.dumps({**record_header("index_scores", device), "bf16_flop_per_s": BF16_FLOP_PER_S,
                      "results": rows}))


if __name__ == "__main__":
    main()
