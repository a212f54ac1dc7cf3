"""Weight-quantisation codec for DeepSeek-V4 checkpoints (official layout).

This module owns the bit-level formats used by the released weights and the conversions between
them and ordinary float tensors:

* `e8m0` (UE8M0): unsigned power-of-two scale, value `2**(code - 127)`; code 255 is NaN.
* `e4m3` (float8_e4m3fn): FP8 weights, max finite magnitude 448; codes 0x7F / 0xFF are NaN, there
  is no infinity.
* `e2m1` (FP4): two values per byte, low nibble first, max magnitude 6; all 16 codes are finite.

and the two block layouts built on them:

* FP8 block: weight `[out, in]` e4m3, scale `[ceil(out/128), ceil(in/128)]` e8m0, one scale per
  128x128 tile (edge tiles partial).
* FP4 group: weight packed `[out, in/2]` (int8 or uint8; both are accepted on read, uint8 is
  written), scale `[out, ceil(in/32)]` e8m0, one scale per run of 32 input values.

Everything here is pure and torch-only; loading files and choosing which tensors are quantised
belong to the checkpoint code.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

FP8_BLOCK = 128
FP4_GROUP = 32
E4M3_MAX = 448.0
E2M1_MAX = 6.0

E8M0_BIAS = 127
_E8M0_MIN_EXP = -127
_E8M0_MAX_EXP = 127
_E8M0_NAN = 255
# Scale used for all-zero blocks/groups: any power of two reproduces zeros exactly, and 2**0 keeps
# the scale tensor free of surprising extremes.
_ZERO_BLOCK_EXP = 0

# e2m1 magnitudes indexed by the low three bits of a nibble.
E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)

_FP4_X2_DTYPE: torch.dtype | None = getattr(torch, "float4_e2m1fn_x2", None)


# ---- raw-byte access -----------------------------------------------------------------------------
def _raw_bytes(t: Tensor, native: torch.dtype | None, what: str) -> Tensor:
    """View `t` as uint8 codes; accept the native dtype, uint8 or int8."""
    if t.dtype == torch.uint8:
        return t
    if t.dtype == torch.int8 or (native is not None and t.dtype == native):
        return t.view(torch.uint8)
    raise TypeError(f"{what}: unsupported dtype {t.dtype}")


# ---- scalar formats ------------------------------------------------------------------------------
def decode_e8m0(scale: Tensor) -> Tensor:
    """Decode UE8M0 scales (float8_e8m0fnu or raw uint8 codes) to float32."""
    raw = _raw_bytes(scale, torch.float8_e8m0fnu, "decode_e8m0")
    if bool((raw == _E8M0_NAN).any()):
        raise ValueError("decode_e8m0: scale contains the e8m0 NaN code 255")
    # Codes >= 1 are normal float32 numbers whose exponent field *is* the code, so shifting the code
    # into the exponent bits is exact. Code 0 (2**-127) is a float32 subnormal that this
    # construction would turn into 0.0.
    bits = raw.to(torch.int32) << 23
    values = bits.view(torch.float32)
    tiny = torch.tensor(2.0**-127, dtype=torch.float32, device=raw.device)
    return torch.where(raw == 0, tiny, values)


def encode_e8m0(exponent: Tensor) -> Tensor:
    """Build float8_e8m0fnu scales `2**exponent` from integer exponents."""
    if exponent.dtype.is_floating_point or exponent.dtype == torch.bool:
        raise TypeError(f"encode_e8m0: expected an integer tensor, got {exponent.dtype}")
    if exponent.numel() and (int(exponent.min()) < _E8M0_MIN_EXP
                             or int(exponent.max()) > _E8M0_MAX_EXP):
        raise ValueError(f"encode_e8m0: exponents must lie in [{_E8M0_MIN_EXP}, {_E8M0_MAX_EXP}]")
    codes = (exponent.to(torch.int32) + E8M0_BIAS).to(torch.uint8)
    return codes.view(torch.float8_e8m0fnu)


def decode_e4m3(w: Tensor) -> Tensor:
    """Decode float8_e4m3fn weights (or raw uint8 codes) to float32."""
    raw = _raw_bytes(w, torch.float8_e4m3fn, "decode_e4m3")
    # e4m3fn spends S.1111.111 on NaN (0x7F and 0xFF); a NaN weight is corruption, so refuse it
    # instead of letting it spread through a model.
    if bool(((raw & 0x7F) == 0x7F).any()):
        raise ValueError("decode_e4m3: weight contains the e4m3fn NaN codes 0x7F/0xFF")
    return raw.view(torch.float8_e4m3fn).to(torch.float32)


def _e2m1_pair_table(device: torch.device) -> Tensor:
    """[256, 2] float32 table: byte -> (low-nibble value, high-nibble value)."""
    nibble = torch.tensor(list(E2M1_MAGNITUDES) + [-m for m in E2M1_MAGNITUDES],
                          dtype=torch.float32, device=device)
    byte = torch.arange(256, device=device)
    return torch.stack((nibble[byte & 0xF], nibble[byte >> 4]), dim=-1)


def decode_e2m1(packed: Tensor) -> Tensor:
    """Unpack FP4 `[..., n/2]` (int8/uint8/float4_e2m1fn_x2) to float32 `[..., n]`.

    Low nibble holds element 2i, high nibble element 2i+1.
    """
    raw = _raw_bytes(packed, _FP4_X2_DTYPE, "decode_e2m1")
    # One lookup per byte yields both elements already in memory order.
    pairs = _e2m1_pair_table(raw.device)[raw.long()]
    return pairs.reshape(*raw.shape[:-1], raw.shape[-1] * 2)


# ---- block layouts: dequantisation ---------------------------------------------------------------
def _apply_block_scale(values: Tensor, scale: Tensor, rows: int, cols: int) -> Tensor:
    """Multiply 2-D `values` by `scale` broadcast over `rows x cols` tiles."""
    n_out, n_in = values.shape
    g_out, g_in = scale.shape
    if n_out == g_out * rows and n_in == g_in * cols:
        # Exact tiling: broadcast through a view, no expanded scale tensor.
        tiled = values.view(g_out, rows, g_in, cols) * scale[:, None, :, None]
        return tiled.view(n_out, n_in)
    full = scale.repeat_interleave(rows, dim=0)[:n_out]
    full = full.repeat_interleave(cols, dim=1)[:, :n_in]
    return values * full


def _check_scale_shape(fn: str, weight: Tensor, scale: Tensor, expected: tuple[int, int]) -> None:
    if scale.dim() != 2 or tuple(scale.shape) != expected:
        raise ValueError(f"{fn}: scale shape {list(scale.shape)} does not match weight shape "
                         f"{list(weight.shape)} (expected scale shape {list(expected)})")


def _finish(fn: str, values: Tensor, dtype: torch.dtype) -> Tensor:
    """Cast to `dtype`, refusing results that overflow it."""
    if not dtype.is_floating_point:
        raise TypeError(f"{fn}: target dtype must be floating point, got {dtype}")
    out = values.to(dtype)
    # Inputs are NaN-free by now, so a non-finite value means overflow (e.g. a huge scale, or a
    # target like float16 with a small range).
    if not bool(torch.isfinite(out).all()):
        raise ValueError(f"{fn}: dequantised values overflow {dtype}")
    return out


def dequant_fp8_block(weight: Tensor, scale: Tensor, dtype: torch.dtype) -> Tensor:
    """FP8 e4m3 `[out, in]` with e8m0 128x128 block scales -> `dtype`."""
    if weight.dim() != 2:
        raise ValueError(f"dequant_fp8_block: weight must be 2-D, got shape {list(weight.shape)}")
    n_out, n_in = weight.shape
    expected = (math.ceil(n_out / FP8_BLOCK), math.ceil(n_in / FP8_BLOCK))
    _check_scale_shape("dequant_fp8_block", weight, scale, expected)
    values = _apply_block_scale(decode_e4m3(weight), decode_e8m0(scale), FP8_BLOCK, FP8_BLOCK)
    return _finish("dequant_fp8_block", values, dtype)


def dequant_fp4_group(weight: Tensor, scale: Tensor, dtype: torch.dtype) -> Tensor:
    """Packed FP4 `[out, in/2]` with e8m0 scales `[out, in/32]` -> `dtype`."""
    if weight.dim() != 2:
        raise ValueError(f"dequant_fp4_group: weight must be 2-D, got shape {list(weight.shape)}")
    n_out, n_in = weight.shape[0], weight.shape[1] * 2
    expected = (n_out, math.ceil(n_in / FP4_GROUP))
    _check_scale_shape("dequant_fp4_group", weight, scale, expected)
    values = _apply_block_scale(decode_e2m1(weight), decode_e8m0(scale), 1, FP4_GROUP)
    return _finish("dequant_fp4_group", values, dtype)


# ---- block layouts: quantisation -----------------------------------------------------------------
def _as_float_matrix(fn: str, w: Tensor) -> Tensor:
    if w.dim() != 2 or not w.dtype.is_floating_point:
        raise ValueError(f"{fn}: expected a 2-D floating tensor, got shape {list(w.shape)} "
                         f"dtype {w.dtype}")
    w32 = w.to(torch.float32)
    if not bool(torch.isfinite(w32).all()):
        raise ValueError(f"{fn}: input contains non-finite values (after float32 cast)")
    return w32


def _scale_exponent(amax: Tensor, qmax: float) -> Tensor:
    """Smallest integer e with `amax / 2**e <= qmax`, clamped to e8m0's range.

    Works in float64, where `qmax * 2**e` and the comparisons are exact, and corrects the log2
    estimate by one step either way so rounding in log2 can never pick a non-minimal or
    overflowing scale. Zero gets `_ZERO_BLOCK_EXP`.
    """
    a = amax.to(torch.float64)
    positive = a > 0
    safe = torch.where(positive, a, torch.ones_like(a))
    e = torch.ceil(torch.log2(safe / qmax))
    two = torch.full_like(e, 2.0)
    e = e + (safe > qmax * torch.pow(two, e)).to(e.dtype)
    e = e - (safe <= qmax * torch.pow(two, e - 1)).to(e.dtype)
    e = torch.where(positive, e, torch.full_like(e, float(_ZERO_BLOCK_EXP)))
    return e.clamp(_E8M0_MIN_EXP, _E8M0_MAX_EXP).to(torch.int32)


def _pow2(exponent: Tensor) -> Tensor:
    """Exact float32 `2**exponent` for e8m0-range integer exponents."""
    return decode_e8m0(encode_e8m0(exponent))


def quant_fp8_block(w: Tensor) -> tuple[Tensor, Tensor]:
    """Float `[out, in]` -> (e4m3 `[out, in]`, e8m0 `[ceil(out/128), ceil(in/128)]`).

    Each 128x128 block gets the smallest power-of-two scale s with `amax / s <= 448`; all-zero
    blocks get s = 1.0. Values round to nearest even in e4m3.
    """
    w32 = _as_float_matrix("quant_fp8_block", w)
    n_out, n_in = w32.shape
    g_out, g_in = math.ceil(n_out / FP8_BLOCK), math.ceil(n_in / FP8_BLOCK)
    # Zero padding never raises a block's amax, so it is safe for edge blocks.
    padded = torch.zeros(g_out * FP8_BLOCK, g_in * FP8_BLOCK, dtype=torch.float32,
                         device=w32.device)
    padded[:n_out, :n_in] = w32
    amax = padded.view(g_out, FP8_BLOCK, g_in, FP8_BLOCK).abs().amax(dim=(1, 3))
    exponent = _scale_exponent(amax, E4M3_MAX)
    scaled = _apply_block_scale(w32, 1.0 / _pow2(exponent), FP8_BLOCK, FP8_BLOCK)
    # torch's float8 cast does not saturate (out-of-range -> NaN); the scale choice keeps
    # |scaled| <= 448 except where the exponent was clamped.
    q = scaled.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return q, encode_e8m0(exponent)


def _round_e2m1_codes(v: Tensor) -> Tensor:
    """Nearest e2m1 nibble for float32 `v` with `|v| <= 6`; ties to the even code."""
    mags = torch.tensor(E2M1_MAGNITUDES, dtype=torch.float32, device=v.device)
    mids = (mags[:-1] + mags[1:]) / 2
    a = v.abs().clamp(max=E2M1_MAX)
    # bucketize(right=False) counts midpoints strictly below a, i.e. rounds ties down; bump ties up
    # when the upper neighbour's code is the even one.
    code = torch.bucketize(a, mids, right=False)
    tie = a == mids[code.clamp(max=len(mids) - 1)]
    code = code + (tie & (code % 2 == 1)).to(code.dtype)
    sign = torch.signbit(v).to(code.dtype) << 3
    return (code | sign).to(torch.uint8)


def quant_fp4_group(w: Tensor) -> tuple[Tensor, Tensor]:
    """Float `[out, in]` -> (packed uint8 `[out, in/2]`, e8m0 `[out, in/32]`).

    Each run of 32 inputs gets the smallest power-of-two scale s with `amax / s <= 6`; all-zero
    groups get s = 1.0. Values round to the nearest e2m1 value (ties to the even code) and pack low
    nibble first. Returned as uint8; readers here accept int8 as well (the official files use
    either).
    """
    w32 = _as_float_matrix("quant_fp4_group", w)
    n_out, n_in = w32.shape
    if n_in % FP4_GROUP:
        raise ValueError(f"quant_fp4_group: in-features {n_in} not a multiple of {FP4_GROUP}")
    groups = w32.view(n_out, n_in // FP4_GROUP, FP4_GROUP)
    exponent = _scale_exponent(groups.abs().amax(dim=-1), E2M1_MAX)
    scaled = groups * (1.0 / _pow2(exponent))[..., None]
    codes = _round_e2m1_codes(scaled).view(n_out, n_in // 2, 2)
    packed = codes[..., 0] | (codes[..., 1] << 4)
    return packed, encode_e8m0(exponent)
