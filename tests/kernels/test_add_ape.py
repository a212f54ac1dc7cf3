"""Parity of `triton_add_ape` with `ref/compressor.py::add_ape`: bit-equal scores, in place.

The compressors' gate scores get `ape[p % ratio]` in one fp32 add, so the kernel, the in-place
reference and the out-of-place torch form the full-sequence path uses (`score + ape[pos % ratio]`)
give the same bits; the trainer's values are unaffected by which one runs.

CPU: the interpreter on small shapes: a decode row, rows over several programs, ratios 4 and
128 at positions past many windows, a width that is not a power of two, a strided score view,
an empty step. GPU (`-m gpu`): V4-Flash widths (C4 1024, indexer 256, C128 512) at T = 1..8192,
inside a CUDA graph.

    PYTHONPATH=src python -m pytest -q tests/kernels/test_add_ape.py [-m gpu]
"""

from __future__ import annotations

import os

import torch

# NOTE: must precede the first `import triton` (tests/kernels/conftest.py may already do this).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from dsv4.kernels.ref.compressor import add_ape  # noqa: E402
from dsv4.kernels.triton.add_ape import triton_add_ape  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def case(T: int, W: int, ratio: int,
         seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator(DEVICE).manual_seed(seed)
    score = torch.randn(T, W, generator=g, device=DEVICE) * 5
    ape = torch.randn(ratio, W, generator=g, device=DEVICE)
    pos = torch.randint(0, 1 << 20, (T,), generator=g, device=DEVICE)
    return score, ape, pos


def assert_same(score: torch.Tensor, ape: torch.Tensor, pos: torch.Tensor, ratio: int) -> None:
    """Kernel == in-place reference == the out-of-place torch add, bit for bit."""
    torch_form = score + ape[pos % ratio]
    want, got = score.clone(), score.clone()
    add_ape(want, ape, pos, ratio)
    triton_add_ape(got, ape, pos, ratio)
    assert torch.equal(want, torch_form) and torch.equal(got, want)


@pytest.mark.parametrize(("T", "W", "ratio"), [(1, 32, 4), (5, 16, 4), (70, 40, 128),
                                               (3, 96, 128), (9, 1, 4)])
def test_parity(T: int, W: int, ratio: int) -> None:
    assert_same(*case(T, W, ratio, seed=T * 13 + W), ratio)


def test_in_place_on_a_strided_view_and_empty() -> None:
    """Writes only the view's columns; an empty step does nothing."""
    score, ape, pos = case(4, 48, 4, seed=1)
    wide = torch.zeros(4, 64, device=DEVICE)
    wide[:, 8:56] = score
    triton_add_ape(wide[:, 8:56], ape, pos, 4)
    assert torch.equal(wide[:, 8:56], score + ape[pos % 4])
    assert bool((wide[:, :8] == 0).all()) and bool((wide[:, 56:] == 0).all())
    empty = score[:0].clone()
    triton_add_ape(empty, ape, pos[:0], 4)


def test_validation() -> None:
    score, ape, pos = case(2, 8, 4, seed=0)
    with pytest.raises(ValueError, match="ratio=4"):
        triton_add_ape(score, ape[:3], pos, 4)
    with pytest.raises(ValueError, match="int64"):
        triton_add_ape(score, ape, pos.int(), 4)
    with pytest.raises(ValueError, match="float32"):
        triton_add_ape(score.double(), ape, pos, 4)


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 64, 8192])
@pytest.mark.parametrize(("W", "ratio"), [(1024, 4), (256, 4), (512, 128)])
def test_gpu_flash_widths_in_graph(T: int, W: int, ratio: int) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    score, ape, pos = case(T, W, ratio, seed=T + W)
    want = score + ape[pos % ratio]
    got = score.clone()
    triton_add_ape(score.clone(), ape, pos, ratio)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        triton_add_ape(got, ape, pos, ratio)
    graph.replay()
    assert torch.equal(got, want)


@pytest.mark.parametrize("backend", ["ref", "triton"])
def test_project_scores_are_the_torch_add(backend: str) -> None:
    """`model/compressor.py::_project` with a backend's ops (the serving path and the trainer's
    `ForwardMode.values` path) adds the ape through `add_ape` in place; its scores are the bits of
    the out-of-place `score + ape[pos % ratio]` on the same projections, so the trainer's values
    do not depend on which form ran."""
    from dsv4.kernels.registry import create_kernels
    from dsv4.model.compressor import _project

    ops = create_kernels(backend)  # type: ignore[arg-type]
    g = torch.Generator(DEVICE).manual_seed(7)
    x = torch.randn(2, 9, 32, generator=g, device=DEVICE).to(torch.bfloat16)
    wkv, wgate = (torch.randn(16, 32, generator=g, device=DEVICE) for _ in range(2))
    ape = torch.randn(4, 16, generator=g, device=DEVICE)
    pos = torch.arange(9, device=DEVICE).repeat(2, 1) + 5
    kv, score = _project(x, pos, wkv, wgate, ape, 4, ops)
    rows = x.float().reshape(-1, 32)
    assert torch.equal(kv, ops.project(rows, wkv).view(2, 9, 16))
    assert torch.equal(score, ops.project(rows, wgate).view(2, 9, 16) + ape[pos % 4])
