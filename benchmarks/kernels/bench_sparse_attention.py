"""Benchmark: hybrid sparse attention (`triton_sparse_attention`) vs the reference and HBM floor.

Cases (V4-Flash, flash-4l attention: H = 64, D = 512, bf16 q and pools, fp32 sink, scale 512^-0.5;
two sources, SWA window W = 128 then compressed entries):
  decode   B in {1, 8, 32, 128} requests, one query each, every request with its own keys (full
           window of 128 permuted SWA slots), and either
             C4    512 top-k entries (ascending entry ids of a 1024-entry, 4K-context request)
             C128  all V visible entries, V = 32, 128, 512, 1024 (contexts 4K, 16K, 64K, 128K);
                   and V = 7200 (900K) at B in {1, 8}
  prefill  T in {4096, 8192} tokens of one request from position 0 (a prompt): windows partly
           filled for the first 127 tokens, C4 top-min(512, (t+1)//4) picks, C128 every visible
           entry ((t+1)//128 <= 64).
Bytes (host side, outside any timed region), with valid = the keys whose slot is not -1:
  io          q + out (T H D x 2 B) + index rows (int64) + sink
  kernel      io + valid x D x 2 B x G (each of the G = H / block_h head-group programs of a token
              gathers the token's keys: the first from HBM, the others mostly from L2) + the
              split-KV workspace (write + read)
  once        io + each DISTINCT key row once: the HBM floor (decode: = valid rows; prefill: shared
              rows once)
"GB/s" = kernel bytes / time (what the SMs read, L2 included); "%HBM" = once bytes / time against
the measured H200 copy bandwidth 4.275 TB/s; "floor us" = once bytes / 4.275 TB/s; "TFLOP/s" =
4 H D valid / time (QK and PV, useful work only); "x_roof" = time / max(HBM floor, FLOPs / 680
TFLOP/s), the meaningful ratio for prefill (compute-bound: 4 H D = 131 KFLOP per key against 1 KB
of key). Timing: parity with the reference is asserted first; then the median of CUDA-event-timed
CUDA-graph replays (each graph holds several calls, cycling through input copies of >= 256 MB in
all to defeat L2 reuse across calls) after warm-up. The reference is timed eagerly.
"us P1/P2/P3": the default configuration with P.V's P written as 1, 2 or 3 16-bit terms
(`PV_TERMS`: 3 is the default, 1 is flash attention's single rounding); "neq P1/P3": the
fraction of output elements not bit-equal to the reference's (which keeps P in fp32).
Prints a table, then ONE JSON line (also written to --out).

    PYTHONPATH=src python3 benchmarks/kernels/bench_sparse_attention.py --out FILE.json  # CUDA
    PYTHONPATH=src python3 benchmarks/kernels/bench_sparse_attention.py --sweep  # + tiles/warps
    PYTHONPATH=src python3 benchmarks/kernels/bench_sparse_attention.py --configs 16/32/4/2/20
    PYTHONPATH=src python3 benchmarks/kernels/bench_sparse_attention.py --cpu-smoke  # interpreter
"""

from __future__ import annotations

import argparse
import math
import time
from dataclasses import dataclass

import torch
from bench_common import (
    HBM_BYTES_PER_S,
    base_parser,
    bench_rows,
    emit,
    print_table,
    record_header,
    select_device,
    time_eager_us,
    time_graph_us,
)

BF16_FLOP_PER_S = 680e12         # measured bf16 matmul on the H200
ROTATE_BYTES = 256 << 20         # >= 5x the H200's 50 MB L2: input copies cycled inside one graph
MAX_SETS = 16
# (block_h, block_n, num_warps, num_stages, num_splits or None = automatic)
Config = tuple[int, int, int, int, int | None]
SWEEP_CONFIGS: list[Config] = [
    (16, 32, 8, 2, None), (16, 64, 8, 2, None), (16, 64, 4, 2, None), (16, 32, 4, 1, None),
    (16, 32, 4, 3, None), (32, 32, 8, 2, None), (32, 64, 8, 2, None), (64, 16, 8, 2, None),
    (64, 32, 8, 2, None), (16, 32, 4, 2, 1), (16, 32, 4, 2, 4), (16, 32, 4, 2, 16),
    (16, 32, 4, 2, 32)]

Inputs = tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]], torch.Tensor]


@dataclass(frozen=True)
class Case:
    comp: str             # "c4" | "c128"
    phase: str            # "decode" | "prefill"
    T: int                # queries (decode: requests)
    width: int            # c4: top-k; c128: visible entries per request (decode)
    H: int = 64
    D: int = 512
    W: int = 128

    @property
    def name(self) -> str:
        if self.phase == "prefill":
            return f"prefill {self.comp} T={self.T}"
        return (f"decode {self.comp} "
                + (f"k={self.width}" if self.comp == "c4" else f"V={self.width}") + f" B={self.T}")


def cuda_cases() -> list[Case]:
    decode = [Case(c, "decode", B, w) for B in (1, 8, 32, 128)
              for c, w in (("c4", 512), ("c128", 32), ("c128", 128), ("c128", 512), ("c128", 1024))]
    decode += [Case("c128", "decode", B, 7200) for B in (1, 8)]
    return decode + [Case(c, "prefill", T, w) for T in (4096, 8192)
                     for c, w in (("c4", 512), ("c128", 0))]


def smoke_cases() -> list[Case]:
    return [Case("c4", "decode", 2, 16, 8, 32, 8), Case("c128", "decode", 3, 12, 8, 32, 8),
            Case("c4", "prefill", 24, 8, 8, 32, 8), Case("c128", "prefill", 40, 0, 8, 32, 8)]


def decode_rows(case: Case, g: torch.Generator,
                device: torch.device) -> tuple[torch.Tensor, torch.Tensor, int]:
    """[B, W] window slots and [B, width] entry slots, each request in its own pool rows; entries
    per request."""
    B, W = case.T, case.W
    window = (torch.rand(B, W, generator=g, device=device).argsort(dim=1)
              + W * torch.arange(B, device=device)[:, None])
    per_req = 2 * case.width if case.comp == "c4" else case.width
    ids = torch.rand(B, per_req, generator=g, device=device).argsort(dim=1)[:, :case.width]
    ids = (ids.sort(dim=1).values if case.comp == "c4"
           else torch.arange(case.width, device=device).expand(B, -1))
    return window, ids + per_req * torch.arange(B, device=device)[:, None], B * per_req


def prefill_rows(case: Case, g: torch.Generator,
                 device: torch.device) -> tuple[torch.Tensor, torch.Tensor, int]:
    """One request from position 0 (module docstring); pool slot = position (SWA) / entry id
    (entries)."""
    T, W, ratio = case.T, case.W, 4 if case.comp == "c4" else 128
    pos = torch.arange(T, device=device)
    win = pos[:, None] - W + 1 + torch.arange(W, device=device)
    window = torch.where(win >= 0, win, -1)
    E = T // ratio
    ids = torch.arange(E, device=device).expand(T, E)
    seen = ids < ((pos + 1) // ratio)[:, None]
    if case.comp == "c128":
        return window, torch.where(seen, ids, -1), E
    score = torch.rand(T, E, generator=g, device=device).masked_fill(~seen, -1.0)
    top, pick = score.topk(min(case.width, E), dim=1)
    pick = torch.where(top >= 0, pick, E).sort(dim=1).values
    return window, torch.where(pick < E, pick, -1), E


def make_inputs(case: Case, dtype: torch.dtype, device: torch.device, seed: int) -> Inputs:
    g = torch.Generator(device).manual_seed(seed)
    window, entries, n_entries = (decode_rows if case.phase == "decode"
                                  else prefill_rows)(case, g, device)
    n_swa = int(window.max()) + 2
    q = torch.randn(case.T, case.H, case.D, generator=g, device=device, dtype=dtype)
    swa = torch.randn(n_swa, case.D, generator=g, device=device, dtype=dtype)
    comp = torch.randn(n_entries + 1, case.D, generator=g, device=device, dtype=dtype)
    sink = torch.randn(case.H, generator=g, device=device)
    return q, [(swa, window.contiguous()), (comp, entries.contiguous())], sink


def count_bytes(case: Case, inputs: Inputs, block_h: int, splits: int) -> dict[str, float]:
    """Bytes and FLOPs (module docstring). NOTE: host syncs, outside any timed region."""
    q, sources, _ = inputs
    T, H, D = q.shape
    row = D * sources[0][0].element_size()
    valid = sum(int((idx >= 0).sum()) for _, idx in sources)
    distinct = (sum(int(idx[idx >= 0].unique().numel()) for _, idx in sources)
                if case.phase == "prefill" else valid)
    io = 2 * q.numel() * q.element_size() + sum(idx.numel() * 8 for _, idx in sources) + H * 4
    workspace = 2 * T * H * splits * (D + 1) * 4 if splits > 1 else 0
    kernel = io + valid * row * math.ceil(H / block_h) + workspace
    once = io + distinct * row
    return {"bytes_kernel": kernel, "bytes_once": once, "valid_keys": valid,
            "flops": 4.0 * H * D * valid, "floor_us": once / HBM_BYTES_PER_S * 1e6,
            "floor_flop_us": 4.0 * H * D * valid / BF16_FLOP_PER_S * 1e6}


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).abs().max()
            / ref.float().abs().max().clamp(min=1e-6)).item()


def time_config(cfg: Config, first: Inputs, sets: list[Inputs],
                ref: torch.Tensor, scale: float, args: argparse.Namespace,
                cuda: bool, p_terms: int | None = None) -> tuple[float, float, float]:
    """(max rel error vs the reference, us per call, fraction of output elements not equal to
    the reference's) of one configuration (and P.V precision); asserts parity first."""
    from dsv4.kernels.triton.sparse_attention import triton_sparse_attention

    kw = dict(block_h=cfg[0], block_n=cfg[1], num_warps=cfg[2], num_stages=cfg[3],
              num_splits=cfg[4], **({} if p_terms is None else {"p_terms": p_terms}))

    def fn(q: torch.Tensor, sources: list[tuple[torch.Tensor, torch.Tensor]],
           sink: torch.Tensor) -> torch.Tensor:
        return triton_sparse_attention(q, sources, sink, scale, **kw)  # type: ignore[arg-type]

    t0 = time.perf_counter()
    out = fn(*first)
    once_us = (time.perf_counter() - t0) * 1e6
    err, differ = rel_error(out, ref), (out != ref).float().mean().item()
    limit = 1e-2 if ref.dtype == torch.bfloat16 else 1e-5
    assert err <= limit, f"{config_key(cfg)}: max |diff| / max |ref| = {err:.3e} > {limit:.0e}"
    # the interpreter's times mean nothing: the parity call's wall clock stands in
    us = time_graph_us(fn, sets, args.iters, args.warmup) if cuda else once_us
    return err, us, differ


def config_key(cfg: Config) -> str:
    """bh/bn/warps/stages/splits ("auto": the plan's)."""
    return "/".join("auto" if v is None else str(v) for v in cfg)


def parse_config(key: str) -> Config:
    """`config_key`'s inverse: "16/32/8/2/auto" -> (16, 32, 8, 2, None)."""
    parts = key.split("/")
    if len(parts) != 5:
        raise ValueError(f"--configs entries are bh/bn/warps/stages/splits; got {key!r}")
    bh, bn, w, st = (int(v) for v in parts[:4])
    return bh, bn, w, st, None if parts[4] == "auto" else int(parts[4])


def bench_case(case: Case, args: argparse.Namespace, device: torch.device) -> dict[str, object]:
    from dsv4.kernels.ref.attention import sparse_attention_multi
    from dsv4.kernels.triton.sparse_attention import default_config, split_plan

    cuda = device.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    scale = case.D ** -0.5
    first = make_inputs(case, dtype, device, args.seed)
    ref = sparse_attention_multi(*first, scale)
    bh, bn, nw, ns = default_config(case.H, case.D, not cuda)
    configs: list[Config] = [(bh, bn, nw, ns, None)]
    # NOTE: forced splits only where split-KV is meant to run (their workspace grows with T)
    extra = [parse_config(c) for c in args.configs.split(",")] if args.configs else (
        SWEEP_CONFIGS if args.sweep else [])
    configs += [c for c in extra if c[4] is None or case.T <= 32]
    per_set = count_bytes(case, first, bh, 1)
    n_sets = min(MAX_SETS, math.ceil(ROTATE_BYTES / per_set["bytes_once"])) if cuda else 1
    sets = [first] + [make_inputs(case, dtype, device, args.seed + i) for i in range(1, n_sets)]
    timed: dict[str, float] = {}
    by_key = {config_key(c): c for c in configs}
    err = 0.0
    failed: dict[str, str] = {}
    for i, cfg in enumerate(configs):
        try:
            cfg_err, timed[config_key(cfg)], _ = time_config(cfg, first, sets, ref, scale, args,
                                                             cuda)
            err = max(err, cfg_err)
        except Exception as e:
            # NOTE: a sweep config may not compile (shared memory); the default must
            if i == 0:
                raise
            failed[config_key(cfg)] = f"{type(e).__name__}: {str(e)[:200]}"
    # P.V precision (`PV_TERMS`): speed and elements that differ from the fp32-P reference
    pv = {t: time_config(configs[0], first, sets, ref, scale, args, cuda, t) for t in (1, 2, 3)}
    default_key, best = config_key(configs[0]), min(timed, key=lambda k: timed[k])
    us = timed[best]
    ref_us = time_eager_us(lambda: sparse_attention_multi(*first, scale), max(3, args.iters // 10),
                           cuda)
    best_h, best_n, _, _, forced = by_key[best]
    blocks = sum(math.ceil(idx.shape[1] / best_n) for _, idx in first[1])
    splits, _ = split_plan(case.T * math.ceil(case.H / best_h), blocks, device, forced)
    fl = count_bytes(case, first, best_h, splits)
    return {"case": case.name, "comp": case.comp, "phase": case.phase, "T": case.T,
            "width": case.width, "H": case.H, "D": case.D, "W": case.W, "dtype": str(dtype)[6:],
            "us": us, "us_default": timed[default_key], "best_config": best, "configs_us": timed,
            "configs_failed": failed, "splits": splits, "ref_us": ref_us,
            "speedup_vs_ref": ref_us / us, "gbps_kernel": fl["bytes_kernel"] / us / 1e3,
            "pct_hbm": fl["bytes_once"] / (us * 1e-6) / HBM_BYTES_PER_S * 100,
            "x_floor": us / fl["floor_us"],
            "x_roof": us / max(fl["floor_us"], fl["floor_flop_us"]),
            "tflops": fl["flops"] / us / 1e6, "max_rel_err": err, "input_sets": n_sets,
            **{f"us_p{t}": v[1] for t, v in pv.items()},
            **{f"differ_p{t}": v[2] for t, v in pv.items()}, **fl}


TABLE = [("case", "{:<28}", "case"),
         ("valid_keys", "{:>10}", "keys"),
         ("bytes_once", "{:>10.3e}", "bytes"),
         ("us", "{:>9.1f}", "us"),
         ("us_default", "{:>9.1f}", "us dflt"),
         ("floor_us", "{:>8.1f}", "floor us"),
         ("x_floor", "{:>7.2f}", "x_floor"),
         ("x_roof", "{:>6.2f}", "x_roof"),
         ("pct_hbm", "{:>6.1f}", "%HBM"),
         ("gbps_kernel", "{:>8.0f}", "GB/s"),
         ("tflops", "{:>7.1f}", "TFLOP/s"),
         ("ref_us", "{:>10.1f}", "ref us"),
         ("speedup_vs_ref", "{:>7.1f}", "x ref"),
         ("splits", "{:>6}", "splits"),
         ("us_p1", "{:>7.1f}", "us P1"),
         ("us_p2", "{:>7.1f}", "us P2"),
         ("us_p3", "{:>7.1f}", "us P3"),
         ("differ_p1", "{:>7.4f}", "neq P1"),
         ("differ_p3", "{:>7.4f}", "neq P3"),
         ("best_config", "{:>16}", "bh/bn/w/st/sp"),
         ("max_rel_err", "{:>8.1e}", "rel err")]


def parse_args() -> argparse.Namespace:
    p = base_parser(__doc__.splitlines()[0], "also time SWEEP_CONFIGS and report the best")
    p.add_argument("--cases", default=None,
                   help="comma-separated substrings: only the cases whose name holds one "
                   "(e.g. 'V=7200,k=512 B=1')")
    p.add_argument("--configs", default=None,
                   help="comma-separated bh/bn/warps/stages/splits keys timed after the default "
                   "in place of the sweep's list (e.g. '16/32/8/2/auto,16/32/4/2/20')")
    return p.parse_args()


def main() -> None:
    args = parse_args()
    device = select_device(args.cpu_smoke)      # before the first `import triton` (done lazily)
    cases = smoke_cases() if args.cpu_smoke else cuda_cases()
    if args.cases:
        cases = [c for c in cases if any(part in c.name for part in args.cases.split(","))]

    rows = bench_rows(cases, lambda case: bench_case(case, args, device), device)
    print_table(rows, TABLE)
    record = {**record_header("sparse_attention", device), "bf16_flop_per_s": BF16_FLOP_PER_S,
              "results": rows}
    emit(record, args.out)


if __name__ == "__main__":
    main()
