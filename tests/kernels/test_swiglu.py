"""Parity of `triton_swiglu` with `ref/moe.py::swiglu` (the shared expert's SwiGLU with its clamp).

CPU: the interpreter on small shapes: fp32 and bf16, N = 0, 1, 7, 64 rows of I = 300 (several
programs, a ragged tail), clamps that bite, a limit bf16 cannot represent (the clamped values round
to bf16 as the reference's do), non-contiguous inputs, validation. The interpreter's fp32 -> bf16
cast truncates where the GPU rounds to nearest even; the tests patch it to round to nearest even.
Under the interpreter silu runs on numpy and differs from torch's CPU one by a few fp32 ulp: fp32
within `FP32_TOL` (measured max relative diff 2.6e-7), bf16 bit-equal on these inputs (a few-ulp
fp32 difference rarely moves a bf16 rounding; one bf16 ulp is allowed).
GPU (`-m gpu`): the V4-Flash shared expert ([N, 2048] bf16, N = 1..512) inside a CUDA graph,
bit-equal.

    PYTHONPATH=src python -m pytest -q tests/kernels/test_swiglu.py
"""

from __future__ import annotations

import os

import torch

# NOTE: must precede the first `import triton` (tests/kernels/conftest.py may already do this).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from dsv4.kernels.ref.moe import swiglu  # noqa: E402
from dsv4.kernels.triton.swiglu import triton_swiglu  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FP32_TOL = {"rtol": 5e-7, "atol": 1e-6}
BF16_TOL = {"rtol": 2 ** -8, "atol": 0.0}


pytestmark = pytest.mark.usefixtures("round_bf16_to_nearest_even")


def inputs(N: int, inter: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """gate, up ~ 6 N(0, 1): beyond the clamp at 10 in a few percent of the elements."""
    g = torch.Generator().manual_seed(seed)
    return ((torch.randn(N, inter, generator=g) * 6).to(dtype).to(DEVICE),
            (torch.randn(N, inter, generator=g) * 6).to(dtype).to(DEVICE))


def check(gate: torch.Tensor, up: torch.Tensor, limit: float) -> None:
    want, got = swiglu(gate, up, limit), triton_swiglu(gate, up, limit)
    assert got.dtype == want.dtype and got.shape == want.shape and got.is_contiguous()
    if DEVICE == "cuda":
        assert torch.equal(got, want)
    else:
        tol = FP32_TOL if gate.dtype == torch.float32 else BF16_TOL
        torch.testing.assert_close(got, want, **tol)


@pytest.mark.parametrize("N", [0, 1, 7, 64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_parity(N: int, dtype: torch.dtype) -> None:
    gate, up = inputs(N, 300, dtype, seed=N)
    check(gate, up, 10.0)
    check(gate, up, 7.3)            # not a bf16 value: the clamped elements round to bf16


def test_bf16_bit_equal_here() -> None:
    gate, up = inputs(64, 300, torch.bfloat16, seed=11)
    assert torch.equal(triton_swiglu(gate, up, 10.0), swiglu(gate, up, 10.0))


def test_non_contiguous() -> None:
    gate, up = inputs(8, 64, torch.float32, seed=2)
    check(gate.t(), up.t(), 10.0)
    check(gate[:, ::2], up[:, 1::2], 10.0)


@pytest.mark.parametrize("N", [1, 7])
def test_fused_halves_read_in_place(N: int) -> None:
    """gate and up as the two column halves of one [N, 2 I] output (a fused w1 | w3 GEMM): rows
    2 I apart, read in place; the result equals that of contiguous copies, bit for bit."""
    gate, up = inputs(N, 300, torch.float32, seed=N)
    both = torch.cat((gate, up), dim=1)
    halves = both[:, :300], both[:, 300:]
    got = triton_swiglu(*halves, 10.0)
    assert got.is_contiguous() and torch.equal(got, triton_swiglu(gate, up, 10.0))
    check(*halves, 10.0)


def test_validation() -> None:
    gate, up = inputs(2, 8, torch.float32, seed=0)
    with pytest.raises(ValueError, match="match"):
        triton_swiglu(gate, up.bfloat16(), 10.0)
    with pytest.raises(ValueError, match="match"):
        triton_swiglu(gate, up[:1], 10.0)
    with pytest.raises(ValueError, match="dtype"):
        triton_swiglu(gate.double(), up.double(), 10.0)


@pytest.mark.gpu
@pytest.mark.parametrize("N", [1, 8, 64, 512])
def test_gpu_flash_shared_expert_in_graph(N: int) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    gate, up = inputs(N, 2048, torch.bfloat16, seed=N)
    want = swiglu(gate, up, 10.0)
    triton_swiglu(gate, up, 10.0)                   # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = triton_swiglu(gate, up, 10.0)
    graph.replay()
    assert torch.equal(got, want)
