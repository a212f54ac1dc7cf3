"""Lightning TopK, long rows at small batch: ONE launch whose programs meet at grid-wide barriers.

Owns the `coop` path of `topk.py::lightning_topk`: `CoopPlan`, the kernel, its workspace layout and
`launch_coop`. Output contract: `kernels/ref/topk.py::topk_ragged`, exactly (lower index first among
ties, ascending indices, -1 padding), deterministic. Spec §6.6.

Why. At batch 1 the compact path (`topk_compact.py`) is latency-bound: two launches, then one
program per row finishing the selection alone (~20 block-wide steps in sequence, a large share of
its time: see benchmarks/results/kernels_i_h200_202611.md). Here every one of a row's P programs
keeps its chunk of keys in registers for the whole kernel and the row's programs take each radix
step together, exchanging only histograms:

    r1  8-bit digit 0 of every key -> H0 (tl.histogram, then atomics)                      barrier 1
        bin0 = find_bin(H0, k_eff); every program computes it, identically
    r2  the 12 bits below, of the keys in bin0 (~2% for real scores) -> H1 (atomics)       barrier 2
        bin1 = find_bin(H1, k_rem); pre20 = (bin0, bin1), the 20-bit bin of the k-th largest key
    r3  ties path (the bin holds <= cap keys, everyone knows H1[bin1]): each program appends its
        keys of that bin to one tie list (an atomic reservation) and stores its count of keys
        above the bin                                                                      barrier 3
        every program ranks the tie list (<= cap^2 compares: key, then lower index) -> the exact
        cut (key, index); its output offset = the earlier programs' counts + the kept ties of
        lower index; it writes its winners.
    r3' heavy ties (> cap keys in the bin): the low 12 bits of the bin's keys -> H2        barrier 3
        thr = the k-th largest key exactly; each program stores its counts of keys > thr and
        == thr                                                                             barrier 4
        offsets and the lower-index tie rule from those counts (select_block); it writes its
        winners.

Barriers. A row's counter only grows: each round adds exactly 2^16 (P - 1 programs add 1, program 0
adds the rest), so between rounds it is a multiple of 2^16 and an arriving program's target is the
next multiple above the value its atomic returned (wrap-around safe: P <= 2^16). Arrival: CTA
barrier, then one release atomic (every thread's earlier stores and atomics precede it:
cumulativity, as in cooperative groups' grid sync); wait: volatile polls, then an acquire fence.
Every program of the grid must be resident at once: `plan_topk` keeps B * P <= the SM count (one
program per SM always fits), so no program can wait on one that cannot start; a bounded spin
(`SPIN_LIMIT` polls, seconds) sets the row's error word and gives up instead of hanging.

Workspace (int32 words): per row a zeroed region
[H0 256 | H1 4096 | H2 4096 | counter, tie counter, error, ..16] then per-program counts [2, P_POW2]
and the tie list [cap] int64. The zeroed region must be zero before a call (`torch.zeros`, once) and
every call leaves it so: after its last barrier each program zeroes a 1/P slice of the histograms
(all reads of them precede that barrier), program 0 the tie counter; the counter stays a multiple of
2^16. Reuse a workspace on one stream only.

Under TRITON_INTERPRET=1 programs run one after another, so a barrier cannot be waited on: the same
kernel then runs as `STAGES` launches (`STAGE` 1..5 the steps, 6 the zeroing), each launch boundary
standing in for a barrier and each stage re-deriving the earlier bins from the (final) histograms;
`TopKConfig.coop_split` asks for that on a GPU too.
Test: tests/kernels/test_topk_coop.py. Benchmark: benchmarks/kernels/bench_topk.py.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from dsv4.kernels.triton.pdl import pdl_args
from dsv4.kernels.triton.pdl_enter import pdl_enter
from dsv4.kernels.triton.topk_radix import (
    find_bin,
    find_bin_count,
    order_key,
    pad_tail,
    row_len,
    select_block,
)
from dsv4.kernels.triton.topk_tail import stamp

# Row region: H0 [0, 256), H1 [256, 4352), H2 [4352, 8448), barrier counter, tie counter, error word
# at 8448..8450; 8464 words in all.
H1 = tl.constexpr(256)
H2 = tl.constexpr(4352)
CTR = tl.constexpr(8448)
TIES = tl.constexpr(8449)
ERR = tl.constexpr(8450)
HIST_WORDS = tl.constexpr(8448)  # the histograms: zeroed by the programs after their last barrier
ZERO_WORDS = tl.constexpr(8464)  # the zeroed region of one row
STAGES = tl.constexpr(6)         # launches of the split form: 5 steps, then the zeroing
# polls of one barrier before giving up (~seconds): a bug or a garbage workspace
SPIN_LIMIT = tl.constexpr(1 << 22)


@dataclass(frozen=True)
class CoopPlan:
    """Chunking of the coop path (built by `topk.py::plan_topk` from Python ints only)."""

    programs: int       # P: programs per row (B * P <= the GPU's SMs)
    chunk: int          # scores per program, a power of two (the program's register tile)
    warps: int          # num_warps
    cap: int            # tie-list capacity (power of two): more keys in the k-th largest's 20-bit
                        # bin -> r3'
    split: bool         # STAGES launches instead of one (the interpreter; `TopKConfig.coop_split`)


@triton.jit
def _find_bin_4096(hist_ptr, k_rem):  # type: ignore[no-untyped-def]
    """`find_bin_count` over the 4096 bins at hist_ptr in two levels: 256 groups of 16 bins (the
    group holding the bin, k_rem less the keys of the groups above it), then its 16 bins: a scan
    over 256 sums instead of 4096 bins. (Either search costs the same in the phase it sits in,
    which the histogram read and the barrier dominate: benchmarks/results/kernels_i_h200_202611.md.)
    """
    g = tl.arange(0, 256)
    tile = tl.load(hist_ptr + g[:, None] * 16 + tl.arange(0, 16)[None, :],
                   cache_modifier=".cg")   # [256, 16]
    group, k_rem, _ = find_bin_count(tl.sum(tile, 1), k_rem)
    digit, k_rem, count = find_bin_count(tl.sum(tl.where((g == group)[:, None], tile, 0), 0), k_rem)
    return group * 16 + digit, k_rem, count


@triton.jit
def _grid_sync(state, part, P, FUSED: tl.constexpr):  # type: ignore[no-untyped-def]
    """Barrier of the row's P programs (module docstring); a launch boundary does this in the split
    form."""
    if FUSED:
        tl.debug_barrier()      # every thread's stores and atomics precede the release below
        old = tl.atomic_add(state + CTR, tl.where(part == 0, 65536 - (P - 1), 1), sem="release",
                            scope="gpu")
        target = ((old.to(tl.uint32, bitcast=True) >> 16) + 1) << 16
        cur = tl.load(state + CTR, volatile=True).to(tl.uint32, bitcast=True)
        spins = tl.zeros([], tl.int32)
        while ((cur - target).to(tl.int32, bitcast=True) < 0) & (spins < SPIN_LIMIT):
            cur = tl.load(state + CTR, volatile=True).to(tl.uint32, bitcast=True)
            spins += 1
        if spins >= SPIN_LIMIT:
            tl.store(state + ERR, 1)
        tl.inline_asm_elementwise("fence.acq_rel.gpu; mov.u32 $0, 0;", "=r", [], dtype=tl.int32,
                                  is_pure=False, pack=1)


@triton.jit
def _pack(key, offs):  # type: ignore[no-untyped-def]
    return (key.to(tl.int64) << 32) | offs.to(tl.int64)


@triton.jit
def _unpack(packed):  # type: ignore[no-untyped-def]
    return ((packed >> 32).to(tl.int32).to(tl.uint32, bitcast=True),
            (packed & 0xFFFFFFFF).to(tl.int32))


@triton.jit
def _ties_cut(tie_list, num, k_rem, CAP: tl.constexpr):  # type: ignore[no-untyped-def]
    """The k_rem-th of the tie list's num keys in the output order (key descending, then index
    ascending): (its key, its index); also the list's indices and which entries are kept. Pairwise
    ranks: ranks are distinct (indices are)."""
    j = tl.arange(0, CAP)
    ok = j < num
    lkey, lidx = _unpack(tl.load(tie_list + j, mask=ok, other=0, cache_modifier=".cg"))
    before = ((lkey[:, None] > lkey[None, :])
              | ((lkey[:, None] == lkey[None, :]) & (lidx[:, None] < lidx[None, :])))
    rank = tl.sum((before & ok[:, None]).to(tl.int32), 0)       # [CAP]: entries ranked before j
    cut = ok & (rank == tl.minimum(k_rem, num) - 1)
    return (tl.max(tl.where(cut, lkey, 0), 0), tl.max(tl.where(cut, lidx, -1), 0), lidx,
            ok & (rank < k_rem))


@triton.jit(do_not_specialize=["N", "P"])
def _coop_kernel(  # type: ignore[no-untyped-def]
    scores_ptr, lengths_ptr, out_ptr, ws_ptr, N, K, stride_s, P, ROW_WORDS,
    CHUNK: tl.constexpr, CAP: tl.constexpr, P_POW2: tl.constexpr, ZERO_BLOCK: tl.constexpr,
    PAD_BLOCK: tl.constexpr, STAGE: tl.constexpr, probe_ptr, PROBE: tl.constexpr,
    PDL: tl.constexpr):
    pdl_enter(PDL)
    FUSED: tl.constexpr = STAGE == 0
    pid = tl.program_id(0)
    probe = probe_ptr + pid * 8
    stamp(probe, 0, PROBE)
    row = pid // P
    part = pid % P
    n = row_len(lengths_ptr, row, N)
    k_eff = tl.minimum(n, K)
    state = ws_ptr + row.to(tl.int64) * ROW_WORDS
    counts = state + ZERO_WORDS     # [2, P_POW2]: above-the-bin (or > thr) / == thr counts
    tie_list = (state + ZERO_WORDS + 2 * P_POW2).to(tl.pointer_type(tl.int64), bitcast=True)
    out_row = out_ptr + row.to(tl.int64) * K
    lo = part * CHUNK
    offs = lo + tl.arange(0, CHUNK)
    valid = offs < n
    key = order_key(tl.load(scores_ptr + row.to(tl.int64) * stride_s + offs, mask=valid, other=0.0))
    if STAGE < STAGES:              # (constexpr: the split form's last launch only zeroes)
        # ---- r1: digit 0 of every key
        if FUSED or STAGE == 1:
            h0 = tl.histogram((key >> 24).to(tl.int32), 256, mask=valid)
            tl.atomic_add(state + tl.arange(0, 256), h0, mask=h0 != 0, sem="relaxed", scope="gpu")
        stamp(probe, 1, PROBE)
        _grid_sync(state, part, P, FUSED)
        stamp(probe, 2, PROBE)
        bin0, k_rem = find_bin(tl.load(state + tl.arange(0, 256), cache_modifier=".cg"), k_eff)
        # ---- r2: the next 12 bits of bin0's keys
        if FUSED or STAGE == 2:
            tl.atomic_add(state + H1 + ((key >> 12) & 0xFFF).to(tl.int32), 1,
                          mask=valid & ((key >> 24) == bin0), sem="relaxed", scope="gpu")
        _grid_sync(state, part, P, FUSED)
        stamp(probe, 3, PROBE)
        bin1, k_rem, in_bin = _find_bin_4096(state + H1, k_rem)
        pre20 = (bin0.to(tl.uint32) << 12) | bin1.to(tl.uint32)
        tie = valid & ((key >> 12) == pre20)
        above = valid & ((key >> 12) > pre20)
        # ---- r3: the bin's keys -> one tie list (uniform: every program read the same H1)
        if in_bin <= CAP:
            if FUSED or STAGE == 3:
                t = tie.to(tl.int32)
                base = tl.atomic_add(state + TIES, tl.sum(t, 0), sem="relaxed", scope="gpu")
                tl.store(tie_list + base + tl.cumsum(t, 0) - t, _pack(key, offs), mask=tie)
                tl.store(counts + part, tl.sum(above.to(tl.int32), 0))
            _grid_sync(state, part, P, FUSED)
            stamp(probe, 4, PROBE)
            if FUSED or STAGE == 4:
                cut_key, cut_idx, lidx, kept = _ties_cut(tie_list, in_bin, k_rem, CAP)
                q = tl.arange(0, P_POW2)
                before = tl.sum(tl.load(counts + q, mask=q < part, other=0,
                                        cache_modifier=".cg"), 0) + \
                    tl.sum((kept & (lidx < lo)).to(tl.int32), 0)
                keep = above | (tie & ((key > cut_key) | ((key == cut_key) & (offs <= cut_idx))))
                kk = keep.to(tl.int32)
                pos = before + tl.cumsum(kk, 0) - kk
                tl.store(out_row + pos, offs.to(tl.int64), mask=keep & (pos < K))
        else:               # ---- r3': heavy ties, the last 12 bits, then counts
            if FUSED or STAGE == 3:
                tl.atomic_add(state + H2 + (key & 0xFFF).to(tl.int32), 1, mask=tie, sem="relaxed",
                              scope="gpu")
            _grid_sync(state, part, P, FUSED)
            stamp(probe, 4, PROBE)
            bin2, k_rem, _ = _find_bin_4096(state + H2, k_rem)
            thr = (pre20 << 12) | bin2.to(tl.uint32)
            if FUSED or STAGE == 4:
                tl.store(counts + part, tl.sum((valid & (key > thr)).to(tl.int32), 0))
                tl.store(counts + P_POW2 + part, tl.sum((valid & (key == thr)).to(tl.int32), 0))
            _grid_sync(state, part, P, FUSED)
            stamp(probe, 5, PROBE)
            if FUSED or STAGE == 5:
                q = tl.arange(0, P_POW2)
                gt = tl.load(counts + q, mask=q < P, other=0, cache_modifier=".cg")
                eq = tl.load(counts + P_POW2 + q, mask=q < P, other=0, cache_modifier=".cg")
                eq_before = tl.cumsum(eq, 0) - eq
                # [P_POW2] kept per program
                kept_q = gt + tl.minimum(tl.maximum(k_rem - eq_before, 0), eq)
                keep, pos, _, _ = select_block(key, valid, thr, k_rem,
                                               tl.sum(tl.where(q < part, eq, 0), 0),
                                               tl.sum(tl.where(q < part, kept_q, 0), 0))
                tl.store(out_row + pos, offs.to(tl.int64), mask=keep & (pos < K))
    # ---- after the last barrier (fused) / in a launch of its own (split: a stage's programs all
    # re-read the histograms, so none may zero them before the others have): leave the zeroed region
    # zero; pad the row
    stamp(probe, 6, PROBE)
    if FUSED or STAGE == STAGES:
        z = part + P * tl.arange(0, ZERO_BLOCK)
        tl.store(state + z, tl.zeros([ZERO_BLOCK], tl.int32), mask=z < HIST_WORDS)
        if part == 0:
            tl.store(state + TIES, 0)
            pad_tail(out_row, k_eff, K, PAD_BLOCK)


# --------------------------------------------------------------------------------------------- host


def row_words(plan: CoopPlan) -> int:
    """int32 words of one row's workspace: the zeroed region, the counts, the tie list (int64)."""
    return ZERO_WORDS.value + 2 * triton.next_power_of_2(plan.programs) + 2 * plan.cap


def coop_workspace_numel(B: int, plan: CoopPlan) -> int:
    return B * row_words(plan)


def launch_coop(scores: torch.Tensor, lengths: torch.Tensor, out: torch.Tensor, plan: CoopPlan,
                workspace: torch.Tensor | None = None, probe: torch.Tensor | None = None) -> None:
    """Fill out [B, k]: one launch (STAGES in the split form). `workspace`: int32,
    >= coop_workspace_numel words, its zeroed region zero (a `torch.zeros` buffer, reused on one
    stream: every call leaves it zero); None: a fresh zeroed one per call (one memset).

    `probe` (profiling only, fused form on a GPU): an int64 [B * P, 8] tensor; each program stores
    the global timer (ns) at 0 entry, 1 digit-0 histogram added, 2 / 3 / 4 past barriers 1 / 2 / 3,
    5 past barrier 4 (heavy ties only), 6 winners written. See bench_topk.py --probe."""
    B, N = scores.shape
    words = coop_workspace_numel(B, plan)
    if workspace is None:
        workspace = torch.zeros(words, dtype=torch.int32, device=scores.device)
    elif (workspace.dtype != torch.int32 or workspace.numel() < words
          or not workspace.is_contiguous()):
        raise ValueError(f"workspace must be a contiguous int32 tensor of >= {words} words, got "
                         f"{workspace.dtype} {workspace.numel()} "
                         f"contiguous={workspace.is_contiguous()}")
    if probe is not None and plan.split:
        raise ValueError("probe: the fused form only (a GPU, coop_split off)")
    p_pow2 = triton.next_power_of_2(plan.programs)
    args = (scores, lengths, out, workspace, N, out.shape[1], scores.stride(0), plan.programs,
            row_words(plan))
    meta = dict(CHUNK=plan.chunk, CAP=plan.cap, P_POW2=p_pow2,
                probe_ptr=out if probe is None else probe, PROBE=probe is not None,
                ZERO_BLOCK=triton.next_power_of_2(triton.cdiv(HIST_WORDS.value, plan.programs)),
                PAD_BLOCK=1024, num_warps=plan.warps, **pdl_args(scores.device))
    for stage in range(1, STAGES.value + 1) if plan.split else (0,):
        _coop_kernel[(B * plan.programs,)](*args, STAGE=stage, **meta)
