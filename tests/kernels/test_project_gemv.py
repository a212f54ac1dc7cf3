"""The triton backend's `project` op (`kernels/triton/project.py::triton_project`) at decode
sizes: the one-launch skinny GEMM with tiles and splits fixed, so a fused group's columns are the
members' own bits (what `tests/kernels/test_fused_projections_triton.py` relies on end to end; the
interpreter's tl.dot rows within `INTERPRETER_DOT_REL`);
at prefill sizes the fp32 weight's bf16 pieces, and on a GPU the tensor-core path of a bf16 x.
Runs under the Triton interpreter on CPU and compiled on CUDA.

    TRITON_INTERPRET=1 PYTHONPATH=src python3 -m pytest -q tests/kernels/test_project_gemv.py
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from dsv4.kernels.triton.gemv import FMA_MAX_M, MAX_M, GemvCounters
from dsv4.kernels.triton.project import triton_project

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
    reason="needs a CUDA GPU or the Triton interpreter")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


INTERPRETER_DOT_REL = 1e-6
"""How far the interpreter's tl.dot rows may put a fused group's columns from its members' (of
max |y|): it runs tl.dot as numpy's fp32 matmul, whose sum order follows the tile's shape on
some CPUs (an AMD EPYC with AVX2, for one; bit-equal on others), a few fp32 roundings of max |y|
apart. Compiled on CUDA and on the FMA rows a column's sum order depends on K only: bit for bit
there."""


def assert_member_columns(m: int, got: torch.Tensor, parts: list[torch.Tensor]) -> None:
    """A fused group's columns against its members' own (module docstring)."""
    want = torch.cat(parts, dim=1)
    if DEVICE == "cuda" or m <= FMA_MAX_M:
        assert torch.equal(got, want)
    else:
        assert float((got - want).abs().max()) <= INTERPRETER_DOT_REL * float(want.abs().max())


def _data(m: int, n: int, k: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g)
    w = torch.randn(n, k, generator=g) / k**0.5
    return x.to(DEVICE), w.to(DEVICE)


@pytest.mark.parametrize("m", [1, 3, 9, 40])
def test_decode_rows_match_linear_and_fused_columns_are_exact(m: int) -> None:
    """Both decode paths: FMA (m <= 4) and tf32x3 tl.dot (up to MAX_M rows; within 2e-6 of max
    |y| of the float64 product, the tolerance its H200 benchmark asserts)."""
    x, w = _data(m, 96, 512)
    counters = GemvCounters()
    got = triton_project(x, w, counters)
    ref = F.linear(x.double(), w.double())
    assert float((got.double() - ref).abs().max()) <= 2e-6 * float(ref.abs().max())
    # a fused group (the rows of two members stacked): each member's columns, bit for bit
    parts = [triton_project(x, w[:32], counters), triton_project(x, w[32:], counters)]
    assert_member_columns(m, got, parts)
    assert int(counters.get(x.device).abs().sum()) == 0, "split-K counters left non-zero"


def test_prefill_rows_take_linear() -> None:
    x, w = _data(MAX_M + 1, 48, 256)
    assert torch.equal(triton_project(x, w, GemvCounters()), F.linear(x, w))


@pytest.mark.parametrize("m", [1, 3, 9, MAX_M + 1])
def test_a_16_bit_x_is_its_fp32_values(m: int) -> None:
    """The compressors hand the `project` op their bf16 x as it is (no cast launch): the result is
    fp32 and equal to projecting x.float() (decode rows read and widen x in the kernel; more
    rows take F.linear of the cast): bit for bit but on the GPU's tf32x3 rows, which are within
    the path's tolerance."""
    x, w = _data(m, 96, 512, seed=1)
    xb = x.bfloat16()
    counters = GemvCounters()
    got = triton_project(xb, w, counters)
    assert got.dtype == torch.float32
    want = triton_project(xb.float(), w, counters)
    if m <= FMA_MAX_M or m > MAX_M or DEVICE == "cpu":
        assert torch.equal(got, want)
    else:   # the tf32x3 tl.dot rows: as close as the path is to the exact product (module doc)
        assert float((got - want).abs().max()) <= 2e-6 * float(want.abs().max())


@pytest.mark.parametrize("m", [1, 3, 9, MAX_M + 1])
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
def test_a_bf16_weight_is_its_fp32_values(m: int, x_dtype: torch.dtype) -> None:
    """A checkpoint-format model holds the compressor projections in bf16, as stored: the op
    widens them as it reads them (no fp32 copy at decode rows), so the result is the product
    with w.float() (within the decode paths' tolerance of the float64 product; prefill rows take
    F.linear of the fp32 copies), and a fused group's columns are still the members' own bits.
    With a bf16 x (the serving path's) too, the GPU's tl.dot rows run bf16 MMAs."""
    x, w = _data(m, 96, 512, seed=2)
    x, wb = x.to(x_dtype), w.bfloat16()
    counters = GemvCounters()
    got = triton_project(x, wb, counters)
    assert got.dtype == torch.float32
    if m > MAX_M:
        assert torch.equal(got, F.linear(x.float(), wb.float()))
        return
    ref = F.linear(x.double(), wb.double())
    assert float((got.double() - ref).abs().max()) <= 2e-6 * float(ref.abs().max())
    parts = [triton_project(x, wb[:32], counters), triton_project(x, wb[32:], counters)]
    assert_member_columns(m, got, parts)
    assert int(counters.get(x.device).abs().sum()) == 0, "split-K counters left non-zero"


def test_bf16_pieces_sum_to_the_weight() -> None:
    """An fp32 weight's three bf16 pieces sum to it within 2^-24 of |w| (over magnitudes
    2^-30 .. 2^10, zeros included); a bf16 weight is its own piece."""
    from dsv4.kernels.triton.project import bf16_pieces

    g = torch.Generator().manual_seed(1)
    w = torch.randn(64, 256, generator=g) * torch.exp2(torch.randint(-30, 10, (64, 1),
                                                                      generator=g).float())
    w[0, :7] = 0.0
    pieces = bf16_pieces(w)
    assert len(pieces) == 3 and all(p.dtype == torch.bfloat16 for p in pieces)
    total = sum(p.double() for p in pieces)
    assert bool(((total - w.double()).abs() <= 2.0**-24 * w.double().abs()).all())
    assert bool((pieces[0].float() != 0).any()) and bool((pieces[2].float() != 0).any())
    wb = w.bfloat16()
    assert bf16_pieces(wb) == (wb,)


def test_prefill_rows_off_cuda_are_the_fp32_linear() -> None:
    """Without CUDA (or for an fp32 x) the prefill path is `F.linear` of the fp32 values."""
    from dsv4.kernels.triton.project import prefill_project

    x, w = _data(MAX_M + 3, 40, 128)
    for xd, wd in ((torch.bfloat16, torch.float32), (torch.float32, torch.bfloat16)):
        xs, ws = x.to(xd), w.to(wd)
        if xs.is_cuda and xd == torch.bfloat16:
            continue
        assert torch.equal(prefill_project(xs, ws), F.linear(xs.float(), ws.float()))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("w_dtype", [torch.float32, torch.bfloat16])
def test_prefill_bf16_rows_on_tensor_cores_on_gpu(w_dtype: torch.dtype) -> None:
    """V4-Flash's fused CSA compressor projection at 1024 prefill rows, bf16 x: the tensor-core
    path (bf16 pieces, fp32 out) within 1e-5 of max |y| of the float64 product (fp32 sums over
    K = 4096; a bf16 rounding anywhere would show as ~4e-3), as the fp32 GEMM it replaces."""
    x, w = _data(1024, 2560, 4096, seed=3)
    x, w = x.bfloat16(), w.to(w_dtype)
    got = triton_project(x, w, GemvCounters())
    assert got.dtype == torch.float32 and got.shape == (1024, 2560)
    ref = F.linear(x.double(), w.double())
    assert float((got.double() - ref).abs().max()) <= 1e-5 * float(ref.abs().max())
