"""In-register decode of one K tile of the routed-expert kernels (kernels/triton/moe.py).

`tile_dot` is the kernels' one entry: acc plus the product of an activation tile and one
[BLOCK_K, BLOCK_N] tile of W_e^T, W's scales applied, for every weight format (FMT) and inner loop
(VARIANT, `moe_plan.py::VARIANTS`):

  split (0)       FP4: the first loop: per 32-wide scale group one contiguous [16, BN] byte tile,
                  its low and high nibbles meeting the activations' even and odd columns in two
                  K = 16 dots, the group scale multiplying the [BM, BN] sum (`fp4_dot`).
  scaled (1)      FP4: the whole [BLOCK_K, BLOCK_N] tile decoded to bf16 with each group's scale
                  folded into its elements (`moe_fp4.py::fp4_tile`), the activations one contiguous
                  [BM, BLOCK_K] tile, ONE dot per K tile, accumulating in the MMA.
  dot_scaled (2)  `tl.dot_scaled` on the raw bytes (and FP4's group scales): Triton decodes; on
                  Hopper it decomposes into its own e2m1 / e4m3 upcast, a bf16 scale multiply and
                  a bf16 MMA.
  words (3)       FP4: as "scaled", decoded a 32-bit word (8 nibbles) at a time into bf16 pairs
                  (k, k + 4) scaled by one bf16x2 multiply (`fp4_tile_words`; inline PTX on the
                  GPU), the activation tile's columns permuted to match (`fp4_word_order`).
  planes (5)      FP4: the words' decode kept as 8 planes (k = 8q + 4h + r for fixed (r, h)) in
                  8 dots of K = BLOCK_K / 8, no join / reshape, so the decoded tiles can feed
                  wgmma (BLOCK_M >= 64, prefill); the activations are in `planes_activations`
                  order (`moe_fp4.py::fp4_planes_dot`).

FP8 is one dot per K tile in every variant (BLOCK_K <= 128 sits inside one 128-wide scale block),
its [BN] per-row block scale multiplying the tile's product once (`fp8_scale`; exact, a power of
two): "split", "scaled" and "words" are one loop, e4m3 -> fp32 -> bf16 (`w_tile`; on sm_90 packed
converts, fewer instructions than a direct e4m3 -> bf16 convert or dot_scaled's upcast), and
"dot_scaled" passes no scale (the block scale is applied to the product as in the others). bf16
weights have one loop. `dot` is the bf16 MMA with fp32 accumulation (fp32 "ieee" under the
interpreter or for fp32 data).
"""

from __future__ import annotations

import triton
import triton.language as tl

from dsv4.kernels.triton.moe_fp4 import (
    fp4_dot_scaled,
    fp4_planes_dot,
    fp4_tile,
    fp4_tile_words,
)


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
def tile_dot(acc, a, a_rows, a_mask, w_ptr, s_ptr, e, rows, k0,  # type: ignore[no-untyped-def]
             K, n_mask, stride_we, stride_wn, stride_se, stride_sn, FMT: tl.constexpr,
             VARIANT: tl.constexpr, FP32_DOT: tl.constexpr, BLOCK_K: tl.constexpr):
    """acc + A[:, k0:k0+BLOCK_K] @ W_e^T[k0:k0+BLOCK_K, rows], W's scales applied: [BM, BLOCK_N]
    fp32.

    a: the [BM, BLOCK_K] activation tile (unused by split and planes FP4, which load their own
    columns through a_rows, [BM, 1] row pointers, and a_mask, [BM, 1]); rows: W's output rows
    [BLOCK_N] (n_mask their bound). FMT 0 bf16 / 1 fp8 / 2 fp4; VARIANT per the module docstring
    ("words": `a` already in `fp4_word_order`). FP4 "scaled", "words", "dot_scaled" and bf16
    accumulate into `acc` inside the MMA (one fixed k order, so BLOCK_K does not change the bits;
    "planes" too, in an order that depends on BLOCK_K); FP8 and split FP4 scale each tile's
    product before adding it.
    """
    if FMT == 2:
        if VARIANT == 0:
            acc += fp4_dot(a_rows, a_mask, w_ptr, s_ptr, e, rows, k0, K, n_mask, stride_we,
                           stride_wn, stride_se, stride_sn, FP32_DOT, BLOCK_K)
        elif VARIANT == 1:
            acc = dot(a, fp4_tile(w_ptr, s_ptr, e, rows, k0, K, n_mask, stride_we, stride_wn,
                                  stride_se, stride_sn, FP32_DOT, BLOCK_K), acc, FP32_DOT)
        elif VARIANT == 2:
            acc = fp4_dot_scaled(acc, a, w_ptr, s_ptr, e, rows, k0, K, n_mask, stride_we,
                                 stride_wn, stride_se, stride_sn, BLOCK_K)
        elif VARIANT == 5:
            acc = fp4_planes_dot(acc, a_rows, a_mask, w_ptr, s_ptr, e, rows, k0, K, n_mask,
                                 stride_we, stride_wn, stride_se, stride_sn, FP32_DOT, BLOCK_K)
        else:
            acc = dot(a, fp4_tile_words(w_ptr, s_ptr, e, rows, k0, K, n_mask, stride_we,
                                        stride_wn, stride_se, stride_sn, FP32_DOT, BLOCK_K),
                      acc, FP32_DOT)
    else:
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask = (offs_k < K)[:, None] & n_mask[None, :]
        if FMT == 0:
            acc = dot(a, w_tile(w_ptr, e, rows, offs_k, mask, stride_we, stride_wn, FMT), acc,
                      FP32_DOT)
        else:
            if VARIANT == 2:
                codes = tl.load(w_ptr + e * stride_we + rows[None, :] * stride_wn
                                + offs_k[:, None], mask=mask, other=0)
                part = tl.dot_scaled(a, None, "bf16", codes, None, "e4m3")
            else:
                part = dot(a, w_tile(w_ptr, e, rows, offs_k, mask, stride_we, stride_wn, FMT),
                           tl.zeros_like(acc), FP32_DOT)
            acc += part * fp8_scale(s_ptr, e, rows // 128, k0, n_mask, stride_se,
                                    stride_sn)[None, :]
    return acc


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
    """[BM, BLOCK_N] partial product over the 32 k of one scale group [kg, kg + 32) from e2m1 bytes
    (the split variant).

    Byte j of a row holds k = 2j (low nibble) and 2j+1 (high nibble). The group's 16 bytes per row
    are loaded as one contiguous [16, BN] tile; the activations' even and odd columns meet the low
    and high nibbles in two K = 16 dots of the unscaled e2m1 values (exact in bf16), and the
    group's per-row scale multiplies the sum (a power of two: exact). a_rows: [BM, 1] row
    pointers; a_mask: [BM, 1]. K is a multiple of 32 (checked), so a group is all in or out."""
    offs_j = kg // 2 + tl.arange(0, 16)
    ke = 2 * offs_j
    k_ok = ke < K
    a_even = tl.load(a_rows + ke[None, :], mask=a_mask & k_ok[None, :], other=0.0)
    a_odd = tl.load(a_rows + ke[None, :] + 1, mask=a_mask & k_ok[None, :], other=0.0)
    raw = tl.load(w_ptr + e * stride_we + rows[None, :] * stride_wn + offs_j[:, None],
                  mask=k_ok[:, None] & n_mask[None, :], other=0).to(tl.int32)
    zero = tl.zeros((a_rows.shape[0], rows.shape[0]), dtype=tl.float32)
    part = (dot(a_even, e2m1(raw & 15), zero, FP32_DOT)
            + dot(a_odd, e2m1((raw >> 4) & 15), zero, FP32_DOT))
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
def dot(a, w, acc, FP32_DOT: tl.constexpr):  # type: ignore[no-untyped-def]
    """acc + a @ w, fp32 accumulation in the MMA."""
    if FP32_DOT:
        # NOTE: the interpreter's tl.dot mishandles bf16 (triton-lang/triton#11584); fp32 "ieee" is
        # exact here.
        return tl.dot(a.to(tl.float32), w.to(tl.float32), acc, input_precision="ieee")
    return tl.dot(a.to(tl.bfloat16), w.to(tl.bfloat16), acc)

