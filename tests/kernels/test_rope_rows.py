"""Parity of `triton_rope_rows` with `ref/rope_rows.py::rope_rows`, and of both with
`RotaryEmbedding.lookup`: bit-equal (cos, sin) rows, shapes and contiguity included.

CPU: the Triton interpreter. The reference against the tables' own `lookup` (and `forward`) on
micro's main and YaRN compress tables, positions [T], [T, k] and a scalar; the kernel against the
reference for 1..4 pairs of different cache lengths P, row widths R (1, 7, 32, and one pair with
the widest R setting the blocks) and position shapes, rows over several programs, empty positions
(alone, beside other pairs, all empty: no launch), strided positions, one launch per call (grid:
row blocks of the longest pair x pairs), zero rows for positions outside [0, P). The checks both
backends make (more than `ROPE_ROWS_MAX_PAIRS` pairs, cache shape / dtype / contiguity,
positions dtype, devices). The model's `lookup_rows`: the same rows as `lookup`, one op call per
`ROPE_ROWS_MAX_PAIRS` lookups, the old lookups without a cache.
GPU (`-m gpu`): V4-Flash sizes (P = 1M positions, rd / 2 = 32; T = 1, 64 and 8192 at the main and
compress tables and the two plans' entry positions), captured in a CUDA graph and replayed.

    PYTHONPATH=src python -m pytest -q tests/kernels/test_rope_rows.py [-m gpu]
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import torch

# NOTE: must precede the first `import triton` (tests/kernels/conftest.py may already do this).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from dsv4.checkpoint.presets import flash_4l, micro  # noqa: E402
from dsv4.kernels.ops import ROPE_ROWS_MAX_PAIRS  # noqa: E402
from dsv4.kernels.ref.rope_rows import rope_rows  # noqa: E402
from dsv4.kernels.triton import rope_rows as tri  # noqa: E402
from dsv4.kernels.triton.rope_rows import triton_rope_rows  # noqa: E402
from dsv4.model.layers.rope import RotaryEmbedding, lookup_rows  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
Pairs = Sequence[tuple[torch.Tensor, torch.Tensor]]


def cache(P: int, R: int, seed: int) -> torch.Tensor:
    g = torch.Generator(DEVICE).manual_seed(seed)
    return torch.randn(2, P, R, generator=g, device=DEVICE)


def positions(P: int, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    g = torch.Generator(DEVICE).manual_seed(seed)
    return torch.randint(0, P, shape, generator=g, device=DEVICE)


def assert_rows_equal(got: Sequence[tuple[torch.Tensor, torch.Tensor]],
                      want: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Same count, and per pair cos and sin of one shape, dtype and bits, each contiguous."""
    assert len(got) == len(want)
    for (cos, sin), (want_cos, want_sin) in zip(got, want, strict=True):
        for a, b in ((cos, want_cos), (sin, want_sin)):
            assert a.shape == b.shape and a.dtype == b.dtype == torch.float32
            assert a.is_contiguous() and b.is_contiguous()
            assert torch.equal(a, b)


def test_ref_is_the_tables_lookup() -> None:
    """`rope_rows` on the tables' caches == each table's `lookup` == `forward`, bit for bit."""
    tables = [RotaryEmbedding(micro(), compressed=c).to(DEVICE) for c in (False, True)]
    for t in tables:
        t.build_cache(300)
    shapes = [(5,), (3, 4), ()]
    pos = [positions(300, s, seed=i) for i, s in enumerate(shapes)]
    lookups = [(tables[0], pos[0]), (tables[1], pos[0]), (tables[1], pos[1]), (tables[0], pos[2])]
    assert all(t.cache is not None for t in tables)
    got = rope_rows([(t.cache, p) for t, p in lookups])  # type: ignore[misc]
    assert_rows_equal(got, [t.lookup(p) for t, p in lookups])
    assert_rows_equal(got, [t(p) for t, p in lookups])


CASES: list[list[tuple[int, int, tuple[int, ...]]]] = [
    [(100, 32, (1,))],                                              # a decode step's one row
    [(300, 32, (150,)), (300, 32, (150,))],                         # 3 row blocks of 64
    [(50, 7, (3, 4)), (1000, 32, (9,)), (20, 1, (2, 3))],           # widths 7, 32, 1
    [(4096, 32, (5,)), (4096, 32, (5,)), (4096, 32, (5,)), (4096, 32, (5,))],   # V4's four
    [(64, 4, (70,)), (64, 100, (2,)), (9, 3, (0,)), (64, 4, (4, 2))],  # widest R 100: 16 x 128
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{len(c)}pairs-" + "-".join(
    f"P{P}R{R}S{'x'.join(map(str, s))}" for P, R, s in c))
def test_parity(case: list[tuple[int, int, tuple[int, ...]]]) -> None:
    pairs = [(cache(P, R, seed=i), positions(P, shape, seed=10 + i))
             for i, (P, R, shape) in enumerate(case)]
    assert_rows_equal(triton_rope_rows(pairs), rope_rows(pairs))


def test_small_blocks_and_strided_positions(monkeypatch: pytest.MonkeyPatch) -> None:
    """Many programs per pair (BLOCK_ELEMS 64: 2 rows of 32) and positions that are a strided
    view (copied to contiguous rows) or a column of a [T, k] tensor."""
    monkeypatch.setattr(tri, "BLOCK_ELEMS", 64)
    c = cache(500, 32, seed=1)
    wide = positions(500, (11, 3), seed=2)
    pairs = [(c, wide[:, 1]), (c, wide[::2]), (c, wide.t())]
    assert_rows_equal(triton_rope_rows(pairs), rope_rows(pairs))


class _CountLaunches:
    """Stands in for `_rope_rows_kernel`: records each launch's grid, then launches."""

    def __init__(self, kernel: Any) -> None:
        self.kernel, self.grids = kernel, []

    def __getitem__(self, grid: tuple[int, int]) -> Any:
        self.grids.append(grid)
        return self.kernel[grid]


def test_one_launch_per_call_and_empty_positions(monkeypatch: pytest.MonkeyPatch) -> None:
    """One launch of grid (row blocks of the longest pair, pairs) whatever the pair count; an
    empty pair beside others gets its [2, 0, R] halves; a call with no rows launches nothing."""
    counter = _CountLaunches(tri._rope_rows_kernel)
    monkeypatch.setattr(tri, "_rope_rows_kernel", counter)
    c0, c1 = cache(200, 32, seed=3), cache(80, 8, seed=4)
    for n in range(1, ROPE_ROWS_MAX_PAIRS + 1):
        pairs = [(c0, positions(200, (130,), seed=5)), (c1, positions(80, (0,), seed=6)),
                 (c1, positions(80, (7, 2), seed=7)), (c0, positions(200, (1,), seed=8))][:n]
        assert_rows_equal(triton_rope_rows(pairs), rope_rows(pairs))
        assert counter.grids[-1] == (3, n)                    # cdiv(130, 64) blocks
    assert len(counter.grids) == ROPE_ROWS_MAX_PAIRS
    empty = [(c0, positions(200, (0,), seed=9)), (c1, positions(80, (0, 3), seed=9))]
    assert_rows_equal(triton_rope_rows(empty), rope_rows(empty))
    assert triton_rope_rows([]) == rope_rows([]) == ()
    assert len(counter.grids) == ROPE_ROWS_MAX_PAIRS


def test_positions_outside_the_cache_read_zero_rows() -> None:
    """The kernel reads no memory for a position outside [0, P): its rows are zero (the
    reference's `index_select` raises; the engine keeps positions inside the cache)."""
    c = cache(40, 16, seed=11)
    (cos, sin), = triton_rope_rows([(c, torch.tensor([-1, 3, 40, 39], device=DEVICE))])
    assert torch.equal(cos[[1, 3]], c[0, [3, 39]]) and torch.equal(sin[[1, 3]], c[1, [3, 39]])
    assert not bool(cos[[0, 2]].any()) and not bool(sin[[0, 2]].any())


@pytest.mark.parametrize("fn", [rope_rows, triton_rope_rows], ids=["ref", "triton"])
def test_validation(fn: Any) -> None:
    c, p = cache(10, 4, seed=0), positions(10, (3,), seed=0)
    with pytest.raises(ValueError, match=f"at most {ROPE_ROWS_MAX_PAIRS}"):
        fn([(c, p)] * (ROPE_ROWS_MAX_PAIRS + 1))
    bad_caches = {"float32": c.double(), r"\[2, P, R\]": c[0], "contiguous": c.transpose(1, 2)}
    for match, bad in bad_caches.items():
        with pytest.raises(ValueError, match=match):
            fn([(c, p), (bad, p)])
    with pytest.raises(ValueError, match="int64"):
        fn([(c, p.int())])
    with pytest.raises(ValueError, match="one device"):
        fn([(c, p), (c.to("meta"), p.to("meta"))])


def test_lookup_rows_matches_lookup_and_chunks() -> None:
    """`lookup_rows` (the model's serving preamble): the rows of each `lookup`; with the caches
    built one op call per `ROPE_ROWS_MAX_PAIRS` lookups, without a cache none."""
    calls: list[int] = []

    def counted(pairs: Pairs) -> tuple[tuple[torch.Tensor, torch.Tensor], ...]:
        calls.append(len(pairs))
        return triton_rope_rows(pairs)

    tables = [RotaryEmbedding(micro(), compressed=c).to(DEVICE) for c in (False, True)]
    lookups = [(tables[i % 2], positions(64, (i + 1,), seed=i)) for i in range(6)]
    want = [t.lookup(p) for t, p in lookups]                  # no cache: computed
    assert_rows_equal(lookup_rows(lookups, counted), want)
    assert calls == []
    tables[0].build_cache(64)
    assert_rows_equal(lookup_rows(lookups, counted), want)    # one table without a cache
    assert calls == []
    tables[1].build_cache(64)
    assert_rows_equal(lookup_rows(lookups, counted), want)
    assert calls == [ROPE_ROWS_MAX_PAIRS, 6 - ROPE_ROWS_MAX_PAIRS]


@pytest.mark.gpu
class TestFlashSizesInGraph:
    """V4-Flash's tables (rd / 2 = 32, YaRN compress table) cached over 1M positions; a step's
    four lookups (main and compress at the positions, compress at the C4 and C128 entry
    positions) in one launch, captured in a CUDA graph and replayed on new positions."""

    @pytest.mark.parametrize("T", [1, 64, 8192])
    def test_step_lookups_in_graph(self, T: int) -> None:
        if not torch.cuda.is_available():
            pytest.skip("needs a CUDA device")
        tables = [RotaryEmbedding(flash_4l(), compressed=c).to(DEVICE) for c in (False, True)]
        for t in tables:
            t.build_cache(1 << 20)
        pos = torch.empty(T, dtype=torch.int64, device=DEVICE)

        def lookups() -> list[tuple[RotaryEmbedding, torch.Tensor]]:
            entry = [(pos - r + 1).clamp(min=0) for r in (4, 128)]
            return [(tables[0], pos), (tables[1], pos), (tables[1], entry[0]),
                    (tables[1], entry[1])]

        def pairs() -> list[tuple[torch.Tensor, torch.Tensor]]:
            return [(t.cache, p) for t, p in lookups()]  # type: ignore[misc]

        pos.copy_(positions(1 << 20, (T,), seed=T))
        triton_rope_rows(pairs())                             # compile outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            got = triton_rope_rows(pairs())
        for seed in (1, 2):
            pos.copy_(positions(1 << 20, (T,), seed=seed))
            graph.replay()
            assert_rows_equal(got, [t.lookup(p) for t, p in lookups()])
