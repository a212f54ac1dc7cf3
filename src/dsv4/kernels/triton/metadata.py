"""Step metadata in Triton: a serving step's index rows in one launch per compress ratio.

Owns `triton_step_metadata`, the fast form of `kernels/ref/metadata.py::step_metadata` (same
signature, bit-equal tensors): token positions, SWA write slots and windows, and per compress
ratio the compressor's source / ring / entry rows and the candidate entry slots. The reference
spends ~100 small torch launches on this per step, each a fixed cost in a decode step.

Kernel design: grid (cdiv(T, BLOCK_T), cdiv(V, BLOCK_V)) per ratio. Every program maps its
BLOCK_T tokens to their requests (token t belongs to the first request whose inclusive prefix sum
of `lens` exceeds t: a scan over the B request rows in BLOCK_B chunks), then the programs of grid
column 0 write the per-token rows (positions, SWA slots and windows on the first launch only; the
ratio's [T] and [T, S] rows) and every program writes its [BLOCK_T, BLOCK_V] tile of candidates.
A model with CSA and HCA layers launches twice; one without compressed layers once. Page columns
are clamped and negative positions read position 0's page, as in the reference, so every gather
is in range, padding lanes included. Candidate offsets are int64 (T * V passes 2^31 at 1M tokens).

Compiled variants: T, B and V change from step to step and are not specialised on
(`do_not_specialize`), so a new prompt length or batch size compiles nothing; the ratio, S, the
block sizes and TOKENS / PLAN are constexpr (model constants). No host sync, no host-to-device
copy: CUDA-graph capturable. Request rows may be strided views (a graph's static input columns).

Test: tests/kernels/test_metadata_kernel.py. Benchmark: benchmarks/kernels/bench_metadata.py.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from dsv4.kernels.ops import CompressRows, CompressSpec, StepRows
from dsv4.kernels.triton.launch import one_device, pow2

BLOCK_T = 8          # tokens per program
BLOCK_V = 512        # candidate columns per program
BLOCK_B = 32         # request rows per step of the token -> request scan


@triton.jit
def _token_rows(slots_ptr, starts_ptr, lens_ptr, stride_slots,  # type: ignore[no-untyped-def]
                stride_starts, stride_lens, t, live, B, BLOCK_B: tl.constexpr):
    """Per token t of the block: (request slot, first new position, end position, position)."""
    req = tl.zeros(t.shape, tl.int32)
    off = tl.zeros(t.shape, tl.int64)
    carry = tl.zeros((1,), tl.int64)
    for b0 in range(0, B, BLOCK_B):
        rb = b0 + tl.arange(0, BLOCK_B)
        n = tl.load(lens_ptr + rb * stride_lens, mask=rb < B, other=0)
        done = (carry + tl.cumsum(n, axis=0))[None, :] <= t[:, None]       # request ends <= t
        req += tl.sum(done.to(tl.int32), axis=1)
        off += tl.sum(tl.where(done, n[None, :], 0), axis=1)
        carry += tl.sum(n, axis=0)
    slot = tl.load(slots_ptr + req * stride_slots, mask=live, other=0)
    start = tl.load(starts_ptr + req * stride_starts, mask=live, other=0)
    n_new = tl.load(lens_ptr + req * stride_lens, mask=live, other=0)
    return slot, start, start + n_new, start + t - off


@triton.jit
def _page(table_ptr, stride_table, slot, p, P, max_pages):  # type: ignore[no-untyped-def]
    """Full page of position p (clamped to the table) of request row `slot`."""
    col = tl.minimum(tl.maximum(p, 0) // P, max_pages - 1)
    return tl.load(table_ptr + slot * stride_table + col)


@triton.jit
def _swa_page(table_ptr, stride_table, f2s_ptr, slot, p, P,  # type: ignore[no-untyped-def]
              max_pages):
    return tl.load(f2s_ptr + _page(table_ptr, stride_table, slot, p, P, max_pages))


@triton.jit
def _write_tokens(table_ptr, stride_table, f2s_ptr, pos_ptr,  # type: ignore[no-untyped-def]
                  swa_ptr, win_ptr, t, live, slot, pos, P, max_pages, W,
                  BLOCK_W: tl.constexpr):
    """Positions, SWA write slots and the [BLOCK_T, W] windows (-1 before position 0)."""
    tl.store(pos_ptr + t, pos, mask=live)
    swa = _swa_page(table_ptr, stride_table, f2s_ptr, slot, pos, P, max_pages) * P + pos % P
    tl.store(swa_ptr + t, swa, mask=live)
    row = t.to(tl.int64)[:, None] * W
    for w0 in range(0, W, BLOCK_W):
        w = w0 + tl.arange(0, BLOCK_W)
        wp = pos[:, None] - W + 1 + w[None, :]
        page = _swa_page(table_ptr, stride_table, f2s_ptr, slot[:, None], wp, P, max_pages)
        val = tl.where(wp >= 0, page * P + tl.maximum(wp, 0) % P, -1)
        tl.store(win_ptr + row + w[None, :], val, mask=live[:, None] & (w < W)[None, :])


@triton.jit
def _write_sources(table_ptr, stride_table, f2s_ptr, src_new_ptr,  # type: ignore[no-untyped-def]
                   src_ring_ptr, from_new_ptr, valid_ptr, t, live, slot, start, pos, P,
                   max_pages, ring, ring_trash, S: tl.constexpr, BLOCK_S: tl.constexpr):
    """The [BLOCK_T, S] compressor source rows of positions p-S+1 .. p."""
    k = tl.arange(0, BLOCK_S)
    src = pos[:, None] - S + 1 + k[None, :]
    valid = src >= 0
    from_new = src >= start[:, None]
    src_new = tl.maximum(t[:, None] - (S - 1) + k[None, :], 0).to(tl.int64)
    ring_row = (_swa_page(table_ptr, stride_table, f2s_ptr, slot[:, None], src, P, max_pages)
                * ring + tl.maximum(src, 0) % ring)
    src_ring = tl.where(valid & (src < start[:, None]), ring_row, ring_trash)
    at = t.to(tl.int64)[:, None] * S + k[None, :]
    mask = live[:, None] & (k < S)[None, :]
    tl.store(src_new_ptr + at, src_new, mask=mask)
    tl.store(src_ring_ptr + at, src_ring, mask=mask)
    tl.store(from_new_ptr + at, from_new.to(tl.uint8), mask=mask)
    tl.store(valid_ptr + at, valid.to(tl.uint8), mask=mask)


@triton.jit
def _write_entries(table_ptr, stride_table, f2s_ptr, write_ptr,  # type: ignore[no-untyped-def]
                   entry_pos_ptr, ring_write_ptr, visible_ptr, t, live, slot, end, pos, P,
                   max_pages, ring, ring_trash, entry_trash, RATIO: tl.constexpr):
    """Per token: entry write slot, its RoPE position, the ring row kept, visible entries."""
    first = (pos // RATIO) * RATIO
    full = _page(table_ptr, stride_table, slot, first, P, max_pages) * P + first % P
    write = tl.where((pos + 1) % RATIO == 0, full // RATIO, entry_trash)
    keep = (pos >= end - ring) | (pos % P >= P - ring)
    ring_row = _swa_page(table_ptr, stride_table, f2s_ptr, slot, pos, P, max_pages) * ring
    ring_write = tl.where(keep, ring_row + pos % ring, ring_trash)
    tl.store(write_ptr + t, write, mask=live)
    tl.store(entry_pos_ptr + t, tl.maximum(pos - RATIO + 1, 0), mask=live)
    tl.store(ring_write_ptr + t, ring_write, mask=live)
    tl.store(visible_ptr + t, (pos + 1) // RATIO, mask=live)


@triton.jit
def _write_candidates(table_ptr, stride_table, cand_ptr, t, live,  # type: ignore[no-untyped-def]
                      slot, pos, P, max_pages, V, RATIO: tl.constexpr, BLOCK_V: tl.constexpr):
    """Grid column j's [BLOCK_T, BLOCK_V] tile of entry slots; -1 past the visible prefix."""
    v = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    q = v.to(tl.int64) * RATIO
    visible = v[None, :] < ((pos + 1) // RATIO)[:, None]
    col = tl.minimum(q // P, max_pages - 1)
    page = tl.load(table_ptr + slot[:, None] * stride_table + col[None, :], mask=visible, other=0)
    val = tl.where(visible, (page * P + (q % P)[None, :]) // RATIO, -1)
    at = t.to(tl.int64)[:, None] * V + v[None, :]
    tl.store(cand_ptr + at, val, mask=live[:, None] & (v < V)[None, :])


@triton.jit(do_not_specialize=["T", "B", "V"])
def _metadata_kernel(  # type: ignore[no-untyped-def]
    slots_ptr, starts_ptr, lens_ptr, stride_slots, stride_starts, stride_lens,
    table_ptr, stride_table, f2s_ptr, pos_ptr, swa_ptr, win_ptr,
    src_new_ptr, src_ring_ptr, from_new_ptr, valid_ptr, write_ptr, entry_pos_ptr,
    ring_write_ptr, cand_ptr, visible_ptr,
    T, B, V, P, max_pages, W, ring, ring_trash, entry_trash,
    RATIO: tl.constexpr, S: tl.constexpr, TOKENS: tl.constexpr, PLAN: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_W: tl.constexpr,
    BLOCK_S: tl.constexpr, BLOCK_V: tl.constexpr,
):
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    live = t < T
    slot, start, end, pos = _token_rows(slots_ptr, starts_ptr, lens_ptr, stride_slots,
                                        stride_starts, stride_lens, t, live, B, BLOCK_B)
    if tl.program_id(1) == 0:
        if TOKENS:
            _write_tokens(table_ptr, stride_table, f2s_ptr, pos_ptr, swa_ptr, win_ptr, t, live,
                          slot, pos, P, max_pages, W, BLOCK_W)
        if PLAN:
            _write_sources(table_ptr, stride_table, f2s_ptr, src_new_ptr, src_ring_ptr,
                           from_new_ptr, valid_ptr, t, live, slot, start, pos, P, max_pages,
                           ring, ring_trash, S, BLOCK_S)
            _write_entries(table_ptr, stride_table, f2s_ptr, write_ptr, entry_pos_ptr,
                           ring_write_ptr, visible_ptr, t, live, slot, end, pos, P, max_pages,
                           ring, ring_trash, entry_trash, RATIO)
    if PLAN:
        _write_candidates(table_ptr, stride_table, cand_ptr, t, live, slot, pos, P, max_pages, V,
                          RATIO, BLOCK_V)


def _empty_rows(spec: CompressSpec, T: int, device: torch.device) -> CompressRows:
    S = 2 * spec.ratio if spec.overlap else spec.ratio

    def new(*shape: int, dtype: torch.dtype = torch.int64) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, device=device)

    return CompressRows(src_new=new(T, S), src_ring=new(T, S), from_new=new(T, S, dtype=torch.bool),
                        src_valid=new(T, S, dtype=torch.bool), write_slot=new(T),
                        entry_pos=new(T), ring_write=new(T), candidates=new(T, spec.num_visible),
                        visible=new(T))


def _check(slots: torch.Tensor, starts: torch.Tensor, lens: torch.Tensor, page_table: torch.Tensor,
           full_to_swa: torch.Tensor) -> None:
    """Shapes, dtypes and devices only (values are not read: that would sync)."""
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


# the plan arguments of a launch that writes the token rows only (a model without compressed layers)
_NO_PLAN = CompressSpec(ratio=1, overlap=False, ring=1, ring_trash=0, entry_trash=0, num_visible=0)


def triton_step_metadata(slots: torch.Tensor, starts: torch.Tensor, lens: torch.Tensor,
                         page_table: torch.Tensor, full_to_swa: torch.Tensor, page_size: int,
                         num_tokens: int, window: int, specs: Sequence[CompressSpec], *,
                         block_t: int = BLOCK_T, block_v: int = BLOCK_V,
                         num_warps: int = 4) -> StepRows:
    """Same contract as `step_metadata` (`kernels/ops.py::StepMetadataOp`): one launch per spec
    (one when `specs` is empty); `num_tokens` must equal sum(lens) (not checked: a device read).
    `block_t`, `block_v`: tile sizes (powers of two), knobs of the benchmark's sweep."""
    _check(slots, starts, lens, page_table, full_to_swa)
    T, device = num_tokens, slots.device
    pos, swa, win = (torch.empty(shape, dtype=torch.int64, device=device)
                     for shape in ((T,), (T,), (T, window)))
    plans = tuple(_empty_rows(spec, T, device) for spec in specs)
    head = (slots, starts, lens, slots.stride(0), starts.stride(0), lens.stride(0), page_table,
            page_table.stride(0), full_to_swa, pos, swa, win)
    block_w = min(128, triton.next_power_of_2(max(window, 1)))
    todo: list[tuple[CompressSpec, CompressRows | None]] = (
        list(zip(specs, plans, strict=True)) or [(_NO_PLAN, None)])
    for i, (spec, rows) in enumerate(todo if T > 0 else []):
        S = 2 * spec.ratio if spec.overlap else spec.ratio
        outs = [pos] * len(CompressRows._fields) if rows is None else [
            x.view(torch.uint8) if x.dtype == torch.bool else x for x in rows]
        grid = (triton.cdiv(T, pow2("block_t", block_t, 1)),
                max(1, triton.cdiv(spec.num_visible, pow2("block_v", block_v, 1))))
        _metadata_kernel[grid](
            *head, *outs, T, slots.shape[0], spec.num_visible, page_size, page_table.shape[1],
            window, spec.ring, spec.ring_trash, spec.entry_trash, RATIO=spec.ratio, S=S,
            TOKENS=i == 0, PLAN=rows is not None, BLOCK_T=block_t, BLOCK_B=BLOCK_B,
            BLOCK_W=block_w, BLOCK_S=triton.next_power_of_2(S), BLOCK_V=block_v,
            num_warps=num_warps)
    return StepRows(positions=pos, swa_write=swa, window=win, plans=plans)
