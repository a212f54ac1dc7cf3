"""Lightning TopK, compact path: the tail that finishes each row (see `topk_compact.py`).

Run by the row's last K2 program in exact mode, by the tail launch (one program per row) in bound
mode. Owns the exact selection over one row's candidate list, and the candidate format shared with
K2.

Candidates are packed int64 (score bits << 32) | index (one store per candidate; the key is computed
when it is read back: candidates are few, scores many). The row's candidate list, in index order, is
cand[:total] in exact mode (each chunk knew its offset). In bound mode chunk p stores its count_p
candidates in its own region cand[p * CHUNK:][:count_p]; list position i then lives in the chunk q
with starts[q] <= i < starts[q + 1] (`_cand_addr`: a binary search per element, no copy; or, with
`chunk_tile`, one [P, J] tile of all chunks).

Given bin0 (K2's lower bound, exact in exact mode), the row's candidate histograms hc0 / hc1 (summed
by K2's atomics) and the counts:

    bin0, k_rem = find_bin(hc0, k_eff)          (bound mode; K1's bin may have been low)
    bin1, k_rem = find_bin(hc1, k_rem)          (hc1 holds bin0's ties only if K1's bin was right,
                                                 else rescan)
    scratch <- every candidate with key >= (bin0, bin1, 0, 0), in order: the ~k winners above that
               16-bit bin plus its ties, for real scores a few hundred
    digits 2, 3 over the scratch list (in registers when it holds <= finish_block), then the
    index-order selection -> out[row]; -1 padding
    (over the whole candidate list instead if the scratch overflows: heavy ties, exact, just slower)
"""

from __future__ import annotations

import triton
import triton.language as tl

from dsv4.kernels.triton.topk_radix import digit_hist, find_bin, order_key, pad_tail, select_block

# K2 state row: hc0 [0, 256), hc1 [256, 512), done counter at 512, K2's bin0 at 513, counts
# [528, 528 + P2r), starts [528 + P2r, 528 + 2 * P2r), P2r = P2 rounded up to 16
HC1 = tl.constexpr(256)
DONE = tl.constexpr(512)
BIN0 = tl.constexpr(513)
COUNTS = tl.constexpr(528)


@triton.jit
def stamp(probe_ptr, j, PROBE: tl.constexpr):  # type: ignore[no-untyped-def]
    """Profiling aid (bench_topk.py --probe): probe[j] = the GPU's global nanosecond timer. Off: no
    code."""
    if PROBE:
        now = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64,
                                        is_pure=False, pack=1)
        tl.store(probe_ptr + j, now)


@triton.jit
def unpack(packed):  # type: ignore[no-untyped-def]
    """(key uint32, index int32) of packed candidates."""
    return (order_key((packed >> 32).to(tl.int32).to(tl.float32, bitcast=True)),
            (packed & 0xFFFFFFFF).to(tl.int32))


@triton.jit
def append_rows(keep, packed, dst_ptr, base, cap):  # type: ignore[no-untyped-def]
    """Append the kept packed candidates of a [rows, R] tile (row-major = index order) at
    dst[base:]; entries past dst[cap] are dropped; returns the new end. When a row is one 16-byte
    vector each thread owns whole rows, so ranks inside a row stay in registers and the block-wide
    scan runs over rows (~2.5x fewer instructions than a 1-D cumsum)."""
    kept = keep.to(tl.int32)
    row_tot = tl.sum(kept, 1)
    slot = base + (tl.cumsum(row_tot, 0) - row_tot)[:, None] + tl.cumsum(kept, 1) - kept
    tl.store(dst_ptr + slot, packed, mask=keep & (slot < cap))
    return base + tl.sum(row_tot, 0)


@triton.jit
def _cand_addr(i, starts_ptr, P, CHUNK, P_POW2: tl.constexpr):  # type: ignore[no-untyped-def]
    """Offset in the chunked candidate array of list position i: the largest q < P with
    starts[q] <= i (a binary search, log2(P_POW2) dependent loads that hit L1: this program wrote
    starts[]).

    NOTE: faster than a branch-free sum over the chunk starts (one compare per chunk per element);
    benchmarks/results/kernels_i_h200_202611.md."""
    q = tl.zeros_like(i)
    for s in tl.static_range(P_POW2.bit_length() - 1):
        mid = q + (P_POW2 >> (s + 1))
        ok = (mid < P) & (tl.load(starts_ptr + mid, mask=mid < P, other=0) <= i)
        q = tl.where(ok, mid, q)
    return q.to(tl.int64) * CHUNK + (i - tl.load(starts_ptr + q))


@triton.jit
def _load_cands(src_ptr, i, valid, starts_ptr, P, CHUNK,  # type: ignore[no-untyped-def]
                P_POW2: tl.constexpr, MAPPED: tl.constexpr):
    """Packed candidates at list positions i: of the chunked array (MAPPED) or of a contiguous
    list."""
    if MAPPED:
        packed = tl.load(src_ptr + _cand_addr(i, starts_ptr, P, CHUNK, P_POW2), mask=valid, other=0,
                         cache_modifier=".cg")
    else:
        packed = tl.load(src_ptr + i, mask=valid, other=0, cache_modifier=".cg")
    return packed


@triton.jit
def _scan_hist(src_ptr, num, prefix, starts_ptr, P, CHUNK,  # type: ignore[no-untyped-def]
               SHIFT: tl.constexpr, P_POW2: tl.constexpr, MAPPED: tl.constexpr,
               BLOCK: tl.constexpr):
    """Digit histogram (at SHIFT) of the candidates of the list [0, num) whose higher digits equal
    prefix's."""
    hist = tl.zeros([256], dtype=tl.int32)
    for start in range(0, num, BLOCK):
        i = start + tl.arange(0, BLOCK)
        key, _ = unpack(_load_cands(src_ptr, i, i < num, starts_ptr, P, CHUNK, P_POW2, MAPPED))
        hist += digit_hist(key, i < num, prefix, SHIFT)
    return hist


@triton.jit
def _compact_ge(src_ptr, num, thr, starts_ptr, P, CHUNK, dst_ptr,  # type: ignore[no-untyped-def]
                cap, P_POW2: tl.constexpr, MAPPED: tl.constexpr, BLOCK: tl.constexpr):
    """The candidates of the list [0, num) with key >= thr -> dst[:cap], in order; returns how many
    matched.

    Hand-pipelined: block i + 1 is loaded before block i is packed (one round trip per block
    otherwise)."""
    i = tl.arange(0, BLOCK // 2)[:, None] * 2 + tl.arange(0, 2)[None, :]
    taken = tl.zeros([], dtype=tl.int32)
    packed = _load_cands(src_ptr, i, i < num, starts_ptr, P, CHUNK, P_POW2, MAPPED)
    for start in range(0, num, BLOCK):
        nxt = start + BLOCK + i
        packed_next = _load_cands(src_ptr, nxt, nxt < num, starts_ptr, P, CHUNK, P_POW2, MAPPED)
        key, _ = unpack(packed)
        taken = append_rows((start + i < num) & (key >= thr), packed, dst_ptr, taken, cap)
        packed = packed_next
    return taken


@triton.jit
def _compact_ge_chunks(cand_ptr, bases, counts, thr, dst_ptr, cap,  # type: ignore[no-untyped-def]
                       P_POW2: tl.constexpr, J: tl.constexpr):
    """`_compact_ge` when every chunk holds <= J candidates: ONE load of a [P_POW2, J] tile (row p =
    chunk p's candidates at cand[bases[p]:][:counts[p]], zero-padded), no address search, one scan.
    Row-major order of the tile is the list's index order (chunk p's indices precede chunk
    p + 1's), which `append_rows` keeps."""
    j = tl.arange(0, J)
    valid = j[None, :] < counts[:, None]                        # counts[p] = 0 for p >= P
    packed = tl.load(cand_ptr + bases[:, None] + j[None, :], mask=valid, other=0,
                     cache_modifier=".cg")
    key, _ = unpack(packed)
    return append_rows(valid & (key >= thr), packed, dst_ptr, 0, cap)


@triton.jit
def _finish_tile(src_ptr, num, prefix, k_rem, out_row_ptr, K,  # type: ignore[no-untyped-def]
                 BLOCK: tl.constexpr):
    """`_finish` for a contiguous list of num <= BLOCK: loaded once, digits 2 and 3 and the
    selection in registers."""
    i = tl.arange(0, BLOCK)
    valid = i < num
    key, idx = unpack(tl.load(src_ptr + i, mask=valid, other=0, cache_modifier=".cg"))
    for p in tl.static_range(2, 4):
        digit, k_rem = find_bin(digit_hist(key, valid, prefix, 24 - 8 * p), k_rem)
        prefix = prefix | (digit.to(tl.uint32) << (24 - 8 * p))
    keep, pos, _, _ = select_block(key, valid, prefix, k_rem, 0, 0)
    tl.store(out_row_ptr + pos, idx.to(tl.int64), mask=keep & (pos < K))


@triton.jit
def _finish(src_ptr, num, prefix, k_rem, out_row_ptr, K, starts_ptr,  # type: ignore[no-untyped-def]
            P, CHUNK, P_POW2: tl.constexpr, MAPPED: tl.constexpr, BLOCK: tl.constexpr):
    """Digits 2 and 3 over the list [0, num) (which holds every key >= prefix), then write the
    winners."""
    for p in tl.static_range(2, 4):
        hist = _scan_hist(src_ptr, num, prefix, starts_ptr, P, CHUNK, 24 - 8 * p, P_POW2, MAPPED,
                          BLOCK)
        digit, k_rem = find_bin(hist, k_rem)
        prefix = prefix | (digit.to(tl.uint32) << (24 - 8 * p))
    eq_seen = tl.zeros([], dtype=tl.int32)
    taken = tl.zeros([], dtype=tl.int32)
    for start in range(0, num, BLOCK):
        i = start + tl.arange(0, BLOCK)
        key, idx = unpack(_load_cands(src_ptr, i, i < num, starts_ptr, P, CHUNK, P_POW2, MAPPED))
        keep, pos, step_eq, step_kept = select_block(key, i < num, prefix, k_rem, eq_seen, taken)
        tl.store(out_row_ptr + pos, idx.to(tl.int64), mask=keep & (pos < K))
        eq_seen += step_eq
        taken += step_kept


@triton.jit
def select_tail(  # type: ignore[no-untyped-def]
    out_row_ptr, state_ptr, cand_ptr, scr_ptr, k_eff, K, bin0_lb, k_rem_lb, total, P, CHUNK, SCR,
    EXACT: tl.constexpr, BLOCK: tl.constexpr, LIST_BLOCK: tl.constexpr, FINISH_BLOCK: tl.constexpr,
    P_POW2: tl.constexpr, PAD_BLOCK: tl.constexpr, probe_ptr, PROBE: tl.constexpr,
    CHUNK_TILE: tl.constexpr,
):
    """One row's finish: exact threshold over the row's candidates, then the output row.

    Exact mode: the list is cand[:total], contiguous, and bin0 / k_rem are exact. Bound mode: chunk
    p's candidates are cand[p * CHUNK:][:count_p]; total, starts and the exact bin0 are found here.
    CHUNK_TILE >= P_POW2 (0: off; bound mode only): when no chunk holds more than
    CHUNK_TILE // P_POW2 candidates, the scratch pass is one [P_POW2, CHUNK_TILE // P_POW2] tile
    load (chunk p's candidates start at p * CHUNK). Its registers are the whole kernel's, which
    bound mode's own tail launch can afford; in exact mode (the tail inside K2) it is slower on the
    H200 (benchmarks/results/kernels_i_h200_202611.md) and is never planned.
    """
    TILED: tl.constexpr = CHUNK_TILE >= P_POW2
    tl.static_assert(not (TILED and EXACT), "chunk_tile is a bound-mode option (plan_topk)")
    MAPPED: tl.constexpr = not EXACT
    starts_ptr = state_ptr + COUNTS + (P + 15) // 16 * 16
    bins = tl.arange(0, 256)
    bin0 = bin0_lb
    k_rem = k_rem_lb
    if MAPPED:
        ids = tl.arange(0, P_POW2)
        counts = tl.load(state_ptr + COUNTS + ids, mask=ids < P, other=0, cache_modifier=".cg")
        tl.store(starts_ptr + ids, tl.cumsum(counts, 0) - counts, mask=ids < P)
        total = tl.sum(counts, 0)
        bin0, k_rem = find_bin(tl.load(state_ptr + bins, cache_modifier=".cg"), k_eff)
        tl.debug_barrier()  # starts[] was stored by other threads of this program
    if TILED:
        bases = ids.to(tl.int64) * CHUNK
        most = tl.max(counts, 0)
    stamp(probe_ptr, 5, PROBE)
    hist1 = tl.load(state_ptr + HC1 + bins, cache_modifier=".cg")
    if bin0 != bin0_lb:     # bound mode's bin was low: hc1 histogrammed the wrong ties
        hist1 = _scan_hist(cand_ptr, total, bin0.to(tl.uint32) << 24, starts_ptr, P, CHUNK, 16,
                           P_POW2, MAPPED, BLOCK)
    bin1, k_rem = find_bin(hist1, k_rem)
    stamp(probe_ptr, 6, PROBE)
    prefix = (bin0.to(tl.uint32) << 24) | (bin1.to(tl.uint32) << 16)
    if TILED:
        if most <= CHUNK_TILE // P_POW2:
            num = _compact_ge_chunks(cand_ptr, bases, counts, prefix, scr_ptr, SCR, P_POW2,
                                     CHUNK_TILE // P_POW2)
        else:
            num = _compact_ge(cand_ptr, total, prefix, starts_ptr, P, CHUNK, scr_ptr, SCR, P_POW2,
                              MAPPED, BLOCK)
    else:
        num = _compact_ge(cand_ptr, total, prefix, starts_ptr, P, CHUNK, scr_ptr, SCR, P_POW2,
                          MAPPED, BLOCK)
    tl.debug_barrier()      # the scratch list was stored by other threads of this program
    stamp(probe_ptr, 7, PROBE)
    if PROBE:
        tl.store(probe_ptr + 10, num.to(tl.int64))
        tl.store(probe_ptr + 11, total.to(tl.int64))
    if num <= SCR:              # the scratch holds the whole list (else it overflowed: heavy ties)
        if num <= FINISH_BLOCK:     # the common case: ~k winners and a few ties
            _finish_tile(scr_ptr, num, prefix, k_rem, out_row_ptr, K, FINISH_BLOCK)
        else:
            _finish(scr_ptr, num, prefix, k_rem, out_row_ptr, K, starts_ptr, P, CHUNK, P_POW2,
                    False, LIST_BLOCK)
    else:
        _finish(cand_ptr, total, prefix, k_rem, out_row_ptr, K, starts_ptr, P, CHUNK, P_POW2,
                MAPPED, BLOCK)
    stamp(probe_ptr, 8, PROBE)
    pad_tail(out_row_ptr, k_eff, K, PAD_BLOCK)
    stamp(probe_ptr, 9, PROBE)
