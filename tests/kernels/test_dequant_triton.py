"""Checkpoint weights decoded by the Triton kernels (`kernels/triton/dequant.py`) bit for bit
against the codec (`ref/quant.py`): FP4 groups and FP8 blocks, single matrices and stacks, edge
tiles, every code, and the `out=` buffer (CPU: the interpreter; `-m gpu`: V4-Flash-sized experts).

    PYTHONPATH=src python -m pytest -q tests/kernels/test_dequant_triton.py
"""

from __future__ import annotations

import os

import torch

# NOTE: must precede the first `import triton` (tests/kernels/conftest.py may already do this).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from dsv4.kernels.ref.quant import (  # noqa: E402
    dequant_fp4_group,
    dequant_fp8_block,
    quant_fp4_group,
    quant_fp8_block,
)
from dsv4.kernels.triton.dequant import (  # noqa: E402
    triton_dequant_fp4_group,
    triton_dequant_fp8_block,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _fp4(E: int, out: int, inp: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Every byte (so every code pair) and scales over 2^-12 .. 2^11, stacked E deep."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randint(0, 256, (E, out, inp // 2), generator=g, dtype=torch.uint8)
    s = torch.randint(115, 139, (E, out, -(-inp // 32)), generator=g, dtype=torch.uint8)
    return w.to(DEVICE), s.to(DEVICE)


def _fp8(E: int, out: int, inp: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Every finite e4m3 code (NaN codes 0x7F / 0xFF never drawn), block scales 2^-12 .. 2^11."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 0x7F, (E, out, inp), generator=g, dtype=torch.uint8)
    codes |= torch.randint(0, 2, codes.shape, generator=g, dtype=torch.uint8) << 7
    s = torch.randint(115, 139, (E, -(-out // 128), -(-inp // 128)), generator=g,
                      dtype=torch.uint8)
    return codes.view(torch.float8_e4m3fn).to(DEVICE), s.to(DEVICE)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("E", "out", "inp"), [(1, 5, 64), (3, 33, 544), (2, 16, 96)])
def test_fp4_bit_equal(E: int, out: int, inp: int, dtype: torch.dtype) -> None:
    w, s = _fp4(E, out, inp, seed=E + out)
    got = triton_dequant_fp4_group(w, s, dtype)
    assert got.shape == (E, out, inp) and got.dtype == dtype
    for e in range(E):
        assert torch.equal(got[e], dequant_fp4_group(w[e], s[e], dtype)), e
    assert torch.equal(triton_dequant_fp4_group(w[E - 1], s[E - 1], dtype), got[E - 1])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("E", "out", "inp"), [(1, 5, 64), (3, 200, 300), (2, 128, 256)])
def test_fp8_bit_equal(E: int, out: int, inp: int, dtype: torch.dtype) -> None:
    w, s = _fp8(E, out, inp, seed=E + out)
    got = triton_dequant_fp8_block(w, s, dtype)
    assert got.shape == (E, out, inp) and got.dtype == dtype
    for e in range(E):
        assert torch.equal(got[e], dequant_fp8_block(w[e], s[e], dtype)), e
    assert torch.equal(triton_dequant_fp8_block(w[0], s[0], dtype), got[0])


def test_round_trip_of_quantised_weights() -> None:
    """A float weight encoded by the checkpoint codec decodes to the codec's own dequantisation."""
    g = torch.Generator().manual_seed(3)
    w = torch.randn(130, 256, generator=g)
    codes, scale = quant_fp4_group(w)
    assert torch.equal(triton_dequant_fp4_group(codes.to(DEVICE), scale.to(DEVICE),
                                                torch.float32).cpu(),
                       dequant_fp4_group(codes, scale, torch.float32))
    codes8, scale8 = quant_fp8_block(w)
    assert torch.equal(triton_dequant_fp8_block(codes8.to(DEVICE), scale8.to(DEVICE),
                                                torch.float32).cpu(),
                       dequant_fp8_block(codes8, scale8, torch.float32))


def test_out_buffer_is_written_in_place() -> None:
    w, s = _fp4(2, 8, 64, seed=1)
    buf = torch.full((2, 8, 64), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    got = triton_dequant_fp4_group(w, s, torch.bfloat16, out=buf)
    assert got.data_ptr() == buf.data_ptr() and not torch.isnan(buf).any()
    w8, s8 = _fp8(1, 8, 64, seed=2)
    buf8 = torch.empty(8, 64, dtype=torch.bfloat16, device=DEVICE)
    assert triton_dequant_fp8_block(w8[0], s8[0], torch.bfloat16, out=buf8).data_ptr() == \
        buf8.data_ptr()


def test_bad_arguments_name_the_problem() -> None:
    w, s = _fp4(1, 8, 64, seed=0)
    with pytest.raises(ValueError, match="does not fit"):
        triton_dequant_fp4_group(w, s[..., :1], torch.bfloat16)
    with pytest.raises(ValueError, match="allowed"):
        triton_dequant_fp4_group(w, s, torch.int32)
    with pytest.raises(ValueError, match="must be"):
        triton_dequant_fp4_group(w, s, torch.bfloat16,
                                 out=torch.empty(1, 8, 32, dtype=torch.bfloat16, device=DEVICE))
    with pytest.raises(TypeError, match="one-byte"):
        triton_dequant_fp8_block(torch.zeros(8, 8, device=DEVICE), s[0], torch.bfloat16)


@pytest.mark.gpu
def test_v4_flash_experts_on_gpu() -> None:
    """One V4-Flash MoE layer's FP4 w2 stack (256 x [4096, 2048]) and an FP8 stack, bit-equal on
    sampled experts."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    w, s = _fp4(256, 4096, 2048, seed=7)
    got = triton_dequant_fp4_group(w, s, torch.bfloat16)
    for e in (0, 131, 255):
        assert torch.equal(got[e], dequant_fp4_group(w[e], s[e], torch.bfloat16)), e
    w8, s8 = _fp8(8, 4096, 2048, seed=8)
    got8 = triton_dequant_fp8_block(w8, s8, torch.bfloat16)
    for e in (0, 7):
        assert torch.equal(got8[e], dequant_fp8_block(w8[e], s8[e], torch.bfloat16)), e
