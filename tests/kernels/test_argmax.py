"""Parity of `triton_argmax` with `ref/argmax.py::argmax` (= `torch.argmax(x, dim=-1)`): the same
int64 indices, bit for bit.

CPU: the interpreter on small shapes: random rows at B = 1..8, many chunks per row (small
`block_v`), V not a multiple of the block, ties (the first maximum wins, within a chunk and
across chunks), NaN of either sign (the first NaN wins, over +inf too), -0.0 against +0.0, rows
of -inf, bf16 / fp16 inputs, strided rows, an empty batch. GPU (`-m gpu`): V4's vocabulary
(V = 129,280) at B = 1..256 with the default block, eager and inside a CUDA graph; the same edge
cases against torch's CUDA argmax.

    PYTHONPATH=src python -m pytest -q tests/kernels/test_argmax.py
"""

from __future__ import annotations

import os

import torch

# NOTE: must precede the first `import triton` (tests/kernels/conftest.py may already do this).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from dsv4.kernels.ref.argmax import argmax  # noqa: E402
from dsv4.kernels.triton.argmax import triton_argmax  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
VOCAB = 129_280
NAN, INF = float("nan"), float("inf")


def negative_nan() -> float:
    """A NaN with its sign bit set (its bits order below -inf as an integer)."""
    return float(torch.tensor([-0x400000], dtype=torch.int32).view(torch.float32)[0])


def assert_same(x: torch.Tensor, block_v: int | None = None) -> None:
    want = argmax(x)
    got = triton_argmax(x) if block_v is None else triton_argmax(x, block_v=block_v)
    assert got.dtype == want.dtype == torch.int64 and got.shape == want.shape
    assert torch.equal(got, want), (got.tolist(), want.tolist())


def edge_rows(V: int) -> torch.Tensor:
    """[10, V] rows, V >= 40: ties inside and across chunks, NaNs, infinities, signed zeros."""
    g = torch.Generator().manual_seed(V)
    x = torch.randn(10, V, generator=g)
    x[0, [3, 17, V - 1]] = 9.0                       # a tie: the first (3) wins
    x[1, [V - 2, V - 1]] = 9.0                       # a tie in the last, partial chunk
    x[2, [5, 30]] = NAN                              # the first NaN wins
    x[2, 1] = INF
    x[3, 20] = negative_nan()                        # a NaN of either sign is the largest
    x[3, 35] = NAN
    x[4] = -INF                                      # all -inf: index 0
    x[5] = -INF
    x[5, V - 1] = -1e30                              # one finite value past many -inf
    x[6] = 0.0                                       # all equal: index 0
    x[7] = -1.0
    x[7, [9, 2]] = torch.tensor([0.0, -0.0])         # -0.0 == +0.0: the first (2)
    x[8, [4, 25]] = INF                              # +inf ties
    x[9] = -x[9].abs() - 1.0                         # all negative
    return x.to(DEVICE)


@pytest.mark.parametrize("B", [1, 2, 3, 5, 8])
@pytest.mark.parametrize(("V", "block_v"), [(1, 16), (7, 16), (100, 16), (300, 64), (129, 128)])
def test_random_rows(B: int, V: int, block_v: int) -> None:
    g = torch.Generator().manual_seed(B * 1000 + V)
    assert_same(torch.randn(B, V, generator=g).to(DEVICE), block_v)


@pytest.mark.parametrize(("V", "block_v"), [(40, 8), (100, 16), (257, 32), (300, 512)])
def test_ties_nan_inf_signed_zero(V: int, block_v: int) -> None:
    assert_same(edge_rows(V), block_v)


def test_default_block_several_chunks() -> None:
    """The default block on a row of three chunks, V not a multiple of it."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 9000, generator=g)
    x[1, [4100, 8999]] = 7.0
    assert_same(x.to(DEVICE))
    assert_same(edge_rows(9000))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_dtypes(dtype: torch.dtype) -> None:
    """Half inputs tie often (few mantissa bits): still the first maximum."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(6, 300, generator=g).to(dtype)
    x[0, [10, 200]] = NAN
    assert_same(x.to(DEVICE), block_v=64)


def test_strided_rows_and_empty() -> None:
    g = torch.Generator().manual_seed(2)
    x = torch.randn(4, 200, generator=g).to(DEVICE)
    assert_same(x[:, 10:150], block_v=32)             # a row stride past the row length
    assert_same(x[::2], block_v=32)
    assert_same(x.t().contiguous().t()[:, :50], block_v=16)   # column stride != 1: a copy
    assert_same(x[:0], block_v=32)


def test_validation() -> None:
    x = torch.randn(2, 8, device=DEVICE)
    with pytest.raises(ValueError, match="B, V >= 1"):
        triton_argmax(x[:, :0])
    with pytest.raises(ValueError, match="B, V >= 1"):
        triton_argmax(x[0])
    with pytest.raises(ValueError, match="dtype"):
        triton_argmax(x.to(torch.float64))
    with pytest.raises(ValueError, match="power of two"):
        triton_argmax(x, block_v=24)


@pytest.mark.gpu
@pytest.mark.parametrize("B", [1, 2, 8, 32, 128, 256])
def test_gpu_vocab_rows_in_graph(B: int) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    g = torch.Generator(DEVICE).manual_seed(B)
    x = torch.randn(B, VOCAB, generator=g, device=DEVICE) * 4
    x[0, [7, VOCAB - 1]] = x[0].max() + 1            # a tie across chunks
    if B > 1:
        x[1, [70_000, 90_000]] = NAN
    want = argmax(x)
    assert torch.equal(triton_argmax(x), want)        # eager; compiles outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = triton_argmax(x)
    graph.replay()
    assert torch.equal(got, want)
    x.copy_(torch.randn(B, VOCAB, generator=g, device=DEVICE))   # new values, same graph
    graph.replay()
    assert torch.equal(got, argmax(x))


@pytest.mark.gpu
def test_gpu_edge_cases_match_cuda_argmax() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    x = torch.cat([edge_rows(VOCAB), edge_rows(VOCAB).to(torch.bfloat16).float()])
    assert_same(x)
    assert_same(x.to(torch.bfloat16))
