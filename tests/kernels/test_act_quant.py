"""FP8 activation quantisation (spec §11.1-2): the reference's semantics, and the Triton kernel
bit for bit against it (CPU: the interpreter; GPU with `-m gpu`: a V4-Flash-sized batch).

    PYTHONPATH=src python -m pytest -q tests/kernels/test_act_quant.py
"""

from __future__ import annotations

import os

import torch

# NOTE: must precede the first `import triton` (tests/kernels/conftest.py may already do this).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from dsv4.kernels.ref.act_quant import (  # noqa: E402
    act_dequant,
    act_quant,
    fake_act_quant,
    pow2_ceil_scale,
)
from dsv4.kernels.triton.act_quant import triton_act_quant  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _rows(n: int, d: int, seed: int = 0) -> torch.Tensor:
    """Rows whose magnitudes span 1e-6 .. 1e3, with an all-zero row and zeros in a block."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g) * torch.logspace(-6, 3, n)[:, None]
    x[0, :5] = 0.0
    x[min(2, n - 1)] = 0.0
    return x


def test_scale_is_the_smallest_power_of_two_that_fits() -> None:
    amax = torch.tensor([0.0, 1e-5, 1.0, 448.0, 448.0 * 2 ** -3, 449.0, 3e4])
    s = pow2_ceil_scale(amax)
    assert torch.equal(torch.exp2(torch.log2(s).round()), s)              # powers of two
    floor = torch.tensor(1e-4).clamp(min=1e-4)
    assert torch.equal(s[:2], pow2_ceil_scale(floor).expand(2))            # amax floored at 1e-4
    assert s[3] == 1.0 and s[4] == 2 ** -3 and s[5] == 2.0                # 448 * 2^k keeps 2^k
    fits = amax.clamp(min=1e-4) / s
    assert bool((fits <= 448).all()) and bool((fits[2:] > 224).all())


TIES = [448.0, 1.0625, 1.1875, -1.0625, 2 ** -9 * 1.5, -1e-9, 3.0]
"""With amax 448 (scale 1): ties between e4m3 neighbours (normal and subnormal) and a -0.0."""


def test_codes_round_to_nearest_even_and_dequantise() -> None:
    vals = torch.tensor(TIES + [0.0])
    codes, scale = act_quant(vals[None, :], block=8)
    assert scale.tolist() == [[1.0]]
    got = codes.float()[0].tolist()
    assert got[:7] == [448.0, 1.0, 1.25, -1.0, 2 ** -8, -0.0, 3.0]
    assert torch.signbit(codes.float()[0, 5])                             # -1e-9 -> -0.0
    x = _rows(6, 300)
    codes, scale = act_quant(x)
    assert codes.dtype == torch.float8_e4m3fn and scale.shape == (6, 3)
    back = act_dequant(codes, scale)
    # e4m3 keeps 3 mantissa bits: half an ulp is <= 2^-4 of the value (normals), or 2^-10 * s
    err = (back - x).abs()
    bound = torch.maximum(x.abs() * 2 ** -4, scale.repeat_interleave(128, 1)[:, :300] * 2 ** -10)
    assert bool((err <= bound).all())
    assert torch.equal(fake_act_quant(x), back)


def test_partial_block_uses_its_own_columns() -> None:
    x = torch.ones(2, 130)
    x[:, :128] = 100.0
    _, scale = act_quant(x)
    assert scale[:, 1].tolist() == pow2_ceil_scale(torch.ones(2)).tolist()
    with pytest.raises(ValueError, match="block"):
        act_quant(x, block=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("n,d,block", [(5, 300, 128), (33, 256, 64), (3, 128, 128)])
def test_triton_matches_reference_bit_for_bit(dtype: torch.dtype, n: int, d: int,
                                              block: int) -> None:
    x = _rows(n, d).to(dtype)
    x[1, 7] = 448.0 * 2 ** -3                      # amax / 448 exactly a power of two
    x[1, 8] = -x[1, 7] * 0.5 ** 12                 # a -0.0 code
    x[-1, :block] = 0.0                             # ties to even at scale 1 (as above)
    x[-1, :7] = torch.tensor(TIES)
    ref_codes, ref_scale = act_quant(x, block)
    codes, scale = triton_act_quant(x.to(DEVICE), block)
    assert torch.equal(scale.cpu(), ref_scale)
    assert torch.equal(codes.view(torch.uint8).cpu(), ref_codes.view(torch.uint8))


def test_triton_strided_rows_and_validation() -> None:
    wide = _rows(7, 512, seed=3).to(DEVICE)
    x = wide[:, :256]                               # rows 512 apart
    codes, scale = triton_act_quant(x)
    ref_codes, ref_scale = act_quant(x.cpu())
    assert torch.equal(codes.view(torch.uint8).cpu(), ref_codes.view(torch.uint8))
    assert torch.equal(scale.cpu(), ref_scale)
    with pytest.raises(ValueError, match="contiguous columns"):
        triton_act_quant(wide.t())
    with pytest.raises(ValueError, match="dtype"):
        triton_act_quant(wide.to(torch.int32))
    with pytest.raises(ValueError, match="power of two"):
        triton_act_quant(wide, block=96)


def test_triton_half_order() -> None:
    """`half_order`: each 128-block's codes with its even columns first, then its odd ones (the
    FP4 W8A8 loop's operand order); the scales unchanged."""
    x = _rows(5, 256, seed=4)
    codes, scale = triton_act_quant(x.to(DEVICE), half_order=True)
    ref_codes, ref_scale = act_quant(x)
    c = torch.arange(128)
    order = torch.cat([b * 128 + torch.cat((c[0::2], c[1::2])) for b in range(2)])
    assert torch.equal(scale.cpu(), ref_scale)
    assert torch.equal(codes.view(torch.uint8).cpu(), ref_codes.view(torch.uint8)[:, order])
    with pytest.raises(ValueError, match="half_order"):
        triton_act_quant(x[:, :200].to(DEVICE), half_order=True)


@pytest.mark.gpu
def test_triton_flash_batch_on_gpu() -> None:
    """A prefill-sized batch of V4-Flash activations (N 4096, d 4096) bit for bit."""
    x = (torch.randn(4096, 4096, device="cuda") * 3).to(torch.bfloat16)
    codes, scale = triton_act_quant(x)
    ref_codes, ref_scale = act_quant(x)
    assert torch.equal(scale, ref_scale)
    assert torch.equal(codes.view(torch.uint8), ref_codes.view(torch.uint8))
