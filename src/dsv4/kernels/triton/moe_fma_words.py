"""The fma loop's weight words (kernels/triton/moe_fma.py): one K step's loads and their decode.

`load_words` reads a step's raw data: the [BLOCK_N, C, 4] 32-bit words (FP4: 32 nibbles per
(row, chunk); FP8: 16 codes) as one row-contiguous [BLOCK_N, 4C] tile viewed as 3-D, so a warp's
lanes run along a row's chunks and each load reads whole 128-byte lines, and the scale codes.
`decode_words` turns them into CHUNK / 4 fp32 tensors W_q of the same layout plus the scale
factors; `next_k` is the step a prefetch loads next.

FP4 (why the scale goes on the partial, not into the weights as "words" does): each nibble is
decoded straight into an fp32 as v * 2^-126 (`moe_fp4.py`'s bias trick at fp32's top: sign to
bit 31, magnitude to bits 24..22) by one AND per word pair of nibbles, then one multiply and one
AND per weight (`_at_top`), no bf16 multiply. The activations enter pre-scaled by 2^ACT_SHIFT (a
fp32 copy written once per launch: x by `fma_activations`, h by the gate/up epilogue), so the
products v * a * 2^(ACT_SHIFT - 126) stay normal, and the group factor 2^(s - 1 - ACT_SHIFT)
multiplies each 32-product partial: ~2.6 instructions per weight to decode plus 1 FFMA (+1/32);
folding the scale would add a bf16x2 multiply per pair, an unpack per weight, and force a
per-element accumulator. Exact products for |a| < 2^(128 - ACT_SHIFT) and scale codes <= 190
(2^63); a code above is clamped to 191, whose factor is inf (inf / NaN out, never a wrong finite
value), as in `moe_fp4.py`.
FP8: e4m3 -> fp32 with the packed converts (`w_tile`'s), activations unscaled; the tile's
128x128 block scale ([BLOCK_N] per K step: BLOCK_K divides 128) multiplies each chunk's partial.
"""

from __future__ import annotations

import triton
import triton.language as tl

from dsv4.kernels.triton.moe_decode import e8m0


@triton.jit
def load_words(w_ptr, s_ptr, e, rows, k0, K,  # type: ignore[no-untyped-def]
               stride_we, stride_wn, stride_se, stride_sn, FMT: tl.constexpr, C: tl.constexpr,
               ASM: tl.constexpr, EVEN_K: tl.constexpr):
    """One K step's raw data of W rows `rows` at k0: the [BLOCK_N, C, 4] uint32 words (FP4: 32
    nibbles per (n, c); FP8: 16 codes) and the scale codes (FP4: [BLOCK_N, C], one per group;
    FP8: [BLOCK_N], the row's 128x128 block: BLOCK_K divides 128). Split from the decode so a
    K loop can issue the next step's loads before it decodes this one."""
    if FMT == 2:
        offs_g = k0 // 32 + tl.arange(0, C)
        codes = _codes(s_ptr + e * stride_se + rows[:, None] * stride_sn + offs_g[None, :],
                       (offs_g * 32 < K)[None, :], ASM, EVEN_K)
        x = _words(w_ptr, e, rows, k0 // 32, K, stride_we, stride_wn, C, 32, EVEN_K)
    else:
        x = _words(w_ptr, e, rows, k0 // 16, K, stride_we, stride_wn, C, 16, EVEN_K)
        codes = tl.load(s_ptr + e * stride_se + (rows // 128) * stride_sn + k0 // 128)
    return x, codes


@triton.jit
def next_k(k0, K, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr):  # type: ignore[no-untyped-def]
    """The step a prefetch loads after k0: k0 + BLOCK_K, clamped to the last step with EVEN_K
    (unmasked loads stay in range; the last step's reload hits the cache), else past K (its
    masked loads read nothing)."""
    if EVEN_K:
        nxt = tl.minimum(k0 + BLOCK_K, K - BLOCK_K)
    else:
        nxt = k0 + BLOCK_K
    return nxt


@triton.jit
def decode_words(raw, FMT: tl.constexpr, SHIFT: tl.constexpr,  # type: ignore[no-untyped-def]
                 ASM: tl.constexpr):
    """(the CHUNK / 4 fp32 tensors W_q, their scale factors) of `load_words`' raw data."""
    if FMT == 2:
        w, factor = _fp4_weights(raw, SHIFT)
    else:
        w, factor = _fp8_weights(raw, ASM)
    return w, factor


@triton.jit
def _fp4_weights(raw, SHIFT: tl.constexpr):  # type: ignore[no-untyped-def]
    """The 8 [BLOCK_N, C, 4] fp32 tensors W_q[n, c, j] = v * 2^-126 of W row n at
    k = k0 + 32c + 8j + q (word j of group c, nibble q), and the [BLOCK_N, C] group factors
    2^(s - 1 - SHIFT), from `_load`'s words and codes. Pair r of a word: nibble r of both 16-bit
    halves (q = r, 4 + r). Groups past K (only without EVEN_K) loaded as 0 with factor 1."""
    x, codes = raw
    factor = ((tl.minimum(codes, 191) + (126 - SHIFT)) << 23).to(tl.float32, bitcast=True)
    x8 = x >> 8
    t0, t1 = x & 0x000F000F, x & 0x00F000F0          # nibble 0 / 1 of both halves
    t2, t3 = x8 & 0x000F000F, x8 & 0x00F000F0        # nibble 2 / 3
    return ((_at_top(t0, 28, 22), _at_top(t1, 24, 18), _at_top(t2, 28, 22), _at_top(t3, 24, 18),
             _at_top(t0, 12, 6), _at_top(t1, 8, 2), _at_top(t2, 12, 6), _at_top(t3, 8, 2)),
            factor)


@triton.jit
def _at_top(t, A: tl.constexpr, B: tl.constexpr):  # type: ignore[no-untyped-def]
    """fp32 v * 2^-126 of the e2m1 nibble that t * (2^A + 2^B) moves to bits 31 (sign, from copy A)
    and 24..22 (magnitude, from copy B): the bias trick of `moe_fp4.py` in an fp32. t holds one
    nibble per 16-bit half; the two copies of each never overlap (no carries), and the other
    half's copies fall outside the mask or past bit 31. One multiply (IMAD) and one AND."""
    return ((t * ((1 << A) + (1 << B))) & 0x81C00000).to(tl.float32, bitcast=True)


@triton.jit
def _words(w_ptr, e, rows, c0, K, stride_we, stride_wn,  # type: ignore[no-untyped-def]
           C: tl.constexpr, CHUNK: tl.constexpr, EVEN_K: tl.constexpr):
    """[BLOCK_N, C, 4] uint32: the 16 bytes of chunks c0 .. c0 + C - 1 (CHUNK k each) of each row,
    one 16-byte vector per thread (rows in range; chunks past K read as 0 unless EVEN_K). Loaded
    as one [BLOCK_N, 4C] row-contiguous tile, then viewed as [BLOCK_N, C, 4]: the load's layout
    puts a warp's lanes along a row's chunks (4C words = 128 bytes at C 8), so each warp reads
    whole 128-byte lines; a 3-D pointer tensor would put them across rows instead (one 16-byte
    piece of 32 rows per load)."""
    words = w_ptr.to(tl.pointer_type(tl.uint32)) + (e * stride_we + rows[:, None] * stride_wn) // 4
    cols = c0 * 4 + tl.arange(0, 4 * C)
    if EVEN_K:
        x = tl.load(words + cols[None, :])
    else:
        x = tl.load(words + cols[None, :], mask=((cols // 4) * CHUNK < K)[None, :], other=0)
    return tl.reshape(x, (rows.shape[0], C, 4))


@triton.jit
def _codes(ptrs, k_ok, ASM: tl.constexpr, EVEN_K: tl.constexpr):  # type: ignore[no-untyped-def]
    """UE8M0 codes at ptrs as uint32 (127 where not k_ok, without EVEN_K). On the GPU an inline
    `ld.global.nc.u8` per element: a tl.load is a layout anchor of its own, and its [BLOCK_N, C]
    codes would reach the words' layout through shared memory (a barrier per K step)."""
    if ASM and EVEN_K:
        codes = tl.inline_asm_elementwise("ld.global.nc.u8 $0, [$1];", "=r,l", [ptrs],
                                          dtype=tl.uint32, is_pure=True, pack=1)
    else:
        codes = tl.load(ptrs, mask=k_ok, other=127).to(tl.uint32)
    return codes


@triton.jit
def _fp8_weights(raw, ASM: tl.constexpr):  # type: ignore[no-untyped-def]
    """The 4 [BLOCK_N, C, 4] fp32 tensors W_b[n, c, j] = the e4m3 value of W row n at
    k = k0 + 16c + 4j + b (byte b of word j of chunk c), and the [BLOCK_N, 1] block scales
    2^(s - 127), from `_load`'s words and codes."""
    x, codes = raw
    if ASM:
        w0, w1, w2, w3 = tl.inline_asm_elementwise(
            _E4M3_WORD_PTX, "=r,=r,=r,=r,r", [x],
            dtype=(tl.float32, tl.float32, tl.float32, tl.float32), is_pure=True, pack=1)
    else:
        w0 = _e4m3(x)
        w1 = _e4m3(x >> 8)
        w2 = _e4m3(x >> 16)
        w3 = _e4m3(x >> 24)
    return (w0, w1, w2, w3), e8m0(codes)[:, None]


@triton.jit
def _e4m3(x):  # type: ignore[no-untyped-def]
    return (x & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32)


# $0..$3: the e4m3 bytes 0..3 of word $4 as fp32 (two packed e4m3x2 -> f16x2 converts, then
# f16 -> f32)
_E4M3_WORD_PTX = tl.constexpr("""
{
.reg .b16 l, h, a, b, c, d;
.reg .b32 lo, hi;
mov.b32 {l, h}, $4;
cvt.rn.f16x2.e4m3x2 lo, l;
cvt.rn.f16x2.e4m3x2 hi, h;
mov.b32 {a, b}, lo;
mov.b32 {c, d}, hi;
cvt.f32.f16 $0, a;
cvt.f32.f16 $1, b;
cvt.f32.f16 $2, c;
cvt.f32.f16 $3, d;
}
""")
