"""HotSet (HiSparse): C4 attention entries in a host mirror, a small hot set of them per request
on the device, and the entry -> hot row mapping that sparse attention reads through.

At long context almost all KV is C4 entries, yet each query reads only the lightning indexer's
top-k of them. The host mirror holds every entry. The device holds at most `device_entries` of
them per request and C4 layer. After the indexer picks (its keys stay on the device, so the
selection is unchanged), `select` copies in the picks that are not hot and returns where they are.

Data layout (L C4 layers, R request slots, E = device_entries, M = max_entries, D = width,
pe = C4 entries per full page):

    host_pool      [L, num_host_rows, D]  the `LayerCache.entries` pool moved to the host (pinned
                                          when the device is CUDA): entry i of slot r at row
                                          page_table[r, i // pe] * pe + i % pe, so prefix-shared
                                          pages share their entries; last row: trash
    device_pool    [L, R * E + 1, D]      hot rows: slot r owns rows [r*E, (r+1)*E) of every
                                          layer (one hot set per C4 layer, as SGLang keeps; no
                                          allocator needed); last row: trash
    entry_to_slot  [L, R + 1, M + 1] i32  hot slot j (0..E-1) holding entry i; -1: not hot
    slot_to_entry  [L, R + 1, E + 1] i32  entry held by hot slot j; -1: empty
    last_used      [L, R + 1, E + 1] i64  `clock` of the last select or hot write that touched
                                          slot j; -1: empty. The LRU victim is the smallest.

Row R is `RequestTable.pad_slot`: never admitted, its rows select nothing (CUDA-graph padding).
Column M / E is the target of masked scatters and always holds -1. The empty slots of a
(layer, request) are its free list: exactly those with slot_to_entry == -1, which the LRU sort
puts first. The maps cost 16 bytes per (layer, request, hot slot) and 4 per (layer, request,
entry), against the >= 584 bytes of an FP8 entry they let stay on the host.

Invariants (`check_integrity`): per layer and admitted slot, entry_to_slot and slot_to_entry are
mutual inverses; last_used is -1 exactly on empty slots and never ahead of `clock`; slots not
admitted hold nothing; trash columns hold -1; every hot row equals the host row of its entry
(writes go through to hot copies); no select has overflowed.

`stage(layer, slot_ids, topk)` serves rows whose picks cannot all be hot at once (a prefill
chunk of one request picks up to every entry it sees): it copies the distinct picks from the host
mirror into a new device buffer and leaves the hot set alone.

`select(layer, slot_ids, topk)` is ops of fixed shapes with no `.item()` / `.tolist()`
(capturable in a CUDA graph when the swap-in is: the Triton op, or `swap_in_ref` with both pools
on the device):
    1. hits: look every pick up in entry_to_slot; stamp the hit slots with the new clock value
    2. misses: the distinct picks not hot, ranked within their request in order of first
       appearance (row by row, column by column)
    3. victims: per request, its slots by ascending last_used (empty first, the slots hit in
       step 1 last); the miss of rank q takes victim q, if q < E - (slots hit in step 1)
    4. remap: unmap the victims' old entries, map the misses, stamp them
    5. swap-in: host rows of the misses -> their hot rows (`swap_in`, one fixed-size copy)
    6. remap the picks: hot row = slot * E + entry_to_slot[slot, entry]; -1 stays -1
Steps 1-4 and 6 are the `plan` op (`kernels/ref/hot_plan.py`): ~50 torch ops in the reference,
one launch in the Triton kernel, which needs one row per request with distinct picks (a plain
decode step; callers say so with `one_row`, else the reference runs).
A call must pick at most E distinct entries per request (one row per request always fits: the
layout refuses E < top_k). Beyond that the extra misses are not placed, their picks return -1 and
`num_overflow` counts them, which `check_integrity` reports.

Host syncs: the copies between the mirror and the device go through the `swap_in` and
`write_rows` hooks (the kernel backend's ops). The references sync when the mirror is on another
device (blocking copies); the Triton ops read and store the pinned mirror in place (UVA) with no
sync, so `write_entries` and `select` are then capturable in a CUDA graph (the engine's decode
graphs). `stage` syncs (its buffer's size: prefill only); `check_integrity` reads everything
back. admit / release / truncate launch device ops from host ints and never read device memory.
Test: tests/cache/test_hisparse.py.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dsv4.cache.layout import CacheLayout
from dsv4.config.model import ModelConfig
from dsv4.kernels.ops import HotPlanOp, HotWriteOp, SwapInOp, WriteRowsOp
from dsv4.kernels.ref.hisparse import swap_in_ref, write_rows_ref
from dsv4.kernels.ref.hot_plan import host_rows, hot_plan_ref, hot_write_ref, lookup_rows


@dataclass(frozen=True)
class HiSparseLayout:
    """Sizes of the hot sets and the host mirror; construction validates them, so a bad
    configuration fails at startup."""

    num_layers: int       # C4 (CSA) layers
    max_reqs: int         # request slots (RequestTable.max_reqs)
    max_entries: int      # C4 entries one request can reach: max_context // csa_ratio
    device_entries: int   # hot slots per request and C4 layer
    top_k: int            # the indexer's top-k (ModelConfig.index_topk)
    num_host_rows: int    # host mirror rows per layer, trash row included
    page_entries: int     # C4 entries per full page: page_size // csa_ratio
    width: int            # entry width (head_dim)

    def __post_init__(self) -> None:
        for name in ("num_layers", "max_reqs", "max_entries", "device_entries", "top_k",
                     "num_host_rows", "page_entries", "width"):
            if getattr(self, name) < 1:
                raise ValueError(f"hisparse {name}={getattr(self, name)} is invalid; "
                                 "allowed: >= 1")
        if self.device_entries < self.top_k:
            raise ValueError(f"hisparse device_entries={self.device_entries} is invalid; "
                             f"allowed: >= top_k={self.top_k} (the indexer's index_topk): every "
                             "pick of one query must be hot at once")

    @classmethod
    def from_configs(cls, model: ModelConfig, layout: CacheLayout, max_reqs: int,
                     max_context: int, device_entries: int) -> HiSparseLayout:
        """The engine's sizes: the host mirror takes the C4 entry coordinates of `layout`."""
        r = model.csa_ratio
        return cls(num_layers=sum(t == "csa" for t in model.attn_types), max_reqs=max_reqs,
                   max_entries=max_context // r, device_entries=device_entries,
                   top_k=model.index_topk, num_host_rows=layout.num_full_slots // r + 1,
                   page_entries=layout.page_size // r, width=model.head_dim)

    @staticmethod
    def device_bytes(model: ModelConfig, max_reqs: int, max_context: int, device_entries: int,
                     dtype: torch.dtype) -> int:
        """Device bytes (hot pools + maps) of the engine's HotSet, before the cache layout exists
        (`plan_cache` reserves them from the KV budget)."""
        probe = HiSparseLayout(num_layers=sum(t == "csa" for t in model.attn_types),
                               max_reqs=max_reqs, max_entries=max_context // model.csa_ratio,
                               device_entries=device_entries, top_k=model.index_topk,
                               num_host_rows=1, page_entries=1, width=model.head_dim)
        return probe.pool_bytes(dtype)[0]

    def pool_bytes(self, dtype: torch.dtype) -> tuple[int, int]:
        """(device bytes: hot pools + maps, host bytes: mirror) of one HotSet."""
        elt = torch.finfo(dtype).bits // 8
        L, R, E, M = self.num_layers, self.max_reqs, self.device_entries, self.max_entries
        maps = L * (R + 1) * (4 * (M + 1) + 12 * (E + 1))
        return (L * (R * E + 1) * self.width * elt + maps,
                L * self.num_host_rows * self.width * elt)


class HotSet:
    """Per request slot and C4 layer: the hot set, its maps and LRU order (module docstring)."""

    def __init__(self, layout: HiSparseLayout, page_table: torch.Tensor, dtype: torch.dtype,
                 device: torch.device, host_device: torch.device | None = None,
                 swap_in: SwapInOp = swap_in_ref, write_rows: WriteRowsOp = write_rows_ref,
                 plan: HotPlanOp = hot_plan_ref, write: HotWriteOp = hot_write_ref) -> None:
        """page_table: [max_reqs + 1, max_pages] int64 full pages per slot, on `device`; held by
        reference (`RequestTable.page_table`), so the host rows follow its updates.
        host_device: where the mirror lives (default: the CPU, pinned when `device` is CUDA).
        swap_in / write_rows: the copies host mirror -> hot rows and new entries -> host mirror
        (the kernel backend's ops; the references sync when the mirror is on another device).
        plan: the backend's `hot_plan` op, run where a call promises one row per request
        (`one_row`); the reference runs otherwise. write: the backend's `hot_write` op, the
        plan and stores of `write_entries(hot=True, one_row=True)` in one call."""
        L, R, E, M = layout.num_layers, layout.max_reqs, layout.device_entries, layout.max_entries
        assert page_table.shape[0] == R + 1, "page_table needs max_reqs + 1 rows (pad slot last)"
        assert page_table.shape[1] * layout.page_entries >= M, "page_table narrower than entries"
        self.layout, self.page_table = layout, page_table
        self.swap_in, self.write_rows, self.plan, self.write = swap_in, write_rows, plan, write
        host = host_device or torch.device("cpu")
        pin = host.type == "cpu" and device.type == "cuda"
        self.host_pool = torch.zeros(L, layout.num_host_rows, layout.width, dtype=dtype,
                                     device=host, pin_memory=pin)
        self.device_pool = torch.zeros(L, R * E + 1, layout.width, dtype=dtype, device=device)
        i32, i64 = torch.int32, torch.int64
        self.entry_to_slot = torch.full((L, R + 1, M + 1), -1, dtype=i32, device=device)
        self.slot_to_entry = torch.full((L, R + 1, E + 1), -1, dtype=i32, device=device)
        self.last_used = torch.full((L, R + 1, E + 1), -1, dtype=i64, device=device)
        self.clock = torch.zeros((), dtype=i64, device=device)
        # valid picks selected, entries copied in, picks found no hot slot (`plan`'s counters)
        self.counters = torch.zeros(3, dtype=i64, device=device)
        self.num_picked, self.num_swapped, self.num_overflow = self.counters.unbind()
        self.num_staged = torch.zeros((), dtype=i64, device=device)    # entries staged (`stage`)
        self._admitted: set[int] = set()

    # ---- request slots -------------------------------------------------------------------
    @property
    def admitted(self) -> frozenset[int]:
        """The request slots with a hot set (admitted, not released)."""
        return frozenset(self._admitted)

    def admit(self, slot: int) -> None:
        """Start an empty hot set for request slot `slot` (every layer)."""
        assert 0 <= slot < self.layout.max_reqs, f"slot {slot} out of range"
        assert slot not in self._admitted, f"slot {slot} is already admitted"
        self._admitted.add(slot)

    def release(self, slot: int) -> None:
        """Empty the hot set of `slot`; its host entries belong to its pages and stay."""
        self.truncate(slot, 0)
        self._admitted.remove(slot)

    def truncate(self, slot: int, num_entries: int) -> None:
        """Drop hot entries >= num_entries of `slot` in every layer (speculative rollback: the
        page table may no longer map them, and their rewrite starts cold)."""
        assert slot in self._admitted, f"slot {slot} is not admitted"
        E, M = self.layout.device_entries, self.layout.max_entries
        held = self.slot_to_entry[:, slot, :E]                                # [L, E]
        drop = held >= num_entries
        self.entry_to_slot[:, slot].scatter_(1, torch.where(drop, held, M).long(), -1)
        held.masked_fill_(drop, -1)
        self.last_used[:, slot, :E].masked_fill_(drop, -1)

    # ---- entries ---------------------------------------------------------------------------
    def write_entries(self, layer: int, slot_ids: torch.Tensor, entry_ids: torch.Tensor,
                      values: torch.Tensor, hot: bool = False, one_row: bool = False) -> None:
        """Store new (or rewritten) entries: entry entry_ids[i] of slot slot_ids[i] = values[i].

        slot_ids, entry_ids: [n] int (entries >= 0, distinct per slot); values: [n, D]. The host
        mirror always gets them; a hot copy is rewritten too. With `hot`, the entries are also
        placed in the hot set (LRU victims) straight from `values`, as the newest entries are
        likely picks; beyond E per slot the rest just stay cold. `one_row`: each request slot
        (but the pad slot) appears at most once in slot_ids; with `hot` the `write` op then runs
        (the plan and every store in one call; the pad slot's rows store nothing).
        NOTE: named sync point with the reference `write_rows` and the mirror on the host (a
        blocking copy); none with the Triton op, which stores into the pinned mirror in place.
        """
        if hot and one_row:     # plan and stores in one call (the pad slot's rows store nothing)
            self.write(self.entry_to_slot[layer], self.slot_to_entry[layer], self.last_used[layer],
                       self.clock, slot_ids, entry_ids, self.page_table, self.layout.page_entries,
                       values, self.host_pool[layer], self.device_pool[layer])
            return
        slots, entries = slot_ids.long(), entry_ids.long()
        self.write_rows(self.host_pool[layer], self._host_rows(slots, entries), values)
        if hot:
            hot_rows = self._plan(layer, slots, entries[:, None], False, one_row)[0].view(-1)
        else:
            hot_rows = self._lookup(layer, slots, self._valid(slots, entries))
        dev = self.device_pool[layer]
        dev.index_copy_(0, torch.where(hot_rows >= 0, hot_rows, dev.shape[0] - 1),
                        values.to(dev.device, dev.dtype))

    def select(self, layer: int, slot_ids: torch.Tensor, topk: torch.Tensor,
               one_row: bool = False) -> torch.Tensor:
        """Make every pick hot and return the hot rows attention reads (module docstring, 1-6).

        slot_ids: [T] int request slot of each row (the pad slot selects nothing); topk: [T, k]
        int entry ids of that request, -1 padded. Returns [T, k] int64 rows of
        `device_pool[layer]`, -1 where topk is -1: device_pool[layer][out[t, c]] is entry
        topk[t, c] of request slot_ids[t]. `one_row`: each request slot (but the pad slot) has
        at most one row and its picks are distinct (a plain decode step; the `plan` op may run).
        """
        rows, src, dst = self._plan(layer, slot_ids, topk, True, one_row)
        self.swap_in(self.host_pool[layer], self.device_pool[layer], src, dst)
        return rows

    def stage(self, layer: int, slot_ids: torch.Tensor,
              topk: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The picks of rows too many to be hot at once (a prefill chunk's), read around the hot
        set: the distinct picked entries copied from the host mirror into one new device buffer.

        slot_ids, topk: as `select`. Returns (buffer [n, D] on the device pool's device, rows
        [T, k] int64 into it, -1 where topk is -1): buffer[out[t, c]] is entry topk[t, c] of
        request slot_ids[t]. The hot set is neither read nor changed.
        NOTE: named sync point: the distinct count sizes the buffer, and the copy is blocking.
        """
        T, k = topk.shape
        slots = slot_ids.long()[:, None].expand(T, k).reshape(-1)
        entries = self._valid(slots, topk.reshape(-1).long())
        rows = torch.where(entries >= 0, self._host_rows(slots, entries), -1)
        distinct, where = torch.unique(rows, return_inverse=True)       # -1 (if any) first
        host = self.host_pool[layer]
        dev = self.device_pool.device
        buffer = host[distinct.clamp(min=0).to(host.device)].to(dev, self.device_pool.dtype)
        self.num_staged += (distinct >= 0).sum().to(self.num_staged.device)
        return buffer, torch.where(rows >= 0, where, -1).view(T, k)

    def stats(self) -> dict[str, torch.Tensor]:
        """Device counters since construction (read them at a sync point)."""
        return {"hisparse/picked": self.num_picked, "hisparse/swapped": self.num_swapped,
                "hisparse/staged": self.num_staged, "hisparse/overflow": self.num_overflow}

    # ---- plan ------------------------------------------------------------------------------
    def _valid(self, slots: torch.Tensor, entries: torch.Tensor) -> torch.Tensor:
        """Entries with the pad slot's picks turned into -1."""
        return torch.where(slots < self.layout.max_reqs, entries, -1)

    def _host_rows(self, slots: torch.Tensor, entries: torch.Tensor) -> torch.Tensor:
        """Host mirror row of entry entries[i] of slot slots[i] (its C4 entry slot)."""
        return host_rows(self.page_table, self.layout.page_entries, slots, entries)

    def _lookup(self, layer: int, slots: torch.Tensor, entries: torch.Tensor) -> torch.Tensor:
        """Hot rows of the picks (flat [n]), -1 where not hot or not a pick."""
        return lookup_rows(self.entry_to_slot[layer], self.layout.device_entries, slots, entries)

    def _plan(self, layer: int, slot_ids: torch.Tensor, picks: torch.Tensor, strict: bool,
              one_row: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Steps 1-4 and 6 for picks [T, k] of slot_ids [T] (`hot_plan_ref`): (rows [T, k], src,
        dst) of the entries to copy in. `one_row`: the caller promises each request one row
        with distinct picks, so the `plan` op (the backend's one-launch kernel) may run."""
        plan = self.plan if one_row else hot_plan_ref
        return plan(self.entry_to_slot[layer], self.slot_to_entry[layer], self.last_used[layer],
                    self.clock, slot_ids, picks, self.page_table, self.layout.page_entries,
                    self.counters, strict)

    # ---- checks ----------------------------------------------------------------------------
    def check_integrity(self) -> None:
        """Rebuild the invariants of the module docstring on the host and compare (syncs)."""
        E, M = self.layout.device_entries, self.layout.max_entries
        e2s, s2e = self.entry_to_slot.cpu().long(), self.slot_to_entry.cpu().long()
        stamp, clock = self.last_used.cpu(), int(self.clock)
        assert int(self.num_overflow) == 0, (
            f"{int(self.num_overflow)} picks found no hot slot: a select picked more than "
            f"device_entries={E} distinct entries of one request")
        assert (e2s[..., M] == -1).all() and (s2e[..., E] == -1).all(), "trash column written"
        assert (stamp[..., E] == -1).all(), "trash column of last_used written"
        idle = torch.ones(e2s.shape[1], dtype=torch.bool)
        idle[sorted(self._admitted)] = False
        assert (e2s[:, idle] == -1).all() and (s2e[:, idle] == -1).all(), (
            "a slot that is not admitted maps hot entries")
        assert (stamp[:, idle] == -1).all(), "a slot that is not admitted has LRU stamps"
        held, used = s2e[..., :E], s2e[..., :E] >= 0
        assert torch.equal(used, stamp[..., :E] >= 0), "LRU stamp set on an empty slot or unset"
        assert (stamp <= clock).all(), "LRU stamp ahead of the clock"
        assert (held < M).all() and (e2s[..., :M] < E).all(), "map value out of range"
        back = e2s.gather(2, torch.where(used, held, M))                         # [L, R + 1, E]
        assert torch.equal(torch.where(used, back, -1),
                           torch.where(used, torch.arange(E).expand_as(held), -1)), (
            "entry_to_slot does not map a held entry back to its slot")
        assert torch.equal((e2s[..., :M] >= 0).sum(-1), used.sum(-1)), (
            "entry_to_slot maps an entry that no slot holds")
        self._check_values(used, held)

    def _check_values(self, used: torch.Tensor, held: torch.Tensor) -> None:
        """Every hot row equals the host mirror row of the entry it holds."""
        dev = self.device_pool.device
        layer, slot, j = used.nonzero(as_tuple=True)
        rows = self._host_rows(slot.to(dev), held[layer, slot, j].to(dev)).cpu()
        hot = self.device_pool[layer.to(dev), (slot * self.layout.device_entries + j).to(dev)]
        want = self.host_pool[layer.to(self.host_pool.device), rows.to(self.host_pool.device)]
        assert torch.equal(hot.cpu(), want.cpu().to(hot.dtype)), (
            "a hot row does not hold the host value of its entry")
