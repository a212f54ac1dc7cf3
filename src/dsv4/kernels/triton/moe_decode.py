"""In-register decode of one weight tile of the routed-expert kernels (kernels/triton/moe.py).

`w_tile` loads a [BLOCK_K, BLOCK_N] tile of W_e^T as bf16 values or e4m3 codes; `fp8_scale` gives
the per-row power-of-two scale of its 128x128 block, applied to the dot product (exact); `fp4_dot`
runs the e2m1 path: per 32-wide scale group one contiguous byte tile, decoded into its low- and
high-nibble halves (`e2m1`, from bits), meeting the activations' even and odd columns in two dots.
`dot` is the bf16 MMA with fp32 accumulation (fp32 "ieee" under the interpreter).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def e8m0(code):  # type: ignore[no-untyped-def]
    # NOTE: code 0 (2^-127, a float32 subnormal) decodes to 0.0 here; no real scale is that small.
    return (code.to(tl.int32) << 23).to(tl.float32, bitcast=True)


@triton.jit
def e2m1(nib):  # type: ignore[no-untyped-def]
    """e2m1 code (int32 in [0, 16)) -> its bf16 value, assembled from bits: no int-to-float convert
    (quarter rate on sm_90) and no fp32 -> bf16 one. |v| = m / 2 for exponent 0, else
    2^(e-1) * (1 + m/2): bf16 exponent field e + 126, mantissa MSB m; sign: the code's bit 3."""
    e = (nib >> 1) & 3
    m = nib & 1
    bits = tl.where(e == 0, m * 0x3F00, ((e + 126) << 7) | (m << 6)) | ((nib & 8) << 12)
    return bits.to(tl.int16).to(tl.bfloat16, bitcast=True)


@triton.jit
def w_tile(w_ptr, e, rows, offs_k, mask, stride_we, stride_wn,  # type: ignore[no-untyped-def]
            FMT: tl.constexpr):
    """[BLOCK_K, BLOCK_N] fp32 tile of W_e^T, unscaled (rows: W's output rows): bf16 values or e4m3
    codes."""
    wbase = w_ptr + e * stride_we + rows[None, :] * stride_wn
    # NOTE: if / else, not an early return: the fp8 bitcast would be type-checked for bf16 weights
    if FMT == 0:
        w = tl.load(wbase + offs_k[:, None], mask=mask, other=0.0).to(tl.float32)
    else:
        w = tl.load(wbase + offs_k[:, None], mask=mask,
                    other=0).to(tl.float8e4nv, bitcast=True).to(tl.float32)
    return w


@triton.jit
def fp8_scale(s_ptr, e, srows, k0, n_mask, stride_se, stride_sn):  # type: ignore[no-untyped-def]
    """[BLOCK_N] 2^(code-127) of the tile's 128x128 scale blocks: one per output row, as BLOCK_K
    divides 128.

    Applied to the tile's dot product rather than to each weight: a power of two commutes exactly
    with the product, and one [BLOCK_N] load replaces a per-element scale gather (a
    [BLOCK_K, BLOCK_N] broadcast load compiles to one byte load per element)."""
    return e8m0(tl.load(s_ptr + e * stride_se + srows * stride_sn + k0 // 128, mask=n_mask,
                         other=127))


@triton.jit
def fp4_group(a_rows, a_mask, w_ptr, s_ptr, e, rows, kg, K, n_mask,  # type: ignore[no-untyped-def]
               stride_we, stride_wn, stride_se, stride_sn, FP32_DOT: tl.constexpr):
    """[BM, BLOCK_N] partial product over the 32 k of one scale group [kg, kg + 32) from e2m1 bytes.

    Byte j of a row holds k = 2j (low nibble) and 2j+1 (high nibble). The group's 16 bytes per row
    are loaded as one contiguous [16, BN] tile (no interleave: per-element byte gathers are far
    slower, benchmarks/results/cuda_graphs_h200_202611.md); the activations' even and odd columns
    meet the low and high nibbles in two K = 16 dots of the unscaled e2m1 values (exact in bf16),
    and the group's per-row scale multiplies the sum (a power of two: exact). a_rows: [BM, 1] row
    pointers; a_mask: [BM, 1]. K is a multiple of 32 (checked), so a group is all in or out."""
    offs_j = kg // 2 + tl.arange(0, 16)
    ke = 2 * offs_j
    k_ok = ke < K
    a_even = tl.load(a_rows + ke[None, :], mask=a_mask & k_ok[None, :], other=0.0)
    a_odd = tl.load(a_rows + ke[None, :] + 1, mask=a_mask & k_ok[None, :], other=0.0)
    raw = tl.load(w_ptr + e * stride_we + rows[None, :] * stride_wn + offs_j[:, None],
                  mask=k_ok[:, None] & n_mask[None, :], other=0).to(tl.int32)
    part = dot(a_even, e2m1(raw & 15), FP32_DOT) + dot(a_odd, e2m1((raw >> 4) & 15), FP32_DOT)
    in_k = (tl.zeros_like(rows) + kg) < K  # (a [BN] mask: the interpreter refuses a scalar bool)
    scale = e8m0(tl.load(s_ptr + e * stride_se + rows * stride_sn + kg // 32, mask=n_mask & in_k,
                          other=127))
    return part * scale[None, :]


@triton.jit
def fp4_dot(a_rows, a_mask, w_ptr, s_ptr, e, rows, k0, K, n_mask,  # type: ignore[no-untyped-def]
             stride_we, stride_wn, stride_se, stride_sn, FP32_DOT: tl.constexpr,
             BLOCK_K: tl.constexpr):
    """[BM, BLOCK_N] A[:, k0:k0+BLOCK_K] @ W_e^T[k0:k0+BLOCK_K, rows] as BLOCK_K / 32 groups."""
    part = fp4_group(a_rows, a_mask, w_ptr, s_ptr, e, rows, k0, K, n_mask,
                      stride_we, stride_wn, stride_se, stride_sn, FP32_DOT)
    for g in tl.static_range(1, BLOCK_K // 32):
        part += fp4_group(a_rows, a_mask, w_ptr, s_ptr, e, rows, k0 + 32 * g, K, n_mask,
                           stride_we, stride_wn, stride_se, stride_sn, FP32_DOT)
    return part


@triton.jit
def dot(a, w, FP32_DOT: tl.constexpr):  # type: ignore[no-untyped-def]
    if FP32_DOT:
        # NOTE: the interpreter's tl.dot mishandles bf16 (triton-lang/triton#11584); fp32 "ieee" is
        # exact here.
        return tl.dot(a.to(tl.float32), w.to(tl.float32), input_precision="ieee")
    return tl.dot(a.to(tl.bfloat16), w.to(tl.bfloat16))
