"""Parity of the step-metadata kernel `triton_step_metadata` with the reference `step_metadata`.

CPU: the Triton interpreter. Random page tables (the padding slot's row all null pages, as
`RequestTable` keeps it) and random full -> SWA maps; steps mixing decode rows (n = 1), verify
rows (n = 4), chunked-prefill rows, a request at position 0, positions across page boundaries,
a padding row on the pad slot, zero-length rows, and more requests than one scan chunk
(BLOCK_B); the request rows as strided columns (a CUDA graph's static inputs); an overlap (C4)
and a non-overlap (C128 / C16) plan; a geometry with no power of two (page size, window,
ratios, rings: the kernel's constexpr divisors); candidate widths V that are no multiple of any
block (and V = 0); default and small tiles (several T and V blocks with tails). Every field must
equal the reference's bit for bit, dtype and shape included. One launch per step: two, one or no
specs launch the kernel once (grid: token blocks x (1 + specs + every spec's candidate tiles)),
an empty step not at all; a third spec is refused. End to end: `device_context` over a real
request table gives the same ForwardContext rows with the triton ops as with `ref`.
GPU: the same tests compile the kernel (they run wherever CUDA is present).

    PYTHONPATH=src python -m pytest -q tests/kernels/test_metadata_kernel.py
"""

from __future__ import annotations

import os
from typing import Any

import torch

# NOTE: must precede the first `import triton` (tests/kernels/conftest.py may already do this).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from dsv4.kernels.ops import CompressSpec, StepRows  # noqa: E402
from dsv4.kernels.ref.metadata import step_metadata  # noqa: E402
from dsv4.kernels.triton import metadata  # noqa: E402
from dsv4.kernels.triton.metadata import triton_step_metadata  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
Row = tuple[int, int, int]           # (request slot, first new position, new tokens)


def make_tables(g: torch.Generator, reqs: int, max_pages: int, num_full: int, num_swa: int
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """page_table [reqs + 1, max_pages] (last row: the pad slot, all null pages), full_to_swa."""
    table = torch.randint(1, num_full, (reqs + 1, max_pages), generator=g)
    table[-1] = 0
    full_to_swa = torch.randint(0, num_swa, (num_full,), generator=g)
    return table.to(DEVICE), full_to_swa.to(DEVICE)


def strided_rows(rows: list[Row]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """slots, starts, lens as columns of one [B, 5] tensor (strides 5, as a graph's inputs)."""
    cols = torch.tensor([[9, slot, 9, start, n] for slot, start, n in rows], dtype=torch.int64)
    cols = cols.to(DEVICE)
    return cols[:, 1], cols[:, 3], cols[:, 4]


def specs_for(rows: list[Row], ratios: tuple[int, int], extra: int) -> list[CompressSpec]:
    """An overlap plan of ratios[0] and a non-overlap plan of ratios[1]; V = max_end // ratio +
    `extra` columns (trash rows and ring sizes arbitrary but distinct)."""
    max_end = max(start + n for _, start, n in rows)
    c4, c128 = ratios
    return [CompressSpec(c4, True, 4 * c4, 1001, 2002, max_end // c4 + extra),
            CompressSpec(c128, False, 2 * c128, 3003, 4004, max_end // c128 + extra)]


def assert_rows_equal(got: StepRows, want: StepRows) -> None:
    pairs = [("positions", got.positions, want.positions),
             ("swa_write", got.swa_write, want.swa_write), ("window", got.window, want.window)]
    assert len(got.plans) == len(want.plans)
    for i, (a, b) in enumerate(zip(got.plans, want.plans, strict=True)):
        pairs += [(f"plan{i}.{f}", getattr(a, f), getattr(b, f)) for f in a._fields]
    for name, a, b in pairs:
        assert a.dtype == b.dtype and a.shape == b.shape, (name, a.dtype, b.dtype, a.shape, b.shape)
        assert torch.equal(a, b), (name, (a != b).nonzero()[:8])


def run_both(rows: list[Row], table: torch.Tensor, full_to_swa: torch.Tensor, P: int, W: int,
             specs: list[CompressSpec], **knobs: int) -> None:
    slots, starts, lens = strided_rows(rows)
    T = sum(n for _, _, n in rows)
    want = step_metadata(slots.contiguous(), starts.contiguous(), lens.contiguous(), table,
                         full_to_swa, P, T, W, specs)
    got = triton_step_metadata(slots, starts, lens, table, full_to_swa, P, T, W, specs, **knobs)
    assert_rows_equal(got, want)


# (page size, window, C4 ratio, compressed ratio, max pages); the last: no power of two anywhere
GEOMETRIES = [(16, 8, 4, 16, 12), (256, 128, 4, 128, 3), (12, 6, 3, 6, 10)]
KNOBS = [{}, {"block_t": 4, "block_v": 16}]


@pytest.mark.parametrize("geo", GEOMETRIES, ids=["P16", "P256", "P12"])
@pytest.mark.parametrize("knobs", KNOBS, ids=["default", "small-tiles"])
def test_mixed_step_matches_ref(geo: tuple[int, int, int, int, int], knobs: dict[str, int]
                                ) -> None:
    P, W, c4, c128, max_pages = geo
    g = torch.Generator().manual_seed(P)
    table, full_to_swa = make_tables(g, 6, max_pages, 40, 30)
    pad = table.shape[0] - 1
    rows = [(2, P + 5, 1),                 # decode, past the first page boundary
            (0, 2 * P - 2, 4),             # verify rows across a page boundary
            (4, P - 6, 40),                # a chunked-prefill chunk across a page boundary
            (1, 0, 19),                    # a prompt from position 0
            (5, 3 * P - 1, 1),             # decode on a page's last position
            (pad, 0, 1)]                   # a CUDA-graph padding row
    run_both(rows, table, full_to_swa, P, W, specs_for(rows, (c4, c128), extra=5), **knobs)


def test_many_requests_and_empty_rows() -> None:
    """More request rows than one scan chunk, zero-length rows between them, V = 0 for C16."""
    P, W = 16, 8
    g = torch.Generator().manual_seed(1)
    table, full_to_swa = make_tables(g, 80, 4, 50, 50)
    starts = torch.randint(0, 3 * P, (75,), generator=g).tolist()
    rows = [(i, s, 0 if i % 7 == 3 else 1 + i % 3) for i, s in enumerate(starts)]
    specs = [CompressSpec(4, True, 16, 7, 8, 3), CompressSpec(16, False, 16, 9, 10, 0)]
    for knobs in KNOBS:
        run_both(rows, table, full_to_swa, P, W, specs, **knobs)


@pytest.mark.parametrize("specs", [[], "one"], ids=["no-plan", "one-plan"])
def test_decode_rows_without_or_with_one_plan(specs: list[CompressSpec] | str) -> None:
    """The MTP drafting context (no plans) and a model with one compressed ratio."""
    P, W = 16, 8
    g = torch.Generator().manual_seed(2)
    table, full_to_swa = make_tables(g, 4, 8, 30, 20)
    rows = [(0, 0, 1), (3, 17, 1), (1, 100, 1), (2, 5, 1)]
    plan = [CompressSpec(4, True, 16, 7, 8, 101 // 4)] if specs == "one" else []
    run_both(rows, table, full_to_swa, P, W, plan)


class _CountLaunches:
    """Stands in for `_metadata_kernel`: records each launch's grid, then launches."""

    def __init__(self, kernel: Any) -> None:
        self.kernel, self.grids = kernel, []

    def __getitem__(self, grid: tuple[int, int]) -> Any:
        self.grids.append(grid)
        return self.kernel[grid]


@pytest.mark.parametrize("nspec", [2, 1, 0])
def test_one_launch_per_step(nspec: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Token rows and every spec's rows in ONE launch: grid (token blocks, 1 + specs + candidate
    tiles of every spec); none for an empty step (and the same empty rows as the reference)."""
    P, W = 16, 8
    g = torch.Generator().manual_seed(4)
    table, full_to_swa = make_tables(g, 4, 8, 30, 20)
    rows = [(0, 3, 1), (3, 40, 5), (1, 100, 1)]
    specs = specs_for(rows, (4, 16), extra=0)[:nspec]          # V = 25 (C4) and 6 (C16)
    counter = _CountLaunches(metadata._metadata_kernel)
    monkeypatch.setattr(metadata, "_metadata_kernel", counter)
    run_both(rows, table, full_to_swa, P, W, specs, block_t=4, block_v=16)
    tiles = {2: 2 + 1, 1: 2, 0: 0}[nspec]
    assert counter.grids == [(2, 1 + nspec + tiles)]
    run_both([(0, 3, 0), (2, 9, 0)], table, full_to_swa, P, W, specs)
    assert len(counter.grids) == 1


def test_rejects_more_specs_than_slots() -> None:
    g = torch.Generator().manual_seed(5)
    table, full_to_swa = make_tables(g, 2, 4, 10, 10)
    slots, starts, lens = strided_rows([(0, 3, 1)])
    specs = [CompressSpec(r, False, r, 1, 2, 1) for r in (2, 4, 8)]
    with pytest.raises(ValueError, match="at most 2 compress specs"):
        triton_step_metadata(slots, starts, lens, table, full_to_swa, 16, 1, 8, specs)


def test_engine_context_matches_ref() -> None:
    """`device_context` through `build_context` over a real request table: every row of the
    triton backend's ForwardContext equals the `ref` backend's."""
    from dsv4.cache.layout import plan_cache
    from dsv4.cache.pools import KVPools
    from dsv4.cache.req_table import RequestTable
    from dsv4.checkpoint.presets import micro
    from dsv4.config.engine import EngineConfig
    from dsv4.engine.metadata import StepShape, build_context
    from dsv4.kernels.registry import REF, create_kernels

    model = micro()
    layout = plan_cache(model, EngineConfig(page_size=16, max_running_requests=8,
                                            max_total_tokens=4096), torch.float32)
    pools = KVPools(model, layout, torch.float32, torch.device("meta"))
    table = RequestTable(layout, 8, 512, DEVICE)
    work = [(0, 37), (29, 1), (61, 3)]                       # (start, new tokens) per request
    slots = [table.open() for _ in work]
    for slot, (start, n) in zip(slots, work, strict=True):
        assert table.reserve(slot, 0, start + n)
    shape = StepShape(slots, [s for s, _ in work], [n for _, n in work], [1] * len(work))
    want = build_context(shape, table, pools, model, DEVICE, REF)
    got = build_context(shape, table, pools, model, DEVICE, create_kernels("triton"))
    assert got.ops.name == "triton" and list(got.plans) == list(want.plans) == [4, 16]
    for name in ("positions", "swa_write", "window", "logits_index"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name
    for ratio, plan in want.plans.items():
        other = got.plans[ratio]
        assert other.ring_reads_disjoint == plan.ring_reads_disjoint
        for f in ("src_new", "src_ring", "from_new", "src_valid", "write_slot", "entry_pos",
                  "ring_write", "candidates", "visible"):
            a, b = getattr(other, f), getattr(plan, f)
            assert a.dtype == b.dtype and torch.equal(a, b), (ratio, f)


def test_rejects_bad_rows() -> None:
    """Shapes and dtypes are checked on the host (values are not: that would sync)."""
    g = torch.Generator().manual_seed(3)
    table, full_to_swa = make_tables(g, 2, 4, 10, 10)
    one = torch.ones(1, dtype=torch.int64, device=DEVICE)
    with pytest.raises(ValueError, match="int64"):
        triton_step_metadata(one.int(), one, one, table, full_to_swa, 16, 1, 8, [])
    with pytest.raises(ValueError, match="page_table"):
        triton_step_metadata(one, one, one, table.t(), full_to_swa, 16, 1, 8, [])
