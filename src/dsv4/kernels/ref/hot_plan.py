"""Reference HiSparse plan: make one C4 layer's picks hot (LRU), in place on the hot-set maps, and
say which host rows to copy where (`hot_plan_ref`).

The executable specification of `kernels/triton/hot_plan.py`; `cache/hisparse.py::HotSet` calls
it (or the kernel backend's op) for `select` and for the hot placement of new entries. One
layer's maps (R request slots, E hot slots per request, M entries per request; row R is the pad
slot, column E / M the trash column, always -1):

    e2s    [R + 1, M + 1] int32  hot slot j of entry i of request slot r; -1: not hot
    s2e    [R + 1, E + 1] int32  entry held by hot slot j; -1: empty
    stamp  [R + 1, E + 1] int64  clock value of the last call that touched slot j; -1: empty

One call, for picks[t, c] (entry ids of request slot_ids[t]; -1: none; rows of the pad slot pick
nothing), with `now` = the clock after its increment:
    1. hits: every pick already hot has its slot stamped `now`
    2. misses: the distinct picks not hot, per request in the order they first appear in picks
       (row by row, column by column), rank q = 0, 1, ..
    3. victims: per request its E slots by ascending (stamp, slot) (empty first, this call's hits
       last); miss q takes victim q when q < E - (slots stamped `now`), else it is not placed
    4. remap: the victims' old entries unmapped, the placed misses mapped and stamped `now`
Returns (rows [T, k] int64: hot row r * E + j of each pick after the call, -1 for none or not
placed; src, dst [n] int64: host mirror row -> hot row of each placed miss, -1 in both where
nothing is copied). The host mirror row of entry i of slot r is
page_table[r, i // pe] * pe + i % pe. With `strict` (a select) the counters [3] int64 get
+= (valid picks, placed misses, misses not placed); otherwise they are left alone.

Fixed shapes and no host reads: capturable in a CUDA graph. Test: tests/kernels/test_hot_plan.py.

`hot_write_ref` is the write path of new entries in one call: their plan with one pick per row
(strict off), then each value stored into the host mirror row of its entry and, where the entry
is now hot, into its hot row; the pad slot's rows store nothing.
"""

from __future__ import annotations

import torch

from dsv4.kernels.ref.hisparse import write_rows_ref


def hot_plan_ref(e2s: torch.Tensor, s2e: torch.Tensor, stamp: torch.Tensor, clock: torch.Tensor,
                 slot_ids: torch.Tensor, picks: torch.Tensor, page_table: torch.Tensor,
                 page_entries: int, counters: torch.Tensor, strict: bool
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Steps 1-4 of the module docstring for any rows (a request may have several, and its picks
    may repeat). clock: [] int64, incremented in place. Returns (rows, src, dst)."""
    T, k = picks.shape
    R = e2s.shape[0] - 1
    slots = slot_ids.long()[:, None].expand(T, k).reshape(-1)
    entries = torch.where(slots < R, picks.reshape(-1).long(), -1)
    now = clock.add_(1)
    miss = (entries >= 0) & ~_stamp_hits(e2s, stamp, slots, entries, now)
    slot_s, entry_s, rank = _rank_misses(slots, entries, miss, R, e2s.shape[1] - 1)
    src, dst, placed, missed = _place(e2s, s2e, stamp, slot_s, entry_s, rank, now, page_table,
                                      page_entries)
    if strict:
        counters += torch.stack([(entries >= 0).sum(), placed, missed - placed])
    return lookup_rows(e2s, s2e.shape[1] - 1, slots, entries).view(T, k), src, dst


def lookup_rows(e2s: torch.Tensor, device_entries: int, slots: torch.Tensor,
                entries: torch.Tensor) -> torch.Tensor:
    """Hot rows slot * E + j of entries[i] of request slot slots[i] (flat [n]), -1 where not hot
    or not a pick (entry -1)."""
    col = torch.where(entries >= 0, entries, e2s.shape[1] - 1)
    j = e2s[slots, col].long()
    return torch.where(j >= 0, slots * device_entries + j, -1)


def host_rows(page_table: torch.Tensor, page_entries: int, slots: torch.Tensor,
              entries: torch.Tensor) -> torch.Tensor:
    """Host mirror row of entry entries[i] of request slot slots[i] (its C4 entry slot)."""
    safe = entries.clamp(min=0)
    return page_table[slots, safe // page_entries] * page_entries + safe % page_entries


def _stamp_hits(e2s: torch.Tensor, stamp: torch.Tensor, slots: torch.Tensor,
                entries: torch.Tensor, now: torch.Tensor) -> torch.Tensor:
    """Step 1: stamp the hot slots of the picks with `now`; returns which picks hit."""
    E, M = stamp.shape[1] - 1, e2s.shape[1] - 1
    cur = e2s[slots, torch.where(entries >= 0, entries, M)].long()
    hit = (entries >= 0) & (cur >= 0)
    stamp.index_put_((slots, torch.where(hit, cur, E)), torch.where(hit, now, -1))
    return hit


def hot_write_ref(e2s: torch.Tensor, s2e: torch.Tensor, stamp: torch.Tensor, clock: torch.Tensor,
                  slot_ids: torch.Tensor, entries: torch.Tensor, page_table: torch.Tensor,
                  page_entries: int, values: torch.Tensor, host_pool: torch.Tensor,
                  device_pool: torch.Tensor) -> None:
    """Store new entries (module docstring): entry entries[t] of request slot slot_ids[t] =
    values[t] ([T, D]) in host_pool (its mirror row) and, once placed hot by the plan, in
    device_pool (its hot row). Rows of the pad slot (and entries < 0) store nothing. The host
    pool may be pinned CPU memory beside CUDA values (a blocking copy here)."""
    R = e2s.shape[0] - 1
    unused = torch.zeros(3, dtype=torch.int64, device=e2s.device)
    rows = hot_plan_ref(e2s, s2e, stamp, clock, slot_ids, entries[:, None], page_table,
                        page_entries, unused, False)[0].view(-1)
    slots = slot_ids.long()
    valid = (slots < R) & (entries >= 0)
    host = torch.where(valid, host_rows(page_table, page_entries, slots, entries.long()), -1)
    write_rows_ref(host_pool, host, values)
    write_rows_ref(device_pool, rows, values)


def _rank_misses(slots: torch.Tensor, entries: torch.Tensor, miss: torch.Tensor, R: int, M: int
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Step 2: (slot, entry, rank) of every pick, reordered; rank q >= 0 marks the q-th distinct
    miss of its request in order of first appearance, -1 a repeat or a non-miss.

    Sort 1 groups repeats: key = slot * (M + 1) + entry (non-misses: `none`, last), stable, so a
    group's first element is its earliest position. Sort 2 orders those firsts by
    (slot, position); ranks count them per slot:

        positions     [0: s0 e7, 1: s0 e3, 2: s0 e3, 3: s2 e1]
        sort 1        [s0 e3 @1, s0 e3 @2, s0 e7 @0 | s2 e1 @3]   first [1, 0, 1 | 1]
        sort 2        [s0 @0 (e7), s0 @1 (e3) | s2 @3 (e1) | repeats ...]
        rank          [  0,          1        |   0        |  -1 ...]   cumsum(first) - start[slot]
    """
    n = slots.shape[0]
    none = (R + 1) * (M + 1)
    keys, order = torch.sort(torch.where(miss, slots * (M + 1) + entries, none), stable=True)
    prev = torch.cat([keys.new_full((1,), -1), keys[:-1]])
    first = (keys != prev) & (keys < none)
    by_pos = torch.sort(torch.where(first, slots[order] * n + order, (R + 1) * n)).indices
    order, first = order[by_pos], first[by_pos]
    slot_s, entry_s = slots[order], entries[order]
    count = torch.zeros(R + 1, dtype=torch.int64, device=slots.device)
    count.index_add_(0, slot_s, first.long())
    start = count.cumsum(0) - count                        # distinct misses of lower slots
    rank = first.long().cumsum(0) - 1 - start[slot_s]
    return slot_s, entry_s, torch.where(first, rank, -1)


def _place(e2s: torch.Tensor, s2e: torch.Tensor, stamp: torch.Tensor, slot_s: torch.Tensor,
           entry_s: torch.Tensor, rank: torch.Tensor, now: torch.Tensor, page_table: torch.Tensor,
           page_entries: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Steps 3-4: the q-th distinct miss of a request takes its q-th LRU slot; remap. Returns
    (src, dst, placed count, distinct miss count)."""
    E, M = s2e.shape[1] - 1, e2s.shape[1] - 1
    # NOTE: the slots hit in step 1 carry `now`, above every other stamp, so they sort last
    # and the first E - hit victims of a request are never slots that this call reads.
    free = E - (stamp[:, :E] == now).sum(-1)                                      # [R + 1]
    fits = (rank >= 0) & (rank < free[slot_s])
    victims = torch.sort(stamp[:, :E], dim=-1, stable=True).indices               # [R + 1, E]
    j = victims[slot_s, rank.clamp(0, E - 1)]
    old = s2e[slot_s, j].long()
    e2s.index_put_((slot_s, torch.where(fits & (old >= 0), old, M)), e2s.new_full((), -1))
    e2s.index_put_((slot_s, torch.where(fits, entry_s, M)), torch.where(fits, j, -1).int())
    s2e.index_put_((slot_s, torch.where(fits, j, E)), torch.where(fits, entry_s, -1).int())
    stamp.index_put_((slot_s, torch.where(fits, j, E)), torch.where(fits, now, -1))
    src = torch.where(fits, host_rows(page_table, page_entries, slot_s, entry_s), -1)
    return src, torch.where(fits, slot_s * E + j, -1), fits.sum(), (rank >= 0).sum()
