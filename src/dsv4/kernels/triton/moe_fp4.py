"""The FP4 tile decodes of the routed-expert kernels' "scaled", "words" and "dot_scaled" loops
(`moe_decode.py::tile_dot` dispatches; `moe_plan.py` picks).

Checkpoint layout: row n of W holds its e2m1 codes two per byte, low nibble first (byte j: k = 2j,
2j + 1), and one UE8M0 code s per 32 k (the weight is v * 2^(s - 127)). Both decodes place a
nibble's 3 magnitude bits at bf16 bits 8..6 and its sign at bit 15, which is exactly v * 2^-126
(exponent 0 is the subnormal 2^-127 = 0.5 * 2^-126: no special case), and finish with one bf16
multiply by 2^(s - 1): a power of two times a 2-bit-significand value, exact in bf16's normal
range, i.e. for codes 2..128 (scales up to 2, |w| <= 12; checkpoint scales are ~2^-7). A code
above 128 is clamped to 129, whose factor is +inf: that group's products become inf / NaN rather
than wrong finite values; codes 0 and 1 (scales < 2^-126) round into bf16 subnormals. With
FP32_DOT (fp32 activations, the interpreter) the multiply runs in fp32 on the same bits.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def fp4_tile(w_ptr, s_ptr, e, rows, k0, K, n_mask,  # type: ignore[no-untyped-def]
             stride_we, stride_wn, stride_se, stride_sn, FP32_DOT: tl.constexpr,
             BLOCK_K: tl.constexpr):
    """[BLOCK_K, BLOCK_N] bf16 tile of W_e^T[k0:k0+BLOCK_K, rows] with the group scales folded in
    (the module docstring's decode, one byte at a time).

    The bytes load as one [BLOCK_N, G, 16] tile (G = BLOCK_K / 32 scale groups, 16 contiguous
    bytes each), so the [BLOCK_N, G] scale factors broadcast over the last dim; the multiply runs
    in bf16 (`mul.bf16x2` on sm_90). The low / high nibble halves are interleaved back into k
    order by `tl.join` + `tl.reshape` ([BLOCK_N, G, 16, 2] -> [BLOCK_N, BLOCK_K]), then
    transposed. K is a multiple of 32 (checked), so a group is all in or out of range.
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
    r0, r1, r2, r3 = word_pairs(x, (factor | (factor << 16))[:, :, None] + 0 * x, FP32_DOT)
    pairs = tl.join(tl.join(r0, r1), tl.join(r2, r3))    # [BN, G, 4, v, u]: r = 2u + v
    bits = tl.join(pairs.to(tl.uint16), (pairs >> 16).to(tl.uint16))   # [.., h]
    if FP32_DOT:
        w = _f32(bits) * _f32(factor[:, :, None, None, None, None])
    else:
        w = _bf16(bits)
    return tl.trans(tl.reshape(w, (BLOCK_N, BLOCK_K)))


@triton.jit
def word_pairs(x, factor2, FP32_DOT: tl.constexpr):  # type: ignore[no-untyped-def]
    """Nibble r = 0..3 of both 16-bit halves of the words x as bf16-bit pairs (k, k + 4): on the
    GPU times factor2 (the group factor in both halves, `mul.rn.bf16x2`, inline PTX); with
    FP32_DOT unscaled, as Triton bit ops (the caller multiplies in fp32)."""
    if FP32_DOT:
        mag, sign = 0x01C001C0, 0x80008000
        r0 = ((x << 6) & mag) | ((x << 12) & sign)
        r1 = ((x << 2) & mag) | ((x << 8) & sign)
        r2 = ((x >> 2) & mag) | ((x << 4) & sign)
        r3 = ((x >> 6) & mag) | (x & sign)
    else:
        r0, r1, r2, r3 = tl.inline_asm_elementwise(
            _FP4_WORD_PTX, "=r,=r,=r,=r,r,r", [x, factor2],
            dtype=(tl.uint32, tl.uint32, tl.uint32, tl.uint32), is_pure=True, pack=1)
    return r0, r1, r2, r3


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
def fp4_planes_dot(acc, a_rows, a_mask, w_ptr, s_ptr, e, rows,  # type: ignore[no-untyped-def]
                   k0, K, n_mask, stride_we, stride_wn, stride_se, stride_sn,
                   FP32_DOT: tl.constexpr, BLOCK_K: tl.constexpr):
    """acc + A[:, k0:k0+BLOCK_K] @ W_e^T tile as 8 dots of K = BLOCK_K / 8 (the "planes" loop):
    no join / reshape, so Triton can feed the decoded tiles to wgmma (BLOCK_M 64 and up).

    The tile's words load as one 2-D [BLOCK_N, BLOCK_K / 8] uint32 tile (word q of a row holds
    k = 8q + 4h + r at half h, nibble r: `fp4_tile_words`). `fp4_tile_words`' shift-and-mask
    decode yields, per nibble r, the bf16 pairs (8q + r, 8q + 4 + r): its low halves are plane
    p = 2r (k = 8q + r over q) and its high halves plane 2r + 1 (k = 8q + 4 + r). Plane p meets
    the activation columns [k0 + p * BLOCK_K / 8, ...) of A in `planes_order` (the caller's
    activations are permuted so: `planes_activations`; a_rows: [BM, 1] row pointers into them,
    a_mask [BM, 1]). The group factor is gathered per word (word q's group: q // 4). Needs
    K % BLOCK_K == 0 (the permutation is per BLOCK_K block; `plan_moe` checks)."""
    PW: tl.constexpr = BLOCK_K // 8
    offs_q = k0 // 8 + tl.arange(0, PW)
    q_mask = n_mask[:, None] & (offs_q * 8 < K)[None, :]
    codes = tl.load(s_ptr + e * stride_se + rows[:, None] * stride_sn + offs_q[None, :] // 4,
                    mask=q_mask, other=127).to(tl.uint32)
    factor = (tl.minimum(codes, 129) + 126) << 7                     # [BN, PW] bf16 bits
    words = w_ptr.to(tl.pointer_type(tl.uint32)) + (e * stride_we + rows[:, None] * stride_wn) // 4
    x = tl.load(words + offs_q[None, :], mask=q_mask, other=0)      # [BN, PW] words
    r0, r1, r2, r3 = word_pairs(x, factor | (factor << 16), FP32_DOT)
    offs_a = k0 + tl.arange(0, PW)
    acc = _plane_dot(acc, a_rows, a_mask, offs_a, 0 * PW, r0, factor, False, FP32_DOT)
    acc = _plane_dot(acc, a_rows, a_mask, offs_a, 1 * PW, r0, factor, True, FP32_DOT)
    acc = _plane_dot(acc, a_rows, a_mask, offs_a, 2 * PW, r1, factor, False, FP32_DOT)
    acc = _plane_dot(acc, a_rows, a_mask, offs_a, 3 * PW, r1, factor, True, FP32_DOT)
    acc = _plane_dot(acc, a_rows, a_mask, offs_a, 4 * PW, r2, factor, False, FP32_DOT)
    acc = _plane_dot(acc, a_rows, a_mask, offs_a, 5 * PW, r2, factor, True, FP32_DOT)
    acc = _plane_dot(acc, a_rows, a_mask, offs_a, 6 * PW, r3, factor, False, FP32_DOT)
    acc = _plane_dot(acc, a_rows, a_mask, offs_a, 7 * PW, r3, factor, True, FP32_DOT)
    return acc


@triton.jit
def _plane_dot(acc, a_rows, a_mask, offs_a, shift,  # type: ignore[no-untyped-def]
               pairs, factor, HIGH: tl.constexpr, FP32_DOT: tl.constexpr):
    """acc + A[:, offs_a + shift] @ one plane^T: the low (or HIGH) bf16 halves of `pairs`
    ([BN, PW], scaled already on the GPU; unscaled bits times `factor` in fp32 with FP32_DOT)."""
    a = tl.load(a_rows + shift + offs_a[None, :], mask=a_mask, other=0.0)
    bits = ((pairs >> 16) if HIGH else pairs).to(tl.uint16)
    if FP32_DOT:
        w = _f32(bits) * _f32(factor)
        return tl.dot(a.to(tl.float32), tl.trans(w), acc, input_precision="ieee")
    return tl.dot(a.to(tl.bfloat16), tl.trans(_bf16(bits)), acc)


def planes_activations(x: torch.Tensor, block_k: int) -> torch.Tensor:
    """x [N, K] with each BLOCK_K block's columns in "planes" order (`fp4_planes_dot`): position
    (2r + h) * BLOCK_K / 8 + q of a block holds its column 8q + 4h + r. One copy of x."""
    n, k = x.shape
    assert k % block_k == 0, (k, block_k)
    return (x.view(n, k // block_k, block_k // 8, 2, 4).permute(0, 1, 4, 3, 2)
            .reshape(n, k).contiguous())


@triton.jit
def planes_column(n, BLOCK_K: tl.constexpr):  # type: ignore[no-untyped-def]
    """Where column n of a row lands in `planes_activations` order (the gate/up epilogue stores h
    so for the down launch)."""
    rem = n % BLOCK_K
    return (n - rem) + (2 * (rem % 4) + (rem // 4) % 2) * (BLOCK_K // 8) + rem // 8


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
