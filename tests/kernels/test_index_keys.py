"""FP8 indexer keys, one key per program as the compress pair kernel quantises them
(`act_quant.py`'s `pow2_ceil_scale` and `e4m3_codes` over one row), against
`kernels/ref/index_keys.py::quantize_index_keys`: the same byte for every code and the same
scale, including every e4m3 value, the midpoints between neighbours (ties to even), amax at and
just above 448 times a power of two, tiny and huge rows, and all-zero rows."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from dsv4.kernels.ref.index_keys import (
    dequantize_index_keys,
    quantize_index_keys,
    round_index_keys,
)
from dsv4.kernels.triton.act_quant import e4m3_codes, inv_pow2, pow2_ceil_scale

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
E4M3_MAX = 448.0


@triton.jit
def _rows_kernel(x_ptr, codes_ptr, scales_ptr, D: tl.constexpr,  # type: ignore[no-untyped-def]
                 BLOCK: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    mask = offs < D
    x = tl.load(x_ptr + row * D + offs, mask=mask, other=0.0)
    scale = pow2_ceil_scale(tl.max(tl.abs(x), axis=0))
    codes = e4m3_codes(x, inv_pow2(scale)).to(tl.uint8, bitcast=True)
    tl.store(codes_ptr + row * D + offs, codes, mask=mask)
    tl.store(scales_ptr + row, scale)


def _kernel_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    R, D = x.shape
    codes = torch.empty(R, D, dtype=torch.uint8, device=x.device)
    scales = torch.empty(R, dtype=torch.float32, device=x.device)
    _rows_kernel[(R,)](x, codes, scales, D=D, BLOCK=triton.next_power_of_2(D))
    return codes, scales


def _cases(D: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    rows = [torch.randn(64, D, generator=g) * torch.logspace(-30, 30, 64)[:, None]]
    # every e4m3 value and every midpoint between neighbours (ties to even), under a 448 amax
    values = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    values = values[torch.isfinite(values)].unique()
    mids = (values[1:] + values[:-1]) / 2
    grid = torch.cat((values, mids, -values, -mids))
    grid = torch.cat((grid, torch.zeros((-len(grid)) % (D - 1))))
    rows.append(torch.cat((grid.view(-1, D - 1),
                           torch.full((len(grid) // (D - 1), 1), E4M3_MAX)), dim=1))
    top = torch.zeros(4, D)
    top[:, 0] = torch.tensor([448.0, 448.0 * (1 + 2 ** -23), 448.0 * 2 ** -40, 1.75 * 2 ** 100])
    top[:, 1:] = torch.randn(4, D - 1, generator=g) * top[:, :1] / 8
    rows += [top, torch.zeros(2, D)]
    return torch.cat(rows).contiguous()


@pytest.mark.parametrize("D", [128, 96])
def test_kernel_row_matches_reference(D: int) -> None:
    x = _cases(D)
    want_codes, want_scales = quantize_index_keys(x)
    codes, scales = _kernel_rows(x.to(DEVICE))
    assert torch.equal(scales.cpu(), want_scales)
    assert torch.equal(codes.cpu(), want_codes.view(torch.uint8))


def test_round_trip_error() -> None:
    """Each value is off by at most half an e4m3 step of its binade (<= 2^-4 relative above the
    scale's normal range), the scales are powers of two, and the round trip is the dequantised
    codes."""
    x = _cases(128)
    codes, scales = quantize_index_keys(x)
    assert torch.equal(scales, torch.exp2(torch.log2(scales).round()))
    assert torch.equal(round_index_keys(x), dequantize_index_keys(codes, scales))
    err = (round_index_keys(x) - x).abs()
    normal = x.abs() >= 2 ** -6 * scales[:, None]
    assert (err[normal] <= x.abs()[normal] * 2 ** -4).all()
    assert (err[~normal] <= 2 ** -10 * scales[:, None].expand_as(x)[~normal]).all()
