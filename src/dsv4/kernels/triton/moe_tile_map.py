"""The routed experts' tile map in one launch: `triton_tile_map`, same contract as `tile_map_ref`.

The grouped expert kernels (`kernels/triton/moe.py`) need the N*k (token, k) slots sorted by
expert and, for each of `max_tiles` tiles, the expert and the sorted-row range it owns. Built from
torch ops (`tile_map_ref`: argsort, two searchsorted, cumsum and glue) that is about 30 small
launches per MoE layer, which at decode cost more GPU time than the expert GEMMs' fixed part. The
kernel builds the same four tensors in one program:

    rank[i]     = #{j : e_j < e_i} + #{j < i : e_j == e_i}      (stable counting sort)
    order[rank[i]] = i
    count[e]    = #{j : e_j == e};  start[e] = Σ_{e' < e} count[e'];  tiles[e] = ceil(count / bm)
    expert(t)   = #{e : tile_cum[e] <= t}                        (searchsorted, right)
    tile t      = rows [start[e] + (t - tile_base[e]) * bm, min(.. + bm, start[e] + count[e]))

Comparisons are blocked (slots against chunks of slots, tiles against all experts), so the work is
O(nk^2 + max_tiles * E) in one CTA: meant for decode-sized maps. `tile_map` dispatches: the kernel
up to `MAX_FUSED_SLOTS` slots and `MAX_FUSED_EXPERTS` experts, the reference above. Both are
integer-exact, so the choice never changes a value.
No host sync; safe inside CUDA-graph capture. Test: tests/kernels/test_moe_tile_map.py.
Benchmark: benchmarks/kernels/bench_moe_tile_map.py.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_wait

from dsv4.kernels.triton.pdl import pdl_args

MAX_FUSED_SLOTS = 512
MAX_FUSED_EXPERTS = 1024
_CHUNK = 32          # slots compared per step of the rank / count loop
_TILE_CHUNK = 32     # tiles resolved per step of the tile loop

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
                     BLOCK_E: tl.constexpr, CHUNK: tl.constexpr, TILE_CHUNK: tl.constexpr,
                     PDL: tl.constexpr):
    if PDL:  # programmatic dependent launch: the prior kernel's writes first
        gdc_wait()
    offs_i = tl.arange(0, BLOCK_NK)
    mi = offs_i < nk
    e_i = tl.load(idx_ptr + offs_i, mask=mi, other=E).to(tl.int32)
    offs_e = tl.arange(0, BLOCK_E)
    count = tl.zeros([BLOCK_E], dtype=tl.int32)
    rank = tl.zeros([BLOCK_NK], dtype=tl.int32)
    for j0 in range(0, nk, CHUNK):
        offs_j = j0 + tl.arange(0, CHUNK)
        mj = offs_j < nk
        e_j = tl.load(idx_ptr + offs_j, mask=mj, other=E).to(tl.int32)
        same = e_j[None, :] == e_i[:, None]
        before = (e_j[None, :] < e_i[:, None]) | (same & (offs_j[None, :] < offs_i[:, None]))
        rank += tl.sum((before & mj[None, :]).to(tl.int32), axis=1)
        hit = (e_j[None, :] == offs_e[:, None]) & mj[None, :]
        count += tl.sum(hit.to(tl.int32), axis=1)
    tl.store(order_ptr + rank, offs_i.to(tl.int64), mask=mi)
    ends = tl.cumsum(count, 0)
    starts = ends - count
    tiles = (count + BM - 1) // BM
    tile_cum = tl.cumsum(tiles, 0)
    tile_base = tile_cum - tiles
    for t0 in range(0, num_tiles, TILE_CHUNK):
        t = t0 + tl.arange(0, TILE_CHUNK)
        expert = tl.sum((tile_cum[None, :] <= t[:, None]).to(tl.int32), axis=1)
        ec = tl.minimum(expert, E - 1)
        sel = offs_e[None, :] == ec[:, None]
        start_e = tl.sum(tl.where(sel, starts[None, :], 0), axis=1)
        end_e = tl.sum(tl.where(sel, ends[None, :], 0), axis=1)
        base_e = tl.sum(tl.where(sel, tile_base[None, :], 0), axis=1)
        start = start_e + (t - base_e) * BM
        end = tl.minimum(start + BM, end_e)
        valid = expert < E
        mt = t < num_tiles
        tl.store(ts_ptr + t, tl.where(valid, start, 0), mask=mt)
        tl.store(te_ptr + t, tl.where(valid, end, 0), mask=mt)
        tl.store(tx_ptr + t, ec, mask=mt)


def triton_tile_map(indices: torch.Tensor, num_experts: int, block_m: int) -> TileMap:
    """`tile_map_ref` in one launch (same outputs, bit for bit); at most `MAX_FUSED_SLOTS` slots
    and `MAX_FUSED_EXPERTS` experts. indices: [N, k] int64 in [0, num_experts) (not checked: a
    host sync); block_m a power of two."""
    flat = indices.reshape(-1).contiguous()
    nk = flat.numel()
    if nk > MAX_FUSED_SLOTS or num_experts > MAX_FUSED_EXPERTS or nk == 0:
        raise ValueError(f"triton_tile_map takes 1..{MAX_FUSED_SLOTS} slots and at most "
                         f"{MAX_FUSED_EXPERTS} experts; got {nk} slots, {num_experts} experts")
    if block_m < 1 or block_m & (block_m - 1):
        raise ValueError(f"block_m must be a power of two; got {block_m}")
    n_tiles = max_tiles(nk, num_experts, block_m)
    order = torch.empty(nk, dtype=torch.int64, device=flat.device)
    ts, te, tx = (torch.empty(n_tiles, dtype=torch.int32, device=flat.device) for _ in range(3))
    _tile_map_kernel[(1,)](flat, order, ts, te, tx, nk, n_tiles, E=num_experts, BM=block_m,
                           BLOCK_NK=max(_CHUNK, triton.next_power_of_2(nk)),
                           BLOCK_E=max(16, triton.next_power_of_2(num_experts)), CHUNK=_CHUNK,
                           TILE_CHUNK=_TILE_CHUNK, num_warps=4, **pdl_args(flat.device))
    return order, ts, te, tx


def tile_map(indices: torch.Tensor, num_experts: int, block_m: int) -> TileMap:
    """The tile map of the grouped expert kernels (which run wherever Triton runs): the one-launch
    `triton_tile_map` for decode-sized maps, `tile_map_ref` above; identical outputs."""
    nk = indices.numel()
    if 0 < nk <= MAX_FUSED_SLOTS and num_experts <= MAX_FUSED_EXPERTS:
        return triton_tile_map(indices, num_experts, block_m)
    return tile_map_ref(indices, num_experts, block_m)
