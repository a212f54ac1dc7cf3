"""Reference step metadata: a serving step's index rows by torch index arithmetic.

The executable specification of `kernels/triton/metadata.py::triton_step_metadata` (the kernel
must return the same tensors bit for bit). Request b feeds positions [start_b, start_b + n_b),
which become the step's tokens [off_b, off_b + n_b) (off_b = n_0 + ... + n_{b-1}); with P the page
size and `slot` the request's row of the page table:

        full slot of position p  = page_table[slot, p // P] * P + p % P
        SWA slot of position p   = full_to_swa[page_table[slot, p // P]] * P + p % P
        entry i (ratio m)        = full slot of position i*m, divided by m
        ring row of position p   = full_to_swa[page_table[slot, p // P]] * ring + p % ring

Negative positions read position 0's page and page columns are clamped to the table (the values
there are masked by the callers' `where`), so every gather stays in range. Pure tensor ops with
shapes from host integers: no host sync, CUDA-graph capturable. The fields' meaning is documented
on `model/forward_context.py::CompressPlan`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from dsv4.kernels.ops import CompressRows, CompressSpec, StepRows


class _Coords:
    """Position -> slot arithmetic for the tokens of one step (`req_slot`: each token's row)."""

    def __init__(self, page_table: Tensor, full_to_swa: Tensor, page_size: int,
                 req_slot: Tensor) -> None:
        self.page_table, self.full_to_swa, self.P = page_table, full_to_swa, page_size
        self.req_slot = req_slot

    def _page(self, p: Tensor) -> Tensor:
        rows = self.req_slot.view(-1, *([1] * (p.dim() - 1))).expand_as(p)
        cols = (p.clamp(min=0) // self.P).clamp(max=self.page_table.shape[1] - 1)
        return self.page_table[rows, cols]

    def full_slot(self, p: Tensor) -> Tensor:
        return self._page(p) * self.P + p.clamp(min=0) % self.P

    def swa_slot(self, p: Tensor) -> Tensor:
        return self.full_to_swa[self._page(p)] * self.P + p.clamp(min=0) % self.P

    def ring_row(self, p: Tensor, ring: int) -> Tensor:
        return self.full_to_swa[self._page(p)] * ring + p.clamp(min=0) % ring


def _plan(c: _Coords, pos: Tensor, start: Tensor, end: Tensor, spec: CompressSpec) -> CompressRows:
    T, device, ratio, ring = pos.shape[0], pos.device, spec.ratio, spec.ring
    S = 2 * ratio if spec.overlap else ratio
    src = pos[:, None] - S + 1 + torch.arange(S, device=device)                 # [T, S]
    valid = src >= 0
    from_new = src >= start[:, None]
    src_new = (torch.arange(T, device=device)[:, None] - (pos[:, None] - src)).clamp(min=0)
    src_ring = torch.where(valid & ~from_new, c.ring_row(src, ring), spec.ring_trash)
    emits = (pos + 1) % ratio == 0
    write_slot = torch.where(emits, c.full_slot((pos // ratio) * ratio) // ratio,
                             spec.entry_trash)
    # keep the chunk's last `ring` tokens (the next step continues from them) and every page's last
    # `ring` tokens (a prefix-cache hit continues from a page boundary): distinct rows, one
    # writer per row
    keep = (pos >= end - ring) | (pos % c.P >= c.P - ring)
    ring_write = torch.where(keep, c.ring_row(pos, ring), spec.ring_trash)
    ids = torch.arange(spec.num_visible, device=device)                         # [V] entry ids
    visible = ids[None, :] < ((pos + 1) // ratio)[:, None]                      # [T, V]
    candidates = torch.where(visible,
                             c.full_slot(ids[None, :] * ratio + 0 * pos[:, None]) // ratio, -1)
    return CompressRows(src_new=src_new, src_ring=src_ring, from_new=from_new, src_valid=valid,
                        write_slot=write_slot, entry_pos=(pos - ratio + 1).clamp(min=0),
                        ring_write=ring_write, candidates=candidates, visible=(pos + 1) // ratio)


def step_metadata(slots: Tensor, starts: Tensor, lens: Tensor, page_table: Tensor,
                  full_to_swa: Tensor, page_size: int, num_tokens: int, window: int,
                  specs: Sequence[CompressSpec]) -> StepRows:
    """The index rows of one step (`kernels/ops.py::StepMetadataOp`).

    `slots`, `starts`, `lens` [B] int64 request rows (`num_tokens` = sum of lens); `page_table`
    [R, max_pages], `full_to_swa` [N] int64; `window`: W SWA positions per query. Returns positions
    [T], SWA write slots [T], windows [T, W] (slots of p-W+1 .. p, -1 before position 0) and one
    `CompressRows` per spec."""
    T, B, device = num_tokens, slots.shape[0], slots.device
    tok_req = torch.repeat_interleave(torch.arange(B, device=device), lens, output_size=T)
    offsets = torch.cumsum(lens, 0) - lens
    pos = starts[tok_req] + torch.arange(T, device=device) - offsets[tok_req]   # [T]
    start, end = starts[tok_req], (starts + lens)[tok_req]
    coords = _Coords(page_table, full_to_swa, page_size, slots[tok_req])
    win_pos = pos[:, None] - window + 1 + torch.arange(window, device=device)   # [T, W]
    win = torch.where(win_pos >= 0, coords.swa_slot(win_pos), -1)
    plans = tuple(_plan(coords, pos, start, end, spec) for spec in specs)
    return StepRows(positions=pos, swa_write=coords.swa_slot(pos), window=win, plans=plans)
