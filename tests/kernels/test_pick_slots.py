"""Parity of `triton_pick_slots` with `ref/indexer.py::pick_slots`: bit-equal ids and slots.

CPU: the interpreter on small shapes: decode rows, a prefill chunk over several programs, picks
of -1, picks of invisible candidates, K not a power of two, the one-column stand-in of a step
before any entry is complete, an empty step. GPU (`-m gpu`): V4-Flash widths (K 512, V up to
65,536) at T = 1..8192, inside a CUDA graph.

    PYTHONPATH=src python -m pytest -q tests/kernels/test_pick_slots.py
"""

from __future__ import annotations

import os

import torch

# NOTE: must precede the first `import triton` (tests/kernels/conftest.py may already do this).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from dsv4.kernels.ref.indexer import pick_slots  # noqa: E402
from dsv4.kernels.triton.pick_slots import triton_pick_slots  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def case(T: int, K: int, V: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Candidates: distinct slots, the columns past each row's visible count -1 (and a few holes
    inside it); picks: distinct columns below the visible count, some -1, some invisible."""
    g = torch.Generator().manual_seed(seed)
    visible = torch.randint(0, V + 1, (T,), generator=g)
    cand = torch.randperm(T * V * 4, generator=g)[:T * V].view(T, V)
    cols = torch.arange(V)[None, :]
    cand = torch.where(cols < visible[:, None], cand, -1)
    cand = torch.where(torch.rand(T, V, generator=g) < 0.05, -1, cand)
    picks = torch.stack([torch.randperm(V, generator=g)[:K] for _ in range(T)]) if V >= K else \
        torch.randint(0, V, (T, K), generator=g)
    picks = torch.where(torch.rand(T, K, generator=g) < 0.2, -1, picks)
    return picks.to(DEVICE), cand.to(DEVICE)


def assert_same(picks: torch.Tensor, cand: torch.Tensor) -> None:
    for name, w, g in zip(("ids", "slots"), pick_slots(picks, cand),
                          triton_pick_slots(picks, cand), strict=True):
        assert g.dtype == w.dtype == torch.int64 and g.shape == w.shape, name
        assert torch.equal(g, w), name


@pytest.mark.parametrize(("T", "K", "V"), [(1, 4, 9), (3, 16, 40), (70, 12, 50), (5, 3, 3),
                                           (2, 8, 1)])
def test_parity(T: int, K: int, V: int) -> None:
    assert_same(*case(T, K, V, seed=T * 31 + K))


def test_before_any_entry_and_empty() -> None:
    """The attention's stand-in when no entry is complete: picks all -1 (padded), candidates one
    -1 column; and a step with no picks."""
    picks = torch.full((4, 6), -1, dtype=torch.int64, device=DEVICE)
    cand = torch.full((4, 1), -1, dtype=torch.int64, device=DEVICE)
    assert_same(picks, cand)
    ids, slots = triton_pick_slots(picks, cand)
    assert bool((ids == -1).all()) and bool((slots == -1).all())
    assert_same(picks[:, :0], cand)


def test_validation() -> None:
    picks, cand = case(2, 4, 8, seed=0)
    with pytest.raises(ValueError, match="int64"):
        triton_pick_slots(picks.int(), cand)
    with pytest.raises(ValueError, match="V >= 1"):
        triton_pick_slots(picks, cand[:, :0])


@pytest.mark.gpu
@pytest.mark.parametrize(("T", "V"), [(1, 1024), (4, 65536), (32, 8192), (8192, 1024)])
def test_gpu_flash_widths_in_graph(T: int, V: int) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    picks, cand = case(T, 512, V, seed=T)
    want = pick_slots(picks, cand)
    triton_pick_slots(picks, cand)                  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = triton_pick_slots(picks, cand)
    graph.replay()
    for w, g in zip(want, got, strict=True):
        assert torch.equal(w, g)
