"""Step metadata in Triton: a serving step's index rows, every compress ratio's included, in one
launch.

Owns `triton_step_metadata`, the fast form of `kernels/ref/metadata.py::step_metadata` (same
signature, bit-equal tensors): token positions, SWA write slots and windows, and per compress
spec the compressor's source / ring / entry rows and the candidate entry slots. The reference
spends ~100 small torch launches on this per step, each a fixed cost in a decode step.

Kernel design: one launch over grid (cdiv(T, BLOCK_T), 1 + n + sum_s cdiv(V_s, BLOCK_V)) for
n <= 2 specs (a V4 model has at most two ratios: CSA and HCA). Program (i, j) serves tokens
[i * BLOCK_T, (i + 1) * BLOCK_T) in the role grid column j gives it:

        j = 0          positions, SWA write slots, the [BLOCK_T, W] windows
        j = 1 .. n     spec j - 1's per-token rows: [BLOCK_T, S] source rows, entry rows
        j > n          one [BLOCK_T, BLOCK_V] tile of candidates: spec 0's tiles, then spec 1's

so the roles run side by side and none does another's serial work. Every program first maps its
tokens to their requests in one pass over the request rows, BLOCK_B at a time (lens, slots and
starts loaded together, the next chunk's before this chunk's sums: no load waits on the scan).
Token t belongs to the request whose [exclusive, inclusive) prefix range of `lens` holds t; as a
token has at most one owner, masked sums select its rows (int32 sums but for the position). Then
each role gathers (page table, then full -> SWA map) and stores, its loads before its stores.
The specs fill two constexpr slots (RATIO, S, RING each; NSPEC of them used) and the page size P
and window W are constexpr too, so every division and modulo is by a compile-time constant
(shifts for powers of two), not the emulated 64-bit division by a runtime value.

Invariants: bit-equal to the reference (request slots and T below 2^31), every gather in range,
padding lanes included: page columns are clamped, negative positions read position 0's page, and
a token past T (a tile's tail) owns no request (slot 0, position t) and stores nothing. Candidate
offsets are int64 (T * V passes 2^31 at 1M tokens). T, B and the V's change from step to step and
are not specialised on (`do_not_specialize`), so a new prompt length, batch size or context
compiles nothing; P, W, the specs' ratios, S and rings and the block sizes are engine constants.
No host sync, no host-to-device copy: CUDA-graph capturable. Request rows may be strided views (a
graph's static input columns).

Test: tests/kernels/test_metadata_kernel.py. Benchmark: benchmarks/kernels/bench_metadata.py.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import triton
import triton.language as tl

from dsv4.kernels.ops import CompressRows, CompressSpec, StepRows
from dsv4.kernels.triton.launch import one_device, pow2
from dsv4.kernels.triton.pdl import pdl_args
from dsv4.kernels.triton.pdl_enter import pdl_enter

BLOCK_T = 8          # tokens per program
BLOCK_V = 512        # candidate columns per program
BLOCK_B = 32         # request rows per step of the token -> request scan
MAX_SPECS = 2        # spec slots of the kernel
MAX_BLOCK_W = 128    # window columns per step of the (unrolled) window loop


@triton.jit
def _request_rows(slots_ptr, starts_ptr, lens_ptr, stride_slots,  # type: ignore[no-untyped-def]
                  stride_starts, stride_lens, b0, B, BLOCK_B: tl.constexpr):
    """Request rows b0 .. b0 + BLOCK_B - 1: lens and slots (int32: < T, < the table's rows),
    first new positions (int64); zeros past B."""
    rb = b0 + tl.arange(0, BLOCK_B)
    ok = rb < B
    n = tl.load(lens_ptr + rb * stride_lens, mask=ok, other=0).to(tl.int32)
    row = tl.load(slots_ptr + rb * stride_slots, mask=ok, other=0).to(tl.int32)
    return n, row, tl.load(starts_ptr + rb * stride_starts, mask=ok, other=0)


@triton.jit
def _token_rows(slots_ptr, starts_ptr, lens_ptr, stride_slots,  # type: ignore[no-untyped-def]
                stride_starts, stride_lens, t, B, BLOCK_B: tl.constexpr):
    """Per token t of the block: (request slot, first new position, end position, position).
    A token past the step's last owns no request: slot 0, start 0, end 0, position t. A token has
    at most one owner, so the masked sums select (int32 but the position). The next chunk's rows
    are loaded before this chunk's sums."""
    slot = tl.zeros(t.shape, tl.int32)
    start = tl.zeros(t.shape, tl.int64)
    n_new = tl.zeros(t.shape, tl.int32)
    off = tl.zeros(t.shape, tl.int32)
    carry = tl.zeros((1,), tl.int32)
    n, row, first = _request_rows(slots_ptr, starts_ptr, lens_ptr, stride_slots, stride_starts,
                                  stride_lens, 0, B, BLOCK_B)
    for b0 in range(0, B, BLOCK_B):
        n_next, row_next, first_next = _request_rows(slots_ptr, starts_ptr, lens_ptr,
                                                     stride_slots, stride_starts, stride_lens,
                                                     b0 + BLOCK_B, B, BLOCK_B)
        incl = carry + tl.cumsum(n, axis=0)
        excl = incl - n
        own = (excl[None, :] <= t[:, None]) & (t[:, None] < incl[None, :])     # one per token
        slot += tl.sum(tl.where(own, row[None, :], 0), axis=1)
        start += tl.sum(tl.where(own, first[None, :], 0), axis=1)
        n_new += tl.sum(tl.where(own, n[None, :], 0), axis=1)
        off += tl.sum(tl.where(own, excl[None, :], 0), axis=1)
        carry += tl.sum(n, axis=0)
        n, row, first = n_next, row_next, first_next
    return slot.to(tl.int64), start, start + n_new, start + (t - off)


@triton.jit
def _page(table_ptr, stride_table, slot, p, mask, max_pages,  # type: ignore[no-untyped-def]
          P: tl.constexpr):
    """Full page of position p (clamped to the table) of request row `slot`; 0 where masked."""
    col = tl.minimum(tl.maximum(p, 0) // P, max_pages - 1)
    return tl.load(table_ptr + slot * stride_table + col, mask=mask, other=0)


@triton.jit
def _swa_page(table_ptr, stride_table, f2s_ptr, slot, p, mask,  # type: ignore[no-untyped-def]
              max_pages, P: tl.constexpr):
    page = _page(table_ptr, stride_table, slot, p, mask, max_pages, P)
    return tl.load(f2s_ptr + page, mask=mask, other=0)


@triton.jit
def _write_tokens(table_ptr, stride_table, f2s_ptr, pos_ptr,  # type: ignore[no-untyped-def]
                  swa_ptr, win_ptr, t, live, slot, pos, max_pages, P: tl.constexpr,
                  W: tl.constexpr, BLOCK_W: tl.constexpr):
    """Positions, SWA write slots and the [BLOCK_T, W] windows (-1 before position 0)."""
    swa = _swa_page(table_ptr, stride_table, f2s_ptr, slot, pos, live, max_pages, P) * P + pos % P
    row = t.to(tl.int64)[:, None] * W
    for w0 in tl.static_range(0, W, BLOCK_W):
        w = w0 + tl.arange(0, BLOCK_W)
        wp = pos[:, None] - W + 1 + w[None, :]
        mask = live[:, None] & (w < W)[None, :]
        page = _swa_page(table_ptr, stride_table, f2s_ptr, slot[:, None], wp, mask & (wp >= 0),
                         max_pages, P)
        val = tl.where(wp >= 0, page * P + tl.maximum(wp, 0) % P, -1)
        tl.store(win_ptr + row + w[None, :], val, mask=mask)
    tl.store(pos_ptr + t, pos, mask=live)
    tl.store(swa_ptr + t, swa, mask=live)


@triton.jit
def _write_plan(table_ptr, stride_table, f2s_ptr, src_new_ptr,  # type: ignore[no-untyped-def]
                src_ring_ptr, from_new_ptr, valid_ptr, write_ptr, entry_pos_ptr, ring_write_ptr,
                visible_ptr, t, live, slot, start, end, pos, max_pages, ring_trash, entry_trash,
                P: tl.constexpr, RATIO: tl.constexpr, S: tl.constexpr, RING: tl.constexpr,
                BLOCK_S: tl.constexpr):
    """One spec's per-token rows: the [BLOCK_T, S] compressor source rows of positions
    p-S+1 .. p, the entry write slot, its RoPE position, the ring row kept, the visible count."""
    k = tl.arange(0, BLOCK_S)
    mask = live[:, None] & (k < S)[None, :]
    src = pos[:, None] - S + 1 + k[None, :]
    valid = src >= 0
    from_new = src >= start[:, None]
    src_new = tl.maximum(t[:, None] - (S - 1) + k[None, :], 0).to(tl.int64)
    old = valid & ~from_new                                     # read from the ring
    ring_row = (_swa_page(table_ptr, stride_table, f2s_ptr, slot[:, None], src, mask & old,
                          max_pages, P) * RING + tl.maximum(src, 0) % RING)
    src_ring = tl.where(old, ring_row, ring_trash)
    emits = (pos + 1) % RATIO == 0
    first = (pos // RATIO) * RATIO
    full = _page(table_ptr, stride_table, slot, first, live & emits, max_pages, P) * P + first % P
    write = tl.where(emits, full // RATIO, entry_trash)
    # the chunk's and every page's last RING tokens keep their ring rows (`ref/metadata.py`)
    keep = (pos >= end - RING) | (pos % P >= P - RING)
    ring_pos = (_swa_page(table_ptr, stride_table, f2s_ptr, slot, pos, live & keep, max_pages, P)
                * RING + pos % RING)
    ring_write = tl.where(keep, ring_pos, ring_trash)
    at = t.to(tl.int64)[:, None] * S + k[None, :]
    tl.store(src_new_ptr + at, src_new, mask=mask)
    tl.store(src_ring_ptr + at, src_ring, mask=mask)
    tl.store(from_new_ptr + at, from_new.to(tl.uint8), mask=mask)
    tl.store(valid_ptr + at, valid.to(tl.uint8), mask=mask)
    tl.store(write_ptr + t, write, mask=live)
    tl.store(entry_pos_ptr + t, tl.maximum(pos - RATIO + 1, 0), mask=live)
    tl.store(ring_write_ptr + t, ring_write, mask=live)
    tl.store(visible_ptr + t, (pos + 1) // RATIO, mask=live)


@triton.jit
def _write_candidates(table_ptr, stride_table, cand_ptr, tile, t,  # type: ignore[no-untyped-def]
                      live, slot, pos, max_pages, V, P: tl.constexpr, RATIO: tl.constexpr,
                      BLOCK_V: tl.constexpr):
    """Candidate tile `tile` of one spec: [BLOCK_T, BLOCK_V] entry slots, -1 past the visible
    prefix."""
    v = tile * BLOCK_V + tl.arange(0, BLOCK_V)
    q = v.to(tl.int64) * RATIO
    visible = (v[None, :] < ((pos + 1) // RATIO)[:, None]) & live[:, None]
    col = tl.minimum(q // P, max_pages - 1)
    page = tl.load(table_ptr + slot[:, None] * stride_table + col[None, :], mask=visible, other=0)
    val = tl.where(visible, (page * P + (q % P)[None, :]) // RATIO, -1)
    at = t.to(tl.int64)[:, None] * V + v[None, :]
    tl.store(cand_ptr + at, val, mask=live[:, None] & (v < V)[None, :])


@triton.jit(do_not_specialize=["T", "B", "V0", "V1"])
def _metadata_kernel(  # type: ignore[no-untyped-def]
    slots_ptr, starts_ptr, lens_ptr, stride_slots, stride_starts, stride_lens,
    table_ptr, stride_table, max_pages, f2s_ptr, pos_ptr, swa_ptr, win_ptr,
    src_new0_ptr, src_ring0_ptr, from_new0_ptr, valid0_ptr, write0_ptr, entry_pos0_ptr,
    ring_write0_ptr, cand0_ptr, visible0_ptr, ring_trash0, entry_trash0, V0,
    src_new1_ptr, src_ring1_ptr, from_new1_ptr, valid1_ptr, write1_ptr, entry_pos1_ptr,
    ring_write1_ptr, cand1_ptr, visible1_ptr, ring_trash1, entry_trash1, V1,
    T, B,
    P: tl.constexpr, W: tl.constexpr, NSPEC: tl.constexpr,
    RATIO0: tl.constexpr, S0: tl.constexpr, RING0: tl.constexpr, BLOCK_S0: tl.constexpr,
    RATIO1: tl.constexpr, S1: tl.constexpr, RING1: tl.constexpr, BLOCK_S1: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_V: tl.constexpr,
    PDL: tl.constexpr):
    pdl_enter(PDL)
    j = tl.program_id(1)
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    live = t < T
    slot, start, end, pos = _token_rows(slots_ptr, starts_ptr, lens_ptr, stride_slots,
                                        stride_starts, stride_lens, t, B, BLOCK_B)
    if j == 0:
        _write_tokens(table_ptr, stride_table, f2s_ptr, pos_ptr, swa_ptr, win_ptr, t, live, slot,
                      pos, max_pages, P, W, BLOCK_W)
    tile = j - 1 - NSPEC                    # candidate tile over spec 0's, then spec 1's
    tiles0 = tl.cdiv(V0, BLOCK_V)
    if NSPEC >= 1:
        if j == 1:
            _write_plan(table_ptr, stride_table, f2s_ptr, src_new0_ptr, src_ring0_ptr,
                        from_new0_ptr, valid0_ptr, write0_ptr, entry_pos0_ptr, ring_write0_ptr,
                        visible0_ptr, t, live, slot, start, end, pos, max_pages, ring_trash0,
                        entry_trash0, P, RATIO0, S0, RING0, BLOCK_S0)
        if (tile >= 0) & (tile < tiles0):
            _write_candidates(table_ptr, stride_table, cand0_ptr, tile, t, live, slot, pos,
                              max_pages, V0, P, RATIO0, BLOCK_V)
    if NSPEC >= 2:
        if j == 2:
            _write_plan(table_ptr, stride_table, f2s_ptr, src_new1_ptr, src_ring1_ptr,
                        from_new1_ptr, valid1_ptr, write1_ptr, entry_pos1_ptr, ring_write1_ptr,
                        visible1_ptr, t, live, slot, start, end, pos, max_pages, ring_trash1,
                        entry_trash1, P, RATIO1, S1, RING1, BLOCK_S1)
        if tile >= tiles0:
            _write_candidates(table_ptr, stride_table, cand1_ptr, tile - tiles0, t, live, slot,
                              pos, max_pages, V1, P, RATIO1, BLOCK_V)


def _source_rows(spec: CompressSpec) -> int:
    """S: the compressor's source rows per token (2 * ratio with overlap)."""
    return 2 * spec.ratio if spec.overlap else spec.ratio


def _empty_rows(spec: CompressSpec, T: int, device: torch.device) -> CompressRows:
    S = _source_rows(spec)

    def new(*shape: int, dtype: torch.dtype = torch.int64) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, device=device)

    return CompressRows(src_new=new(T, S), src_ring=new(T, S), from_new=new(T, S, dtype=torch.bool),
                        src_valid=new(T, S, dtype=torch.bool), write_slot=new(T),
                        entry_pos=new(T), ring_write=new(T), candidates=new(T, spec.num_visible),
                        visible=new(T))


def _check(slots: torch.Tensor, starts: torch.Tensor, lens: torch.Tensor, page_table: torch.Tensor,
           full_to_swa: torch.Tensor, specs: Sequence[CompressSpec]) -> None:
    """Shapes, dtypes, devices and the spec count only (values are not read: that would sync)."""
    one_device(slots, starts, lens, page_table, full_to_swa)
    rows = (slots, starts, lens, full_to_swa)
    if any(x.dim() != 1 for x in rows) or not slots.shape == starts.shape == lens.shape:
        raise ValueError(f"slots, starts, lens must be [B] and full_to_swa [N]; got "
                         f"{[list(x.shape) for x in rows]}")
    if page_table.dim() != 2 or page_table.stride(1) != 1:
        raise ValueError(f"page_table must be [R, max_pages] with unit column stride; got "
                         f"{list(page_table.shape)} strides {page_table.stride()}")
    if any(x.dtype != torch.int64 for x in (*rows, page_table)):
        raise ValueError("slots, starts, lens, page_table and full_to_swa must be int64; got "
                         f"{[str(x.dtype) for x in (*rows, page_table)]}")
    if len(specs) > MAX_SPECS:
        raise ValueError(f"the metadata kernel serves at most {MAX_SPECS} compress specs (one "
                         f"launch, {MAX_SPECS} constexpr slots); got {len(specs)}")


def _spec_args(spec: CompressSpec | None, rows: CompressRows | None, pos: torch.Tensor, i: int,
               block_v: int) -> tuple[list[Any], dict[str, int], int]:
    """Spec slot i's launch arguments, constexprs and candidate tiles; an unused slot gets
    `pos` (and its bytes) as its never-written outputs."""
    if spec is None or rows is None:
        byte = pos.view(torch.uint8)
        outs: list[Any] = [pos, pos, byte, byte, pos, pos, pos, pos, pos]
        return [*outs, 0, 0, 0], {f"RATIO{i}": 1, f"S{i}": 1, f"RING{i}": 1, f"BLOCK_S{i}": 1}, 0
    S = _source_rows(spec)
    outs = [x.view(torch.uint8) if x.dtype == torch.bool else x for x in rows]
    consts = {f"RATIO{i}": spec.ratio, f"S{i}": S, f"RING{i}": spec.ring,
              f"BLOCK_S{i}": triton.next_power_of_2(S)}
    return ([*outs, spec.ring_trash, spec.entry_trash, spec.num_visible], consts,
            triton.cdiv(spec.num_visible, block_v))


def triton_step_metadata(slots: torch.Tensor, starts: torch.Tensor, lens: torch.Tensor,
                         page_table: torch.Tensor, full_to_swa: torch.Tensor, page_size: int,
                         num_tokens: int, window: int, specs: Sequence[CompressSpec], *,
                         block_t: int = BLOCK_T, block_v: int = BLOCK_V,
                         num_warps: int = 4) -> StepRows:
    """Same contract as `step_metadata` (`kernels/ops.py::StepMetadataOp`), in one launch (none
    when `num_tokens` is 0); at most `MAX_SPECS` specs (ValueError above). `num_tokens` must equal
    sum(lens) (not checked: a device read). `block_t`, `block_v`: tile sizes (powers of two),
    knobs of the benchmark's sweep."""
    _check(slots, starts, lens, page_table, full_to_swa, specs)
    T, device = num_tokens, slots.device
    pos, swa, win = (torch.empty(shape, dtype=torch.int64, device=device)
                     for shape in ((T,), (T,), (T, window)))
    plans = tuple(_empty_rows(spec, T, device) for spec in specs)
    if T == 0:
        return StepRows(positions=pos, swa_write=swa, window=win, plans=plans)
    args: list[Any] = []
    consts: dict[str, int] = {}
    tiles = 0
    for i in range(MAX_SPECS):
        spec_args, spec_consts, spec_tiles = _spec_args(
            specs[i] if i < len(specs) else None, plans[i] if i < len(plans) else None, pos, i,
            pow2("block_v", block_v, 1))
        args += spec_args
        consts |= spec_consts
        tiles += spec_tiles
    grid = (triton.cdiv(T, pow2("block_t", block_t, 1)), 1 + len(specs) + tiles)
    _metadata_kernel[grid](
        slots, starts, lens, slots.stride(0), starts.stride(0), lens.stride(0), page_table,
        page_table.stride(0), page_table.shape[1], full_to_swa, pos, swa, win, *args, T,
        slots.shape[0], P=page_size, W=window, NSPEC=len(specs), **consts, BLOCK_T=block_t,
        BLOCK_B=BLOCK_B, BLOCK_W=min(MAX_BLOCK_W, triton.next_power_of_2(max(window, 1))),
        BLOCK_V=block_v, num_warps=num_warps, **pdl_args(slots.device))
    return StepRows(positions=pos, swa_write=swa, window=win, plans=plans)
