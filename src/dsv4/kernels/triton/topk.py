"""Lightning TopK: exact, deterministic ragged top-k by radix select.

Owns `lightning_topk`, the fast form of `kernels/ref/topk.py::topk_ragged` (same signature,
identical output: indices of the k largest scores among columns j < lengths[b], ties -> lower index,
ascending, -1 padded; NaN ranks above +inf as in `torch.sort`), its thresholds (`TopKConfig`) and
the path choice (`plan_topk`). Serving-reference §1.7; spec §6.6.

Algorithm (no sort). Scores map to order-preserving uint32 keys (`topk_radix.py`). The k-th largest
key `thr` among the row's n = min(lengths[b], N) candidates is found exactly by 4 radix passes of
8-bit digits, most significant first; the selection keeps every key > thr plus the first k_rem keys
== thr in index order (the lower-index tie rule, exactly) and writes each kept index at its rank in
index order (exclusive cumsum of the keep mask), so the output is ascending; positions
[min(k, n), k) get -1. A row with n <= k needs no special case: its k-th largest is the row minimum,
so every candidate is kept.

Paths, chosen on the host from Python ints only (no device sync: it runs inside CUDA-graph capture):

    row      N <= row_max (4096)   one program per row, the whole row in registers, 1 launch;
                                   it stops its passes once a pass's bin is kept whole (the
                                   bin's count is the keys still wanted: with Gaussian-like
                                   scores after pass 1 at 1,024 keys and k = 512, pass 2 at
                                   4,096; at pass 0 when n <= k), then keeps every key >= the
                                   bin's lowest key
    coop     N >  row_max, B * P <= coop_programs (and the GPU's SMs), P = N / chunk:
                                   1 launch (`topk_coop.py`), chunk 2048..8192: every program keeps
                                   its chunk's keys in registers and the row's programs take the
                                   radix steps together through grid-wide barriers (3, or 4 with
                                   heavy ties), then each writes its own winners. Needs a zeroed
                                   workspace (each call leaves it zero).
    compact  N >  row_max          2 or 3 launches, no memset (`topk_compact.py`, `topk_tail.py`):
                                   K1 digit-0 histograms per chunk; K2 packs each chunk's candidates
                                   (scores in or above a lower-bound digit-0 bin) in index order;
                                   the tail finishes the radix select on the candidates and writes
                                   the row.
                                   Exact mode (B * N <= exact_max: latency-bound sizes) histograms
                                   every key, which also gives each chunk its offset in one
                                   contiguous candidate list, and the row's last K2 program runs the
                                   tail (2 launches); bound mode (larger) histograms group maxima
                                   (`group` x fewer histogram updates), each chunk keeps its
                                   candidates in its own region, and a third launch (one program per
                                   row) runs the tail, so that K2 stays small in registers.

Compiled variants: the sizes that change from request to request (N, B, the split counts) are not
specialised on (`do_not_specialize`: Triton would otherwise build a variant for 1, for multiples of
16 and for the rest), so each path compiles once per plan class and a new prompt length does not
compile (engine/warmup.py compiles the classes a serving engine meets). Row strides stay
specialised (they place the loads).

Only K1 and K2 read whole rows, once each; the tail reads the candidates (for Gaussian-like scores a
few percent of the row: a digit-0 bin spans two octaves; all-equal rows keep everything: exact, just
slower).
Timings of the paths and the `TopKConfig` defaults: benchmarks/results/kernels_i_h200_202611.md.
Test: tests/kernels/test_topk.py. Benchmark: benchmarks/kernels/bench_topk.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import triton
import triton.language as tl

from dsv4.kernels.triton import launch
from dsv4.kernels.triton.pdl import pdl_args
from dsv4.kernels.triton.pdl_enter import pdl_enter
from dsv4.kernels.triton.topk_compact import CompactPlan, launch_compact, workspace_numel
from dsv4.kernels.triton.topk_coop import CoopPlan, coop_workspace_numel, launch_coop, row_words
from dsv4.kernels.triton.topk_radix import (
    digit_hist,
    find_bin_count,
    order_key,
    pad_tail,
    row_len,
    select_block,
)


@dataclass(frozen=True)
class TopKConfig:
    """Path thresholds and chunking (see the module docstring); tests shrink them to reach every
    path on small rows. The defaults are H200 choices: the sweeps behind them are in
    benchmarks/results/kernels_i_h200_202611.md."""

    row_max: int = 4096             # longest row kept whole in registers (<= 16384)
    block: int = 4096               # elements per loop step of the histogram and counting passes
    compact_block: int = 1024       # loop step of the compaction (x2 on a wide grid;
                                    # hand-pipelined: 2 steps in flight; sets K2's registers: 59 at
                                    # 1024 x 8 warps, 100 at 2048)
    tail_block: int = 2048          # loop step of the tail's passes over the candidate list
    compact_warps: int = 8          # most K2 warps on a wide grid (one program per SM: latency)
    narrow_warps: int = 2           # K2 warps otherwise (many programs per SM)
    target_programs: int = 528      # 4 programs per SM on a 132-SM H200
    max_chunk: int = 8192           # longest K2 chunk (shorter ones balance the rows' last
                                    # programs)
    max_hist_splits: int = 64       # most K1 chunks per row (<= 128): every K2 program loads all of
                                    # its row's slots as one [splits, 256] register tile
    group: int = 4                  # bound mode: K1 histograms the max of each group of this many
    exact_max: int = 1 << 20        # B * N at or below this: exact mode (K1 histograms every key)
    small_block: int = 256          # loop step over a chunk's candidates (real scores: ~2-3% of it)
    finish_block: int = 4096        # largest tail list (~k winners + ties) finished in registers
    sample: int = 8                 # bound mode: K1 histograms every sample-th block of rows
                                    # >= 16 * sample * k long (1: every block)
    chunk_tile: int = 8192          # bound-mode tail: one load of all chunks' candidates when each
                                    # holds <= this // P2 (0: off; exact mode: never, slower there)
    wide_programs: int = 132        # a K2 grid this small (one program per SM): 2x compact_block
    coop_programs: int = 132        # coop path (`topk_coop.py`: one launch, grid-wide barriers)
                                    # when B * P fits in this many programs (0: off; the H200's SMs,
                                    # so that the CPU plans as it does); on a GPU also capped at its
                                    # SM count (every program must be resident)
    coop_chunk: int = 2048          # smallest coop chunk per program (doubled until B * P fits)
    coop_max_chunk: int = 8192      # and its largest (a program's register tile: 16384 spills at 8
                                    # or 16 warps)
    coop_warps: int = 8             # coop num_warps; 16 for chunks of 8192 (8 warps spill there)
    coop_cap: int = 32              # coop tie list: most keys in the k-th largest's 20-bit bin
                                    # (more: 2 more rounds; the [cap, cap] rank tile is on the
                                    # critical path)
    coop_split: bool = False        # the coop path as staged launches on a GPU too (always on CPU)

    def __post_init__(self) -> None:
        for name in ("block", "compact_block", "tail_block", "small_block", "group", "finish_block",
                     "coop_chunk", "coop_max_chunk", "coop_cap"):
            value = getattr(self, name)
            if value < 1 or value & (value - 1):
                raise ValueError(f"TopKConfig.{name}={value} must be a power of two (tl.arange)")
        if min(self.block // self.group, self.compact_block, self.tail_block,
               self.small_block) < 16:
            raise ValueError(f"TopKConfig: block // group={self.block // self.group}, "
                             f"compact_block={self.compact_block}, tail_block={self.tail_block} "
                             f"and small_block={self.small_block} must be >= 16")
        if self.chunk_tile and self.chunk_tile & (self.chunk_tile - 1):
            raise ValueError(f"TopKConfig.chunk_tile={self.chunk_tile} must be 0 or a power of two "
                             "(tl.arange)")
        if not 1 <= self.max_hist_splits <= 128:
            raise ValueError(f"TopKConfig.max_hist_splits={self.max_hist_splits} must be in "
                             "[1, 128] (K2 holds a [splits, 256] tile of K1's slots in registers)")
        if not 1 <= self.row_max <= 16384:
            raise ValueError(f"TopKConfig.row_max={self.row_max} must be in [1, 16384] (a row "
                             "lives in registers)")
        if self.coop_programs < 0 or self.coop_programs > 1 << 16:
            raise ValueError(f"TopKConfig.coop_programs={self.coop_programs} must be in [0, 65536] "
                             "(0: off)")
        for name in ("target_programs", "max_chunk", "compact_warps", "narrow_warps", "sample",
                     "coop_warps"):
            if getattr(self, name) < 1:
                raise ValueError(f"TopKConfig.{name}={getattr(self, name)} must be >= 1")


DEFAULT_CONFIG = TopKConfig()


@dataclass(frozen=True)
class TopKPlan:
    path: Literal["row", "compact", "coop"]
    block: int          # row path: the padded row; compact path: the loop step; coop: the chunk
    compact: CompactPlan | None = None
    coop: CoopPlan | None = None

    @property
    def splits(self) -> int:
        """Programs per row in the second launch (1 on the row path; the coop path's one launch)."""
        if self.coop is not None:
            return self.coop.programs
        return self.compact.splits if self.compact is not None else 1

    @property
    def name(self) -> str:
        """Path name with its mode, for logs and benchmarks: row | compact-exact |
        compact-bound | coop."""
        if self.compact is None:
            return self.path
        return f"compact-{'exact' if self.compact.exact else 'bound'}"


def _chunking(N: int, splits: int, block: int) -> tuple[int, int]:
    """(splits, chunk) with chunk a multiple of block and splits * chunk >= N."""
    chunk = triton.cdiv(triton.cdiv(N, splits), block) * block
    return triton.cdiv(N, chunk), chunk


def _plan_coop(B: int, N: int, config: TopKConfig, sms: int | None) -> TopKPlan | None:
    """The coop path when B * P programs fit (at most `sms`, the GPU's SMs: every program must be
    resident; None: the interpreter, which runs the split form)."""
    limit = config.coop_programs if sms is None else min(config.coop_programs, sms)
    chunk = config.coop_chunk
    while B * triton.cdiv(N, chunk) > limit and chunk < config.coop_max_chunk:
        chunk *= 2
    if B * triton.cdiv(N, chunk) > limit:
        return None
    warps = max(config.coop_warps, 16 if chunk >= 8192 else 1)
    return TopKPlan("coop", chunk, coop=CoopPlan(programs=triton.cdiv(N, chunk), chunk=chunk,
                                                warps=warps, cap=config.coop_cap,
                                                split=config.coop_split or sms is None))


def plan_topk(B: int, N: int, config: TopKConfig = DEFAULT_CONFIG,
              sms: int | None = None) -> TopKPlan:
    """Pick the path and its chunking for a [B, N] problem from Python ints only (`sms`: the GPU's
    SM count, None on CPU)."""
    if N <= config.row_max:
        return TopKPlan("row", max(128, triton.next_power_of_2(N)))
    coop = _plan_coop(max(B, 1), N, config, sms) if config.coop_programs else None
    if coop is not None:
        return coop
    c, B = config, max(B, 1)
    per_row = triton.cdiv(c.target_programs, B)                 # programs per row that fill the GPU
    splits, chunk = _chunking(N, min(triton.cdiv(N, c.block),
                                     max(per_row, triton.cdiv(N, c.max_chunk))), c.block)
    exact = B * N <= c.exact_max
    if exact:   # K1 chunks = K2 chunks: the exact slots then give every chunk's write offset
        splits, chunk = _chunking(N, min(splits, c.max_hist_splits), c.block)
        hist_splits, hist_chunk = splits, chunk
    else:
        hist_splits, hist_chunk = _chunking(N, min(splits, per_row, c.max_hist_splits), c.block)
    # NOTE: with one program per SM occupancy is moot and latency is all: fewer, longer compaction
    # steps (more registers) and, in exact mode, 16 warps for K1's histograms (bound mode's group
    # maxima would replicate)
    wide = B * splits <= c.wide_programs
    compact_block = min(c.block, c.compact_block * (2 if wide else 1))
    warps = min(c.compact_warps if wide else c.narrow_warps, max(1, compact_block // 128))
    hist_warps = min(16 if exact and B * hist_splits <= c.wide_programs else 8,
                     max(1, c.block // 256))
    return TopKPlan("compact", c.block, CompactPlan(
        block=c.block, group=1 if exact else c.group, sample=1 if exact else c.sample,
        hist_splits=hist_splits, hist_chunk=hist_chunk,
        hist_warps=hist_warps, splits=splits, chunk=chunk, warps=warps, compact_block=compact_block,
        small_block=max(c.small_block, 32 * warps), tail_block=c.tail_block,
        chunk_tile=0 if exact else c.chunk_tile,
        finish_block=c.finish_block))


def topk_workspace_numel(B: int, N: int, k: int, config: TopKConfig = DEFAULT_CONFIG,
                         sms: int | None = None) -> int:
    """int32 elements `lightning_topk(..., workspace=)` needs for a [B, N] problem (0 on the row
    path)."""
    plan = plan_topk(B, N, config, sms)
    if plan.coop is not None:
        return coop_workspace_numel(B, plan.coop)
    return 0 if plan.compact is None else workspace_numel(B, N, k, plan.compact)


def device_sms(device: torch.device) -> int | None:
    """The GPU's SM count (the coop path's co-residency bound), None off CUDA (`plan_topk`'s
    `sms`)."""
    return launch.sms(device) if device.type == "cuda" else None


# ---------------------------------------------------------------------------------------------- row


@triton.jit(do_not_specialize=["N"])
def _topk_row_kernel(  # type: ignore[no-untyped-def]
    scores_ptr, lengths_ptr, out_ptr, N, K, stride_s, BLOCK: tl.constexpr, PAD_BLOCK: tl.constexpr,
    PDL: tl.constexpr):
    pdl_enter(PDL)
    row = tl.program_id(0)
    n = row_len(lengths_ptr, row, N)
    k_eff = tl.minimum(n, K)
    offs = tl.arange(0, BLOCK)
    valid = offs < n
    key = order_key(tl.load(scores_ptr + row.to(tl.int64) * stride_s + offs, mask=valid, other=0.0))
    prefix = tl.full([], 0, tl.uint32)
    k_rem = k_eff
    whole = k_rem < 0               # the pass's bin is kept whole: the later passes are skipped
    for p in tl.static_range(4):
        if not whole:
            digit, k_rem, count = find_bin_count(digit_hist(key, valid, prefix, 24 - 8 * p), k_rem)
            prefix = prefix | (digit.to(tl.uint32) << (24 - 8 * p))
            whole = count == k_rem
    # a whole bin: its keys are those >= prefix (lower digits 0) up to the next bin; every tie
    # == prefix is kept then
    keep, pos, _, _ = select_block(key, valid, prefix, tl.where(whole, BLOCK, k_rem), 0, 0)
    out_row = out_ptr + row.to(tl.int64) * K
    tl.store(out_row + pos, offs.to(tl.int64), mask=keep & (pos < K))
    pad_tail(out_row, k_eff, K, PAD_BLOCK)


# --------------------------------------------------------------------------------------------- host


def row_warps(block: int) -> int:
    """Warps of the row path's program: 4 up to 1024 keys, 8 up to 4096, 16 above (its radix
    passes are a chain of block-wide histograms and scans; fewer warps serialise the keys, more
    pay for cross-warp steps). The output does not depend on it (the selection is exact)."""
    return 4 if block <= 1024 else 8 if block <= 4096 else 16


def _check_inputs(scores: torch.Tensor, lengths: torch.Tensor, k: int) -> None:
    if scores.dtype != torch.float32 or scores.dim() != 2 or not scores.is_contiguous():
        raise ValueError(f"scores must be a contiguous [B, N] float32 tensor, got {scores.dtype} "
                         f"{tuple(scores.shape)} contiguous={scores.is_contiguous()}")
    if (lengths.dim() != 1 or lengths.shape[0] != scores.shape[0]
            or lengths.dtype not in (torch.int32, torch.int64)):
        raise ValueError(f"lengths must be an int32/int64 [B={scores.shape[0]}] tensor, got "
                         f"{lengths.dtype} {tuple(lengths.shape)}")
    if lengths.device != scores.device:
        raise ValueError(f"lengths on {lengths.device}, scores on {scores.device}")
    if not isinstance(k, int) or k < 1:
        raise ValueError(f"k must be an int >= 1, got {k!r}")


def lightning_topk(scores: torch.Tensor, lengths: torch.Tensor, k: int, *,
                   config: TopKConfig = DEFAULT_CONFIG,
                   workspace: torch.Tensor | None = None) -> torch.Tensor:
    """Same contract as `kernels/ref/topk.py::topk_ragged`: [B, N] fp32, [B] int, k -> [B, k] int64.

    No host syncs: the path comes from (B, N), `config` and the GPU's SM count; lengths stay on the
    device. `workspace` (optional): a contiguous int32 tensor of
    >= `topk_workspace_numel(B, N, k, config, device_sms(device))` elements, ZERO-filled when
    allocated and then reused across calls on one stream: the compact path accepts any contents; the
    coop path needs its counter region zero and leaves it zero, so never write to it. By default
    each call takes a fresh one (the coop path's is zero-filled: one memset).
    """
    _check_inputs(scores, lengths, k)
    B, N = scores.shape
    return _run(scores, lengths, k, plan_topk(B, N, config, device_sms(scores.device)), workspace)


def _run(scores: torch.Tensor, lengths: torch.Tensor, k: int, plan: TopKPlan,
         workspace: torch.Tensor | None) -> torch.Tensor:
    """`lightning_topk` on checked inputs and their plan."""
    B, N = scores.shape
    out = torch.empty((B, k), dtype=torch.int64, device=scores.device)
    if B == 0 or N == 0:
        return out.fill_(-1)
    if plan.coop is not None:
        launch_coop(scores, lengths, out, plan.coop, workspace)
    elif plan.compact is not None:
        launch_compact(scores, lengths, out, plan.compact, workspace)
    else:
        _topk_row_kernel[(B,)](scores, lengths, out, N, k, scores.stride(0), BLOCK=plan.block,
                               PAD_BLOCK=1024, num_warps=row_warps(plan.block),
                               **pdl_args(scores.device))
    return out


class TopKRunner:
    """`lightning_topk` holding the coop path's zeroed workspace across calls, as a serving engine
    holds its buffers (the `triton` kernel backend's `topk`): the coop path then needs no per-call
    zero fill (one memset less a call; timed in benchmarks/results/kernels_i_h200_202611.md). The
    compact path keeps taking a fresh buffer per call (it needs no zeros).

    One buffer per device, sized once for the largest coop grid `config` allows, so it never moves
    under a CUDA graph that captured it. Calls must not overlap (one stream at a time, as the
    engine's forward runs). Never allocated during CUDA-graph capture (a captured zero fill would
    only run at replay): a first call inside a capture takes a fresh zero-filled buffer inside the
    graph instead, correct on every replay.
    """

    def __init__(self, config: TopKConfig = DEFAULT_CONFIG) -> None:
        self.config = config
        self._held: dict[torch.device, torch.Tensor] = {}

    def workspace_numel(self) -> int:
        """int32 words of the held buffer: every row of the largest coop grid at its largest row."""
        c = self.config
        widest = CoopPlan(programs=max(1, c.coop_programs), chunk=c.coop_chunk, warps=c.coop_warps,
                          cap=c.coop_cap, split=False)
        # rows <= B * P <= coop_programs, each <= the widest
        return c.coop_programs * row_words(widest)

    def held(self, device: torch.device) -> torch.Tensor | None:
        """This device's held buffer, allocated (zeroed) on first use outside CUDA-graph capture."""
        # one key per GPU: "cuda" is the current one
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        buf = self._held.get(device)
        if buf is None and not (device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
            buf = self._held[device] = torch.zeros(self.workspace_numel(), dtype=torch.int32,
                                                   device=device)
        return buf

    def __call__(self, scores: torch.Tensor, lengths: torch.Tensor, k: int) -> torch.Tensor:
        _check_inputs(scores, lengths, k)
        B, N = scores.shape
        plan = plan_topk(B, N, self.config, device_sms(scores.device))
        return _run(scores, lengths, k, plan,
                    self.held(scores.device) if plan.coop is not None else None)
