"""Device functions: one fp32 row -> FP8 e4m3 codes (as their byte) and a power-of-two scale.

The Triton form of `kernels/ref/index_keys.py::quantize_index_keys` for a row held by one program
(the compressors' entry store: `compressor_pair.py`). Same bits as the reference: the scale's
exponent from amax's bits (`scale_exponent`), the code of x * 2^-k by integer rounding to nearest
even. The cast is spelled out in integer ops, not `.to(tl.float8e4nv)`: every implementation
(the compiled kernel, the interpreter, torch's cast) must give the same byte, and the interpreter's
fp32 -> e4m3 cast does not round to nearest.

Test: tests/kernels/test_fp8_rows.py (every e4m3 rounding case against torch's cast).
"""

from __future__ import annotations

import triton
import triton.language as tl

_MANT_175 = tl.constexpr(0x600000)      # the mantissa bits of 1.75 (448 = 1.75 * 2^8)
_MIN_NORMAL_BITS = tl.constexpr(0x3C800000)  # 2^-6, e4m3's smallest normal, as fp32 bits
_RNE_INT = tl.constexpr(8388608.0)      # 2^23: (v + 2^23) - 2^23 rounds v in [0, 2^22) to even


@triton.jit
def pow2(k):  # type: ignore[no-untyped-def]
    """2^k fp32 for int32 k in [-126, 127], from its exponent bits."""
    return ((k + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def scale_exponent(amax):  # type: ignore[no-untyped-def]
    """k (int32) of the smallest power of two with amax <= 448 * 2^k, clamped to [-126, 126]."""
    bits = amax.to(tl.int32, bitcast=True)
    e = (bits >> 23) - 127
    k = e - 8 + ((bits & 0x7FFFFF) > _MANT_175).to(tl.int32)
    return tl.minimum(tl.maximum(k, -126), 126)


@triton.jit
def e4m3_bits(v):  # type: ignore[no-untyped-def]
    """The e4m3fn byte (int32 in [0, 255]) nearest v (fp32, |v| <= 448), ties to even.

    Normal range (|v| >= 2^-6): round the 23 mantissa bits to 3 at bit 20, the carry running into
    the exponent; below it the code is the subnormal count of 2^-9, an integer rounding."""
    bits = v.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    a = bits & 0x7FFFFFFF
    r = a + 0x7FFFF + ((a >> 20) & 1)
    normal = (((r >> 23) - 120) << 3) | ((r >> 20) & 7)
    af = a.to(tl.float32, bitcast=True)
    sub = ((af * 512.0 + _RNE_INT) - _RNE_INT).to(tl.int32)
    return tl.where(a < _MIN_NORMAL_BITS, sub, normal) | sign


@triton.jit
def fp8_row(x, mask):  # type: ignore[no-untyped-def]
    """x [BLOCK] fp32 (lanes off `mask` ignored) -> (codes [BLOCK] uint8, scale fp32 scalar)."""
    amax = tl.max(tl.where(mask, tl.abs(x), 0.0), axis=0)
    k = scale_exponent(amax)
    codes = e4m3_bits(tl.where(mask, x, 0.0) * pow2(-k))
    return codes.to(tl.uint8), pow2(k)
