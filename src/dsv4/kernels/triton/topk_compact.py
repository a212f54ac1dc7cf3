"""Lightning TopK, long rows: 2 launches (exact mode) or 3 (bound mode), no memset (spec §6.6).

Owns the `compact` path of `topk.py::lightning_topk` (rows longer than `TopKConfig.row_max`): K1,
K2, the bound-mode tail launch, the workspace layout and `launch_compact`; the tail that finishes
each row lives in `topk_tail.py`. Output contract: `kernels/ref/topk.py::topk_ragged`, exactly (the
lower-index tie rule included), deterministic.

    K1 hist     grid B x P1. Each chunk's digit-0 histogram (key >> 24), stored as counts of digit
                >= d in its own slot ge0[b, p1, :] (plain stores). Exact mode (group 1): of every
                key. Bound mode (group G): of the max of each group of G scores (group j = scores j,
                j + M, j + 2M, .. of a block: strided, so neighbours with similar scores land in
                different groups); G x fewer `tl.histogram` updates, the costly op (Triton 3.6: a
                ballot per bin bit and a popcount per 32 bins, per element). K1 also zeroes K2's
                per-row state. Bound mode may sample (`TopKConfig.sample`): every sample-th block of
                a long row; any subset gives a valid lower bound, only a looser one.
    K2 compact  grid B x P2. bin0 = largest d with (sum of the row's slots)[d] >= k_eff. Exact mode:
                digit 0 of the k-th largest key. Bound mode: a lower bound of it (>= k_eff groups
                have a max in a bin >= bin0, so >= k_eff distinct scores do). Candidates = scores
                with key >= bin0 << 24 (one float compare, `bin_floor`): every possible winner; for
                Gaussian-like scores a few percent of the row (a digit-0 bin spans two octaves). The
                chunk packs them, in index order, into cand[b]: in exact mode at its offset in one
                contiguous list (K1 chunks = K2 chunks, so column bin0 of the earlier chunks' slots
                counts their candidates), in bound mode into its own region (an offset would need a
                look-back). No program ever waits for another. It stores its count and adds its
                candidates' histograms (digit 0 in bound mode; digit 1 of bin0's ties) into the
                row's hc0 / hc1. Exact mode: it then bumps the row's done counter, and the program
                that brings it to P2 runs `topk_tail.select_tail` (no third launch: at B = 1 a
                launch costs more than the tail). K2 reads K1's slots as one [P1, 256] register tile
                (one round trip), and its compaction loop is hand-pipelined (the next block's load
                is issued before this block is packed).
    K3 tail     bound mode only, grid B: `select_tail` per row after K2 has finished. Its own launch
                because the tail's register tiles (~110 registers a thread) would otherwise be K2's
                too (59 at 1024 x 8 warps), and K2's occupancy is what bounds it at large batch
                (timed in benchmarks/results/kernels_i_h200_202611.md).

Memory ordering (K2, exact mode). Each program's candidate and count stores and its hc atomics
precede a CTA barrier; one thread then bumps the done counter (atomic_add, acq_rel, gpu scope: on
sm_90 a MEMBAR.GPU before and an L1 invalidate after). The barrier orders every thread's writes
before that release (cumulativity, the pattern of cooperative groups' grid sync and of CUDA's
threadFenceReduction), and the counter's RMWs form a release sequence, so the program that reads
P2 - 1 acquires every chunk's writes; the tail still reads them with L1-bypassing (.cg) loads.
Nobody waits on anybody, so there is no deadlock at any occupancy, and under TRITON_INTERPRET=1
(programs run one after another) the last program in order is the one that finishes.

Workspace (int32 words, any initial contents, so one buffer can be reused call after call): ge0
slots [B, P1, 256] | state [B, 528 + 2 * P2 rounded to 16] (hc0, hc1, done counter, bin0, counts,
starts; zeroed by K1 each call: nothing carries over and no memset node is needed) | cand [B, N]
int64 (worst case every score is a candidate) | scratch [B, k + block] int64.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from dsv4.kernels.triton.pdl import pdl_args
from dsv4.kernels.triton.pdl_enter import pdl_enter
from dsv4.kernels.triton.topk_radix import bin_floor, digit_hist, order_key, row_len
from dsv4.kernels.triton.topk_tail import (
    BIN0,
    COUNTS,
    DONE,
    HC1,
    append_rows,
    select_tail,
    stamp,
    unpack,
)

STATE_FIXED = 528           # words of a state row before the counts (see topk_tail.COUNTS)


@dataclass(frozen=True)
class CompactPlan:
    """Chunking of the compact path (built by `topk.py::plan_topk` from Python ints only)."""

    block: int          # elements per loop step of K1, a power of two
    group: int          # K1 group size; 1 = exact mode
    sample: int         # bound mode: K1 histograms every sample-th block of long rows (1: all;
                        # exact mode: 1)
    hist_splits: int    # P1: K1 programs per row
    hist_chunk: int     # elements per K1 program, a multiple of block
    hist_warps: int     # K1 num_warps
    splits: int         # P2: K2 programs per row
    chunk: int          # elements per K2 program, a multiple of block
    warps: int          # K2 num_warps
    compact_block: int  # loop step of the compaction (power of two <= block; sets K2's registers)
    small_block: int    # loop step over one chunk's candidates (power of two)
    tail_block: int     # loop step of the tail's passes over the candidate list (power of two)
    chunk_tile: int     # bound mode: the tail's scratch pass as one [P2, chunk_tile // P2] load
                        # when it fits (0: off; always 0 in exact mode)
    finish_block: int   # largest register tile of the tail's last step (power of two; <= 2k of
                        # it is used)

    @property
    def exact(self) -> bool:
        return self.group == 1


# ----------------------------------------------------------------------------------------------- K1


@triton.jit
def _hist_offs(start, GROUP: tl.constexpr, BLOCK: tl.constexpr):  # type: ignore[no-untyped-def]
    """Offsets of one K1 block: [BLOCK] (GROUP 1) or [GROUP, BLOCK // GROUP], group j = column j
    (strided, so neighbours with similar scores land in different groups; the max runs over the axis
    a thread holds)."""
    if GROUP == 1:
        offs = start + tl.arange(0, BLOCK)
    else:
        offs = (start + tl.arange(0, GROUP)[:, None] * (BLOCK // GROUP)
                + tl.arange(0, BLOCK // GROUP)[None, :])
    return offs


@triton.jit
def _block_hist0(x, offs, hi, MASKED: tl.constexpr,  # type: ignore[no-untyped-def]
                 GROUP: tl.constexpr):
    """Digit-0 histogram of one loaded block: of every key (GROUP 1) or of each group's max.
    MASKED: the last.

    NOTE: a float max may skip NaNs (GPU) or keep them (interpreter): both are <= the group's max
    key, which is all the lower bound needs."""
    if GROUP == 1:
        key = (order_key(x) >> 24).to(tl.int32)
        hist = tl.histogram(key, 256, mask=offs < hi) if MASKED else tl.histogram(key, 256)
    else:
        key = (order_key(tl.max(x, axis=0)) >> 24).to(tl.int32)
        hist = (tl.histogram(key, 256, mask=tl.min(offs, axis=0) < hi) if MASKED
                else tl.histogram(key, 256))
    return hist


@triton.jit(do_not_specialize=["N", "P1"])
def _hist_kernel(  # type: ignore[no-untyped-def]
    scores_ptr, lengths_ptr, slots_ptr, state_ptr, N, K, stride_s, P1, CHUNK1, STATE_LEN,
    GROUP: tl.constexpr, BLOCK: tl.constexpr, ZERO_BLOCK: tl.constexpr, SAMPLE: tl.constexpr,
    PDL: tl.constexpr):
    pdl_enter(PDL)
    pid = tl.program_id(0)
    row = pid // P1
    lo = (pid % P1) * CHUNK1
    n = row_len(lengths_ptr, row, N)
    hi = tl.maximum(tl.minimum(lo + CHUNK1, n), lo)
    # unmasked (vectorised) blocks, then one masked
    full = lo + (hi - lo) // BLOCK * BLOCK
    row_ptr = scores_ptr + row.to(tl.int64) * stride_s
    # Bound mode may histogram only every SAMPLE-th full block: the histogram of ANY subset of the
    # row still gives a valid lower bound of the k-th largest (>= k sampled scores at or above a bin
    # => >= k in the row); it is only looser (about the row's (SAMPLE * k)-th largest), so long rows
    # only (n >= 16 * SAMPLE * k).
    if SAMPLE > 1:
        step = tl.where(n >= 16 * SAMPLE * K, BLOCK * SAMPLE, BLOCK)
        last = lo + (full - lo - BLOCK) // step * step  # the last block start on the sampling grid
    else:               # NOTE: statically the unsampled loop (the form measured and GPU-tested)
        step = BLOCK
        last = full - BLOCK
    hist = tl.zeros([256], dtype=tl.int32)
    if full > lo:                                       # hand-pipelined as in `_compact_chunk`
        x = tl.load(row_ptr + _hist_offs(lo, GROUP, BLOCK))
        for start in range(lo, full, step):
            x_next = tl.load(row_ptr + _hist_offs(tl.minimum(start + step, last), GROUP, BLOCK))
            hist += _block_hist0(x, None, hi, False, GROUP)
            x = x_next
    if full < hi:
        offs = _hist_offs(full, GROUP, BLOCK)
        x = tl.load(row_ptr + offs, mask=offs < hi, other=float("-inf") if GROUP > 1 else 0.0)
        hist += _block_hist0(x, offs, hi, True, GROUP)
    # count(digit >= d): K2 sums these and reads columns
    ge = tl.sum(hist, 0) - tl.cumsum(hist, 0) + hist
    tl.store(slots_ptr + pid.to(tl.int64) * 256 + tl.arange(0, 256), ge)
    # NOTE: K2's row state is zeroed here, one launch before K2 uses it: no memset node, nothing
    # survives between calls, and a reused (or garbage-filled) workspace is fine.
    if pid % P1 == 0:
        state = state_ptr + row.to(tl.int64) * STATE_LEN
        for start in range(0, STATE_LEN, ZERO_BLOCK):
            offs = start + tl.arange(0, ZERO_BLOCK)
            tl.store(state + offs, tl.zeros([ZERO_BLOCK], dtype=tl.int32), mask=offs < STATE_LEN)


# ----------------------------------------------------------------------------------------------- K2


@triton.jit
def _row_slots(slots_row_ptr, P1, P1_POW2: tl.constexpr):  # type: ignore[no-untyped-def]
    """The row's K1 slots as one [P1_POW2, 256] register tile (one round trip: the slots sit in L2)
    and their sum over chunks, count(digit 0 >= d) over the row."""
    q = tl.arange(0, P1_POW2)
    tile = tl.load(slots_row_ptr + q[:, None] * 256 + tl.arange(0, 256)[None, :],
                   mask=q[:, None] < P1, other=0)
    return tile, tl.sum(tile, 0)


@triton.jit
def _find_bin_ge(ge, k_rem):  # type: ignore[no-untyped-def]
    """`find_bin` from count(digit >= d) instead of the histogram."""
    bins = tl.arange(0, 256)
    digit = tl.max(tl.where(ge >= k_rem, bins, 0), 0)
    return digit, k_rem - tl.sum(tl.where(bins == digit + 1, ge, 0), 0)  # minus count(digit > bin)


@triton.jit
def _exact_offset(tile, part, bin0, P1_POW2: tl.constexpr):  # type: ignore[no-untyped-def]
    """Exact mode (K1 chunks = K2 chunks): candidates (digit 0 >= bin0) in the row's chunks before
    `part`, read off the slot tile already in registers (column bin0 of the earlier chunks)."""
    q = tl.arange(0, P1_POW2)
    take = (q < part)[:, None] & (tl.arange(0, 256) == bin0)[None, :]
    return tl.sum(tl.sum(tl.where(take, tile, 0), 1), 0)


@triton.jit
def _block_offs(start, BLOCK: tl.constexpr):  # type: ignore[no-untyped-def]
    """Offsets of one block as rows of 4 scores (one 16-byte load per row; rows are index order)."""
    return start + tl.arange(0, BLOCK // 4)[:, None] * 4 + tl.arange(0, 4)[None, :]


@triton.jit
def _append_block(x, offs, keep, dst_ptr, base, hi):  # type: ignore[no-untyped-def]
    """Append the kept scores of one block, packed with their indices, to dst[base:]; returns the
    new end."""
    packed = (x.to(tl.int32, bitcast=True).to(tl.int64) << 32) | offs.to(tl.int64)
    return append_rows(keep, packed, dst_ptr, base, hi)


@triton.jit
def _compact_chunk(row_ptr, lo, hi, floor, dst_ptr,  # type: ignore[no-untyped-def]
                   BLOCK: tl.constexpr):
    """Every candidate of scores[lo:hi] (not below `floor`), packed, -> dst in index order; returns
    the count.

    The full blocks are software-pipelined by hand: block i + 1 is loaded before block i is
    processed, so a program keeps two blocks of loads in flight instead of waiting one round trip
    per block (tl.range's num_stages does not pipeline this loop; see
    benchmarks/results/kernels_i_h200_202611.md). The prefetch address is clamped to the last full
    block, which keeps every full-block load unmasked (128-bit vectors)."""
    full = lo + (hi - lo) // BLOCK * BLOCK
    num = tl.zeros([], dtype=tl.int32)
    if full > lo:
        x = tl.load(row_ptr + _block_offs(lo, BLOCK))
        for start in range(lo, full, BLOCK):
            x_next = tl.load(row_ptr + _block_offs(tl.minimum(start + BLOCK, full - BLOCK), BLOCK))
            offs = _block_offs(start, BLOCK)
            num = _append_block(x, offs, ~(x < floor), dst_ptr, num, hi)
            x = x_next
    if full < hi:
        offs = _block_offs(full, BLOCK)
        x = tl.load(row_ptr + offs, mask=offs < hi, other=0.0)
        num = _append_block(x, offs, (offs < hi) & ~(x < floor), dst_ptr, num, hi)
    return num


@triton.jit
def _cand_hists(state_ptr, cand_ptr, num, bin0,  # type: ignore[no-untyped-def]
                EXACT: tl.constexpr, BLOCK: tl.constexpr):
    """Add this chunk's candidate histograms to the row's: digit 0 (bound mode) -> hc0, digit 1 of
    bin0 -> hc1."""
    h0 = tl.zeros([256], dtype=tl.int32)
    h1 = tl.zeros([256], dtype=tl.int32)
    prefix = bin0.to(tl.uint32) << 24
    for start in range(0, num, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        key, _ = unpack(tl.load(cand_ptr + offs, mask=offs < num, other=0, cache_modifier=".cg"))
        if not EXACT:
            h0 += tl.histogram((key >> 24).to(tl.int32), 256, mask=offs < num)
        h1 += digit_hist(key, offs < num, prefix, 16)
    bins = tl.arange(0, 256)
    if not EXACT:
        tl.atomic_add(state_ptr + bins, h0, mask=h0 != 0, sem="relaxed")
    tl.atomic_add(state_ptr + HC1 + bins, h1, mask=h1 != 0, sem="relaxed")


@triton.jit(do_not_specialize=["B", "N", "P1", "P2"])
def _compact_kernel(  # type: ignore[no-untyped-def]
    scores_ptr, lengths_ptr, out_ptr, slots_ptr, state_ptr, cand_ptr, scr_ptr, B, N, K, stride_s,
    P1, P2, CHUNK, STATE_LEN, SCR, EXACT: tl.constexpr, CBLOCK: tl.constexpr,
    TBLOCK: tl.constexpr, LIST_BLOCK: tl.constexpr, SMALL_BLOCK: tl.constexpr,
    FINISH_BLOCK: tl.constexpr, P1_POW2: tl.constexpr, P2_POW2: tl.constexpr,
    PAD_BLOCK: tl.constexpr, probe_ptr, PROBE: tl.constexpr, CHUNK_TILE: tl.constexpr,
    PDL: tl.constexpr):
    pdl_enter(PDL)
    pid = tl.program_id(0)
    probe = probe_ptr + pid * 16
    stamp(probe, 0, PROBE)
    row = B - 1 - pid // P2     # rows in reverse: K1 ran them forward, so these are still in L2
    part = pid % P2
    n = row_len(lengths_ptr, row, N)
    k_eff = tl.minimum(n, K)
    lo = part * CHUNK
    hi = tl.maximum(tl.minimum(lo + CHUNK, n), lo)
    state = state_ptr + row.to(tl.int64) * STATE_LEN
    slots = slots_ptr + row.to(tl.int64) * P1 * 256
    tile, ge = _row_slots(slots, P1, P1_POW2)
    bin0, k_rem = _find_bin_ge(ge, k_eff)
    if EXACT:   # one contiguous list: the chunk's offset comes off the exact slots
        offset = _exact_offset(tile, part, bin0, P1_POW2)
        total = tl.sum(tl.where(tl.arange(0, 256) == bin0, ge, 0), 0)
    else:       # the chunk's own region; the tail sums the counts
        offset, total = lo, 0
        if part == 0:   # for the tail launch (every program of the row has the same bin0)
            tl.store(state + BIN0, bin0)
    cand = cand_ptr + row.to(tl.int64) * N
    stamp(probe, 1, PROBE)
    num = _compact_chunk(scores_ptr + row.to(tl.int64) * stride_s, lo, hi, bin_floor(bin0),
                         cand + offset, CBLOCK)
    tl.store(state + COUNTS + part, num)
    tl.debug_barrier()                  # this chunk's candidates were stored by all of its threads
    stamp(probe, 2, PROBE)
    _cand_hists(state, cand + offset, num, bin0, EXACT, SMALL_BLOCK)
    stamp(probe, 3, PROBE)
    # latency mode: the row's last program finishes it (bound mode: `_tail_kernel`, a launch later)
    if EXACT:
        tl.debug_barrier()      # every thread's stores and atomics precede the release below
        done = tl.atomic_add(state + DONE, 1, sem="acq_rel", scope="gpu")
        stamp(probe, 4, PROBE)
        if done == P2 - 1:
            select_tail(out_ptr + row.to(tl.int64) * K, state, cand,
                        scr_ptr + row.to(tl.int64) * SCR, k_eff, K, bin0, k_rem, total, P2, CHUNK,
                        SCR, EXACT, TBLOCK, LIST_BLOCK, FINISH_BLOCK, P2_POW2, PAD_BLOCK, probe,
                        PROBE, CHUNK_TILE)


@triton.jit(do_not_specialize=["N", "P2"])
def _tail_kernel(  # type: ignore[no-untyped-def]
    lengths_ptr, out_ptr, state_ptr, cand_ptr, scr_ptr, N, K, P2, CHUNK, STATE_LEN, SCR,
    TBLOCK: tl.constexpr, LIST_BLOCK: tl.constexpr, FINISH_BLOCK: tl.constexpr,
    P2_POW2: tl.constexpr, PAD_BLOCK: tl.constexpr, probe_ptr, PROBE: tl.constexpr,
    CHUNK_TILE: tl.constexpr, PDL: tl.constexpr):
    """Bound mode: one program per row runs `select_tail` after K2 (its own launch, so K2 does not
    carry the tail's registers: at 8 warps ~3x K2's otherwise, which cost K2 most of its occupancy
    at large batch). K2's lower-bound bin0 comes from the row state (stored by the row's first K2
    program), not recomputed from K1's slots; the tail finds the exact bin0 and k_rem from hc0
    itself, so k_eff stands in for K2's k_rem."""
    pdl_enter(PDL)
    row = tl.program_id(0)
    probe = probe_ptr + row.to(tl.int64) * P2 * 16
    stamp(probe, 4, PROBE)
    k_eff = tl.minimum(row_len(lengths_ptr, row, N), K)
    r = row.to(tl.int64)
    state = state_ptr + r * STATE_LEN
    select_tail(out_ptr + r * K, state, cand_ptr + r * N, scr_ptr + r * SCR, k_eff, K,
                tl.load(state + BIN0), k_eff, 0, P2, CHUNK, SCR, False, TBLOCK, LIST_BLOCK,
                FINISH_BLOCK, P2_POW2, PAD_BLOCK, probe, PROBE, CHUNK_TILE)


# --------------------------------------------------------------------------------------------- host


def _round16(n: int) -> int:
    return (n + 15) // 16 * 16


def _state_len(plan: CompactPlan) -> int:
    return STATE_FIXED + 2 * _round16(plan.splits)


def _region_sizes(B: int, N: int, k: int, plan: CompactPlan) -> list[int]:
    """int32 words of: hist0 slots, state, candidates (int64), scratch (int64)."""
    return [B * plan.hist_splits * 256, B * _state_len(plan), 2 * _round16(B * N),
            2 * _round16(B * (k + plan.block))]


def workspace_numel(B: int, N: int, k: int, plan: CompactPlan) -> int:
    """int32 words of the compact path's workspace for a [B, N] problem (see the module
    docstring)."""
    return sum(_region_sizes(B, N, k, plan))


def launch_compact(scores: torch.Tensor, lengths: torch.Tensor, out: torch.Tensor,
                   plan: CompactPlan, workspace: torch.Tensor | None = None,
                   probe: torch.Tensor | None = None) -> None:
    """Fill out [B, k] with K1 (histograms) and K2 (compact, then select). No host sync, no memset.

    `probe` (profiling only, GPU only): an int64 [B * plan.splits, 16] tensor; each K2 program
    stores the global timer (ns) at its phase boundaries into its row (0 entry, 1 bin0 known, 2
    compacted, 3 candidate histograms added, 4 done counter bumped) and the row's last program also
    at the tail's (5 start, 6 bin1, 7 scratch list, 8 selected, 9 padded; 10 scratch length, 11
    candidates). See bench_topk.py --probe.
    """
    B, N = scores.shape
    K = out.shape[1]
    sizes = _region_sizes(B, N, K, plan)
    if workspace is None:
        workspace = torch.empty(sum(sizes), dtype=torch.int32, device=scores.device)
    elif (workspace.dtype != torch.int32 or workspace.numel() < sum(sizes)
          or not workspace.is_contiguous()):
        raise ValueError(f"workspace must be a contiguous int32 tensor of >= {sum(sizes)} words, "
                         f"got {workspace.dtype} {workspace.numel()} "
                         f"contiguous={workspace.is_contiguous()}")
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    slots, state, cand, scr = (workspace[s: s + size]
                               for s, size in zip(starts, sizes, strict=True))
    probing = dict(probe_ptr=out if probe is None else probe, PROBE=probe is not None)
    tail = dict(TBLOCK=plan.tail_block, LIST_BLOCK=min(plan.tail_block, 1024),
                FINISH_BLOCK=min(plan.finish_block, max(1024, triton.next_power_of_2(2 * K))),
                P2_POW2=max(16, triton.next_power_of_2(plan.splits)), PAD_BLOCK=1024,
                CHUNK_TILE=plan.chunk_tile, **probing)
    cand, scr = cand.view(torch.int64), scr.view(torch.int64)
    _hist_kernel[(B * plan.hist_splits,)](
        scores, lengths, slots, state, N, K, scores.stride(0), plan.hist_splits, plan.hist_chunk,
        _state_len(plan), GROUP=plan.group, BLOCK=plan.block, ZERO_BLOCK=1024, SAMPLE=plan.sample,
        num_warps=plan.hist_warps, **pdl_args(scores.device))
    _compact_kernel[(B * plan.splits,)](
        scores, lengths, out, slots, state, cand, scr, B, N, K, scores.stride(0), plan.hist_splits,
        plan.splits, plan.chunk, _state_len(plan), K + plan.block, EXACT=plan.exact,
        CBLOCK=plan.compact_block, SMALL_BLOCK=plan.small_block,
        P1_POW2=max(16, triton.next_power_of_2(plan.hist_splits)), num_warps=plan.warps, **tail,
        **pdl_args(scores.device))
    if not plan.exact:
        _tail_kernel[(B,)](lengths, out, state, cand, scr, N, K, plan.splits, plan.chunk,
                           _state_len(plan), K + plan.block, num_warps=8, **tail,
                           **pdl_args(lengths.device))
