"""RequestTable: which pages each running request holds, on the host and mirrored on the device.

Device tensors (read by the metadata builder, never by Python on the hot path):
    page_table  [max_reqs, max_pages_per_req] int64   full page of request slot r at page index i (0 = none)
    full_to_swa [num_full_pages] int64                SWA page behind a full page (0 = none / freed)
Host mirror: `full_pages[slot]` (list, in position order) and `swa_of[full_page]`.

Life of a request: `reserve` before every step that writes positions [start, end) — it makes full
pages cover [0, end) and SWA pages cover [start - horizon, end), all-or-nothing; `release_swa`
frees SWA pages that fell behind the horizon; `truncate` drops positions >= new_len (speculative
rollback); `free` returns everything. `check_integrity` compares both mirrors and the allocators.
"""

from __future__ import annotations

import math

import torch

from dsv4.cache.allocator import PageAllocator
from dsv4.cache.layout import CacheLayout


class RequestTable:
    def __init__(self, layout: CacheLayout, max_reqs: int, max_context: int, device: torch.device) -> None:
        self.layout, self.P = layout, layout.page_size
        self.max_pages = math.ceil(max_context / self.P)
        self.full = PageAllocator(layout.num_full_pages, "full")
        self.swa = PageAllocator(layout.num_swa_pages, "swa")
        self.page_table = torch.zeros(max_reqs, self.max_pages, dtype=torch.int64, device=device)
        self.full_to_swa = torch.zeros(layout.num_full_pages, dtype=torch.int64, device=device)
        self.full_pages: dict[int, list[int]] = {}
        self.swa_of: dict[int, int] = {}
        self._free_slots = list(range(max_reqs - 1, -1, -1))

    # ---- request slots -------------------------------------------------------------------
    @property
    def num_free_slots(self) -> int:
        return len(self._free_slots)

    def open(self) -> int:
        """A fresh request slot with no pages."""
        slot = self._free_slots.pop()
        self.full_pages[slot] = []
        return slot

    # ---- pages -----------------------------------------------------------------------------
    def pages_needed(self, slot: int, start: int, end: int) -> tuple[int, int]:
        """(full, swa) pages `reserve(slot, start, end)` would allocate."""
        have = self.full_pages[slot]
        full = max(0, math.ceil(end / self.P) - len(have))
        lo = max(0, start - self.layout.swa_horizon) // self.P
        hi = math.ceil(end / self.P)
        swa = sum(1 for i in range(lo, hi) if i >= len(have) or have[i] not in self.swa_of)
        return full, swa

    def reserve(self, slot: int, start: int, end: int) -> bool:
        """Allocate what positions [start, end) need; False (nothing allocated) if the pools are short."""
        assert end <= self.max_pages * self.P, f"position {end} exceeds the request page table"
        n_full, n_swa = self.pages_needed(slot, start, end)
        if not (self.full.can_alloc(n_full) and self.swa.can_alloc(n_swa)):
            return False
        have = self.full_pages[slot]
        if n_full:
            new = self.full.alloc(n_full)
            self.page_table[slot, len(have):len(have) + n_full] = torch.tensor(new)
            have.extend(new)
        lo = max(0, start - self.layout.swa_horizon) // self.P
        missing = [p for p in have[lo:math.ceil(end / self.P)] if p not in self.swa_of]
        if missing:
            swa_pages = self.swa.alloc(len(missing))
            self.swa_of.update(zip(missing, swa_pages, strict=True))
            self.full_to_swa[torch.tensor(missing)] = torch.tensor(swa_pages)
        return True

    def release_swa(self, slot: int, keep_from: int) -> None:
        """Free the SWA pages of full pages that lie entirely before position `keep_from - horizon`."""
        limit = max(0, keep_from - self.layout.swa_horizon) // self.P
        stale = [p for p in self.full_pages[slot][:limit] if p in self.swa_of]
        self._drop_swa(stale)

    def truncate(self, slot: int, new_len: int) -> None:
        """Forget positions >= new_len: whole pages past it go back to the pools."""
        have = self.full_pages[slot]
        keep = math.ceil(new_len / self.P)
        dropped = have[keep:]
        self._drop_swa([p for p in dropped if p in self.swa_of])
        self.full.free(dropped)
        del have[keep:]
        self.page_table[slot, keep:] = 0

    def free(self, slot: int) -> None:
        self.truncate(slot, 0)
        del self.full_pages[slot]
        self._free_slots.append(slot)

    def _drop_swa(self, full_pages: list[int]) -> None:
        if not full_pages:
            return
        self.swa.free(self.swa_of.pop(p) for p in full_pages)
        self.full_to_swa[torch.tensor(full_pages)] = 0

    # ---- invariants --------------------------------------------------------------------------
    def check_integrity(self) -> None:
        self.full.check_integrity()
        self.swa.check_integrity()
        owned = [p for pages in self.full_pages.values() for p in pages]
        assert len(owned) == len(set(owned)), "a full page is owned twice"
        assert len(owned) == self.full.num_usable - self.full.num_free, "full pages leaked or double-counted"
        assert set(self.swa_of) <= set(owned), "SWA page behind a full page nobody owns"
        assert len(self.swa_of) == self.swa.num_usable - self.swa.num_free, "SWA pages leaked"
        table = self.page_table.cpu()
        for slot, pages in self.full_pages.items():
            assert table[slot, :len(pages)].tolist() == pages, f"device page table of slot {slot} is stale"
            assert not table[slot, len(pages):].any(), f"slot {slot} has device pages past its length"
        f2s = self.full_to_swa.cpu()
        expected = torch.zeros_like(f2s)
        for p, s in self.swa_of.items():
            expected[p] = s
        assert torch.equal(f2s, expected), "device full->SWA table disagrees with the host mirror"
        assert len(set(self._free_slots)) == len(self._free_slots), "duplicate free request slots"
        assert not set(self._free_slots) & set(self.full_pages), "a request slot is both free and open"
