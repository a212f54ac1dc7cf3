"""In-register decode of one K tile of the routed-expert kernels (kernels/triton/moe.py).

`tile_dot` is the kernels' one entry: acc plus the product of an activation tile and one
[BLOCK_K, BLOCK_N] tile of W_e^T, W's scales applied, for every weight format (FMT) and inner loop
(VARIANT, `moe_plan.py::VARIANTS`):

  split (0)       FP4: the first loop: per 32-wide scale group one contiguous [16, BN] byte tile,
                  its low and high nibbles meeting the activations' even and odd columns in two
                  K = 16 dots, the group scale multiplying the [BM, BN] sum (`fp4_dot`).
  scaled (1)      FP4: the whole [BLOCK_K, BLOCK_N] tile decoded to bf16 with each group's scale
                  folded into its elements (`fp4_tile`), the activations one contiguous
                  [BM, BLOCK_K] tile, ONE dot per K tile, accumulating in the MMA.
  dot_scaled (2)  `tl.dot_scaled` on the raw bytes (and FP4's group scales): Triton decodes; on
                  Hopper it decomposes into its own e2m1 / e4m3 upcast, a bf16 scale multiply and
                  a bf16 MMA.
  words (3)       FP4: as "scaled", decoded a 32-bit word (8 nibbles) at a time into bf16 pairs
                  (k, k + 4) scaled by one bf16x2 multiply (`fp4_tile_words`; inline PTX on the
                  GPU), the activation tile's columns permuted to match (`fp4_word_order`).

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

    a: the [BM, BLOCK_K] activation tile (unused by split FP4, which loads its own columns through
    a_rows, [BM, 1] row pointers, and a_mask, [BM, 1]); rows: W's output rows [BLOCK_N] (n_mask
    their bound). FMT 0 bf16 / 1 fp8 / 2 fp4; VARIANT per the module docstring ("words": `a`
    already in `fp4_word_order`). FP4 "scaled", "words", "dot_scaled" and bf16 accumulate into
    `acc` inside the MMA (one fixed k order, so BLOCK_K does not change the bits); FP8 and split
    FP4 scale each tile's product before adding it.
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
def fp4_tile(w_ptr, s_ptr, e, rows, k0, K, n_mask,  # type: ignore[no-untyped-def]
             stride_we, stride_wn, stride_se, stride_sn, FP32_DOT: tl.constexpr,
             BLOCK_K: tl.constexpr):
    """[BLOCK_K, BLOCK_N] bf16 tile of W_e^T[k0:k0+BLOCK_K, rows] with the group scales folded in.

    The bytes load as one [BLOCK_N, G, 16] tile (G = BLOCK_K / 32 scale groups, 16 contiguous
    bytes each; row n's bytes are contiguous), so the [BLOCK_N, G] scale codes broadcast over the
    last dim. Each nibble's 3 magnitude bits go to bf16 bits 8..6 and its sign to bit 15: that
    bf16 is exactly v * 2^-126 for the e2m1 value v (exponent 0 -> the subnormal 2^-127 = 0.5 *
    2^-126, so no special case). One bf16 multiply by 2^(s - 1) then gives v * 2^(s - 127), the
    dequantised weight, exactly: a power of two times a 2-bit-mantissa value, in bf16's normal
    range (|result| >= 2^-126) for scale codes s >= 2 and finite for s <= 128 (scales <= 2:
    |w| <= 12; checkpoint scales are ~2^-7). A code s > 128 would overflow the factor: it is
    clamped to 129, whose factor is +inf, so such a group turns the products into inf / NaN,
    never silently wrong values; s < 2 (scales < 2^-126) rounds into bf16 subnormals.
    The multiply runs in bf16 (`mul.bf16x2` on sm_90: two weights per instruction) or, with
    FP32_DOT (fp32 activations, the interpreter), in fp32 on the same bits (an fp32 tile).
    The low / high nibble halves are interleaved back into k order (byte j: k = 2j, 2j + 1) by
    `tl.join` + `tl.reshape`: [BLOCK_N, G, 16, 2] -> [BLOCK_N, BLOCK_K], then transposed.
    K is a multiple of 32 (checked), so a group is all in or out of range.
    """
    G: tl.constexpr = BLOCK_K // 32
    BLOCK_N: tl.constexpr = rows.shape[0]
    offs_g = k0 // 32 + tl.arange(0, G)
    g_mask = n_mask[:, None] & (offs_g * 32 < K)[None, :]
    codes = tl.load(s_ptr + e * stride_se + rows[:, None] * stride_sn + offs_g[None, :],
                    mask=g_mask, other=127).to(tl.uint16)
    factor = ((tl.minimum(codes, 129) + 126) << 7).to(tl.uint16)[:, :, None]
    offs_b = offs_g[None, :, None] * 16 + tl.arange(0, 16)[None, None, :]
    raw = tl.load(w_ptr + e * stride_we + rows[:, None, None] * stride_wn + offs_b,
                  mask=g_mask[:, :, None], other=0).to(tl.uint16)
    lo = (((raw & 7) << 6) | ((raw & 8) << 12)).to(tl.uint16)
    hi = (((raw & 0x70) << 2) | ((raw & 0x80) << 8)).to(tl.uint16)
    if FP32_DOT:
        w = tl.join(_f32(lo) * _f32(factor), _f32(hi) * _f32(factor))
    else:
        w = tl.join(_bf16(lo) * _bf16(factor), _bf16(hi) * _bf16(factor))
    return tl.trans(tl.reshape(w, (BLOCK_N, BLOCK_K)))


@triton.jit
def fp4_tile_words(w_ptr, s_ptr, e, rows, k0, K, n_mask,  # type: ignore[no-untyped-def]
                   stride_we, stride_wn, stride_se, stride_sn, FP32_DOT: tl.constexpr,
                   BLOCK_K: tl.constexpr):
    """`fp4_tile` decoded 32 bits at a time, its k in `fp4_word_order` (a fixed permutation within
    each 8 k; the activations' columns get the same one, so the dot is the same sum).

    A 32-bit word holds bytes 4j..4j+3 of a row: 8 nibbles, the one at bits 4r of 16-bit half h
    being k = 8j + 4h + r. One shift of the whole word moves nibble r of both halves into the bf16
    fields at once: ((x << 6 - 4r) & 0x01C001C0) | ((x << 12 - 4r) & 0x80008000) (negative:
    right shifts) is the pair (k, k + 4) as bf16 bits of v * 2^-126 (`fp4_tile`'s bias trick),
    and one `mul.rn.bf16x2` by the group factor 2^(s - 1) in both halves finishes it: ~4
    instructions per 2 weights, no per-byte unpacking, the pairs ready for the MMA. On the GPU
    (bf16 dots) that runs as inline PTX (Triton's own lowering of the same ops swaps the halves
    around the multiply); with FP32_DOT (fp32 activations, the interpreter) the same bit ops run
    as Triton ops and the multiply in fp32. Same values and scale range as `fp4_tile`.
    Rows are read as 4-byte words: the checkpoint's d / 2 and I / 2 bytes are multiples of 16.
    """
    G: tl.constexpr = BLOCK_K // 32
    BLOCK_N: tl.constexpr = rows.shape[0]
    offs_g = k0 // 32 + tl.arange(0, G)
    g_mask = n_mask[:, None] & (offs_g * 32 < K)[None, :]
    codes = tl.load(s_ptr + e * stride_se + rows[:, None] * stride_sn + offs_g[None, :],
                    mask=g_mask, other=127).to(tl.uint32)
    factor = (tl.minimum(codes, 129) + 126) << 7                     # [BN, G] bf16 bits
    words = w_ptr.to(tl.pointer_type(tl.uint32)) + (e * stride_we
                                                    + rows[:, None, None] * stride_wn) // 4
    x = tl.load(words + offs_g[None, :, None] * 4 + tl.arange(0, 4)[None, None, :],
                mask=g_mask[:, :, None], other=0)                    # [BN, G, 4] words
    if FP32_DOT:
        mag, sign = 0x01C001C0, 0x80008000
        r0 = ((x << 6) & mag) | ((x << 12) & sign)
        r1 = ((x << 2) & mag) | ((x << 8) & sign)
        r2 = ((x >> 2) & mag) | ((x << 4) & sign)
        r3 = ((x >> 6) & mag) | (x & sign)
    else:
        r0, r1, r2, r3 = tl.inline_asm_elementwise(
            _FP4_WORD_PTX, "=r,=r,=r,=r,r,r", [x, (factor | (factor << 16))[:, :, None] + 0 * x],
            dtype=(tl.uint32, tl.uint32, tl.uint32, tl.uint32), is_pure=True, pack=1)
    pairs = tl.join(tl.join(r0, r1), tl.join(r2, r3))    # [BN, G, 4, v, u]: r = 2u + v
    bits = tl.join(pairs.to(tl.uint16), (pairs >> 16).to(tl.uint16))   # [.., h]
    if FP32_DOT:
        w = _f32(bits) * _f32(factor[:, :, None, None, None, None])
    else:
        w = _bf16(bits)
    return tl.trans(tl.reshape(w, (BLOCK_N, BLOCK_K)))


# $0..$3: nibble r = 0..3 of both 16-bit halves of word $4 as bf16 pairs times $5 (the group
# factor in both halves); see `fp4_tile_words`.
_FP4_WORD_PTX = tl.constexpr("""
{
.reg .b32 a, b;
shl.b32 a, $4, 6;
shl.b32 b, $4, 12;
and.b32 a, a, 0x01C001C0;
and.b32 b, b, 0x80008000;
or.b32 a, a, b;
mul.rn.bf16x2 $0, a, $5;
shl.b32 a, $4, 2;
shl.b32 b, $4, 8;
and.b32 a, a, 0x01C001C0;
and.b32 b, b, 0x80008000;
or.b32 a, a, b;
mul.rn.bf16x2 $1, a, $5;
shr.b32 a, $4, 2;
shl.b32 b, $4, 4;
and.b32 a, a, 0x01C001C0;
and.b32 b, b, 0x80008000;
or.b32 a, a, b;
mul.rn.bf16x2 $2, a, $5;
shr.b32 a, $4, 6;
and.b32 a, a, 0x01C001C0;
and.b32 b, $4, 0x80008000;
or.b32 a, a, b;
mul.rn.bf16x2 $3, a, $5;
}
""")


@triton.jit
def fp4_word_order(a):  # type: ignore[no-untyped-def]
    """[BM, BK] activation columns in the k order of an `fp4_tile_words` tile: within each 8,
    position 4v + 2u + h holds k = 4h + 2u + v (the decoded tile's [.., v, u, h] flattened). A
    permute of each thread's 8 contiguous columns: the loads stay 16-byte vectors."""
    BM: tl.constexpr = a.shape[0]
    BK: tl.constexpr = a.shape[1]
    return tl.reshape(tl.permute(tl.reshape(a, (BM, BK // 8, 2, 2, 2)), (0, 1, 4, 3, 2)),
                      (BM, BK))


@triton.jit
def _bf16(bits):  # type: ignore[no-untyped-def]
    return bits.to(tl.bfloat16, bitcast=True)


@triton.jit
def _f32(bits):  # type: ignore[no-untyped-def]
    """The fp32 of bf16 bits (bf16 is fp32's top half). NOTE: not `.to(tl.float32)` of the bf16:
    the interpreter flushes bf16 subnormals there (and multiplies bf16 tensors as integers)."""
    return (bits.to(tl.uint32) << 16).to(tl.float32, bitcast=True)


@triton.jit
def fp4_dot_scaled(acc, a, w_ptr, s_ptr, e, rows, k0, K,  # type: ignore[no-untyped-def]
                   n_mask, stride_we, stride_wn, stride_se, stride_sn, BLOCK_K: tl.constexpr):
    """acc + a @ W_e^T tile through `tl.dot_scaled(a, None, "bf16", bytes, scales,
    "e2m1")`: bytes [BLOCK_K / 2, BLOCK_N] packed along K (low nibble first, the checkpoint's
    order), scales [BLOCK_N, BLOCK_K / 32] UE8M0 codes (not transposed: dot_scaled's rhs_scale
    layout). fast_math skips the NaN select for code 255 (no checkpoint scale is NaN). Triton's
    Hopper decomposition multiplies e2m1 values by 2^(s - 127) in bf16: exact for every code in
    [1, 254] whose products stay finite."""
    offs_j = k0 // 2 + tl.arange(0, BLOCK_K // 2)
    offs_g = k0 // 32 + tl.arange(0, BLOCK_K // 32)
    raw = tl.load(w_ptr + e * stride_we + rows[None, :] * stride_wn + offs_j[:, None],
                  mask=(offs_j * 2 < K)[:, None] & n_mask[None, :], other=0)
    codes = tl.load(s_ptr + e * stride_se + rows[:, None] * stride_sn + offs_g[None, :],
                    mask=n_mask[:, None] & (offs_g * 32 < K)[None, :], other=127)
    return tl.dot_scaled(a, None, "bf16", raw, codes, "e2m1", acc=acc, fast_math=True)


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

