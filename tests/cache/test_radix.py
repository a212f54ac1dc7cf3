"""RadixPrefixCache under random insert / match / lock / unlock / evict / tombstone sequences.

A hypothesis state machine plays requests the way the scheduler does (match + lock at admission,
reserve pages, insert completed pages, release SWA behind the horizon, insert + free + unlock at
finish) interleaved with eviction under full and SWA pressure; the tree's and the table's
`check_integrity()` run after every step and, at the end, every page of every pool is free again.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from dsv4.cache.layout import CacheLayout
from dsv4.cache.radix import LockHandle, RadixPrefixCache
from dsv4.cache.req_table import RequestTable

P = 4
LAYOUT = CacheLayout(page_size=P, num_full_pages=40, num_swa_pages=14, ring_c4=8, ring_c128=16,
                     swa_horizon=6)
BASES = [[1] * 12, [1] * 8 + [2] * 8, [3, 4, 5] * 5]


class Req:
    def __init__(self, slot: int, tokens: list[int], cached: int, lock: LockHandle) -> None:
        self.slot, self.tokens, self.cached, self.lock = slot, tokens, cached, lock
        self.prompt_len = len(tokens)


MAX_CONTEXT = 64


class RadixMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.table = RequestTable(LAYOUT, max_reqs=4, max_context=MAX_CONTEXT,
                                  device=torch.device("cpu"))
        self.cache = RadixPrefixCache(self.table, LAYOUT.swa_horizon)
        self.reqs: list[Req] = []

    @precondition(lambda self: self.table.num_free_slots > 0)
    @rule(base=st.integers(0, len(BASES) - 1), extra=st.lists(st.integers(1, 5), max_size=14))
    def admit(self, base: int, extra: list[int]) -> None:
        tokens = BASES[base] + extra
        m = self.cache.match(tokens)
        assert m.length % P == 0 and m.length <= len(tokens) - 1
        assert m.pages == [p for p in m.pages if p in self.table.shared]
        lock = self.cache.lock(m.node, m.length)
        slot = self.table.open(m.pages)
        req = Req(slot, tokens, m.length, lock)
        if self.table.reserve(slot, m.length, min(len(tokens), m.length + 5)):
            req.cached = min(len(tokens), m.length + 5)
            self.reqs.append(req)
        else:                                    # could not admit: undo like the scheduler does
            self.table.free(slot)
            self.cache.unlock(lock)

    @precondition(lambda self: self.reqs)
    @rule(i=st.integers(0, 3), n=st.integers(1, 7))
    def extend(self, i: int, n: int) -> None:
        req = self.reqs[i % len(self.reqs)]
        # the engine never grows a request past its context length
        n = min(n, MAX_CONTEXT - req.cached)
        if n <= 0:
            return
        req.tokens = req.tokens + [7] * n
        if self.table.reserve(req.slot, req.cached, req.cached + n):
            req.cached += n
            self.table.release_swa(req.slot, req.cached)
            if req.lock.swa_held and req.cached - req.lock.length >= self.cache.horizon:
                self.cache.release_swa(req.lock)

    @precondition(lambda self: self.reqs)
    @rule(i=st.integers(0, 3))
    def insert(self, i: int) -> None:
        self._insert(self.reqs[i % len(self.reqs)], finished=False)

    @precondition(lambda self: self.reqs)
    @rule(i=st.integers(0, 3))
    def finish(self, i: int) -> None:
        req = self.reqs.pop(i % len(self.reqs))
        self._insert(req, finished=True)
        self.table.free(req.slot)
        self.cache.unlock(req.lock)

    @rule(full=st.integers(0, 10), swa=st.integers(0, 10))
    def evict(self, full: int, swa: int) -> None:
        self.cache.evict(full, swa)

    def _insert(self, req: Req, finished: bool) -> None:
        pages = req.cached // P
        if pages:
            repeat = (req.prompt_len - 1) // P           # as the scheduler marks anchors
            node = self.cache.insert(req.tokens[:pages * P],
                                     self.table.full_pages[req.slot][:pages], finished,
                                     anchor=repeat if repeat <= pages else None)
            lock = self.cache.lock(node, pages * P)
            self.cache.unlock(req.lock)
            req.lock = lock

    @invariant()
    def consistent(self) -> None:
        self.cache.check_integrity()
        self.table.check_integrity()

    def teardown(self) -> None:
        for req in self.reqs:
            self.table.free(req.slot)
            self.cache.unlock(req.lock)
        self.cache.flush()
        self.cache.check_integrity()
        self.table.check_integrity()
        assert self.cache.num_pages == 0
        assert self.table.full.num_free == self.table.full.num_usable
        assert self.table.swa.num_free == self.table.swa.num_usable


TestRadixMachine = RadixMachine.TestCase
TestRadixMachine.settings = settings(max_examples=120, stateful_step_count=40, deadline=None)


def test_match_is_swa_safe_and_page_aligned() -> None:
    table = RequestTable(LAYOUT, max_reqs=2, max_context=64, device=torch.device("cpu"))
    cache = RadixPrefixCache(table, horizon=6)
    tokens = list(range(1, 22))
    slot = table.open()
    assert table.reserve(slot, 0, 21)
    cache.insert(tokens[:20], table.full_pages[slot][:5], finished=True)
    table.free(slot)
    # one token is left to compute
    assert cache.match(tokens).length == 20 and cache.match(tokens[:20]).length == 16
    # SWA pressure tombstones inner nodes first, LRU, nearest the root
    cache.evict(0, 1)
    cache.check_integrity()
    assert cache.num_pages == 5 and cache.swa_live == 2
    # the tail still has a horizon of live SWA behind the cut
    assert cache.match(tokens).length == 20
    assert cache.match(tokens[:13]).length == 0  # a cut after the tombstone is not SWA-safe
    handle = cache.lock(cache.match(tokens).node, 20)
    cache.evict(0, 10)                         # the SWA-locked last horizon cannot be tombstoned
    assert cache.swa_live == 2
    cache.release_swa(handle)
    # now every node is a tombstone (the leaf is full-locked, so kept)
    cache.evict(0, 10)
    cache.check_integrity()
    assert cache.swa_live == 0 and cache.num_pages == 5 and cache.match(tokens).length == 0
    # an unlocked tombstone leaf is deleted, and its tombstone parents
    cache.unlock(handle)
    cache.check_integrity()
    assert cache.num_pages == 0 and table.full.num_free == table.full.num_usable
    with pytest.raises(AssertionError, match="not locked"):
        cache.unlock(handle)


def test_the_point_a_repeated_prompt_matches_keeps_its_swa_longest() -> None:
    """Two requests of 14-token prompts (3 whole pages before the last token) that grew to 20
    tokens: the prompt's end is an inner node of the cached path. Under SWA pressure the inner
    node before it goes first; the anchor at the prompt's repeat point is tombstoned only after
    it (least recent prompt first), so a repeat of either prompt still matches 12 tokens."""
    table = RequestTable(LAYOUT, max_reqs=2, max_context=64, device=torch.device("cpu"))
    cache = RadixPrefixCache(table, horizon=6)            # a horizon of 2 pages (P = 4)
    prompts = [list(range(1, 15)), list(range(21, 35))]
    for prompt in prompts:
        tokens = prompt + [99] * 6
        slot = table.open()
        assert table.reserve(slot, 0, 20)
        pages = table.full_pages[slot][:5]
        cache.insert(tokens[:12], pages[:3], finished=False, anchor=3)   # the prefill
        cache.insert(tokens[:20], pages, finished=True, anchor=3)        # at its finish
        table.free(slot)
    cache.check_integrity()
    assert [cache.match(p).length for p in prompts] == [12, 12]
    cache.evict(0, 2)                # two inner non-anchor pages: the first page of each path
    cache.check_integrity()
    assert [cache.match(p).length for p in prompts] == [12, 12]
    cache.evict(0, 4)                # then anchors and leaves, least recent first: the output
    cache.check_integrity()          # leaves (the repeats' matches touched the anchors since)
    assert cache.num_pages == 6 and [cache.match(p).length for p in prompts] == [12, 12]
    cache.evict(0, 1)                # prompt 0's anchor, now its path's unlocked leaf: deleted
    cache.check_integrity()
    assert [cache.match(p).length for p in prompts] == [0, 12]
