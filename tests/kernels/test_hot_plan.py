"""Parity of HiSparse's one-launch plan `triton_hot_plan` with `hot_plan_ref`.

CPU: small shapes under the Triton interpreter. A state is evolved through a sequence of calls
from empty hot sets; before each call both implementations get clones of the same maps and must
agree exactly on the maps after it (e2s, s2e, stamps), the clock, the counters, the rows, and the
set of (host row, hot row) copies. Calls mix hits and misses, more misses than free slots
(k > E: overflow counted with strict, unplaced without), pad-slot rows, -1 picks, k = 1 (the hot
placement of new entries), int32 picks, a non-contiguous picks view, and E not a power of two.
Validation errors name the field. A HotSet with the kernel as its `plan` hook equals one with the
reference through decode-shaped writes and selects, and a micro engine whose decode steps run
the kernel gives the greedy tokens of HiSparse off. GPU (`-m gpu`): V4-Flash shape (k 512,
E 1024, 64 requests) inside a captured CUDA graph, against the reference.

    PYTHONPATH=src python -m pytest -q tests/kernels/test_hot_plan.py          # interpreter
    PYTHONPATH=src python -m pytest -q -m gpu tests/kernels/test_hot_plan.py   # a CUDA machine
"""

from __future__ import annotations

import os

import torch

# NOTE: must precede the first `import triton` (tests/kernels/conftest.py may already do this).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from dsv4 import EngineConfig, SamplingParams  # noqa: E402
from dsv4.cache.hisparse import HiSparseLayout, HotSet  # noqa: E402
from dsv4.checkpoint.presets import micro  # noqa: E402
from dsv4.checkpoint.writer import random_model  # noqa: E402
from dsv4.engine.engine import LLMEngine  # noqa: E402
from dsv4.kernels.ref.hot_plan import hot_plan_ref, hot_write_ref  # noqa: E402
from dsv4.kernels.triton.hot_plan import triton_hot_plan, triton_hot_write  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

State = dict[str, torch.Tensor]


def empty_state(R: int, E: int, M: int, pe: int, device: str = DEVICE) -> State:
    """Empty maps of R request slots (+ pad), a page table of distinct pages per slot."""
    pages = -(-M // pe)
    table = torch.randperm((R + 1) * pages, generator=torch.Generator().manual_seed(7))
    return {"e2s": torch.full((R + 1, M + 1), -1, dtype=torch.int32, device=device),
            "s2e": torch.full((R + 1, E + 1), -1, dtype=torch.int32, device=device),
            "stamp": torch.full((R + 1, E + 1), -1, dtype=torch.int64, device=device),
            "clock": torch.zeros((), dtype=torch.int64, device=device),
            "counters": torch.zeros(3, dtype=torch.int64, device=device),
            "page_table": table.view(R + 1, pages).to(device)}


def clone(state: State) -> State:
    return {k: v.clone() for k, v in state.items()}


def call(fn: object, state: State, slots: torch.Tensor, picks: torch.Tensor, pe: int,
         strict: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return fn(state["e2s"], state["s2e"], state["stamp"], state["clock"], slots,  # type: ignore
              picks, state["page_table"], pe, state["counters"], strict)


def random_picks(T: int, k: int, M: int, g: torch.Generator, window: int) -> torch.Tensor:
    """[T, k] distinct entries per row from a window of the first `window` entries (repeats across
    calls make hits), ~1/6 of them -1."""
    rows = [torch.randperm(window, generator=g)[:k] for _ in range(T)]
    picks = torch.stack(rows)
    return torch.where(torch.rand(T, k, generator=g) < 1 / 6, -1, picks)


def assert_same(ref: State, tri: State, got_ref: tuple[torch.Tensor, ...],
                got_tri: tuple[torch.Tensor, ...]) -> None:
    for name in ("e2s", "s2e", "stamp", "clock", "counters"):
        assert torch.equal(ref[name].cpu(), tri[name].cpu()), name
    assert torch.equal(got_ref[0].cpu(), got_tri[0].cpu()), "rows"

    def copies(src: torch.Tensor, dst: torch.Tensor) -> list[tuple[int, int]]:
        keep = dst >= 0
        assert torch.equal(keep, src >= 0)
        return sorted(zip(src[keep].tolist(), dst[keep].tolist(), strict=True))

    assert copies(*got_ref[1:]) == copies(*got_tri[1:]), "copies"


@pytest.mark.parametrize(("R", "E", "M", "k", "pe"), [(3, 16, 40, 8, 4), (4, 12, 64, 20, 8)])
def test_matches_reference_over_a_sequence(R: int, E: int, M: int, k: int, pe: int) -> None:
    g = torch.Generator().manual_seed(R * 100 + E)
    ref = empty_state(R, E, M, pe)
    for step in range(7):
        T = R + 1                                              # every slot once and a pad row
        slots = torch.cat([torch.randperm(R, generator=g), torch.tensor([R])])
        window = M if step % 3 == 2 else min(M, max(E, k) + 4)  # every 3rd call: mostly misses
        picks = random_picks(T, k, M, g, window)
        if step == 4:
            picks = picks.int()
        strict = step != 5                                     # overflow counted only if strict
        tri = clone(ref)
        got_tri = call(triton_hot_plan, tri, slots.to(DEVICE), picks.to(DEVICE), pe, strict)
        got_ref = call(hot_plan_ref, ref, slots.to(DEVICE), picks.to(DEVICE), pe, strict)
        assert_same(ref, tri, got_ref, got_tri)
    assert int(ref["counters"][1]) > 0, "nothing swapped"
    assert (int(ref["counters"][2]) > 0) == (k > E), "overflow exactly when k > E"


def test_single_entry_rows_and_views() -> None:
    """k = 1 rows (the hot placement of new entries), a pad row, and a strided picks view."""
    R, E, M, pe = 3, 16, 48, 4
    g = torch.Generator().manual_seed(3)
    ref = empty_state(R, E, M, pe)
    for step in range(5):
        slots = torch.tensor([2, R, 0, 1]).to(DEVICE)
        wide = torch.randint(-1, M, (4, 3), generator=g).to(DEVICE)
        picks = wide[:, 1:2] if step % 2 else torch.randint(0, M, (4, 1), generator=g).to(DEVICE)
        tri = clone(ref)
        got_tri = call(triton_hot_plan, tri, slots, picks, pe, False)
        got_ref = call(hot_plan_ref, ref, slots, picks, pe, False)
        assert_same(ref, tri, got_ref, got_tri)
    assert int(ref["counters"].abs().sum()) == 0, "counters move only with strict"


def test_single_entry_rows_evict_the_least_recently_used() -> None:
    """k = 1 calls (the min-key victim, no sort) between k = 5 calls, on hot sets kept full, so
    each new entry's victim is a real LRU choice among stamped slots."""
    R, E, M, pe = 2, 8, 64, 4
    g = torch.Generator().manual_seed(5)
    ref = empty_state(R, E, M, pe)
    for step in range(40):
        slots = torch.tensor([1, R, 0]).to(DEVICE)
        k = 1 if step % 3 else 5
        picks = random_picks(3, k, M, g, 3 * E).to(DEVICE)
        tri = clone(ref)
        got_tri = call(triton_hot_plan, tri, slots, picks, pe, step % 2 == 0)
        got_ref = call(hot_plan_ref, ref, slots, picks, pe, step % 2 == 0)
        assert_same(ref, tri, got_ref, got_tri)
    assert bool((ref["s2e"][:R, :E] >= 0).all()), "the hot sets never filled up"
    assert int(ref["counters"][1]) > 0, "nothing swapped"


def test_misses_take_victims_in_order_of_first_appearance() -> None:
    """Into an empty hot set (victims: slots 0, 1, 2 ..), the q-th distinct miss of a request
    in pick order (row by row, repeats skipped) takes slot q; the kernel, whose rows hold
    distinct picks, ranks them the same way."""
    R, E, M, pe = 1, 4, 16, 4
    slots = torch.tensor([0, 0]).to(DEVICE)
    state = empty_state(R, E, M, pe)
    call(hot_plan_ref, state, slots, torch.tensor([[7, 3, -1], [3, 5, 7]]).to(DEVICE), pe, True)
    assert state["e2s"][0, [7, 3, 5]].tolist() == [0, 1, 2]
    for fn in (hot_plan_ref, triton_hot_plan):
        state = empty_state(R, E, M, pe)
        call(fn, state, slots[:1], torch.tensor([[9, 2, 11]]).to(DEVICE), pe, True)
        assert state["e2s"][0, [9, 2, 11]].tolist() == [0, 1, 2], fn


def test_validation_names_the_field() -> None:
    state = empty_state(2, 16, 32, 4)
    slots = torch.tensor([0, 1], device=DEVICE)
    picks = torch.zeros(2, 4, dtype=torch.int64, device=DEVICE)
    bad = clone(state)
    bad["stamp"] = bad["stamp"].int()
    with pytest.raises(ValueError, match="stamp must be torch.int64"):
        call(triton_hot_plan, bad, slots, picks, 4, True)
    with pytest.raises(ValueError, match="picks"):
        call(triton_hot_plan, state, slots[:1], picks, 4, True)
    bad = clone(state)
    bad["counters"] = bad["counters"][:2]
    with pytest.raises(ValueError, match="counters"):
        call(triton_hot_plan, bad, slots, picks, 4, True)


@pytest.mark.gpu
def test_flash_shape_in_a_cuda_graph() -> None:
    """V4-Flash decode: 64 requests, k 512 picks of 50K entries, E 1024 hot slots; replays of a
    captured graph against the reference, call for call."""
    R, E, M, k, pe = 64, 1024, 50_000, 512, 64
    g = torch.Generator().manual_seed(0)
    ref = empty_state(R, E, M, pe)
    tri = clone(ref)
    slots = torch.randperm(R, generator=g).cuda()
    picks = torch.zeros(R, k, dtype=torch.int64, device="cuda")
    out: list[tuple[torch.Tensor, ...]] = []
    call(triton_hot_plan, clone(tri), slots, picks, pe, True)              # compile
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out.append(call(triton_hot_plan, tri, slots, picks, pe, True))
    for step in range(6):
        window = 3000 if step % 2 else 1500
        picks.copy_(random_picks(R, k, M, g, window))
        graph.replay()
        got_ref = call(hot_plan_ref, ref, slots, picks, pe, True)
        assert_same(ref, tri, got_ref, out[0])


@pytest.mark.gpu
def test_hot_write_pinned_mirror_in_a_cuda_graph() -> None:
    """V4-Flash decode writes: 64 requests, one new entry each, E 1024, D 512 bf16, the host
    mirror pinned CPU memory written in place (UVA) from a captured graph; against the reference
    on device copies, call for call."""
    R, E, M, pe, D = 64, 1024, 50_000, 64, 512
    g = torch.Generator().manual_seed(1)
    ref, tri = empty_state(R, E, M, pe), empty_state(R, E, M, pe)
    rows = (R + 1) * -(-M // pe) * pe + 1
    host = torch.zeros(rows, D, dtype=torch.bfloat16, pin_memory=True)
    host_ref = torch.zeros(rows, D, dtype=torch.bfloat16, device="cuda")
    dev, dev_ref = (torch.zeros(R * E + 1, D, dtype=torch.bfloat16, device="cuda")
                    for _ in range(2))
    slots = torch.randperm(R, generator=g).cuda()
    entries = torch.zeros(R, dtype=torch.int64, device="cuda")
    values = torch.zeros(R, D, dtype=torch.bfloat16, device="cuda")

    def run(fn: object, st: State, h: torch.Tensor, d: torch.Tensor) -> None:
        fn(st["e2s"], st["s2e"], st["stamp"], st["clock"], slots, entries,  # type: ignore
           st["page_table"], pe, values, h, d)

    warm = empty_state(R, E, M, pe)
    run(triton_hot_write, warm, host.clone().pin_memory(), dev.clone())    # compile
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run(triton_hot_write, tri, host, dev)
    for step in range(1, 2 * E, 97):
        entries.copy_(torch.randint(0, M, (R,), generator=g))
        values.copy_(torch.randn(R, D, generator=g).to(torch.bfloat16))
        graph.replay()
        run(hot_write_ref, ref, host_ref, dev_ref)
        torch.cuda.synchronize()
        for name in ("e2s", "s2e", "stamp", "clock"):
            assert torch.equal(ref[name], tri[name]), (step, name)
    assert torch.equal(host[:-1], host_ref[:-1].cpu()) and torch.equal(dev[:-1], dev_ref[:-1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_hot_write_matches_reference(dtype: torch.dtype) -> None:
    """`triton_hot_write` (one launch: the one-pick plan and the stores) against `hot_write_ref`
    over a sequence of decode-shaped writes (one new entry per request, the pad slot's row in
    between, entries past E evicting the least recently used): same maps, clock, host mirror
    and hot pool; D 40 is not a power of two (a masked tail)."""
    R, E, M, pe, D = 3, 4, 32, 4, 40
    states = [empty_state(R, E, M, pe) for _ in range(2)]
    pools = [(torch.zeros((R + 1) * -(-M // pe) * pe + 1, D, dtype=dtype, device=DEVICE),
              torch.zeros(R * E + 1, D, dtype=dtype, device=DEVICE)) for _ in range(2)]
    g = torch.Generator().manual_seed(5)
    slots = torch.tensor([1, R, 0, 2], device=DEVICE)
    for step in range(10):
        entries = torch.tensor([step, 0, 2 * step, step + 3], device=DEVICE)
        values = torch.randn(4, D, generator=g).to(DEVICE, dtype)
        for fn, st, (host, dev) in zip((hot_write_ref, triton_hot_write), states, pools,
                                       strict=True):
            fn(st["e2s"], st["s2e"], st["stamp"], st["clock"], slots, entries,
               st["page_table"], pe, values, host, dev)
    for name in ("e2s", "s2e", "stamp", "clock"):
        assert torch.equal(states[0][name], states[1][name]), name
    assert torch.equal(pools[0][0][:-1], pools[1][0][:-1]), "host mirror"
    assert torch.equal(pools[0][1][:-1], pools[1][1][:-1]), "hot pool"
    assert bool((pools[1][1][:-1] != 0).any()) and bool((pools[1][0][:-1] != 0).any())


def test_hot_write_validation_names_the_field() -> None:
    st = empty_state(2, 4, 16, 4)
    host = torch.zeros(20, 8, device=DEVICE)
    dev = torch.zeros(9, 8, device=DEVICE)
    slots, entries = torch.tensor([0, 1], device=DEVICE), torch.tensor([0, 1], device=DEVICE)
    args = (st["e2s"], st["s2e"], st["stamp"], st["clock"], slots, entries, st["page_table"], 4)
    with pytest.raises(ValueError, match="values"):
        triton_hot_write(*args, torch.zeros(3, 8, device=DEVICE), host,  # type: ignore[arg-type]
                         dev)
    with pytest.raises(ValueError, match="device_pool"):
        triton_hot_write(*args, torch.zeros(2, 8, device=DEVICE), host,  # type: ignore[arg-type]
                         torch.zeros(9, 4, device=DEVICE))


def small_hot_sets(layers: int, hot: int, ops: list[tuple[object, object]]) -> list[HotSet]:
    """One fp32 HotSet per (plan, write) op pair: 3 request slots (every one admitted) of 24
    entries, 4 per page, `hot` hot slots, width 8; page 0 is the null page, the pad slot's."""
    layout = HiSparseLayout(num_layers=layers, max_reqs=3, max_entries=24, device_entries=hot,
                            top_k=5, num_host_rows=(4 * 6 + 1) * 4 + 1, page_entries=4, width=8)
    page_table = 1 + torch.arange(4 * 6).view(4, 6)       # page 0: the null page
    page_table[3] = 0                                      # the pad slot
    device = torch.device(DEVICE)
    sets = [HotSet(layout, page_table.to(DEVICE), torch.float32, device, host_device=device,
                   plan=plan, write=write)  # type: ignore[arg-type]
            for plan, write in ops]
    for hs in sets:
        for slot in range(3):
            hs.admit(slot)
    return sets


def test_write_entries_in_one_call_equals_the_general_path() -> None:
    """`write_entries(hot=True, one_row=True)` (the `write` op: plan and stores in one call)
    leaves the same maps, clock, hot pool and host mirror as the general path (`one_row=False`:
    the reference plan, the mirror write, the hot copy), but for the pad slot's rows, which the
    one call does not store (the general path writes them to the null page's rows)."""
    sets = small_hot_sets(1, 6, [(triton_hot_plan, triton_hot_write)] * 2)
    g = torch.Generator().manual_seed(13)
    slots = torch.tensor([2, 3, 0, 1], device=DEVICE)
    for step in range(12):
        values = torch.randn(4, 8, generator=g).to(DEVICE)
        entries = torch.tensor([step, 0, step + 5, 2 * step], device=DEVICE)
        for hs, one_row in zip(sets, (True, False), strict=True):
            hs.write_entries(0, slots, entries, values, hot=True, one_row=one_row)
    for name in ("entry_to_slot", "slot_to_entry", "last_used", "clock"):
        assert torch.equal(getattr(sets[0], name), getattr(sets[1], name)), name
    assert torch.equal(sets[0].device_pool[:, :-1], sets[1].device_pool[:, :-1])
    null_page = 4                                          # host rows 0..3: the pad slot's writes
    assert torch.equal(sets[0].host_pool[:, null_page:-1], sets[1].host_pool[:, null_page:-1])
    assert bool((sets[1].host_pool[:, :null_page] != 0).any())
    assert not bool((sets[0].host_pool[:, :null_page] != 0).any())
    for hs in sets:
        hs.check_integrity()


def test_hot_set_with_the_kernel_plan_equals_the_reference() -> None:
    """HotSet's `plan` hook: decode-shaped writes (one new entry per request, placed hot) and
    selects (one row per request) with `one_row` run the kernel and give the same maps, hot
    pools, rows and counters as the reference plan; the result passes `check_integrity`."""
    sets = small_hot_sets(2, 8, [(hot_plan_ref, hot_write_ref),
                                 (triton_hot_plan, triton_hot_write)])
    g = torch.Generator().manual_seed(11)
    slots = torch.tensor([2, 0, 3, 1], device=DEVICE)     # the pad slot's row in between
    for step in range(6):                                  # entries 4 * step .. 4 * step + 3
        for n in range(4):
            values = torch.randn(4, 8, generator=g).to(DEVICE)
            entries = torch.full((4,), 4 * step + n, device=DEVICE)
            picks = random_picks(4, 5, 24, g, max(5, 4 * step + n + 1)).to(DEVICE)
            for hs, v in zip(sets, (values, values.clone()), strict=True):
                for layer in range(2):
                    hs.write_entries(layer, slots, entries, v, hot=True, one_row=True)
            rows = [hs.select(step % 2, slots, picks, one_row=True) for hs in sets]
            assert torch.equal(rows[0], rows[1])
    for name in ("entry_to_slot", "slot_to_entry", "last_used", "clock", "counters"):
        assert torch.equal(getattr(sets[0], name), getattr(sets[1], name)), name
    assert torch.equal(sets[0].device_pool[:, :-1], sets[1].device_pool[:, :-1])
    assert torch.equal(sets[0].host_pool[:, :-1], sets[1].host_pool[:, :-1])
    assert int(sets[1].num_swapped) > 0 and int(sets[1].num_picked) > 0
    sets[1].check_integrity()


@pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter test (a CPU engine); on a GPU "
                    "the triton backend's engine tests run the kernel plan in captured graphs "
                    "(tests/engine/test_hisparse_engine.py -m gpu)")
def test_engine_decode_runs_the_kernel_plan() -> None:
    """A micro engine (fp32, `ref` ops) with HiSparse on and the kernels as its HotSet's `plan`
    and `write`: decode steps (one row per request) run them, prefill chunks the reference, and the
    greedy outputs equal those with HiSparse off; every manager passes `check_integrity` after
    every step."""
    model = random_model(micro().replace(max_position_embeddings=512), torch.float32,
                         torch.device("cpu"))
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(2, micro().vocab_size, (n,), generator=g).tolist() for n in (45, 70)]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    base = dict(page_size=16, max_total_tokens=1024, max_running_requests=2,
                chunked_prefill_size=32)
    outs: list[list[list[int]]] = []
    calls: list[str] = []
    for hisparse in (False, True):
        extra = dict(enable_hisparse=True, hisparse_device_entries=micro().index_topk)
        engine = LLMEngine(model, EngineConfig(**base, **(extra if hisparse else {})))
        hot = engine.runner.pools.hot
        if hot is not None:
            def plan(*args: object, **kwargs: object) -> object:
                calls.append("plan")
                return triton_hot_plan(*args, **kwargs)  # type: ignore[arg-type]

            def write(*args: object, **kwargs: object) -> None:
                calls.append("write")
                triton_hot_write(*args, **kwargs)  # type: ignore[arg-type]
            hot.plan, hot.write = plan, write
        reqs = [engine.add_request(p, params) for p in prompts]
        while engine.has_unfinished():
            engine.step()
            engine.check_integrity()
        outs.append([r.output_ids for r in reqs])
    assert outs[0] == outs[1]
    assert hot is not None and int(hot.num_swapped) > 0 and int(hot.num_overflow) == 0
    steps = 7 * micro().attn_types.count("csa")       # decode steps x C4 layers, per request
    assert calls.count("plan") >= steps and calls.count("write") >= steps, (
        "decode steps ran the kernels (select: the plan; new entries: the write)")
