"""Flash Compressor: one fused Triton pass for a compressor's serving step (spec §6.5).

Owns `triton_compress_cached`, the fast form of `kernels/ref/compressor.py::compress_cached`
(serving-reference §1.6; same signature, same semantics; the `triton` kernel backend maps
`KernelOps.compress` to it). For T new tokens with S source slots each (S = 2m for the overlap C4
compressor, m for C128), Dc output channels and c*Dc projected ones:

    for every token t that completes a window (write_slot[t] != trash):
        z_s, k_s = score / kv row of source slot s: this step's row src_new[t, s] if
                   from_new[t, s], else ring row src_ring[t, s]; columns [0, Dc) for s < m,
                   [Dc, 2Dc) for s >= m (overlap)
        pooled   = Σ_s softmax_s(z_s) k_s           per channel, over valid slots only
        entry    = RoPE_pos(norm_w * pooled / sqrt(mean(pooled²) + eps))
                                                    RoPE on the trailing rd channels
        out[write_slot[t]] = entry.to(out.dtype)
    then for every token with ring_write[t] != trash:  ring_kv/score[ring_write[t]] = kv/score[t]

Kernel design. Grid = (T,): program t owns token t and the whole Dc row of its entry, so the
RMSNorm's sum of squares is a register reduction (no second pass, no workspace). It walks the S
slots in BLOCK_S chunks with an online softmax per channel (running max m, denominator l,
accumulator acc, each [BLOCK_D] fp32):

    for each chunk of BLOCK_S slots:                 index rows: 4 small [BLOCK_S] loads
        K, Z = one gather each ([BLOCK_S, BLOCK_D] fp32) through a per-slot row pointer: this
               step's row where from_new, else the ring row; masked on valid (a masked-off lane
               moves no bytes; Z = -inf)
        m' = max(m, max_s Z);  l = l e^(m-m') + Σ_s e^(Z-m');  acc = acc e^(m-m') + Σ_s e^(Z-m') K
    pooled = acc / l  ->  norm  ->  RoPE on (even, odd) pairs (tl.split of a [BLOCK_D/2, 2] view)
        ->  store

Each source row half is Dc * 4 contiguous bytes (2 KB for Dc = 512): the gathers are row-granular,
coalesced and 128-bit vectorised. The geometry (S, m, Dc, c*Dc, first rope pair) is constexpr: one
compile per compressor shape and configuration (sm_90, triton 3.6, `default_config`'s choices:
56-128 registers, no spills).

Latency. In decode a program moves little (C4 attention ~42 KB, indexer ~11 KB), so the number of
dependent memory round trips, not bandwidth, sets its time. Loads that depend on no loaded value go
first: round trip 1 carries write_slot, ring_write, the window's index rows (one chunk, or two with
PREFETCH: C4's whole window at BLOCK_S = S / 2), the token's own kv / score row for the ring copy
(unmasked: row t is in bounds) and the norm weight; round trip 2 the gathers, with cos / sin (one
joined load) behind them. Whatever waits on a loaded value comes after the loads it must not delay:
the ring-row stores, the branch on write_slot, and the layout conversions through shared memory of w
and cos / sin (a conversion waits for its load, and the next load in program order waits behind it,
hence w last in round trip 1 and cos / sin after the gathers). Tokens that complete no window (m-1
of every m tokens in prefill) branch past the pooling after round trip 1. Long windows (C128: 4-32
chunks, up to 16 warps at <= 128 registers) load each chunk's index rows in its loop iteration
instead (2 round trips per chunk; many resident programs hide them at large batch). Measurements:
benchmarks/results/compressor_h200_202611.md.

Ring rows, and why a second launch. The reference reads every ring row before it writes any. A
program that wrote its token's ring row while another program of the same launch still had to read
the old contents would race. That happens only when some request brings n >= ring - S + 2 new tokens
(engine/metadata.py, NOTE in `_plan`), i.e. in prefill / extend, where
`CompressIndex.ring_reads_disjoint` is False: the ring rows are then written by a second, tiny
launch (`_ring_write_kernel`, grid (T,)) that runs after the first has finished reading. In decode
(n = 1 per request, ring >= S) the flag is True and the first launch writes the ring rows itself:
one launch per compressor per step.

Invariants: the last row of `out` / of the ring is the trash row (LayerCache.entry_trash,
RingState.trash); the kernel never writes it (its contents are unspecified; the reference writes
garbage there and nobody reads it). Every non-trash write_slot and ring_write is distinct (one
writer per row: metadata.py). Every source index must be in range (not checked: that would need a
host sync). An entry has at least one valid slot (its own window's last token), so l > 0. Dc and rd
are even; padded channels (Dc not a power of two) are masked.

Not implemented: splitting one entry over several programs. C128 has S = 128 slots of 2 KB
(Dc = 512): at small batch the T programs are too few to fill the GPU. A channel split is free for
the pooling (the softmax is per channel) but the RMSNorm then needs a cross-program reduction (a
second launch over a [T, Dc] fp32 workspace, ~10% more bytes for C4, or a last-arriver atomic
pattern).

A CSA layer's attention and indexer compressors share one plan: `compressor_pair.py` serves both in
one launch from the device functions below (load_index, gather_chunk, fold_chunk, load_rope,
store_entry). The launch configurations (`default_config`, `default_tokens`) live in
`compressor_config.py` and are re-exported here; the inputs' layout checks (`check_inputs`) in
`compressor_checks.py`.

Test: tests/kernels/test_compressor_triton.py. Benchmark: benchmarks/kernels/bench_compressor.py.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsv4.kernels.ref.compressor import CompressIndex, compress_geometry
from dsv4.kernels.triton.compressor_ape import slot_ape
from dsv4.kernels.triton.compressor_checks import check_inputs
from dsv4.kernels.triton.compressor_config import SHORT_WINDOW, default_config, default_tokens
from dsv4.kernels.triton.compressor_group import launch_group
from dsv4.kernels.triton.pdl import pdl_args
from dsv4.kernels.triton.pdl_enter import pdl_enter


@triton.jit
def load_index(src_new_ptr, src_ring_ptr, from_new_ptr, valid_ptr,  # type: ignore[no-untyped-def]
               row, s0, S: tl.constexpr, BLOCK_S: tl.constexpr):
    """Index rows of slots [s0, s0 + BLOCK_S) of one token (`row` = t * S). Lanes >= S are masked
    (they move no bytes and come back invalid), so a chunk past the window is a free no-op."""
    offs_s = s0 + tl.arange(0, BLOCK_S)
    s_mask = offs_s < S
    new_row = tl.load(src_new_ptr + row + offs_s, mask=s_mask, other=0)
    ring_row = tl.load(src_ring_ptr + row + offs_s, mask=s_mask, other=0)
    is_new = tl.load(from_new_ptr + row + offs_s, mask=s_mask, other=0) != 0
    ok = (tl.load(valid_ptr + row + offs_s, mask=s_mask, other=0) != 0) & s_mask
    return new_row, ring_row, is_new, ok


@triton.jit
def gather_chunk(kv_ptr, score_ptr, ring_kv_ptr, ring_score_ptr,  # type: ignore[no-untyped-def]
                 ape_ptr, stride_kv, stride_ring, stride_ape, new_row, ring_row, is_new, ok, s0,
                 offs_d, d_mask, RATIO: tl.constexpr, DC: tl.constexpr, BLOCK_S: tl.constexpr,
                 OVERLAP: tl.constexpr, HAS_APE: tl.constexpr):
    """K, Z ([BLOCK_S, BLOCK_D] fp32) of slots [s0, s0 + BLOCK_S): K = 0 and Z = -inf where a slot
    is invalid; with HAS_APE, Z includes the slot's ape (the scores and rings hold raw scores)."""
    offs_s = s0 + tl.arange(0, BLOCK_S)
    if OVERLAP:   # slots [0, ratio) read the Ca half, [ratio, 2 ratio) the Cb half
        # NOTE: a product, not tl.where(s >= RATIO, DC, 0): it keeps the x16 divisibility that lets
        # the compiler vectorise the gathers (128-bit loads)
        cols = ((offs_s // RATIO) * DC)[:, None] + offs_d[None, :]
    else:
        cols = tl.zeros([BLOCK_S], tl.int32)[:, None] + offs_d[None, :]
    take = ok[:, None] & d_mask[None, :]                                # ok is False past S
    # One gather per tensor from a per-slot row pointer (this step's row or the ring row): half the
    # load instructions of two masked gathers and a select of their values. The select is over
    # [BLOCK_S] rows, so a thread keeps one 64-bit base per row and the columns fold into the loads'
    # offsets.
    kv_rows = tl.where(is_new, kv_ptr + new_row * stride_kv, ring_kv_ptr + ring_row * stride_ring)
    score_rows = tl.where(is_new, score_ptr + new_row * stride_kv,
                          ring_score_ptr + ring_row * stride_ring)
    k = tl.load(kv_rows[:, None] + cols, mask=take, other=0.0)
    z = tl.load(score_rows[:, None] + cols, mask=take, other=float("-inf"))
    if HAS_APE:   # an address of constants only: its load needs no round trip before it
        z += slot_ape(ape_ptr, stride_ape, offs_s, cols, take, RATIO)
    return k, z


@triton.jit
def fold_chunk(k, z, m, den, acc):  # type: ignore[no-untyped-def]
    """Online softmax per channel: fold one chunk's K, Z into the running max m, denominator den
    and sum acc."""
    m_new = tl.maximum(m, tl.max(z, axis=0))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)      # no valid slot yet: -inf - -inf
    alpha = tl.exp(m - m_safe)
    p = tl.exp(z - m_safe[None, :])
    return m_new, den * alpha + tl.sum(p, axis=0), acc * alpha + tl.sum(p * k, axis=0)


@triton.jit
def load_rope(cos_ptr, sin_ptr, t, stride_cs, pair, is_rope,  # type: ignore[no-untyped-def]
              ROPE_FIRST: tl.constexpr):
    """Token t's (cos, sin) per pair ([BLOCK_D/2] fp32 each; 0 on unrotated pairs, which ignore
    them) from ONE load of a [BLOCK_D/2, 2] pointer tile: its layout conversion then waits once,
    not twice in a row."""
    off = t * stride_cs + (pair - ROPE_FIRST)
    which = tl.arange(0, 2)[None, :]
    mask = is_rope[:, None] & (which < 2)                     # (which < 2: broadcast to 2D)
    cs = tl.load(tl.where(which == 0, cos_ptr, sin_ptr) + off[:, None], mask=mask, other=0.0)
    return tl.split(cs)


@triton.jit
def entry_value(den, acc, w, cos, sin, is_rope, eps,  # type: ignore[no-untyped-def]
                d_mask, DC: tl.constexpr, BLOCK_D: tl.constexpr):
    """pooled = acc / den -> weighted RMSNorm -> RoPE on the rotated pairs: the entry [BLOCK_D]
    fp32."""
    pooled = tl.where(d_mask, acc / tl.where(d_mask, den, 1.0), 0.0)   # [BLOCK_D] fp32
    inv_rms = 1.0 / tl.sqrt(tl.sum(pooled * pooled, axis=0) / DC + eps)
    y = w * (pooled * inv_rms)
    # RoPE on interleaved pairs (y[2i], y[2i+1]); pair i is rotated when i >= rope_first
    a, b = tl.split(tl.reshape(y, (BLOCK_D // 2, 2)))
    ra = tl.where(is_rope, a * cos - b * sin, a)
    rb = tl.where(is_rope, a * sin + b * cos, b)
    return tl.reshape(tl.join(ra, rb), (BLOCK_D,))


@triton.jit
def store_entry(den, acc, w, cos, sin, is_rope, eps,  # type: ignore[no-untyped-def]
                out_row_ptr, offs_d, d_mask, DC: tl.constexpr, BLOCK_D: tl.constexpr):
    """`entry_value` -> out_row (cast to its dtype)."""
    entry = entry_value(den, acc, w, cos, sin, is_rope, eps, d_mask, DC, BLOCK_D)
    tl.store(out_row_ptr + offs_d, entry.to(out_row_ptr.dtype.element_ty), mask=d_mask)


@triton.jit
def _compress_kernel(  # type: ignore[no-untyped-def]
    kv_ptr, score_ptr, ring_kv_ptr, ring_score_ptr,
    src_new_ptr, src_ring_ptr, from_new_ptr, valid_ptr, write_slot_ptr, ring_write_ptr,
    w_ptr, cos_ptr, sin_ptr, out_ptr, ape_ptr,
    out_trash, ring_trash, eps,
    stride_kv, stride_ring, stride_cs, stride_out, stride_ape,
    S: tl.constexpr, RATIO: tl.constexpr, DC: tl.constexpr, WIDTH: tl.constexpr,
    ROPE_FIRST: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_W: tl.constexpr,
    OVERLAP: tl.constexpr, WRITE_RING: tl.constexpr, PREFETCH: tl.constexpr,
    HAS_APE: tl.constexpr, PDL: tl.constexpr):
    pdl_enter(PDL)
    # NOTE: the geometry is compile-time (a model has 3 compressor shapes): masks over d vanish for
    # Dc = 2^k. Index rows are [T, S] contiguous (checked by the wrapper): token t's start at t * S,
    # a multiple of S that lets the compiler vectorise their loads.
    # Load schedule (module docstring, "Latency"): loads that depend on no loaded value are issued
    # before the first instruction that waits for one (a store of loaded data, a layout conversion,
    # the branch on `slot`). UP_FRONT (one chunk, or PREFETCH): index rows in the first round trip,
    # cos / sin behind the first gathers; otherwise (C128: many chunks, up to 16 warps at <= 128
    # registers) each chunk loads its own rows.
    UP_FRONT: tl.constexpr = PREFETCH or BLOCK_S >= S
    t = tl.program_id(0).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < DC
    # ---- round trip 1: this token's metadata, index rows, its ring row, the norm weight
    slot = tl.load(write_slot_ptr + t)
    if WRITE_RING:
        dst = tl.load(ring_write_ptr + t)
    if UP_FRONT:   # row t of the index: always in bounds
        new_row, ring_row, is_new, ok = load_index(src_new_ptr, src_ring_ptr, from_new_ptr,
                                                   valid_ptr, t * S, 0, S, BLOCK_S)
    if PREFETCH:   # chunk 1's rows too (C4 at BLOCK_S = S / 2: the whole window's)
        new_row1, ring_row1, is_new1, ok1 = load_index(src_new_ptr, src_ring_ptr, from_new_ptr,
                                                       valid_ptr, t * S, BLOCK_S, S, BLOCK_S)
    if WRITE_RING:
        # The token's own row, unmasked (row t is in bounds) so that it does not wait for `dst`. In
        # a fused launch every real token keeps its row (engine/metadata.py: n <= ring), so only
        # padding tokens load it for nothing. Written before the pooling reads, which is safe: this
        # launch reads no ring row it writes (ring_reads_disjoint).
        offs_w = tl.arange(0, BLOCK_W)
        w_mask = offs_w < WIDTH
        row_kv = tl.load(kv_ptr + t * stride_kv + offs_w, mask=w_mask)
        row_score = tl.load(score_ptr + t * stride_kv + offs_w, mask=w_mask)
    # The norm weight (one row shared by every program: an L2 hit) last: its layout conversion
    # waits for it.
    w = tl.load(w_ptr + offs_d, mask=d_mask, other=0.0).to(tl.float32)
    if WRITE_RING:
        # never the trash row. NOTE: tl.where, not w_mask & (dst != ring_trash): the interpreter
        # (triton 3.9) turns a block & scalar bool into an int32 mask that tl.load / tl.store reject
        keep = tl.where(dst != ring_trash, w_mask, False)
        tl.store(ring_kv_ptr + dst * stride_ring + offs_w, row_kv, mask=keep)
        tl.store(ring_score_ptr + dst * stride_ring + offs_w, row_score, mask=keep)
    # A branch, not a mask: it waits on `slot`, which arrives with the index rows the gathers need
    # anyway, and it lets the m-1 of m prefill tokens that complete no window skip the pooling math
    # (S x Dc exps for C128).
    if slot != out_trash:
        pair = tl.arange(0, BLOCK_D // 2)
        is_rope = (pair >= ROPE_FIRST) & (2 * pair < DC)
        m = tl.full([BLOCK_D], float("-inf"), tl.float32)
        den = tl.zeros([BLOCK_D], tl.float32)
        acc = tl.zeros([BLOCK_D], tl.float32)
        if UP_FRONT:
            # ---- round trip 2: chunk 0's gathers, cos / sin behind them (NOTE: behind, as their
            # layout conversion waits for them), with PREFETCH the index rows two chunks ahead
            # (past S: no bytes)
            if PREFETCH:
                pf_new, pf_ring, pf_is_new, pf_ok = load_index(src_new_ptr, src_ring_ptr,
                                                               from_new_ptr, valid_ptr, t * S,
                                                               2 * BLOCK_S, S, BLOCK_S)
            k, z = gather_chunk(kv_ptr, score_ptr, ring_kv_ptr, ring_score_ptr, ape_ptr,
                                stride_kv, stride_ring, stride_ape, new_row, ring_row, is_new, ok,
                                0, offs_d, d_mask, RATIO, DC, BLOCK_S, OVERLAP, HAS_APE)
            cos, sin = load_rope(cos_ptr, sin_ptr, t, stride_cs, pair, is_rope, ROPE_FIRST)
            m, den, acc = fold_chunk(k, z, m, den, acc)
            if PREFETCH:  # chunks 1, 2, ... (none without PREFETCH: the window is one chunk)
                for s0 in range(BLOCK_S, S, BLOCK_S):
                    new_row, ring_row, is_new, ok = new_row1, ring_row1, is_new1, ok1
                    new_row1, ring_row1, is_new1, ok1 = pf_new, pf_ring, pf_is_new, pf_ok
                    pf_new, pf_ring, pf_is_new, pf_ok = load_index(src_new_ptr, src_ring_ptr,
                                                                   from_new_ptr, valid_ptr, t * S,
                                                                   s0 + 2 * BLOCK_S, S, BLOCK_S)
                    k, z = gather_chunk(kv_ptr, score_ptr, ring_kv_ptr, ring_score_ptr, ape_ptr,
                                        stride_kv, stride_ring, stride_ape, new_row, ring_row,
                                        is_new, ok, s0, offs_d, d_mask, RATIO, DC, BLOCK_S,
                                        OVERLAP, HAS_APE)
                    m, den, acc = fold_chunk(k, z, m, den, acc)
        else:
            for s0 in range(0, S, BLOCK_S):
                new_row, ring_row, is_new, ok = load_index(src_new_ptr, src_ring_ptr,
                                                           from_new_ptr, valid_ptr, t * S, s0,
                                                           S, BLOCK_S)
                k, z = gather_chunk(kv_ptr, score_ptr, ring_kv_ptr, ring_score_ptr, ape_ptr,
                                    stride_kv, stride_ring, stride_ape, new_row, ring_row, is_new,
                                    ok, s0, offs_d, d_mask, RATIO, DC, BLOCK_S, OVERLAP, HAS_APE)
                m, den, acc = fold_chunk(k, z, m, den, acc)
            cos, sin = load_rope(cos_ptr, sin_ptr, t, stride_cs, pair, is_rope, ROPE_FIRST)
        store_entry(den, acc, w, cos, sin, is_rope, eps, out_ptr + slot * stride_out, offs_d,
                    d_mask, DC, BLOCK_D)


@triton.jit
def _ring_write_kernel(kv_ptr, score_ptr, ring_kv_ptr,  # type: ignore[no-untyped-def]
                       ring_score_ptr, ring_write_ptr, width, ring_trash, stride_kv, stride_ring,
                       BLOCK_W: tl.constexpr, PDL: tl.constexpr):
    pdl_enter(PDL)
    # Prefill / extend: most tokens keep no ring row, so the row is loaded only where it is written
    # (masked on `dst`: two round trips, which a launch this small can afford).
    t = tl.program_id(0).to(tl.int64)
    dst = tl.load(ring_write_ptr + t)
    offs = tl.arange(0, BLOCK_W)
    keep = tl.where(dst != ring_trash, offs < width, False)     # NOTE: not &, see _compress_kernel
    kv = tl.load(kv_ptr + t * stride_kv + offs, mask=keep)
    score = tl.load(score_ptr + t * stride_kv + offs, mask=keep)
    tl.store(ring_kv_ptr + dst * stride_ring + offs, kv, mask=keep)
    tl.store(ring_score_ptr + dst * stride_ring + offs, score, mask=keep)


def triton_compress_cached(kv: torch.Tensor, score: torch.Tensor, ring_kv: torch.Tensor,
                           ring_score: torch.Tensor, index: CompressIndex,
                           norm_weight: torch.Tensor, eps: float, cos: torch.Tensor,
                           sin: torch.Tensor, out: torch.Tensor, *, ape: torch.Tensor | None = None,
                           block_s: int | None = None, num_warps: int | None = None,
                           num_stages: int | None = None, prefetch: bool | None = None,
                           tokens: int | None = None) -> None:
    """Same contract as `compress_cached` (in place: entries into `out`, this step's rows into the
    ring).

    `kv`, `score`: [T, c*Dc] fp32; `ring_kv`, `ring_score`: [N_ring, c*Dc] fp32; `index`:
    CompressIndex ([T, S] rows); `norm_weight`: [Dc]; `cos`, `sin`: [T, rd/2] fp32; `out`: [N_out,
    Dc] bf16 / fp16 / fp32; `ape`: [ratio, c*Dc] fp32 (added per slot as the step pools: raw scores
    and rings; None: they include it). All contiguous except `out` (unit last stride: a row-sliced
    view of a pool is fine) and `kv` / `score` (unit last stride, one row stride for both: column
    slices of one fused projection's output are fine); all on one device. One launch when
    `index.ring_reads_disjoint`, else two (module docstring). Keyword arguments are tuning knobs
    (benchmark sweeps, tests); `prefetch` (default: short windows, S <= 16) keeps index rows two
    chunks ahead of the gathers when the window takes several chunks; `tokens` > 1 (a power of two,
    S <= 16) serves that many tokens per program (`compressor_group.py`; `block_s` and `prefetch`
    then do not apply; default `default_tokens`, or 1 when `block_s` or `prefetch` is given). No
    host syncs: safe inside CUDA-graph capture.
    """
    check_inputs(kv, score, ring_kv, ring_score, index, norm_weight, cos, sin, out, ape)
    launch_compress(kv, score, ring_kv, ring_score, index, norm_weight, eps, cos, sin, out,
                    ape=ape, block_s=block_s, num_warps=num_warps, num_stages=num_stages,
                    prefetch=prefetch, tokens=tokens)


def launch_compress(kv: torch.Tensor, score: torch.Tensor, ring_kv: torch.Tensor,
                    ring_score: torch.Tensor, index: CompressIndex, norm_weight: torch.Tensor,
                    eps: float, cos: torch.Tensor, sin: torch.Tensor, out: torch.Tensor, *,
                    ape: torch.Tensor | None = None, block_s: int | None = None,
                    num_warps: int | None = None, num_stages: int | None = None,
                    prefetch: bool | None = None, tokens: int | None = None) -> None:
    """`triton_compress_cached` on inputs its caller has checked (`check_inputs`): the launches
    only."""
    T, width = kv.shape
    if T == 0:
        return
    ratio, overlap = compress_geometry(kv, index, out)
    Dc, S = out.shape[1], index.src_new.shape[1]
    fused = index.ring_reads_disjoint
    auto_s, auto_w, auto_st = default_config(S, Dc)
    if tokens is None:
        tokens = default_tokens(S, Dc) if block_s is None and prefetch is None else 1
    block_s = block_s or auto_s
    if block_s & (block_s - 1):
        raise ValueError(f"block_s must be a power of two; got {block_s}")
    if tokens < 1 or tokens & (tokens - 1) or (tokens > 1 and S > SHORT_WINDOW):
        raise ValueError(f"tokens must be a power of two, and 1 for windows of S > {SHORT_WINDOW} "
                         f"slots; got tokens={tokens}, S={S}")
    if tokens > 1:
        launch_group(kv, score, ring_kv, ring_score, tuple(index[:6]), norm_weight, eps, cos, sin,
                     out, ape=ape, ratio=ratio, overlap=overlap, tokens=tokens, write_ring=fused,
                     num_warps=num_warps or auto_w, num_stages=num_stages or auto_st)
    else:
        _compress_kernel[(T,)](
            kv, score, ring_kv, ring_score, *index[:6], norm_weight, cos, sin, out,
            score if ape is None else ape, out.shape[0] - 1, ring_kv.shape[0] - 1, eps,
            kv.stride(0), ring_kv.stride(0), cos.stride(0), out.stride(0),
            0 if ape is None else ape.stride(0),
            S=S, RATIO=ratio, DC=Dc, WIDTH=width, ROPE_FIRST=Dc // 2 - cos.shape[1],
            BLOCK_S=block_s, BLOCK_D=triton.next_power_of_2(Dc),
            BLOCK_W=triton.next_power_of_2(width), OVERLAP=overlap, WRITE_RING=fused,
            PREFETCH=(S <= SHORT_WINDOW if prefetch is None else prefetch) and block_s < S,
            HAS_APE=ape is not None,
            num_warps=num_warps or auto_w, num_stages=num_stages or auto_st, **pdl_args(kv.device),
        )
    if not fused:  # NOTE: after every ring read of the launch above (module docstring)
        write_ring_rows(kv, score, ring_kv, ring_score, index.ring_write)


def write_ring_rows(kv: torch.Tensor, score: torch.Tensor, ring_kv: torch.Tensor,
                    ring_score: torch.Tensor, ring_write: torch.Tensor) -> None:
    """ring_kv / ring_score[ring_write[t]] = kv / score[t] (trash row skipped): the second launch
    of a step whose ring reads and writes may overlap. Inputs already checked by the caller."""
    T, width = kv.shape
    _ring_write_kernel[(T,)](kv, score, ring_kv, ring_score, ring_write, width,
                             ring_kv.shape[0] - 1, kv.stride(0), ring_kv.stride(0),
                             BLOCK_W=triton.next_power_of_2(width), num_warps=4,
                             **pdl_args(kv.device))
