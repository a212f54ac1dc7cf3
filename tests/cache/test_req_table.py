"""Allocator and request-table accounting under random allocate/extend/release/truncate/free."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dsv4.cache.allocator import OutOfPages, PageAllocator
from dsv4.cache.layout import CacheLayout
from dsv4.cache.req_table import RequestTable

LAYOUT = CacheLayout(page_size=4, num_full_pages=24, num_swa_pages=10, ring_c4=8, ring_c128=16,
                     swa_horizon=6)

op = st.one_of(
    st.tuples(st.just("open")),
    st.tuples(st.just("extend"), st.integers(0, 7), st.integers(1, 20)),
    st.tuples(st.just("truncate"), st.integers(0, 7), st.integers(0, 40)),
    st.tuples(st.just("free"), st.integers(0, 7)),
)


@settings(max_examples=150, deadline=None)
@given(st.lists(op, max_size=40))
def test_request_table_stays_consistent(ops: list[tuple]) -> None:
    table = RequestTable(LAYOUT, max_reqs=4, max_context=64, device=torch.device("cpu"))
    lengths: dict[int, int] = {}
    for o in ops:
        kind, open_slots = o[0], sorted(lengths)
        if kind == "open" and table.num_free_slots:
            lengths[table.open()] = 0
        elif kind == "extend" and open_slots:
            slot = open_slots[o[1] % len(open_slots)]
            start, end = lengths[slot], min(lengths[slot] + o[2], 64)
            ok = table.reserve(slot, start, end)
            if ok:
                lengths[slot] = end
                table.release_swa(slot, end)
                pages = table.full_pages[slot]
                assert len(pages) == math.ceil(end / LAYOUT.page_size)
                lo = max(0, start - LAYOUT.swa_horizon) // LAYOUT.page_size
                assert all(p in table.swa_of
                           for p in pages[max(lo, (max(0, end - LAYOUT.swa_horizon)) // 4):])
        elif kind == "truncate" and open_slots:
            slot = open_slots[o[1] % len(open_slots)]
            lengths[slot] = min(lengths[slot], o[2])
            table.truncate(slot, lengths[slot])
            assert len(table.full_pages[slot]) == math.ceil(lengths[slot] / LAYOUT.page_size)
        elif kind == "free" and open_slots:
            slot = open_slots[o[1] % len(open_slots)]
            table.free(slot)
            del lengths[slot]
        table.check_integrity()
    for slot in list(lengths):
        table.free(slot)
    table.check_integrity()
    assert (table.full.num_free == table.full.num_usable
            and table.swa.num_free == table.swa.num_usable)
    assert table.num_free_slots == 4


def test_reserve_is_all_or_nothing() -> None:
    table = RequestTable(LAYOUT, max_reqs=4, max_context=200, device=torch.device("cpu"))
    a, b = table.open(), table.open()
    # grow to 80 tokens (20 of 23 full pages), releasing old SWA pages
    for end in range(4, 81, 4):
        assert table.reserve(a, end - 4, end)
        table.release_swa(a, end)
    free_full, free_swa = table.full.num_free, table.swa.num_free
    assert not table.reserve(b, 0, 16)      # needs 4 full pages, 3 left
    assert (table.full.num_free, table.swa.num_free) == (free_full, free_swa)
    assert table.full_pages[b] == []
    table.check_integrity()


def test_allocator_errors() -> None:
    alloc = PageAllocator(4, "t")
    pages = alloc.alloc(3)
    assert sorted(pages) == [1, 2, 3] and not alloc.can_alloc(1)
    with pytest.raises(OutOfPages):
        alloc.alloc(1)
    alloc.free(pages[:1])
    with pytest.raises(AssertionError, match="not allocated"):
        alloc.free(pages[:1])
    alloc.check_integrity()


class _SliceLog(list):
    """A page list that records how many pages each slice read returns."""

    def __init__(self, pages: list[int]) -> None:
        super().__init__(pages)
        self.scanned = 0

    def __getitem__(self, index):  # type: ignore[no-untyped-def]
        out = super().__getitem__(index)
        if isinstance(index, slice):
            self.scanned += len(out)
        return out


def test_release_swa_scans_only_pages_that_left_the_horizon() -> None:
    """Per-step host work is O(batch), not O(context): a decode step's `release_swa` looks at the
    pages that fell behind the horizon since the last call, not at every page of the request."""
    layout = CacheLayout(page_size=4, num_full_pages=300, num_swa_pages=10, ring_c4=8,
                         ring_c128=16, swa_horizon=6)
    table = RequestTable(layout, max_reqs=1, max_context=1024, device=torch.device("cpu"))
    slot = table.open()
    log = _SliceLog(table.full_pages[slot])
    table.full_pages[slot] = log
    for end in range(1, 1001):
        assert table.reserve(slot, end - 1, end)
        table.release_swa(slot, end)
    # reserve reads a horizon's worth of pages per step; release_swa adds one page per P steps
    horizon_pages = math.ceil(layout.swa_horizon / layout.page_size) + 2
    assert log.scanned <= 1000 * horizon_pages + 1000 // layout.page_size
    table.check_integrity()
    # a truncate below the floor lets reserve give those pages SWA again; release frees them
    table.truncate(slot, 400)
    assert table.reserve(slot, 400, 401)
    table.release_swa(slot, 401)
    table.check_integrity()
