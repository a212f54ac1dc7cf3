"""Batch metadata by index arithmetic on the device (DESIGN decision 5).

Input: per request its slot in the request table, the first new position `start` and the number
of new tokens `n`; three small host lists, copied once. Everything else — token positions, SWA
window slots, compressed-entry write slots and visibility, compressor source rows — is computed
from the device page tables with tensor ops, so no per-request Python runs per step.

        request r:  positions [start_r, start_r + n_r)  ->  tokens t in [off_r, off_r + n_r)
        full slot of position p  = page_table[r, p // P] * P + p % P
        SWA slot of position p   = full_to_swa[page_table[r, p // P]] * P + p % P
        entry i (ratio m)        = full slot of position i*m, divided by m
        ring row of position p   = full_to_swa[page_table[r, p // P]] * ring + p % ring
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dsv4.cache.pools import KVPools
from dsv4.cache.req_table import RequestTable
from dsv4.config.model import ModelConfig
from dsv4.model.forward_context import CompressPlan, ForwardContext, HiSparseStep
from dsv4.utils.device import to_device


@dataclass(frozen=True)
class StepShape:
    """Host-side description of one step (the scheduler's output)."""

    slots: list[int]
    starts: list[int]
    lens: list[int]
    # per request, how many of its last new tokens produce logits (0 <= k <= n)
    num_logits: list[int]

    def logits_index(self) -> list[int]:
        """Rows (among the step's T tokens) whose logits are computed, request by request."""
        rows: list[int] = []
        end = 0
        for n, k in zip(self.lens, self.num_logits, strict=True):
            assert 0 <= k <= n, f"num_logits {k} outside [0, {n}]"
            end += n
            rows.extend(range(end - k, end))
        return rows


class Coords:
    """Position -> slot arithmetic for the tokens of one step."""

    def __init__(self, table: RequestTable, req_slot: torch.Tensor) -> None:
        self.table, self.P, self.req_slot = table, table.P, req_slot

    def _page(self, p: torch.Tensor) -> torch.Tensor:
        rows = self.req_slot.view(-1, *([1] * (p.dim() - 1))).expand_as(p)
        cols = (p.clamp(min=0) // self.P).clamp(max=self.table.max_pages - 1)
        return self.table.page_table[rows, cols]

    def full_slot(self, p: torch.Tensor) -> torch.Tensor:
        return self._page(p) * self.P + p.clamp(min=0) % self.P

    def swa_page(self, p: torch.Tensor) -> torch.Tensor:
        return self.table.full_to_swa[self._page(p)]

    def swa_slot(self, p: torch.Tensor) -> torch.Tensor:
        return self.swa_page(p) * self.P + p.clamp(min=0) % self.P

    def ring_row(self, p: torch.Tensor, ring: int) -> torch.Tensor:
        return self.swa_page(p) * ring + p.clamp(min=0) % ring


def _plan(c: Coords, pos: torch.Tensor, start: torch.Tensor, end: torch.Tensor, ratio: int,
          overlap: bool, ring: int, ring_trash: int, entry_trash: int, num_visible: int,
          max_len: int) -> CompressPlan:
    T, device = pos.shape[0], pos.device
    S = 2 * ratio if overlap else ratio
    src = pos[:, None] - S + 1 + torch.arange(S, device=device)                 # [T, S]
    valid = src >= 0
    from_new = src >= start[:, None]
    src_new = (torch.arange(T, device=device)[:, None] - (pos[:, None] - src)).clamp(min=0)
    src_ring = torch.where(valid & ~from_new, c.ring_row(src, ring), ring_trash)
    emits = (pos + 1) % ratio == 0
    write_slot = torch.where(emits, c.full_slot((pos // ratio) * ratio) // ratio, entry_trash)
    # keep the chunk's last `ring` tokens (the next step continues from them) and every page's last
    # `ring` tokens (a prefix-cache hit continues from a page boundary): distinct rows, one
    # writer per row
    keep = (pos >= end - ring) | (pos % c.P >= c.P - ring)
    ring_write = torch.where(keep, c.ring_row(pos, ring), ring_trash)
    ids = torch.arange(num_visible, device=device)                              # [V] entry ids
    visible = ids[None, :] < ((pos + 1) // ratio)[:, None]                      # [T, V]
    candidates = torch.where(visible,
                             c.full_slot(ids[None, :] * ratio + 0 * pos[:, None]) // ratio, -1)
    # NOTE: a ring row written in this step (new position p) and one read from the ring
    # (old p' >= start - S + 1) coincide only if p - p' is a positive multiple of `ring`, which
    # needs some request with n >= ring - S + 2 new tokens; below that (decode), a kernel may read
    # and write the ring in one pass.
    disjoint = max_len <= ring - S + 1
    return CompressPlan(ratio=ratio, overlap=overlap, src_new=src_new, src_ring=src_ring,
                        from_new=from_new, src_valid=valid, write_slot=write_slot,
                        entry_pos=(pos - ratio + 1).clamp(min=0), ring_write=ring_write,
                        candidates=candidates, visible=(pos + 1) // ratio,
                        ring_reads_disjoint=disjoint)


def build_context(shape: StepShape, table: RequestTable, pools: KVPools, model: ModelConfig,
                  device: torch.device) -> ForwardContext:
    """The ForwardContext of one step; `table.reserve` must already cover every new position."""
    host = torch.tensor([shape.slots, shape.starts, shape.lens], dtype=torch.int64)
    slots, starts, lens = to_device(host, device).unbind(0)
    total = sum(shape.lens)
    logits_index = to_device(torch.tensor(shape.logits_index(), dtype=torch.int64), device)
    max_end = max(s + n for s, n in zip(shape.starts, shape.lens, strict=True))
    return device_context(slots, starts, lens, logits_index,
                          StepBounds(total, max_end, max(shape.lens)), table, pools, model)


@dataclass(frozen=True)
class StepBounds:
    """The host integers that size a step's metadata tensors (the only host input besides the
    device rows).

    `num_tokens`: T = sum of lens. `max_end`: sizes the compressed-candidate lists (entries visible
    to any query are < max_end // ratio; a larger value only adds -1 columns). `max_len`: the
    longest request's new tokens (decides whether compressor ring reads and writes can overlap)."""

    num_tokens: int
    max_end: int
    max_len: int


def device_context(slots: torch.Tensor, starts: torch.Tensor, lens: torch.Tensor,
                   logits_index: torch.Tensor, bounds: StepBounds, table: RequestTable,
                   pools: KVPools, model: ModelConfig) -> ForwardContext:
    """The ForwardContext from device rows only: `slots`, `starts`, `lens` [B] int64 and
    `logits_index` [R].

    Pure tensor ops on device tensors with shapes from `bounds`: no host sync and no host-to-device
    copy, so it can run inside CUDA-graph capture (engine/cuda_graph.py) as well as eagerly."""
    T, B, device = bounds.num_tokens, slots.shape[0], slots.device
    tok_req = torch.repeat_interleave(torch.arange(B, device=device), lens, output_size=T)
    offsets = torch.cumsum(lens, 0) - lens
    pos = starts[tok_req] + torch.arange(T, device=device) - offsets[tok_req]   # [T]
    start, end = starts[tok_req], (starts + lens)[tok_req]
    coords = Coords(table, slots[tok_req])
    W = model.window
    win_pos = pos[:, None] - W + 1 + torch.arange(W, device=device)             # [T, W]
    window = torch.where(win_pos >= 0, coords.swa_slot(win_pos), -1)
    layout = pools.layout
    plans: dict[int, CompressPlan] = {}
    for cache in pools.layers:
        if cache.attn_type == "swa" or cache.state is None:
            continue
        overlap = cache.attn_type == "csa"
        ratio = model.csa_ratio if overlap else model.hca_ratio
        if ratio not in plans:
            ring = layout.ring_c4 if overlap else layout.ring_c128
            plans[ratio] = _plan(coords, pos, start, end, ratio, overlap, ring, cache.state.trash,
                                 cache.entry_trash, bounds.max_end // ratio, bounds.max_len)
    hisparse = None
    if pools.hot is not None:
        hisparse = _hisparse_step(pos, slots[tok_req], bounds, table.pad_slot,
                                  pools.hot.layout.device_entries, model)
    return ForwardContext(positions=pos, swa_write=coords.swa_slot(pos), window=window,
                          plans=plans, caches=pools.layers, logits_index=logits_index,
                          hisparse=hisparse)


def _hisparse_step(pos: torch.Tensor, token_slots: torch.Tensor, bounds: StepBounds,
                   pad_slot: int, hot_entries: int, model: ModelConfig) -> HiSparseStep:
    """The step's HiSparse rows (`HiSparseStep`). The picks of one request fit its hot set when it
    feeds at most hot_entries // index_topk tokens or sees at most hot_entries entries."""
    T, m = pos.shape[0], model.csa_ratio
    emits = (pos + 1) % m == 0
    rows = torch.arange(T, device=pos.device)
    fits = (bounds.max_len * model.index_topk <= hot_entries
            or bounds.max_end // m <= hot_entries)
    return HiSparseStep(token_slots=token_slots, scratch_rows=torch.where(emits, rows, T),
                        write_slots=torch.where(emits, token_slots, pad_slot),
                        write_entries=torch.where(emits, pos // m, 0), use_hot=fits)
