"""Tests for dsv4.kernels.ref.quant.

The reference decoders below are written from the format definitions with
Python floats (sign / exponent / mantissa arithmetic) and deliberately avoid
torch's own float8 conversions, so they check the codec independently.
"""

from __future__ import annotations

import math

import pytest
import torch

from dsv4.kernels.ref import quant
from dsv4.kernels.ref.quant import (
    E2M1_MAX,
    E4M3_MAX,
    FP4_GROUP,
    FP8_BLOCK,
    decode_e2m1,
    decode_e4m3,
    decode_e8m0,
    dequant_fp4_group,
    dequant_fp8_block,
    encode_e8m0,
    quant_fp4_group,
    quant_fp8_block,
)

E4M3_NAN_CODES = (0x7F, 0xFF)


# ---- independent reference decoders --------------------------------------------------------------


def ref_e8m0(code: int) -> float:
    """UE8M0: no sign, no mantissa, bias 127."""
    assert 0 <= code <= 254
    return math.ldexp(1.0, code - 127)


def ref_e4m3(code: int) -> float:
    """float8_e4m3fn: 1 sign, 4 exponent (bias 7), 3 mantissa bits."""
    sign = (code >> 7) & 1
    exp = (code >> 3) & 0xF
    man = code & 0x7
    assert not (exp == 0xF and man == 0x7), "NaN code"
    if exp == 0:
        mag = math.ldexp(man, -9)  # subnormal: man/8 * 2**-6
    else:
        mag = math.ldexp(8 + man, exp - 10)  # (1 + man/8) * 2**(exp-7)
    return -mag if sign else mag


def ref_e2m1(nibble: int) -> float:
    """FP4 e2m1: bit3 sign, bits 2..1 exponent (bias 1), bit0 mantissa."""
    sign = (nibble >> 3) & 1
    exp = (nibble >> 1) & 0x3
    man = nibble & 0x1
    if exp == 0:
        mag = 0.5 * man  # subnormal: man/2 * 2**0
    else:
        mag = (1.0 + 0.5 * man) * 2.0 ** (exp - 1)
    return -mag if sign else mag


E4M3_VALID = [c for c in range(256) if c not in E4M3_NAN_CODES]
E4M3_TABLE = torch.tensor([ref_e4m3(c) if c in E4M3_VALID else 0.0 for c in range(256)],
                          dtype=torch.float64)
E8M0_TABLE = torch.tensor([ref_e8m0(c) for c in range(255)], dtype=torch.float64)
E2M1_TABLE = torch.tensor([ref_e2m1(n) for n in range(16)], dtype=torch.float64)


def hexes(t: torch.Tensor) -> list[str]:
    return [float.hex(x) for x in t.to(torch.float64).flatten().tolist()]


def fp8_reference(w_codes: torch.Tensor, s_codes: torch.Tensor) -> torch.Tensor:
    """float64 dequant via explicit block index arithmetic."""
    rows = torch.arange(w_codes.shape[0])[:, None] // 128
    cols = torch.arange(w_codes.shape[1])[None, :] // 128
    return E4M3_TABLE[w_codes.long()] * E8M0_TABLE[s_codes.long()[rows, cols]]


def fp4_reference(packed: torch.Tensor, s_codes: torch.Tensor) -> torch.Tensor:
    p = packed.view(torch.uint8).long()
    n_out, half = p.shape
    vals = torch.empty(n_out, 2 * half, dtype=torch.float64)
    vals[:, 0::2] = E2M1_TABLE[p & 0xF]
    vals[:, 1::2] = E2M1_TABLE[p >> 4]
    cols = torch.arange(2 * half)[None, :] // 32
    return vals * E8M0_TABLE[s_codes.long()[torch.arange(n_out)[:, None], cols]]


def random_e4m3_codes(shape: tuple[int, int], gen: torch.Generator) -> torch.Tensor:
    codes = torch.randint(0, 256, shape, dtype=torch.uint8, generator=gen)
    # Replace NaN codes by a finite one of the same sign.
    return torch.where((codes & 0x7F) == 0x7F, codes - 1, codes)


# ---- scalar formats, exhaustive ------------------------------------------------------------------


@pytest.mark.parametrize("as_native", [True, False])
def test_decode_e8m0_all_codes_exact(as_native: bool) -> None:
    codes = torch.arange(255, dtype=torch.uint8)
    inp = codes.view(torch.float8_e8m0fnu) if as_native else codes
    out = decode_e8m0(inp)
    assert out.dtype == torch.float32
    assert hexes(out) == [float.hex(ref_e8m0(c)) for c in range(255)]
    assert out[0].item() == math.ldexp(1.0, -127) != 0.0
    assert out[254].item() == math.ldexp(1.0, 127)
    assert out[127].item() == 1.0


@pytest.mark.parametrize("as_native", [True, False])
def test_decode_e8m0_nan_code_raises(as_native: bool) -> None:
    codes = torch.tensor([127, 255, 3], dtype=torch.uint8)
    inp = codes.view(torch.float8_e8m0fnu) if as_native else codes
    with pytest.raises(ValueError, match="255"):
        decode_e8m0(inp)


def test_encode_e8m0_round_trip_and_range() -> None:
    exps = torch.arange(-127, 128, dtype=torch.int32)
    enc = encode_e8m0(exps)
    assert enc.dtype == torch.float8_e8m0fnu
    assert enc.view(torch.uint8).tolist() == list(range(255))
    assert hexes(decode_e8m0(enc)) == [float.hex(math.ldexp(1.0, e)) for e in range(-127, 128)]
    for bad in (-128, 128):
        with pytest.raises(ValueError):
            encode_e8m0(torch.tensor([bad]))


@pytest.mark.parametrize("as_native", [True, False])
def test_decode_e4m3_all_valid_codes_exact(as_native: bool) -> None:
    codes = torch.tensor(E4M3_VALID, dtype=torch.uint8)
    inp = codes.view(torch.float8_e4m3fn) if as_native else codes
    out = decode_e4m3(inp)
    assert out.dtype == torch.float32
    # float.hex distinguishes -0.0 (code 0x80) from 0.0.
    assert hexes(out) == [float.hex(ref_e4m3(c)) for c in E4M3_VALID]
    assert out.abs().max().item() == E4M3_MAX
    assert float.hex(decode_e4m3(torch.tensor([0x80], dtype=torch.uint8)).item()) == "-0x0.0p+0"


@pytest.mark.parametrize("code", E4M3_NAN_CODES)
@pytest.mark.parametrize("as_native", [True, False])
def test_decode_e4m3_nan_codes_raise(code: int, as_native: bool) -> None:
    codes = torch.tensor([0x38, code, 0x01], dtype=torch.uint8)
    inp = codes.view(torch.float8_e4m3fn) if as_native else codes
    with pytest.raises(ValueError, match="NaN"):
        decode_e4m3(inp)


def _e2m1_inputs() -> list[tuple[str, torch.Tensor]]:
    raw = torch.arange(256, dtype=torch.uint8)
    inputs = [("uint8", raw), ("int8", raw.view(torch.int8))]
    fp4 = getattr(torch, "float4_e2m1fn_x2", None)
    if fp4 is not None:
        inputs.append(("float4_e2m1fn_x2", raw.view(fp4)))
    return inputs


@pytest.mark.parametrize("name,packed", _e2m1_inputs(),
                         ids=lambda x: x if isinstance(x, str) else "")
def test_decode_e2m1_all_bytes_exact(name: str, packed: torch.Tensor) -> None:
    out = decode_e2m1(packed)
    assert out.dtype == torch.float32
    assert out.shape == (512,)
    expected = []
    for byte in range(256):
        expected += [float.hex(ref_e2m1(byte & 0xF)), float.hex(ref_e2m1(byte >> 4))]
    assert hexes(out) == expected
    assert torch.isfinite(out).all()


def test_decode_e2m1_nibble_order_and_batch_dims() -> None:
    # 0x71: low nibble 1 -> 0.5 (element 0), high nibble 7 -> 6.0 (element 1).
    packed = torch.tensor([[[0x71, 0x8A]], [[0x00, 0xF2]]], dtype=torch.uint8)
    out = decode_e2m1(packed)
    assert out.shape == (2, 1, 4)
    assert out[0, 0].tolist() == [0.5, 6.0, -1.0, -0.0]
    assert out[1, 0].tolist() == [0.0, 0.0, 1.0, -6.0]


# ---- dequantisation of block layouts -------------------------------------------------------------


@pytest.mark.parametrize("shape", [(130, 200), (256, 384), (1, 1), (127, 129)])
def test_dequant_fp8_block_matches_reference(shape: tuple[int, int]) -> None:
    gen = torch.Generator().manual_seed(1)
    w = random_e4m3_codes(shape, gen)
    s_shape = (math.ceil(shape[0] / 128), math.ceil(shape[1] / 128))
    s = torch.randint(100, 155, s_shape, dtype=torch.uint8, generator=gen)
    out = dequant_fp8_block(w.view(torch.float8_e4m3fn), s.view(torch.float8_e8m0fnu),
                            torch.float32)
    assert out.shape == shape and out.dtype == torch.float32
    ref = fp8_reference(w, s)
    # float64 comparison: every product is exactly representable in float32.
    assert torch.equal(out.to(torch.float64), ref)
    assert torch.equal(torch.signbit(out), torch.signbit(ref))


def test_dequant_fp8_block_casts_to_dtype() -> None:
    gen = torch.Generator().manual_seed(2)
    w = random_e4m3_codes((130, 200), gen)
    s = torch.randint(120, 135, (2, 2), dtype=torch.uint8, generator=gen)
    out = dequant_fp8_block(w, s, torch.bfloat16)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, fp8_reference(w, s).to(torch.bfloat16))


@pytest.mark.parametrize("packed_shape", [(130, 100), (4, 64), (5, 40), (1, 16)])
def test_dequant_fp4_group_matches_reference(packed_shape: tuple[int, int]) -> None:
    gen = torch.Generator().manual_seed(3)
    packed = torch.randint(0, 256, packed_shape, dtype=torch.uint8, generator=gen)
    n_in = packed_shape[1] * 2
    s = torch.randint(90, 160, (packed_shape[0], math.ceil(n_in / 32)), dtype=torch.uint8,
                      generator=gen)
    for p in (packed, packed.view(torch.int8)):
        out = dequant_fp4_group(p, s.view(torch.float8_e8m0fnu), torch.float32)
        assert out.shape == (packed_shape[0], n_in)
        ref = fp4_reference(packed, s)
        assert torch.equal(out.to(torch.float64), ref)
        assert torch.equal(torch.signbit(out), torch.signbit(ref))


def test_extreme_scale_combinations_are_finite_and_exact() -> None:
    # Smallest scale with largest / smallest-subnormal e4m3 magnitudes.
    w = torch.tensor([[0x7E, 0xFE, 0x01, 0x00]], dtype=torch.uint8)  # 448, -448, 2**-9, 0
    out = dequant_fp8_block(w, torch.tensor([[0]], dtype=torch.uint8), torch.float32)
    assert hexes(out) == [
        float.hex(448 * 2.0**-127),
        float.hex(-448 * 2.0**-127),
        float.hex(2.0**-136),
        float.hex(0.0),
    ]
    # Largest scale with zeros must give exact zeros, not NaN (0 * inf).
    zeros = torch.tensor([[0x00, 0x80]], dtype=torch.uint8)
    out = dequant_fp8_block(zeros, torch.tensor([[254]], dtype=torch.uint8), torch.float32)
    assert hexes(out) == ["0x0.0p+0", "-0x0.0p+0"]
    # Largest scale with the smallest e4m3 subnormal is finite: 2**118.
    tiny = torch.tensor([[0x01]], dtype=torch.uint8)
    out = dequant_fp8_block(tiny, torch.tensor([[254]], dtype=torch.uint8), torch.float32)
    assert out.item() == 2.0**118
    # FP4: code-0 scale with 6.0, code-254 scale with +-0 nibbles.
    p = torch.tensor([[0x07] + [0] * 15], dtype=torch.uint8)
    out = dequant_fp4_group(p, torch.tensor([[0]], dtype=torch.uint8), torch.float32)
    assert out[0, 0].item() == 6 * 2.0**-127 and not out.isnan().any()
    p = torch.tensor([[0x80] * 16], dtype=torch.uint8)
    out = dequant_fp4_group(p, torch.tensor([[254]], dtype=torch.uint8), torch.float32)
    assert (out == 0).all() and not out.isnan().any()


def test_dequant_overflow_raises() -> None:
    w = torch.tensor([[0x7E]], dtype=torch.uint8)  # 448
    with pytest.raises(ValueError, match="overflow"):
        dequant_fp8_block(w, torch.tensor([[254]], dtype=torch.uint8), torch.float32)
    with pytest.raises(ValueError, match="overflow"):
        dequant_fp8_block(w, torch.tensor([[127 + 8]], dtype=torch.uint8), torch.float16)


def test_dequant_propagates_nan_errors() -> None:
    w = torch.tensor([[0x7F]], dtype=torch.uint8)
    with pytest.raises(ValueError, match="NaN"):
        dequant_fp8_block(w, torch.tensor([[127]], dtype=torch.uint8), torch.float32)
    with pytest.raises(ValueError, match="255"):
        dequant_fp4_group(torch.zeros(1, 16, dtype=torch.uint8),
                          torch.tensor([[255]], dtype=torch.uint8), torch.float32)


def test_dequant_fp8_block_shape_mismatch_names_both_shapes() -> None:
    w = torch.zeros(130, 200, dtype=torch.uint8)
    s = torch.full((1, 2), 127, dtype=torch.uint8)
    with pytest.raises(ValueError) as err:
        dequant_fp8_block(w, s, torch.float32)
    msg = str(err.value)
    assert "[130, 200]" in msg and "[1, 2]" in msg and "[2, 2]" in msg


def test_dequant_fp4_group_shape_mismatch_names_both_shapes() -> None:
    w = torch.zeros(8, 64, dtype=torch.uint8)  # in = 128 -> 4 groups
    s = torch.full((8, 2), 127, dtype=torch.uint8)
    with pytest.raises(ValueError) as err:
        dequant_fp4_group(w, s, torch.float32)
    msg = str(err.value)
    assert "[8, 64]" in msg and "[8, 2]" in msg and "[8, 4]" in msg


def test_dequant_rejects_unsupported_dtypes() -> None:
    with pytest.raises(TypeError):
        dequant_fp8_block(torch.zeros(2, 2), torch.zeros(1, 1, dtype=torch.uint8), torch.float32)
    with pytest.raises(TypeError):
        dequant_fp8_block(torch.zeros(2, 2, dtype=torch.uint8), torch.ones(1, 1), torch.float32)


# ---- quantisation and round trips ----------------------------------------------------------------


def _is_power_of_two(t: torch.Tensor) -> bool:
    mant, _ = torch.frexp(t.to(torch.float64))
    return bool((mant == 0.5).all())


def _random_weights(shape: tuple[int, int], seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(shape, generator=gen)
    # Spread magnitudes over many binades so scales differ between blocks.
    row_scale = torch.pow(2.0, torch.randint(-20, 20, (shape[0], 1), generator=gen).float())
    return w * row_scale


def test_quant_fp8_block_round_trip() -> None:
    w = _random_weights((300, 260), seed=4)
    q, s = quant_fp8_block(w)
    assert q.dtype == torch.float8_e4m3fn and q.shape == w.shape
    assert s.dtype == torch.float8_e8m0fnu and s.shape == (3, 3)
    scale = decode_e8m0(s).to(torch.float64)
    assert _is_power_of_two(scale)

    # Scale is the smallest power of two with amax / s <= 448.
    rows = torch.arange(300)[:, None] // 128
    cols = torch.arange(260)[None, :] // 128
    block_id = (rows * 3 + cols).flatten()
    amax = (
        torch.zeros(9, dtype=torch.float64)
        .scatter_reduce(0, block_id, w.abs().to(torch.float64).flatten(), "amax")
        .view(3, 3)
    )
    assert (amax / scale <= E4M3_MAX).all()
    assert (amax / (scale / 2) > E4M3_MAX).all()

    deq = dequant_fp8_block(q, s, torch.float32).to(torch.float64)
    w64 = w.to(torch.float64)
    s_full = scale[rows, cols]
    # Round-to-nearest in e4m3: half an ulp is <= |v| * 2**-4 for normals
    # and 2**-10 (in units of the block scale) for subnormals.
    bound = torch.maximum(w64.abs() * 2.0**-4, s_full * 2.0**-10)
    assert ((deq - w64).abs() <= bound).all()
    # The block maximum lands within one e4m3 step of itself, never above 448.
    assert (q.to(torch.float32).abs() <= E4M3_MAX).all()


def test_quant_fp8_block_exact_for_representable_values() -> None:
    gen = torch.Generator().manual_seed(5)
    codes = random_e4m3_codes((130, 140), gen)
    codes[0, 0] = 0x7E  # make block amaxes reach 448 so the scale is 2**k
    codes[0, 130] = 0x7E
    codes[128, 0] = 0xFE
    codes[128, 130] = 0x7E
    k = torch.randint(-30, 30, (2, 2), generator=gen)
    w = fp8_reference(codes, (k + 127).to(torch.uint8)).to(torch.float32)
    q, s = quant_fp8_block(w)
    assert torch.equal(s.view(torch.uint8), (k + 127).to(torch.uint8))
    assert torch.equal(dequant_fp8_block(q, s, torch.float32), w)


def test_quant_fp8_block_zero_and_tiny_blocks() -> None:
    w = torch.zeros(130, 130)
    w[129, 129] = 1e-40  # float32 subnormal: below 448 * 2**-127, scale clamps
    q, s = quant_fp8_block(w)
    assert s.view(torch.uint8).tolist() == [[127, 127], [127, 0]]  # zero blocks -> 1.0
    out = dequant_fp8_block(q, s, torch.float32)
    assert not out.isnan().any()
    assert (out[:128] == 0).all()
    assert abs(out[129, 129].item() - 1e-40) <= 1e-40 * 2**-4


def test_quant_rejects_bad_input() -> None:
    for fn in (quant_fp8_block, quant_fp4_group):
        with pytest.raises(ValueError):
            fn(torch.tensor([[float("nan")] * 32]))
        with pytest.raises(ValueError):
            fn(torch.tensor([[float("inf")] * 32]))
        with pytest.raises(ValueError):
            fn(torch.zeros(32))
    with pytest.raises(ValueError, match="32"):
        quant_fp4_group(torch.zeros(2, 48))


def test_quant_fp4_group_exact_for_representable_values() -> None:
    gen = torch.Generator().manual_seed(6)
    n_out, n_in = 7, 128
    nibbles = torch.randint(0, 16, (n_out, n_in), generator=gen)
    k = torch.randint(-40, 40, (n_out, n_in // 32), generator=gen)
    w = (E2M1_TABLE[nibbles] * torch.pow(2.0, k.double()).repeat_interleave(32, dim=1)).float()
    q, s = quant_fp4_group(w)
    assert q.dtype == torch.uint8 and q.shape == (n_out, n_in // 2)
    assert s.dtype == torch.float8_e8m0fnu and s.shape == (n_out, n_in // 32)
    assert _is_power_of_two(decode_e8m0(s))
    out = dequant_fp4_group(q, s, torch.float32)
    assert torch.equal(out, w)
    assert torch.equal(torch.signbit(out), torch.signbit(w))
    # int8 storage (as in some official files) decodes identically.
    assert torch.equal(dequant_fp4_group(q.view(torch.int8), s, torch.float32), w)


def test_quant_fp4_group_rounding_ties_to_even_code() -> None:
    # With a 6.0 in the group the scale is 1, so values are rounded directly.
    vals = [6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -5.0, 0.3, 4.9, 5.1, 0.0]
    expect = [6.0, 0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, -0.0, -4.0, 0.5, 4.0, 6.0, 0.0]
    w = torch.zeros(1, 32)
    w[0, : len(vals)] = torch.tensor(vals)
    q, s = quant_fp4_group(w)
    assert s.view(torch.uint8).tolist() == [[127]]
    out = dequant_fp4_group(q, s, torch.float32)[0, : len(vals)]
    assert hexes(out) == [float.hex(v) for v in expect]
    # Low nibble first: element 0 (6.0 = code 7) and element 1 (0.0 = code 0).
    assert q[0, 0].item() == 0x07


def test_quant_fp4_group_round_trip_nearest() -> None:
    w = _random_weights((40, 256), seed=7)
    w[3, 32:64] = 0.0  # an all-zero group
    q, s = quant_fp4_group(w)
    scale = decode_e8m0(s).to(torch.float64)
    assert _is_power_of_two(scale)
    assert scale[3, 1].item() == 1.0
    w64 = w.to(torch.float64).view(40, 8, 32)
    amax = w64.abs().amax(dim=-1)
    nz = amax > 0
    assert (amax / scale <= E2M1_MAX).all()
    assert (amax[nz] / (scale[nz] / 2) > E2M1_MAX).all()

    # Brute-force nearest e2m1 value (ties are measure-zero for randn data).
    v = w64 / scale[..., None]
    dist = (v[..., None] - E2M1_TABLE).abs()
    nearest = E2M1_TABLE[dist.argmin(dim=-1)] * scale[..., None]
    out = dequant_fp4_group(q, s, torch.float32).to(torch.float64).view(40, 8, 32)
    assert torch.equal(out, nearest)
    assert ((out - w64).abs() <= scale[..., None]).all()  # largest half-gap is 1


def test_module_constants() -> None:
    assert (FP8_BLOCK, FP4_GROUP, E4M3_MAX, E2M1_MAX) == (128, 32, 448.0, 6.0)
    assert quant.__doc__
