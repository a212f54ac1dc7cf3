"""The routed experts' tile map in one launch: `triton_tile_map`, same contract as `tile_map_ref`.

The grouped expert kernels (`kernels/triton/moe.py`) need the N*k (token, k) slots sorted by
expert and, for each of `max_tiles` tiles, the expert and the sorted-row range it owns. Built from
torch ops (`tile_map_ref`: argsort, two searchsorted, cumsum and glue) that is about 30 small
launches per MoE layer, which at decode cost more GPU time than the expert GEMMs' fixed part. The
kernel builds the same four tensors in one program:

    order       = the slots sorted by (expert, slot): one in-register `tl.sort` of the unique
                  keys e * BLOCK_NK + slot (a stable sort by expert)
    count[e]    = #{j : e_j == e} (`tl.histogram`);  start[e] = Σ_{e' < e} count[e']
    tiles[e]    = ceil(count / bm);  tile_base[e] = Σ_{e' < e} tiles[e']
    tile tile_base[e] + j = rows [start[e] + j * bm, min(.. + bm, start[e] + count[e])), expert e
    tiles past Σ tiles: rows [0, 0), expert E - 1

Each expert writes its own tiles (max_e tiles[e] steps of E-wide stores), so the work is a sort of
next_pow2(nk) keys plus O(E * max tiles per expert) in one CTA: meant for decode-sized maps.
The one CTA's sort grows with next_pow2(nk), so from SPLIT_MIN_SLOTS slots (where the two forms
crossed in benchmarks/kernels/bench_moe_tile_map.py) `triton_tile_map` splits the slots into
chunks of SPLIT_CHUNK over many programs, in two launches:

    hist[c, e]  = #{slots of chunk c on expert e}                       (one program per chunk)
    order       : chunk c sorts its own keys (e * C + slot in chunk); the slot at sorted place j
                  of expert e goes to row start[e] + Σ_{c' < c} hist[c', e] + j - first[c, e],
                  first[c, e] = Σ_{e' < e} hist[c, e'] (the sorted place of the chunk's first
                  slot of e: j - first[c, e] is the slot's rank among them)
    tiles       : one more program, from count[e] = Σ_c hist[c, e], as above

which is the same stable order, so the outputs are the same bits.
`tile_map` dispatches: the kernels up to `MAX_FUSED_SLOTS` slots (the one-CTA form up to
`MAX_ONE_CTA_SLOTS`) and `MAX_FUSED_EXPERTS` experts, the reference above. All are
integer-exact, so the choice never changes a value.
No host sync; safe inside CUDA-graph capture. Test: tests/kernels/test_moe_tile_map.py.
Benchmark: benchmarks/kernels/bench_moe_tile_map.py.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsv4.kernels.triton.pdl import pdl_args
from dsv4.kernels.triton.pdl_enter import pdl_enter

MAX_FUSED_SLOTS = 65536     # the chunked form: a prefill chunk of 8,192 tokens at k 8
MAX_ONE_CTA_SLOTS = 4096    # the one-CTA form: its keys in one program's registers
MAX_FUSED_EXPERTS = 1024
SPLIT_MIN_SLOTS = 384    # the chunked two-launch form from this many slots
SPLIT_CHUNK = 256        # its slots per program
_HIST_ROWS = 16          # chunk histograms summed per step
_CHUNK = 32          # surplus tiles cleared per step

TileMap = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


@triton.jit
def tile_and_block(OUT, BLOCK_N: tl.constexpr):  # type: ignore[no-untyped-def]
    """(row tile, output block) of this program on a 1-D grid of tiles x cdiv(OUT, BLOCK_N), the
    output blocks fastest: the programs that run together share a tile's activation rows (read
    once into L2, not once per output block) and one expert's weights."""
    blocks = tl.cdiv(OUT, BLOCK_N)
    pid = tl.program_id(0)
    return pid // blocks, pid % blocks


@triton.jit
def tile_rows(t_start_ptr, t_end_ptr, t_exp_ptr, tile,  # type: ignore[no-untyped-def]
              BLOCK_M: tl.constexpr):
    """(expert, sorted rows [BLOCK_M], their mask, whether the tile has any row) of tile `tile`
    from the tile map; expert and rows int64 (e * stride_we and N*k*I pass 2^31 on V4-Flash)."""
    row_start = tl.load(t_start_ptr + tile)
    row_end = tl.load(t_end_ptr + tile)
    offs_p = row_start.to(tl.int64) + tl.arange(0, BLOCK_M)
    return (tl.load(t_exp_ptr + tile).to(tl.int64), offs_p, offs_p < row_end,
            row_start < row_end)


@triton.jit
def expert_rows(t_start_ptr, t_end_ptr, t_exp_ptr,  # type: ignore[no-untyped-def]
                tile, e_lo, e_hi, BLOCK_M: tl.constexpr):
    """`tile_rows` for a launch over the experts [e_lo, e_hi) alone, whose weights are entries
    0 .. e_hi - e_lo of the stack it reads (a decoded chunk of the layer: `moe_dequant.py`): the
    expert comes back relative to e_lo, and a tile of any other expert is dead."""
    e, offs_p, p_mask, live = tile_rows(t_start_ptr, t_end_ptr, t_exp_ptr, tile, BLOCK_M)
    return e - e_lo, offs_p, p_mask, live & (e >= e_lo) & (e < e_hi)


@triton.jit
def slot_or_tile(t_start_ptr, t_end_ptr, t_exp_ptr,  # type: ignore[no-untyped-def]
                 SLOTS: tl.constexpr):
    """(first sorted row, end, expert) of this program (program_id 0): its tile of the tile map,
    or with SLOTS (one row per program, no tile map) program t is slot t alone and t_exp_ptr the
    flat indices. The expert is int64 (e * stride_we passes 2^31 on V4-Flash)."""
    tile = tl.program_id(0)
    if SLOTS:
        row_start = tile
        row_end = tile + 1
    else:
        row_start = tl.load(t_start_ptr + tile)
        row_end = tl.load(t_end_ptr + tile)
    return row_start, row_end, tl.load(t_exp_ptr + tile).to(tl.int64)


def max_tiles(nk: int, num_experts: int, block_m: int) -> int:
    """Upper bound on the tiles of nk slots over `num_experts` experts (>= 1), from shapes only."""
    return max(1, (nk + min(num_experts, nk) * (block_m - 1)) // block_m)


def tile_map_ref(indices: torch.Tensor, num_experts: int, block_m: int) -> TileMap:
    """(order, tile_start, tile_end, tile_expert): the sorted (token, k) slots, per-tile row ranges.

    order [N*k] int64: slots sorted by expert (stable). The tile tensors have `max_tiles` entries,
    int32; surplus tiles have tile_start == tile_end == 0 and tile_expert == E - 1. Torch ops, no
    host sync.
    """
    flat = indices.reshape(-1)
    nk = flat.numel()
    order = torch.argsort(flat, stable=True)
    bounds = torch.searchsorted(flat[order].contiguous(),
                                torch.arange(num_experts + 1, device=flat.device, dtype=flat.dtype))
    starts, ends = bounds[:-1], bounds[1:]
    tiles = (ends - starts + block_m - 1) // block_m
    tile_cum = tiles.cumsum(0)
    t = torch.arange(max_tiles(nk, num_experts, block_m), device=flat.device)
    expert = torch.searchsorted(tile_cum, t, right=True)
    valid = expert < num_experts
    ec = expert.clamp(max=num_experts - 1)
    start = starts[ec] + (t - (tile_cum[ec] - tiles[ec])) * block_m
    end = torch.minimum(start + block_m, ends[ec])
    zero = torch.zeros_like(start)
    return (order, torch.where(valid, start, zero).to(torch.int32),
            torch.where(valid, end, zero).to(torch.int32), ec.to(torch.int32))


@triton.jit(do_not_specialize=["nk", "num_tiles"])
def _tile_map_kernel(idx_ptr, order_ptr, ts_ptr, te_ptr, tx_ptr,  # type: ignore[no-untyped-def]
                     nk, num_tiles, E: tl.constexpr, BM: tl.constexpr, BLOCK_NK: tl.constexpr,
                     BLOCK_E: tl.constexpr, CHUNK: tl.constexpr, PDL: tl.constexpr):
    pdl_enter(PDL)
    offs_i = tl.arange(0, BLOCK_NK)
    mi = offs_i < nk
    e_i = tl.load(idx_ptr + offs_i, mask=mi, other=0).to(tl.int32)
    # stable counting sort as one in-register sort of unique keys (expert, slot); padding last
    keys = tl.sort(tl.where(mi, e_i, E) * BLOCK_NK + offs_i)
    tl.store(order_ptr + offs_i, (keys % BLOCK_NK).to(tl.int64), mask=mi)
    _write_tiles(tl.histogram(e_i, BLOCK_E, mask=mi), ts_ptr, te_ptr, tx_ptr, num_tiles, E, BM,
                 BLOCK_E, CHUNK)


@triton.jit
def _write_tiles(count, ts_ptr, te_ptr, tx_ptr, num_tiles,  # type: ignore[no-untyped-def]
                 E: tl.constexpr, BM: tl.constexpr, BLOCK_E: tl.constexpr, CHUNK: tl.constexpr):
    """The tile tensors from the slots per expert, count [BLOCK_E] (0 past E)."""
    offs_e = tl.arange(0, BLOCK_E)
    ends = tl.cumsum(count, 0)
    starts = ends - count
    tiles = (count + BM - 1) // BM
    tile_cum = tl.cumsum(tiles, 0)
    tile_base = tile_cum - tiles
    # each expert writes its own tiles (tile j of expert e is tile tile_base[e] + j) ...
    for j in range(0, tl.max(tiles, 0)):
        mt = j < tiles
        t = tile_base + j
        start = starts + j * BM
        tl.store(ts_ptr + t, start, mask=mt)
        tl.store(te_ptr + t, tl.minimum(start + BM, ends), mask=mt)
        tl.store(tx_ptr + t, offs_e, mask=mt)
    # ... and the surplus tiles past the last one own nothing (expert E - 1, rows [0, 0))
    for t0 in range(tl.sum(tiles, 0), num_tiles, CHUNK):
        t = t0 + tl.arange(0, CHUNK)
        mt = t < num_tiles
        zero = tl.zeros([CHUNK], dtype=tl.int32)
        tl.store(ts_ptr + t, zero, mask=mt)
        tl.store(te_ptr + t, zero, mask=mt)
        tl.store(tx_ptr + t, zero + (E - 1), mask=mt)


@triton.jit(do_not_specialize=["nk"])
def _chunk_hist_kernel(idx_ptr, hist_ptr, nk,  # type: ignore[no-untyped-def]
                       C: tl.constexpr, BLOCK_E: tl.constexpr, PDL: tl.constexpr):
    """hist[c, :] = the slots of chunk c (slots c C .. c C + C) per expert."""
    pdl_enter(PDL)
    c = tl.program_id(0)
    offs = c * C + tl.arange(0, C)
    m = offs < nk
    e = tl.load(idx_ptr + offs, mask=m, other=0).to(tl.int32)
    tl.store(hist_ptr + c * BLOCK_E + tl.arange(0, BLOCK_E), tl.histogram(e, BLOCK_E, mask=m))


@triton.jit
def _hist_sums(hist_ptr, c, chunks, BLOCK_E: tl.constexpr,  # type: ignore[no-untyped-def]
               ROWS: tl.constexpr):
    """(count, prior, own) [BLOCK_E]: the slots per expert of all chunks, of the chunks before
    c and of chunk c, from the chunk histograms, ROWS rows per step."""
    offs_e = tl.arange(0, BLOCK_E)[None, :]
    count = tl.zeros([BLOCK_E], dtype=tl.int32)
    prior, own = count, count
    for r0 in range(0, chunks, ROWS):
        rows = r0 + tl.arange(0, ROWS)[:, None]
        hist = tl.load(hist_ptr + rows * BLOCK_E + offs_e, mask=rows < chunks, other=0)
        count += tl.sum(hist, 0)
        prior += tl.sum(tl.where(rows < c, hist, 0), 0)
        own += tl.sum(tl.where(rows == c, hist, 0), 0)
    return count, prior, own


@triton.jit(do_not_specialize=["nk", "num_tiles"])
def _chunk_order_kernel(idx_ptr, hist_ptr, order_ptr, ts_ptr,  # type: ignore[no-untyped-def]
                        te_ptr, tx_ptr, nk, num_tiles, E: tl.constexpr, BM: tl.constexpr,
                        C: tl.constexpr, ROWS: tl.constexpr, BLOCK_E: tl.constexpr,
                        CHUNK: tl.constexpr, PDL: tl.constexpr):
    """Program c < the chunks: the rows of chunk c's slots in `order` (module docstring); the
    last program: the tile tensors. ROWS: chunk histograms summed per step."""
    pdl_enter(PDL)
    c = tl.program_id(0)
    chunks = tl.cdiv(nk, C)
    count, prior, own = _hist_sums(hist_ptr, c, chunks, BLOCK_E, ROWS)
    if c < chunks:
        # row of the chunk's first slot of each expert, less its sorted place in the chunk
        base = tl.cumsum(count, 0) - count + prior - (tl.cumsum(own, 0) - own)
        offs = tl.arange(0, C)
        m = c * C + offs < nk
        e = tl.load(idx_ptr + c * C + offs, mask=m, other=0).to(tl.int32)
        keys = tl.sort(tl.where(m, e, E) * C + offs)    # padding (expert E) last
        ek = keys // C
        ok = ek < E
        row = tl.gather(base, tl.where(ok, ek, 0), 0) + offs
        tl.store(order_ptr + row, (c * C + keys % C).to(tl.int64), mask=ok)
    else:
        _write_tiles(count, ts_ptr, te_ptr, tx_ptr, num_tiles, E, BM, BLOCK_E, CHUNK)


def triton_tile_map(indices: torch.Tensor, num_experts: int, block_m: int,
                    chunked: bool | None = None) -> TileMap:
    """`tile_map_ref` in one launch, or two over chunks of slots (`chunked`; None: from
    SPLIT_MIN_SLOTS slots); the same outputs bit for bit. At most `MAX_FUSED_SLOTS` slots
    (`MAX_ONE_CTA_SLOTS` in one launch) and `MAX_FUSED_EXPERTS` experts. indices: [N, k] int64 in
    [0, num_experts) (not checked: a host sync); block_m a power of two."""
    flat = indices.reshape(-1).contiguous()
    nk = flat.numel()
    if nk > MAX_FUSED_SLOTS or num_experts > MAX_FUSED_EXPERTS or nk == 0:
        raise ValueError(f"triton_tile_map takes 1..{MAX_FUSED_SLOTS} slots and at most "
                         f"{MAX_FUSED_EXPERTS} experts; got {nk} slots, {num_experts} experts")
    if block_m < 1 or block_m & (block_m - 1):
        raise ValueError(f"block_m must be a power of two; got {block_m}")
    if chunked is False and nk > MAX_ONE_CTA_SLOTS:
        raise ValueError(f"triton_tile_map takes at most {MAX_ONE_CTA_SLOTS} slots in one launch "
                         f"(chunked=False); got {nk}")
    n_tiles = max_tiles(nk, num_experts, block_m)
    order = torch.empty(nk, dtype=torch.int64, device=flat.device)
    ts, te, tx = (torch.empty(n_tiles, dtype=torch.int32, device=flat.device) for _ in range(3))
    block_e = max(16, triton.next_power_of_2(num_experts))
    pdl = pdl_args(flat.device)
    common = {"E": num_experts, "BM": block_m, "BLOCK_E": block_e, "CHUNK": _CHUNK, **pdl}
    if nk >= SPLIT_MIN_SLOTS if chunked is None else chunked:
        chunks = triton.cdiv(nk, SPLIT_CHUNK)
        hist = torch.empty(chunks, block_e, dtype=torch.int32, device=flat.device)
        _chunk_hist_kernel[(chunks,)](flat, hist, nk, C=SPLIT_CHUNK, BLOCK_E=block_e, num_warps=4,
                                      **pdl)
        _chunk_order_kernel[(chunks + 1,)](flat, hist, order, ts, te, tx, nk, n_tiles,
                                           C=SPLIT_CHUNK, ROWS=_HIST_ROWS,
                                           num_warps=8 if block_e * _HIST_ROWS > 4096 else 4,
                                           **common)
    else:
        block_nk = max(_CHUNK, triton.next_power_of_2(nk))
        _tile_map_kernel[(1,)](flat, order, ts, te, tx, nk, n_tiles, BLOCK_NK=block_nk,
                               num_warps=min(16, max(4, block_nk // 256)), **common)
    return order, ts, te, tx


def tile_map(indices: torch.Tensor, num_experts: int, block_m: int) -> TileMap:
    """The tile map of the grouped expert kernels (which run wherever Triton runs):
    `triton_tile_map` up to `MAX_FUSED_SLOTS` slots (decode batches and prefill chunks),
    `tile_map_ref` above; identical outputs."""
    nk = indices.numel()
    if 0 < nk <= MAX_FUSED_SLOTS and num_experts <= MAX_FUSED_EXPERTS:
        return triton_tile_map(indices, num_experts, block_m)
    return tile_map_ref(indices, num_experts, block_m)
