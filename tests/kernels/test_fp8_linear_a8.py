"""W8A8 FP8 linear (`triton_fp8_linear_a8`) against the reference model's FP8 linear
(`ref/fp8_linear.py::fp8_linear_a8`: act_quant(x) times the decoded weight).

CPU: the interpreter's fp32 dots on exact e4m3 products: equal to the reference up to fp32
summation order (fp32 out), or within one bf16 ulp (bf16 out; both round the same fp32 value on
the bits, so only a sum that lands on a rounding boundary can differ). Partial M / N tiles, a
partial last K block, both knob tile sizes, validation.
GPU (`-m gpu`): prefill shapes of V4-Flash's FP8 linears at M 2048, rows independent of M. The
QGMMA tiles accumulate inside one instruction less precisely than fp32, so the fp32 sums move
slightly (fp32 out: held to 2e-3 max, 5e-4 norm-wise). In bf16 out each such move that crosses a
rounding boundary becomes a whole bf16 ulp: measured on the H200 (benchmarks/results/
quant_moe_h200_202612.md) 3.4e-3 max (one ulp of the largest element is up to
3.9e-3) and 6.9e-4 norm-wise, held to 8e-3 and 1.5e-3.

    PYTHONPATH=src python -m pytest -q tests/kernels/test_fp8_linear_a8.py
"""

from __future__ import annotations

import os

import torch

# NOTE: must precede the first `import triton` (tests/kernels/conftest.py may already do this).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from dsv4.kernels.ref import quant  # noqa: E402
from dsv4.kernels.ref.fp8_linear import fp8_linear, fp8_linear_a8  # noqa: E402
from dsv4.kernels.triton.fp8_linear_a8 import triton_fp8_linear_a8  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def operands(M: int, N: int, K: int, dtype: torch.dtype,
             seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    w, s = quant.quant_fp8_block(torch.randn(N, K, generator=g) * K ** -0.5)
    x = torch.randn(M, K, generator=g) * torch.logspace(-2, 1, M)[:, None]
    return x.to(dtype).to(DEVICE), w.to(DEVICE), s.to(DEVICE)


def _rel(out: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    diff = (out.float() - ref.float())
    return ((diff.abs().max() / ref.float().abs().max()).item(),
            (diff.norm() / ref.float().norm()).item())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("M,N,K,bm,bn", [(5, 96, 300, None, None), (70, 256, 256, 64, 128),
                                          (33, 160, 128, 16, 32)])
def test_matches_reference(dtype: torch.dtype, M: int, N: int, K: int, bm: int | None,
                           bn: int | None) -> None:
    x, w, s = operands(M, N, K, dtype)
    out = triton_fp8_linear_a8(x, w, s, block_m=bm, block_n=bn)
    ref = fp8_linear_a8(x, w, s)
    assert out.dtype == dtype and out.shape == (M, N)
    if dtype == torch.float32:
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    else:   # one bf16 ulp at most, and rarely
        ulp = ref.float().abs() * 2 ** -7
        assert bool(((out.float() - ref.float()).abs() <= ulp).all())
        assert (out != ref).float().mean().item() < 0.01
    # the activations' quantisation shows against the weight-only linear
    assert _rel(ref, fp8_linear(x.float(), w, s))[0] > 1e-3


def test_rows_independent_of_m() -> None:
    x, w, s = operands(40, 128, 256, torch.float32, seed=3)
    full = triton_fp8_linear_a8(x, w, s, block_m=16)
    assert torch.equal(full[17:18], triton_fp8_linear_a8(x[17:18], w, s, block_m=16))


def test_validation() -> None:
    x, w, s = operands(4, 128, 256, torch.bfloat16)
    with pytest.raises(ValueError, match="x must be"):
        triton_fp8_linear_a8(x.half(), w, s)
    with pytest.raises(ValueError, match="w must be"):
        triton_fp8_linear_a8(x, w[:, :128], s)
    with pytest.raises(ValueError, match="scale must be"):
        triton_fp8_linear_a8(x, w, s[:, :1])
    with pytest.raises(ValueError, match="block_m"):
        triton_fp8_linear_a8(x, w, s, block_m=256)
    assert triton_fp8_linear_a8(x[:0], w, s).shape == (0, 128)


@pytest.mark.gpu
@pytest.mark.parametrize("N,K", [(1024, 4096), (4096, 2048), (512, 4096)])
def test_flash_prefill_shapes(N: int, K: int) -> None:
    for dtype, tol in ((torch.float32, (2e-3, 5e-4)), (torch.bfloat16, (8e-3, 1.5e-3))):
        x, w, s = operands(2048, N, K, dtype, seed=N)
        ref = fp8_linear_a8(x, w, s)
        for bm in (64, 128):
            max_rel, norm_rel = _rel(triton_fp8_linear_a8(x, w, s, block_m=bm), ref)
            assert max_rel <= tol[0] and norm_rel <= tol[1], (dtype, bm, max_rel, norm_rel)
    full = triton_fp8_linear_a8(x, w, s)
    assert torch.equal(full[5:6], triton_fp8_linear_a8(x[5:6], w, s, block_m=128))
