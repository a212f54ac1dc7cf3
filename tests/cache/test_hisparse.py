"""HotSet (cache/hisparse.py) and swap_in_ref (kernels/ref/hisparse.py).

A hypothesis state machine plays requests through admit / write (cold or hot) / select /
truncate / release over several slots and both layers, keeping a full copy of every request's
entries that is never evicted: after every select, what attention gathers through the returned hot
rows must equal what it would gather from that copy, and `check_integrity()` runs after every
rule. It runs twice: a hot set wider than top-k with two rows per request (the picks of one call
dedup across rows), and one exactly top-k wide. Unit tests: the bad-configuration error, -1 picks,
exact LRU victims, eviction of every entry, the padding slot, truncation, write-through, overflow,
`from_configs`, the reference copy, no host reads in select (meta tensors), and (GPU)
CUDA-graph replay of `select` against eager.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from dsv4.cache.hisparse import HiSparseLayout, HotSet
from dsv4.cache.layout import CacheLayout
from dsv4.checkpoint.presets import micro
from dsv4.kernels.ref.hisparse import swap_in_ref

D, PE = 3, 2      # entry width, C4 entries per page


def make_hot_set(num_layers: int = 2, max_reqs: int = 3, max_entries: int = 24,
                 device_entries: int = 6, top_k: int = 4, seed: int = 0,
                 device: str = "cpu", host_device: str | None = None) -> HotSet:
    """A HotSet whose slots own shuffled private pages (the host rows are not the entry order)."""
    pages_per_req = -(-max_entries // PE)
    perm = torch.randperm(max_reqs * pages_per_req, generator=torch.Generator().manual_seed(seed))
    page_table = torch.zeros(max_reqs + 1, pages_per_req, dtype=torch.int64)
    page_table[:max_reqs] = perm.view(max_reqs, pages_per_req) + 1      # page 0: the null page
    layout = HiSparseLayout(num_layers=num_layers, max_reqs=max_reqs, max_entries=max_entries,
                            device_entries=device_entries, top_k=top_k,
                            num_host_rows=(max_reqs * pages_per_req + 1) * PE + 1,
                            page_entries=PE, width=D)
    return HotSet(layout, page_table.to(device), torch.float32, torch.device(device),
                  host_device=None if host_device is None else torch.device(host_device))


def fill(hs: HotSet, slot: int, n: int, seed: int = 1) -> torch.Tensor:
    """Write entries 0..n-1 of `slot` in every layer (cold); returns them [L, n, D]."""
    L, dev = hs.layout.num_layers, hs.device_pool.device
    values = torch.randn(L, n, D, generator=torch.Generator().manual_seed(seed)).to(dev)
    for layer in range(L):
        hs.write_entries(layer, torch.full((n,), slot, device=dev), torch.arange(n, device=dev),
                         values[layer])
    return values


def gathered(hs: HotSet, layer: int, rows: torch.Tensor) -> torch.Tensor:
    """What attention reads through hot rows [T, k]: zeros where -1."""
    got = hs.device_pool[layer][rows.clamp(min=0)]
    return got.masked_fill((rows < 0)[..., None], 0.0)


def expected(full: torch.Tensor, slots: torch.Tensor, topk: torch.Tensor) -> torch.Tensor:
    """The same gather from a full copy full[slot, entry] [R, M, D] of one layer."""
    want = full[slots[:, None], topk.clamp(min=0)]
    return want.masked_fill((topk < 0)[..., None], 0.0)


def hot_entries(hs: HotSet, layer: int, slot: int) -> set[int]:
    held = hs.slot_to_entry[layer, slot, :hs.layout.device_entries]
    return {int(e) for e in held if e >= 0}


class HotSetMachine(RuleBasedStateMachine):
    L, R, M, E, K, ROWS = 2, 3, 24, 8, 4, 2

    def __init__(self) -> None:
        super().__init__()
        self.hs = make_hot_set(self.L, self.R, self.M, self.E, self.K)
        self.full = torch.zeros(self.L, self.R, self.M, D)
        self.length: dict[int, int] = {}
        self.gen = torch.Generator().manual_seed(0)

    def _slot(self, data: st.DataObject, nonempty: bool = False) -> int:
        slots = [s for s, n in sorted(self.length.items()) if n > 0 or not nonempty]
        return data.draw(st.sampled_from(slots))

    @precondition(lambda self: len(self.length) < self.R)
    @rule(data=st.data())
    def admit(self, data: st.DataObject) -> None:
        slot = data.draw(st.sampled_from(sorted(set(range(self.R)) - set(self.length))))
        self.hs.admit(slot)
        self.length[slot] = 0

    @precondition(lambda self: any(n < self.M for n in self.length.values()))
    @rule(data=st.data(), n=st.integers(1, 8), hot=st.booleans())
    def write(self, data: st.DataObject, n: int, hot: bool) -> None:
        slot = data.draw(st.sampled_from([s for s, m in self.length.items() if m < self.M]))
        ids = torch.arange(self.length[slot], min(self.M, self.length[slot] + n))
        values = torch.randn(self.L, len(ids), D, generator=self.gen)
        for layer in range(self.L):
            self.hs.write_entries(layer, torch.full_like(ids, slot), ids, values[layer], hot=hot)
        self.full[:, slot, ids] = values
        self.length[slot] = int(ids[-1]) + 1

    @precondition(lambda self: any(self.length.values()))
    @rule(data=st.data(), layer=st.integers(0, 1), pad=st.booleans())
    def select(self, data: st.DataObject, layer: int, pad: bool) -> None:
        live = [s for s, n in sorted(self.length.items()) if n > 0]
        rows: list[tuple[int, list[int]]] = []
        for slot in data.draw(st.lists(st.sampled_from(live), min_size=1, unique=True)):
            # the picks of one request in one call: at most E distinct entries
            pool = data.draw(st.lists(st.integers(0, self.length[slot] - 1), min_size=1,
                                      max_size=self.E, unique=True))
            for _ in range(data.draw(st.integers(1, self.ROWS))):
                picks = data.draw(st.lists(st.sampled_from(pool), max_size=self.K, unique=True))
                row = data.draw(st.permutations(picks + [-1] * (self.K - len(picks))))
                rows.append((slot, list(row)))
        if pad:   # a CUDA-graph padding row: the pad slot selects nothing, whatever it holds
            rows.append((self.R, list(range(self.K))))
        rows = data.draw(st.permutations(rows))
        slots = torch.tensor([s for s, _ in rows])
        topk = torch.tensor([r for _, r in rows])
        out = self.hs.select(layer, slots, topk)
        topk = torch.where(slots[:, None] < self.R, topk, -1)
        assert torch.equal(out < 0, topk < 0)
        assert ((out // self.E == slots[:, None]) | (out < 0)).all(), "a row outside its slot"
        full = torch.cat([self.full[layer], torch.zeros(1, self.M, D)])     # + the pad slot
        assert torch.equal(gathered(self.hs, layer, out), expected(full, slots, topk))

    @precondition(lambda self: any(self.length.values()))
    @rule(data=st.data())
    def truncate(self, data: st.DataObject) -> None:
        slot = self._slot(data, nonempty=True)
        n = data.draw(st.integers(0, self.length[slot] - 1))
        self.hs.truncate(slot, n)
        self.length[slot] = n
        assert all(e < n for layer in range(self.L) for e in hot_entries(self.hs, layer, slot))

    @precondition(lambda self: self.length)
    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        slot = self._slot(data)
        self.hs.release(slot)
        del self.length[slot]

    @invariant()
    def consistent(self) -> None:
        self.hs.check_integrity()


class ExactHotSetMachine(HotSetMachine):
    """device_entries == top_k, one row per request: every call may replace the whole hot set."""

    E, K, ROWS = 4, 4, 1


TestHotSetMachine = HotSetMachine.TestCase
TestHotSetMachine.settings = settings(max_examples=200, stateful_step_count=30, deadline=None)
TestExactHotSetMachine = ExactHotSetMachine.TestCase
TestExactHotSetMachine.settings = settings(max_examples=100, stateful_step_count=30,
                                           deadline=None)


def test_hot_set_smaller_than_top_k_is_a_value_error() -> None:
    with pytest.raises(ValueError, match=r"device_entries=3 is invalid; allowed: >= top_k=4"):
        make_hot_set(device_entries=3, top_k=4)
    with pytest.raises(ValueError, match=r"hisparse max_reqs=0 is invalid"):
        make_hot_set(max_reqs=0)


def test_minus_one_picks_stay_minus_one_and_copy_nothing() -> None:
    hs = make_hot_set()
    hs.admit(1)
    values = fill(hs, 1, 10)
    out = hs.select(0, torch.tensor([1, 1]), torch.tensor([[-1, -1, -1, -1], [-1, 7, -1, 2]]))
    assert torch.equal(out < 0, torch.tensor([[True] * 4, [True, False, True, False]]))
    assert torch.equal(hs.device_pool[0][out[1, [1, 3]]], values[0, [7, 2]])
    assert int(hs.num_swapped) == 2 and int(hs.num_picked) == 2
    hs.check_integrity()


def test_hot_set_exactly_top_k_replaces_every_slot_and_hits_cost_nothing() -> None:
    hs = make_hot_set(device_entries=4, top_k=4)
    hs.admit(0)
    values = fill(hs, 0, 24)
    for start in (0, 4, 8, 0):
        picks = torch.arange(start, start + 4)
        out = hs.select(1, torch.tensor([0]), picks[None])
        assert torch.equal(hs.device_pool[1][out[0]], values[1, picks])
        assert hot_entries(hs, 1, 0) == set(picks.tolist())
        hs.check_integrity()
    assert int(hs.num_swapped) == 16
    hs.select(1, torch.tensor([0]), torch.tensor([[3, 1, 2, 0]]))           # all hot
    assert int(hs.num_swapped) == 16


def test_lru_evicts_the_least_recently_picked() -> None:
    hs = make_hot_set(device_entries=4, top_k=2)
    hs.admit(2)
    fill(hs, 2, 8)
    for picks in ([0, 1], [2, 3], [0, 4]):       # 1 is the oldest not picked again
        hs.select(0, torch.tensor([2]), torch.tensor([picks]))
    assert hot_entries(hs, 0, 2) == {0, 2, 3, 4}
    hs.select(0, torch.tensor([2]), torch.tensor([[5, 6]]))                 # then 2 and 3 go
    assert hot_entries(hs, 0, 2) == {0, 4, 5, 6}
    assert hot_entries(hs, 1, 2) == set()                                  # layers are apart
    hs.check_integrity()


def test_a_sweep_evicts_every_entry() -> None:
    hs = make_hot_set(max_entries=24, device_entries=6, top_k=3)
    hs.admit(0)
    values = fill(hs, 0, 24)
    for start in range(0, 24, 3):
        picks = torch.arange(start, start + 3)
        out = hs.select(0, torch.tensor([0]), picks[None])
        assert torch.equal(hs.device_pool[0][out[0]], values[0, picks])
        hs.check_integrity()
    assert hot_entries(hs, 0, 0) == set(range(18, 24))      # every earlier entry was evicted
    assert int(hs.num_swapped) == 24
    out = hs.select(0, torch.tensor([0]), torch.tensor([[0, 1, 2]]))        # and comes back
    assert torch.equal(hs.device_pool[0][out[0]], values[0, :3])


def test_the_pad_slot_selects_nothing() -> None:
    hs = make_hot_set(max_reqs=3)
    out = hs.select(0, torch.tensor([3, 3]), torch.tensor([[0, 1, 2, 3], [4, -1, 5, 6]]))
    assert (out == -1).all() and int(hs.num_swapped) == 0
    hs.check_integrity()


def test_truncate_then_rewrite_reads_the_new_values() -> None:
    hs = make_hot_set()
    hs.admit(0)
    fill(hs, 0, 8)
    hs.select(0, torch.tensor([0]), torch.tensor([[4, 5, 6, 7]]))
    hs.truncate(0, 5)
    assert hot_entries(hs, 0, 0) == {4}
    new = torch.randn(3, D)
    hs.write_entries(0, torch.zeros(3, dtype=torch.int64), torch.arange(5, 8), new)
    out = hs.select(0, torch.tensor([0]), torch.tensor([[5, 6, 7, -1]]))
    assert torch.equal(hs.device_pool[0][out[0, :3]], new)
    hs.check_integrity()


def test_writes_go_through_to_hot_copies_and_hot_writes_skip_the_swap() -> None:
    hs = make_hot_set()
    hs.admit(1)
    fill(hs, 1, 6)
    out = hs.select(0, torch.tensor([1]), torch.tensor([[0, 1, 2, 3]]))
    new = torch.randn(2, D)
    hs.write_entries(0, torch.tensor([1, 1]), torch.tensor([1, 3]), new)    # rewrites, cold
    assert torch.equal(hs.device_pool[0][out[0, [1, 3]]], new)
    hs.write_entries(0, torch.tensor([1, 1]), torch.tensor([6, 7]), new, hot=True)
    swapped = int(hs.num_swapped)
    out = hs.select(0, torch.tensor([1]), torch.tensor([[6, 7, -1, -1]]))
    assert int(hs.num_swapped) == swapped and torch.equal(hs.device_pool[0][out[0, :2]], new)
    hs.check_integrity()


def test_more_distinct_picks_than_the_hot_set_is_an_overflow() -> None:
    hs = make_hot_set(device_entries=4, top_k=4)
    hs.admit(0)
    values = fill(hs, 0, 8)
    hs.select(0, torch.tensor([0]), torch.tensor([[0, 1, 2, 3]]))
    out = hs.select(0, torch.tensor([0, 0]), torch.tensor([[0, 1, 2, 3], [4, 5, 6, 7]]))
    # the hits keep their slots (no miss may evict a slot this call reads); the misses find none
    assert torch.equal(hs.device_pool[0][out[0]], values[0, :4]) and (out[1] == -1).all()
    assert int(hs.num_overflow) == 4
    with pytest.raises(AssertionError, match="picked more than device_entries=4"):
        hs.check_integrity()


def test_from_configs_takes_the_c4_coordinates_of_the_cache_layout() -> None:
    model = micro()
    cache = CacheLayout(page_size=16, num_full_pages=10, num_swa_pages=4, ring_c4=8,
                        ring_c128=16, swa_horizon=16)
    layout = HiSparseLayout.from_configs(model, cache, max_reqs=2, max_context=64,
                                         device_entries=4)
    assert (layout.num_layers, layout.max_entries, layout.top_k) == (2, 16, model.index_topk)
    assert (layout.num_host_rows, layout.page_entries, layout.width) == (41, 4, model.head_dim)
    device, host = layout.pool_bytes(torch.float32)
    assert host == 2 * 41 * model.head_dim * 4 and device > 2 * (2 * 4 + 1) * model.head_dim * 4


def test_swap_in_ref_copies_kept_rows_only() -> None:
    host = torch.arange(20.0).view(10, 2)
    dev = torch.full((5, 2), -7.0)
    swap_in_ref(host, dev, torch.tensor([3, 9, -1, 0]), torch.tensor([1, -1, -1, 3]))
    assert torch.equal(dev[:4], torch.tensor([[-7.0, -7], [6, 7], [-7, -7], [0, 1]]))


def test_select_and_hot_writes_never_read_device_memory_on_the_host() -> None:
    """On meta tensors any `.item()`, `.tolist()` or data-dependent shape raises: a select and a
    hot write with the mirror on the device run there, so they hold no host sync (the CPU-side
    stand-in for the CUDA-graph test below)."""
    hs = make_hot_set(device="meta", host_device="meta")
    ids = torch.zeros(2, dtype=torch.int64, device="meta")
    hs.write_entries(0, ids, ids, torch.zeros(2, D, device="meta"), hot=True)
    out = hs.select(1, torch.zeros(3, dtype=torch.int64, device="meta"),
                    torch.zeros(3, 4, dtype=torch.int64, device="meta"))
    assert out.shape == (3, 4) and out.device.type == "meta"


@pytest.mark.gpu
def test_select_replays_in_a_cuda_graph_like_eager() -> None:
    """The whole select (plan, swap-in, remap) captured once, replayed on fresh picks."""
    pair = [make_hot_set(device="cuda", host_device="cuda") for _ in range(2)]
    for hs in pair:
        for slot in range(3):
            hs.admit(slot)
            fill(hs, slot, 24, seed=slot)
    graphed, eager = pair
    slots = torch.tensor([0, 2, 1, 3], device="cuda")
    topk = torch.full((4, 4), -1, dtype=torch.int64, device="cuda")
    gen = torch.Generator().manual_seed(0)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):                    # warm-up, as capture wants
        graphed.select(0, slots, topk)
        eager.select(0, slots, topk)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = graphed.select(0, slots, topk)
    for _ in range(20):
        picks = torch.stack([torch.randperm(24, generator=gen)[:4] for _ in range(4)])
        topk.copy_(picks.masked_fill(torch.rand(4, 4, generator=gen) < 0.2, -1).cuda())
        graph.replay()
        want = eager.select(0, slots, topk)
        assert torch.equal(out, want)
        assert torch.equal(graphed.device_pool[:, :-1], eager.device_pool[:, :-1])  # no trash
        assert torch.equal(graphed.entry_to_slot, eager.entry_to_slot)
        graphed.check_integrity()
