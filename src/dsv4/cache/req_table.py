"""RequestTable: which pages each running request holds, on the host and mirrored on the device.

Device tensors (read by the metadata builder, never by Python on the hot path):
    page_table   [max_reqs + 1, max_pages_per_req] int64: full page of request slot r at page
                 index i (0 = none); the last row (`pad_slot`) is never handed out: it stays all
                 null pages, so the padding rows of a CUDA-graph batch write only to the null page
    full_to_swa  [num_full_pages] int64: SWA page behind a full page (0 = none / freed)
Host mirror: `full_pages[slot]` (list, in position order) and `swa_of[full_page]`.

Ownership: a full page is either private to one request or `shared` — owned by the prefix cache
(radix tree), possibly mapped by several requests. Requests free only their private pages and
only their private SWA pages; the tree frees shared pages (and tombstones their SWA) itself.

Life of a request: `open(prefix_pages)` (pages matched in the prefix cache), then `reserve` before
every step that writes positions [start, end) — full pages cover [0, end), SWA pages cover
[start - horizon, end), all-or-nothing, after asking the `evict` callback (the prefix cache) for
room; `release_swa` frees private SWA pages that fell behind the horizon; `truncate` drops
positions >= new_len (speculative rollback); `free` returns the private pages.

With HiSparse, `hot` (the engine's HotSet, which reads `page_table`) follows the slots: `open`
admits the slot's empty hot set, `truncate` drops its hot entries past the new length, `free`
releases it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

import torch

from dsv4.cache.allocator import PageAllocator
from dsv4.cache.hisparse import HotSet
from dsv4.cache.layout import CacheLayout
from dsv4.utils.device import to_device

Evictor = Callable[[int, int], None]   # (full pages wanted, SWA pages wanted) -> frees what it can


class RequestTable:
    def __init__(self, layout: CacheLayout, max_reqs: int, max_context: int,
                 device: torch.device) -> None:
        self.layout, self.P = layout, layout.page_size
        self.max_pages = math.ceil(max_context / self.P)
        self.full = PageAllocator(layout.num_full_pages, "full")
        self.swa = PageAllocator(layout.num_swa_pages, "swa")
        self.page_table = torch.zeros(max_reqs + 1, self.max_pages, dtype=torch.int64,
                                      device=device)
        self.pad_slot = max_reqs
        self.full_to_swa = torch.zeros(layout.num_full_pages, dtype=torch.int64, device=device)
        self.full_pages: dict[int, list[int]] = {}
        # per slot: page index below which `release_swa` has already freed every private SWA
        # page (so each call scans only the pages that fell out of the horizon since the last)
        self._swa_floor: dict[int, int] = {}
        self.swa_of: dict[int, int] = {}
        self.shared: set[int] = set()
        self.evict: Evictor | None = None
        self.hot: HotSet | None = None
        self._free_slots = list(range(max_reqs - 1, -1, -1))

    # ---- request slots -------------------------------------------------------------------
    @property
    def num_free_slots(self) -> int:
        return len(self._free_slots)

    def open(self, prefix_pages: Iterable[int] = ()) -> int:
        """A fresh request slot mapping `prefix_pages` at its start.

        `prefix_pages` are shared pages from the prefix cache.
        """
        slot = self._free_slots.pop()
        pages = list(prefix_pages)
        assert all(p in self.shared for p in pages), (
            "a matched prefix page is not owned by the prefix cache")
        self.full_pages[slot] = pages
        self._swa_floor[slot] = 0
        if pages:
            self.page_table[slot, :len(pages)] = self._dev(pages)
        if self.hot is not None:
            self.hot.admit(slot)
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
        """Allocate for positions [start, end); False (nothing allocated) if the pools are short."""
        assert end <= self.max_pages * self.P, f"position {end} exceeds the request page table"
        n_full, n_swa = self.pages_needed(slot, start, end)
        short_full, short_swa = n_full - self.full.num_free, n_swa - self.swa.num_free
        if (short_full > 0 or short_swa > 0) and self.evict is not None:
            self.evict(max(0, short_full), max(0, short_swa))
        if not (self.full.can_alloc(n_full) and self.swa.can_alloc(n_swa)):
            return False
        have = self.full_pages[slot]
        if n_full:
            new = self.full.alloc(n_full)
            self.page_table[slot, len(have):len(have) + n_full] = self._dev(new)
            have.extend(new)
        lo = max(0, start - self.layout.swa_horizon) // self.P
        missing = [p for p in have[lo:math.ceil(end / self.P)] if p not in self.swa_of]
        assert not any(p in self.shared for p in missing), (
            "a shared page inside the horizon lost its SWA")
        if missing:
            self._give_swa(missing)
        return True

    def release_swa(self, slot: int, keep_from: int) -> None:
        """Free the SWA pages of private full pages lying entirely before `keep_from - horizon`.

        O(pages that left the horizon since the last call), not O(context): called every step."""
        limit = max(0, keep_from - self.layout.swa_horizon) // self.P
        floor = self._swa_floor[slot]
        if limit <= floor:
            return
        self.drop_swa([p for p in self.full_pages[slot][floor:limit]
                       if p in self.swa_of and p not in self.shared])
        self._swa_floor[slot] = limit

    def truncate(self, slot: int, new_len: int) -> None:
        """Forget positions >= new_len: whole private pages past it go back to the pools, and
        hot C4 entries that are not complete below new_len leave the slot's hot set."""
        self._truncate_pages(slot, new_len)
        if self.hot is not None:
            # entry i pools positions < m(i+1) (m = P // page_entries, the C4 ratio): complete
            # below new_len iff i < new_len // m
            self.hot.truncate(slot, new_len * self.hot.layout.page_entries // self.P)

    def free(self, slot: int) -> None:
        self._truncate_pages(slot, 0)
        del self.full_pages[slot], self._swa_floor[slot]
        if self.hot is not None:
            self.hot.release(slot)
        self._free_slots.append(slot)

    def _truncate_pages(self, slot: int, new_len: int) -> None:
        have = self.full_pages[slot]
        keep = math.ceil(new_len / self.P)
        dropped = [p for p in have[keep:] if p not in self.shared]
        self.drop_swa([p for p in dropped if p in self.swa_of])
        self.full.free(dropped)
        del have[keep:]
        self.page_table[slot, keep:] = 0
        # a later `reserve` may give SWA again to pages from new_len - horizon on
        floor = max(0, new_len - self.layout.swa_horizon) // self.P
        self._swa_floor[slot] = min(self._swa_floor[slot], floor)

    # ---- used by the prefix cache ---------------------------------------------------------
    def share(self, pages: Iterable[int]) -> None:
        """Hand private pages over to the prefix cache (their request no longer frees them)."""
        self.shared.update(pages)

    def release_shared(self, pages: list[int]) -> None:
        """The prefix cache evicts shared pages: free them and their SWA pages."""
        assert all(p in self.shared for p in pages), (
            "releasing a page the prefix cache does not own")
        self.drop_swa([p for p in pages if p in self.swa_of])
        self.shared.difference_update(pages)
        self.full.free(pages)

    def move_swa(self, src: int, dst: int) -> None:
        """Move the SWA page behind full page `src` to full page `dst` (same tokens, positions)."""
        assert dst not in self.swa_of, "destination page already has an SWA page"
        swa = self.swa_of.pop(src)
        self.swa_of[dst] = swa
        self.full_to_swa[src] = 0
        self.full_to_swa[dst] = swa

    def drop_swa(self, full_pages: list[int]) -> None:
        """Free the SWA pages behind these full pages (their compressed shadows stay)."""
        if not full_pages:
            return
        self.swa.free(self.swa_of.pop(p) for p in full_pages)
        self.full_to_swa[self._dev(full_pages)] = 0

    def _give_swa(self, full_pages: list[int]) -> None:
        swa_pages = self.swa.alloc(len(full_pages))
        self.swa_of.update(zip(full_pages, swa_pages, strict=True))
        self.full_to_swa[self._dev(full_pages)] = self._dev(swa_pages)

    def _dev(self, values: list[int]) -> torch.Tensor:
        return to_device(torch.tensor(values, dtype=torch.int64), self.page_table.device)

    # ---- invariants --------------------------------------------------------------------------
    def check_integrity(self) -> None:
        self.full.check_integrity()
        self.swa.check_integrity()
        private = [p for pages in self.full_pages.values() for p in pages if p not in self.shared]
        assert len(private) == len(set(private)), "a private full page is owned twice"
        used = set(private) | self.shared
        assert len(used) == len(private) + len(self.shared), "a page is both private and shared"
        assert len(used) == self.full.num_usable - self.full.num_free, (
            "full pages leaked or double-counted")
        assert set(self.swa_of) <= used, "SWA page behind a full page nobody owns"
        assert len(self.swa_of) == self.swa.num_usable - self.swa.num_free, "SWA pages leaked"
        table = self.page_table.cpu()
        for slot, pages in self.full_pages.items():
            assert table[slot, :len(pages)].tolist() == pages, (
                f"device page table of slot {slot} is stale")
            assert not table[slot, len(pages):].any(), (
                f"slot {slot} has device pages past its length")
        f2s = self.full_to_swa.cpu()
        expected = torch.zeros_like(f2s)
        for p, s in self.swa_of.items():
            expected[p] = s
        assert torch.equal(f2s, expected), "device full->SWA table disagrees with the host mirror"
        assert not table[self.pad_slot].any(), "the padding slot maps a page"
        assert len(set(self._free_slots)) == len(self._free_slots), "duplicate free request slots"
        assert not set(self._free_slots) & set(self.full_pages), (
            "a request slot is both free and open")
        for slot, pages in self.full_pages.items():
            below = pages[:self._swa_floor[slot]]
            assert not any(p in self.swa_of for p in below if p not in self.shared), (
                f"slot {slot} holds a private SWA page below its release floor")
        assert self.hot is None or self.hot.admitted == set(self.full_pages), (
            "the HotSet's admitted slots are not the open request slots")
