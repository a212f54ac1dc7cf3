"""Lightning TopK: exact, deterministic ragged top-k by radix select (serving-reference §1.7; spec §6.6).

Owns `lightning_topk`, the fast form of `kernels/ref/topk.py::topk_ragged` (same signature, identical output:
indices of the k largest scores among columns j < lengths[b], ties -> lower index, ascending, -1 padded).

Algorithm (no sort). Each score maps to an order-preserving uint32 key (sign bit set -> invert all bits,
else set the sign bit; -0.0 is folded onto +0.0 first because the reference treats them as equal). The
k-th largest key `thr` among the row's n = min(lengths[b], N) candidates is found exactly by 4 passes of
8-bit digits, most significant first:

    pass p: histogram (256 bins) of digit p over keys whose higher digits equal the prefix found so far
            bin   = largest d with count(digit >= d) >= k_rem
            k_rem -= count(digit > bin);  prefix |= bin << (24 - 8p)
    after 4 passes: thr = prefix, k_rem = how many keys == thr to keep (>= 1)

The selection pass keeps every key > thr plus the first k_rem keys == thr in index order (the lower-index
tie rule, exactly), and writes each kept index at its rank in index order (exclusive cumsum of the keep mask,
carried across blocks / programs), so the output is ascending; positions [min(k, n), k) get -1. A row with
n <= k needs no special case: its k-th largest is the row minimum, so every candidate is kept.

Paths, chosen on the host from Python ints only (no device sync); thresholds live in `TopKConfig`:

    row     N <= row_max (4096)            one program per row, whole row in registers, 1 launch
    split   N >  row_max, N >= split_min_n (16384) and splits = min(ceil(N / block), max_splits,
            target_programs // B) >= 2     each row cut into `splits` chunks of whole blocks, one program per
                                           chunk, 5 launches + 1 memset (below)
    stream  otherwise (mid-length rows, or batches large enough to fill the GPU one row per program)
                                           one program per row, 4 histogram passes + 1 selection pass, each
                                           streaming the row in `block`-sized pieces, 1 launch

Split path. Workspace: flags [B, P] int64, hist [B, 4, 256] int32 and the ticket, zeroed by one memset;
cnt [B, P]; cand_idx, cand_key [B, N] int32 (uninitialised; chunk p of row b owns its own chunk's range).

    K1 hist0   each chunk: digit-0 histogram -> atomic_add into hist[b, 0]
    K2 compact each chunk (programs in reverse order, so the first ones re-read what K1 left in L2): replay
               pass 0 from hist[b, 0]; keep j with digit0(j) >= bin0 (every index that can be selected; fewer
               than k are strictly above bin0) -> (j, key) into cand_*[b, chunk range] in index order, and
               cnt[b, p]; digit-1 histogram of the bin0 ties -> hist[b, 1]
    K3, K4     each chunk: replay passes 0..p-1; digit-p histogram over its compacted keys -> hist[b, p]
    K5 select  ticket = atomic_add(ticket, 1) orders the programs; each publishes its (#> thr, #== thr) in
               flags, then sums its predecessors' flags (decoupled look-back: a predecessor holds an earlier
               ticket, so it is already running and publishes without waiting: no deadlock, and the
               sequential interpreter sees them done), and writes its kept indices at their global ranks

Only K1 and K2 read whole rows; K3..K5 read only the compacted candidates (for Gaussian-like scores a few
percent of the row: bin0 spans two octaves; all-equal rows keep everything, still exact). Digits are 8 bits
because `tl.histogram` costs per element about one ballot per bin bit plus one popcount per 32 bins (an
11-bit histogram is ~10x dearer).
Test: tests/kernels/test_topk.py. Benchmark: benchmarks/kernels/bench_topk.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import triton
import triton.language as tl

NUM_BINS = 256      # 8-bit digits, 4 passes


@dataclass(frozen=True)
class TopKConfig:
    """Path thresholds (see the module docstring). Tests shrink them to reach every path on small rows."""

    row_max: int = 4096             # longest row kept whole in registers (<= 16384)
    block: int = 4096               # elements per program per loop step (stream and split paths)
    split_min_n: int = 16384        # shorter rows are never split across programs
    target_programs: int = 528      # 4 programs per SM on a 132-SM H200
    max_splits: int = 128           # bounds the look-back vector in K5

    def __post_init__(self) -> None:
        if self.block < 16 or self.block & (self.block - 1):
            raise ValueError(f"TopKConfig.block={self.block} must be a power of two >= 16 (tl.arange)")
        if not 1 <= self.row_max <= 16384:
            raise ValueError(f"TopKConfig.row_max={self.row_max} must be in [1, 16384] (a row lives in registers)")
        for name in ("split_min_n", "target_programs", "max_splits"):
            if getattr(self, name) < 1:
                raise ValueError(f"TopKConfig.{name}={getattr(self, name)} must be >= 1")


DEFAULT_CONFIG = TopKConfig()


@dataclass(frozen=True)
class TopKPlan:
    path: Literal["row", "stream", "split"]
    block: int          # elements per program per step (row path: the padded row)
    splits: int = 1     # programs per row (split path)
    chunk: int = 0      # elements per program (split path), a multiple of block


def plan_topk(B: int, N: int, config: TopKConfig = DEFAULT_CONFIG) -> TopKPlan:
    """Pick the path for a [B, N] problem from Python ints only."""
    if N <= config.row_max:
        return TopKPlan("row", max(128, triton.next_power_of_2(N)))
    splits = min(triton.cdiv(N, config.block), config.max_splits, config.target_programs // max(B, 1))
    if N < config.split_min_n or splits < 2:
        return TopKPlan("stream", config.block)
    chunk = triton.cdiv(triton.cdiv(N, splits), config.block) * config.block
    return TopKPlan("split", config.block, triton.cdiv(N, chunk), chunk)


# ----------------------------------------------------------------------------------------------- helpers


@triton.jit
def _order_key(x):  # type: ignore[no-untyped-def]
    """fp32 -> uint32 whose unsigned order is the float order (-0.0 first folded onto +0.0)."""
    x = tl.where(x == 0.0, 0.0, x)
    u = x.to(tl.uint32, bitcast=True)
    return tl.where((u >> 31) != 0, u ^ 0xFFFFFFFF, u | 0x80000000)


@triton.jit
def _row_len(lengths_ptr, row, N):  # type: ignore[no-untyped-def]
    n = tl.load(lengths_ptr + row).to(tl.int64)
    return tl.minimum(tl.maximum(n, 0), N).to(tl.int32)


@triton.jit
def _digit_hist(key, mask, prefix, SHIFT: tl.constexpr):  # type: ignore[no-untyped-def]
    """256-bin histogram of digit (key >> SHIFT) & 255 over masked keys whose higher digits equal prefix's."""
    match = mask & (((key >> SHIFT) >> 8) == ((prefix >> SHIFT) >> 8))
    digit = ((key >> SHIFT) & 0xFF).to(tl.int32)
    return tl.histogram(digit, 256, mask=match)


@triton.jit
def _find_bin(hist, k_rem):  # type: ignore[no-untyped-def]
    """Digit of the k_rem-th largest key (largest d with count(digit >= d) >= k_rem), and the new k_rem."""
    bins = tl.arange(0, 256)
    incl = tl.cumsum(hist, 0)                                   # count(digit <= d)
    total = tl.sum(hist, 0)
    ge = total - incl + hist                                    # count(digit >= d), non-increasing in d
    digit = tl.max(tl.where(ge >= k_rem, bins, 0), 0)
    above = tl.sum(tl.where(bins == digit, total - incl, 0), 0)   # count(digit > d)
    return digit, k_rem - above


@triton.jit
def _replay(hist_row_ptr, k_eff, NUM_PASSES: tl.constexpr):  # type: ignore[no-untyped-def]
    """Re-derive (prefix, k_rem) after NUM_PASSES passes from the row's finished global histograms."""
    prefix = tl.full([], 0, tl.uint32)
    k_rem = k_eff
    for p in tl.static_range(NUM_PASSES):
        hist = tl.load(hist_row_ptr + p * 256 + tl.arange(0, 256))
        digit, k_rem = _find_bin(hist, k_rem)
        prefix = prefix | (digit.to(tl.uint32) << (24 - 8 * p))
    return prefix, k_rem


@triton.jit
def _select(key, mask, thr, k_rem, eq_before, taken_before):  # type: ignore[no-untyped-def]
    """Keep mask and output positions for one block in index order; also its (#== thr, #kept)."""
    eq = (mask & (key == thr)).to(tl.int32)
    eq_rank = eq_before + tl.cumsum(eq, 0) - eq                 # ties seen before this element
    keep = (mask & (key > thr)) | ((eq != 0) & (eq_rank < k_rem))
    kept = keep.to(tl.int32)
    pos = taken_before + tl.cumsum(kept, 0) - kept
    return keep, pos, tl.sum(eq, 0), tl.sum(kept, 0)


@triton.jit
def _pad(out_row_ptr, k_eff, K, PAD_BLOCK: tl.constexpr):  # type: ignore[no-untyped-def]
    """out[k_eff:K] = -1."""
    for start in range(0, K, PAD_BLOCK):
        offs = start + tl.arange(0, PAD_BLOCK)
        tl.store(out_row_ptr + offs, tl.full([PAD_BLOCK], -1, tl.int64), mask=(offs >= k_eff) & (offs < K))


# ----------------------------------------------------------------------------------------- row / stream


@triton.jit
def _topk_row_kernel(  # type: ignore[no-untyped-def]
    scores_ptr, lengths_ptr, out_ptr, N, K, stride_s, BLOCK: tl.constexpr, PAD_BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    n = _row_len(lengths_ptr, row, N)
    k_eff = tl.minimum(n, K)
    offs = tl.arange(0, BLOCK)
    valid = offs < n
    key = _order_key(tl.load(scores_ptr + row.to(tl.int64) * stride_s + offs, mask=valid, other=0.0))
    prefix = tl.full([], 0, tl.uint32)
    k_rem = k_eff
    for p in tl.static_range(4):
        digit, k_rem = _find_bin(_digit_hist(key, valid, prefix, 24 - 8 * p), k_rem)
        prefix = prefix | (digit.to(tl.uint32) << (24 - 8 * p))
    keep, pos, _, _ = _select(key, valid, prefix, k_rem, 0, 0)
    out_row = out_ptr + row.to(tl.int64) * K
    tl.store(out_row + pos, offs.to(tl.int64), mask=keep & (pos < K))
    _pad(out_row, k_eff, K, PAD_BLOCK)


@triton.jit
def _topk_stream_kernel(  # type: ignore[no-untyped-def]
    scores_ptr, lengths_ptr, out_ptr, N, K, stride_s, BLOCK: tl.constexpr, PAD_BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    n = _row_len(lengths_ptr, row, N)
    k_eff = tl.minimum(n, K)
    row_ptr = scores_ptr + row.to(tl.int64) * stride_s
    prefix = tl.full([], 0, tl.uint32)
    k_rem = k_eff
    for p in tl.static_range(4):
        hist = tl.zeros([256], dtype=tl.int32)
        for start in range(0, n, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            valid = offs < n
            key = _order_key(tl.load(row_ptr + offs, mask=valid, other=0.0))
            hist += _digit_hist(key, valid, prefix, 24 - 8 * p)
        digit, k_rem = _find_bin(hist, k_rem)
        prefix = prefix | (digit.to(tl.uint32) << (24 - 8 * p))
    out_row = out_ptr + row.to(tl.int64) * K
    eq_seen = tl.zeros([], dtype=tl.int32)
    taken = tl.zeros([], dtype=tl.int32)
    for start in range(0, n, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        valid = offs < n
        key = _order_key(tl.load(row_ptr + offs, mask=valid, other=0.0))
        keep, pos, num_eq, num_kept = _select(key, valid, prefix, k_rem, eq_seen, taken)
        tl.store(out_row + pos, offs.to(tl.int64), mask=keep & (pos < K))
        eq_seen += num_eq
        taken += num_kept
    _pad(out_row, k_eff, K, PAD_BLOCK)


# ---------------------------------------------------------------------------------------------- split


@triton.jit
def _split_hist0_kernel(  # type: ignore[no-untyped-def]
    scores_ptr, lengths_ptr, hist_ptr, N, stride_s, P, CHUNK, BLOCK: tl.constexpr,
):
    pid = tl.program_id(0)
    row = pid // P
    lo = (pid % P) * CHUNK
    n = _row_len(lengths_ptr, row, N)
    hi = tl.minimum(lo + CHUNK, n)
    row_ptr = scores_ptr + row.to(tl.int64) * stride_s
    hist = tl.zeros([256], dtype=tl.int32)
    for start in range(lo, hi, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        valid = offs < hi
        key = _order_key(tl.load(row_ptr + offs, mask=valid, other=0.0))
        hist += _digit_hist(key, valid, tl.full([], 0, tl.uint32), 24)
    bins = tl.arange(0, 256)
    tl.atomic_add(hist_ptr + row * 1024 + bins, hist, mask=hist != 0)


@triton.jit
def _split_compact_kernel(  # type: ignore[no-untyped-def]
    scores_ptr, lengths_ptr, hist_ptr, cnt_ptr, cand_idx_ptr, cand_key_ptr, N, K, stride_s, P, CHUNK,
    BLOCK: tl.constexpr,
):
    # NOTE: reversed program order: the first programs re-read the chunks K1 touched last, still in L2.
    pid = tl.num_programs(0) - 1 - tl.program_id(0)
    row = pid // P
    lo = (pid % P) * CHUNK
    n = _row_len(lengths_ptr, row, N)
    hi = tl.minimum(lo + CHUNK, n)
    prefix, _ = _replay(hist_ptr + row * 1024, tl.minimum(n, K), 1)
    row_ptr = scores_ptr + row.to(tl.int64) * stride_s
    cand = row.to(tl.int64) * N + lo
    hist = tl.zeros([256], dtype=tl.int32)
    num = tl.zeros([], dtype=tl.int32)
    for start in range(lo, hi, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        valid = offs < hi
        key = _order_key(tl.load(row_ptr + offs, mask=valid, other=0.0))
        keep = (valid & (key >= prefix)).to(tl.int32)            # digit0 >= bin0: every index that can win
        slot = cand + num + tl.cumsum(keep, 0) - keep
        tl.store(cand_idx_ptr + slot, offs, mask=keep != 0)
        tl.store(cand_key_ptr + slot, key.to(tl.int32, bitcast=True), mask=keep != 0)
        num += tl.sum(keep, 0)
        hist += _digit_hist(key, valid, prefix, 16)
    tl.store(cnt_ptr + pid, num)
    tl.atomic_add(hist_ptr + row * 1024 + 256 + tl.arange(0, 256), hist, mask=hist != 0)


@triton.jit
def _split_hist_kernel(  # type: ignore[no-untyped-def]
    lengths_ptr, hist_ptr, cnt_ptr, cand_key_ptr, N, K, P, CHUNK, PASS: tl.constexpr, BLOCK: tl.constexpr,
):
    pid = tl.program_id(0)
    row = pid // P
    n = _row_len(lengths_ptr, row, N)
    prefix, _ = _replay(hist_ptr + row * 1024, tl.minimum(n, K), PASS)
    num = tl.load(cnt_ptr + pid)
    cand = cand_key_ptr + row.to(tl.int64) * N + (pid % P) * CHUNK
    hist = tl.zeros([256], dtype=tl.int32)
    for start in range(0, num, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        valid = offs < num
        key = tl.load(cand + offs, mask=valid, other=0).to(tl.uint32, bitcast=True)
        hist += _digit_hist(key, valid, prefix, 24 - 8 * PASS)
    tl.atomic_add(hist_ptr + row * 1024 + PASS * 256 + tl.arange(0, 256), hist, mask=hist != 0)


@triton.jit
def _split_select_kernel(  # type: ignore[no-untyped-def]
    lengths_ptr, out_ptr, hist_ptr, cnt_ptr, cand_idx_ptr, cand_key_ptr, flags_ptr, ticket_ptr, N, K, P, CHUNK,
    BLOCK: tl.constexpr, P_POW2: tl.constexpr, PAD_BLOCK: tl.constexpr,
):
    # NOTE: the ticket, not program_id, names the chunk: it guarantees every predecessor is already running.
    ticket = tl.atomic_add(ticket_ptr, 1)
    row = ticket // P
    part = ticket % P
    n = _row_len(lengths_ptr, row, N)
    k_eff = tl.minimum(n, K)
    thr, k_rem = _replay(hist_ptr + row * 1024, k_eff, 4)
    num = tl.load(cnt_ptr + ticket)
    cand = row.to(tl.int64) * N + part * CHUNK
    num_gt = tl.zeros([], dtype=tl.int32)
    num_eq = tl.zeros([], dtype=tl.int32)
    for start in range(0, num, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        valid = offs < num
        key = tl.load(cand_key_ptr + cand + offs, mask=valid, other=0).to(tl.uint32, bitcast=True)
        num_gt += tl.sum((valid & (key > thr)).to(tl.int32), 0)
        num_eq += tl.sum((valid & (key == thr)).to(tl.int32), 0)
    # publish 1 + (gt << 32) + eq (nonzero = ready), then wait for and sum every predecessor's counts
    flags_row = flags_ptr + row.to(tl.int64) * P
    tl.atomic_xchg(flags_row + part, 1 + (num_gt.to(tl.int64) << 32) + num_eq.to(tl.int64))
    ids = tl.arange(0, P_POW2)
    before = ids < part
    flags = tl.load(flags_row + ids, mask=before, other=1, volatile=True)
    pending = tl.sum((flags == 0).to(tl.int32), 0)
    while pending > 0:
        flags = tl.load(flags_row + ids, mask=before, other=1, volatile=True)
        pending = tl.sum((flags == 0).to(tl.int32), 0)
    counts = tl.where(before, flags - 1, 0)
    eq_seen = tl.sum(counts & 0xFFFFFFFF, 0).to(tl.int32)
    taken = tl.sum(counts >> 32, 0).to(tl.int32) + tl.minimum(eq_seen, k_rem)
    out_row = out_ptr + row.to(tl.int64) * K
    for start in range(0, num, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        valid = offs < num
        key = tl.load(cand_key_ptr + cand + offs, mask=valid, other=0).to(tl.uint32, bitcast=True)
        keep, pos, step_eq, step_kept = _select(key, valid, thr, k_rem, eq_seen, taken)
        idx = tl.load(cand_idx_ptr + cand + offs, mask=keep, other=0)
        tl.store(out_row + pos, idx.to(tl.int64), mask=keep & (pos < K))
        eq_seen += step_eq
        taken += step_kept
    if part == 0:
        _pad(out_row, k_eff, K, PAD_BLOCK)


# ---------------------------------------------------------------------------------------------- host


def _check_inputs(scores: torch.Tensor, lengths: torch.Tensor, k: int) -> None:
    if scores.dtype != torch.float32 or scores.dim() != 2 or not scores.is_contiguous():
        raise ValueError(f"scores must be a contiguous [B, N] float32 tensor, got {scores.dtype} "
                         f"{tuple(scores.shape)} contiguous={scores.is_contiguous()}")
    if lengths.dim() != 1 or lengths.shape[0] != scores.shape[0] or lengths.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"lengths must be an int32/int64 [B={scores.shape[0]}] tensor, got {lengths.dtype} "
                         f"{tuple(lengths.shape)}")
    if lengths.device != scores.device:
        raise ValueError(f"lengths on {lengths.device}, scores on {scores.device}")
    if not isinstance(k, int) or k < 1:
        raise ValueError(f"k must be an int >= 1, got {k!r}")


def _num_warps(block: int, cap: int) -> int:
    """About 16 elements per thread, so small test blocks do not replicate across idle warps."""
    return min(cap, max(1, block // 512))


def _launch_split(scores: torch.Tensor, lengths: torch.Tensor, out: torch.Tensor, plan: TopKPlan) -> None:
    B, N = scores.shape
    K = out.shape[1]
    P = plan.splits
    grid = (B * P,)
    # one memset: flags [B, P] int64 first (8-byte aligned), then hist [B, 4, 256] int32 and the ticket
    zeroed = torch.zeros(2 * B * P + B * 4 * NUM_BINS + 1, dtype=torch.int32, device=scores.device)
    flags = zeroed[: 2 * B * P].view(torch.int64)
    hist = zeroed[2 * B * P: 2 * B * P + B * 4 * NUM_BINS]
    ticket = zeroed[-1:]
    cnt = torch.empty(B * P, dtype=torch.int32, device=scores.device)
    cand_idx = torch.empty(B * N, dtype=torch.int32, device=scores.device)
    cand_key = torch.empty(B * N, dtype=torch.int32, device=scores.device)   # uint32 bits
    meta = dict(BLOCK=plan.block, num_warps=_num_warps(plan.block, 8))
    _split_hist0_kernel[grid](scores, lengths, hist, N, scores.stride(0), P, plan.chunk, **meta)
    _split_compact_kernel[grid](scores, lengths, hist, cnt, cand_idx, cand_key, N, K, scores.stride(0), P,
                                plan.chunk, **meta)
    for p in (2, 3):
        _split_hist_kernel[grid](lengths, hist, cnt, cand_key, N, K, P, plan.chunk, PASS=p, **meta)
    _split_select_kernel[grid](lengths, out, hist, cnt, cand_idx, cand_key, flags, ticket, N, K, P, plan.chunk,
                               P_POW2=max(16, triton.next_power_of_2(P)), PAD_BLOCK=1024, **meta)


def lightning_topk(scores: torch.Tensor, lengths: torch.Tensor, k: int, *,
                   config: TopKConfig = DEFAULT_CONFIG) -> torch.Tensor:
    """Same contract as `kernels/ref/topk.py::topk_ragged`: [B, N] fp32, [B] int, k -> [B, k] int64.

    No host syncs: the path comes from (B, N) and `config`; lengths stay on the device.
    """
    _check_inputs(scores, lengths, k)
    B, N = scores.shape
    out = torch.empty((B, k), dtype=torch.int64, device=scores.device)
    if B == 0 or N == 0:
        return out.fill_(-1)
    plan = plan_topk(B, N, config)
    if plan.path == "split":
        _launch_split(scores, lengths, out, plan)
    elif plan.path == "row":
        _topk_row_kernel[(B,)](scores, lengths, out, N, k, scores.stride(0), BLOCK=plan.block, PAD_BLOCK=1024,
                               num_warps=_num_warps(plan.block, 16))
    else:
        _topk_stream_kernel[(B,)](scores, lengths, out, N, k, scores.stride(0), BLOCK=plan.block, PAD_BLOCK=1024,
                                  num_warps=_num_warps(plan.block, 8))
    return out
