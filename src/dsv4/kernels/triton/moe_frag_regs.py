"""One K step of the routed experts' "frag" loop in registers (kernels/triton/moe_frag.py, whose
docstring has the fragment layout): the lane's vector loads, the B registers from bf16
activation words, the FP4 words (or e4m3 words: `fp8_pairs`, shared with `fp8_frag.py`) decoded
into scaled bf16 pairs (A registers) and the m16n8k16 MMA as inline PTX, or, without it (the
interpreter), the same fragments as fp32 pairs and the MMA emulated in fp32 (`cols`). Every tensor
is in the [WK, WN, 8, 4] lane grid, one element per thread; the loads are inline PTX too, since a
`tl.load` would anchor another layout (`ld4`). The kernels' K steps (`gate_up_step`,
`down_step`: loads, then decode and MMAs) are here too.
"""

from __future__ import annotations

import triton
import triton.language as tl

from dsv4.kernels.triton.moe_plan import FRAG_SPLITS, FRAG_STEP

_STEP = tl.constexpr(FRAG_STEP)
_VK = tl.constexpr(FRAG_SPLITS)


@triton.jit
def ld4(ptr, ASM: tl.constexpr, L2PF: tl.constexpr,  # type: ignore[no-untyped-def]
        NA: tl.constexpr = False):
    """The 4 uint32 words at ptr (16-byte aligned): one vector load per thread on the GPU, with
    the L2 prefetch-size hint L2PF (128 or 256 bytes: the aligned block around the 16 bytes is
    fetched into L2, where the neighbouring K splits' warps find it). Inline PTX, not `tl.load`:
    a `tl.load` anchors a layout, and the inline MMA needs every tensor in the default lane grid
    (`moe_frag.py`); on the H200 `tl.load`s here gave wrong products. NA: not allocated in L1
    (for bytes read once, the weights: L1 keeps the activations, which every warp reads)."""
    if ASM and NA:
        if L2PF == 256:
            w0, w1, w2, w3 = tl.inline_asm_elementwise(
                "ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {$0, $1, $2, $3}, [$4];",
                "=r,=r,=r,=r,l", [ptr], dtype=(tl.uint32, tl.uint32, tl.uint32, tl.uint32),
                is_pure=True, pack=1)
        else:
            w0, w1, w2, w3 = tl.inline_asm_elementwise(
                "ld.global.nc.L1::no_allocate.L2::128B.v4.u32 {$0, $1, $2, $3}, [$4];",
                "=r,=r,=r,=r,l", [ptr], dtype=(tl.uint32, tl.uint32, tl.uint32, tl.uint32),
                is_pure=True, pack=1)
    elif ASM:
        if L2PF == 256:
            w0, w1, w2, w3 = tl.inline_asm_elementwise(
                "ld.global.nc.L2::256B.v4.u32 {$0, $1, $2, $3}, [$4];", "=r,=r,=r,=r,l", [ptr],
                dtype=(tl.uint32, tl.uint32, tl.uint32, tl.uint32), is_pure=True, pack=1)
        else:
            w0, w1, w2, w3 = tl.inline_asm_elementwise(
                "ld.global.nc.L2::128B.v4.u32 {$0, $1, $2, $3}, [$4];", "=r,=r,=r,=r,l", [ptr],
                dtype=(tl.uint32, tl.uint32, tl.uint32, tl.uint32), is_pure=True, pack=1)
    else:
        w0, w1, w2, w3 = tl.load(ptr), tl.load(ptr + 1), tl.load(ptr + 2), tl.load(ptr + 3)
    return w0, w1, w2, w3


@triton.jit
def scale_code(ptr, ASM: tl.constexpr):  # type: ignore[no-untyped-def]
    """One UE8M0 scale code as uint32 (an inline byte load on the GPU: no layout anchor)."""
    if ASM:
        c = tl.inline_asm_elementwise("ld.global.nc.u8 $0, [$1];", "=r,l", [ptr],
                                      dtype=tl.uint32, is_pure=True, pack=1)
    else:
        c = tl.load(ptr).to(tl.uint32)
    return c


@triton.jit
def _b_word(x0, x1, x2, x3, PAIRED: tl.constexpr,  # type: ignore[no-untyped-def]
            ASM: tl.constexpr):
    """The B registers of one 8-k word: the pairs (r, r + 4), r = 0..3, as bf16x2 bits (GPU) or
    (lo, hi) fp32. PAIRED: x0..x3 already are those pairs (h as the gate/up epilogue writes it);
    else they are the activation words (0, 1) .. (6, 7), repacked (one `prmt` each on the GPU)."""
    if ASM:
        if PAIRED:
            b = (x0, x1, x2, x3)
        else:
            b = (prmt_lo(x0, x2), prmt_hi(x0, x2), prmt_lo(x1, x3), prmt_hi(x1, x3))
    else:
        # NOTE: the interpreter re-patches builtins at every jit call: the halves are inline
        # bit casts (lo: << 16, hi: & 0xFFFF0000), no helper
        lo0 = (x0 << 16).to(tl.float32, bitcast=True)
        hi0 = (x0 & 0xFFFF0000).to(tl.float32, bitcast=True)
        lo1 = (x1 << 16).to(tl.float32, bitcast=True)
        hi1 = (x1 & 0xFFFF0000).to(tl.float32, bitcast=True)
        lo2 = (x2 << 16).to(tl.float32, bitcast=True)
        hi2 = (x2 & 0xFFFF0000).to(tl.float32, bitcast=True)
        lo3 = (x3 << 16).to(tl.float32, bitcast=True)
        hi3 = (x3 & 0xFFFF0000).to(tl.float32, bitcast=True)
        if PAIRED:
            b = ((lo0, hi0), (lo1, hi1), (lo2, hi2), (lo3, hi3))
        else:
            b = ((lo0, lo2), (hi0, hi2), (lo1, lo3), (hi1, hi3))
    return b


@triton.jit
def prmt_lo(a, b):  # type: ignore[no-untyped-def]
    """(a.lo, b.lo) as 16-bit halves: one `prmt.b32`."""
    return tl.inline_asm_elementwise("prmt.b32 $0, $1, $2, 0x5410;", "=r,r,r", [a, b],
                                     dtype=tl.uint32, is_pure=True, pack=1)


@triton.jit
def prmt_hi(a, b):  # type: ignore[no-untyped-def]
    """(a.hi, b.hi) as 16-bit halves: one `prmt.b32`."""
    return tl.inline_asm_elementwise("prmt.b32 $0, $1, $2, 0x7632;", "=r,r,r", [a, b],
                                     dtype=tl.uint32, is_pure=True, pack=1)


@triton.jit
def b_regs(row_ptr, k, PAIRED: tl.constexpr, ASM: tl.constexpr,  # type: ignore[no-untyped-def]
           L2PF: tl.constexpr, FP8: tl.constexpr):
    """The lane's B registers for its 32-k group at k: the activations x[k .. k + 32) of the row
    at row_ptr (uint32 words of bf16 pairs) as 4 words x 4 pairs (`_b_word`), or against e4m3
    codes (FP8; plain order) as 8 (b0, b1) pairs (`b_pair`)."""
    p = row_ptr + k // 2
    a0, a1, a2, a3 = ld4(p, ASM, L2PF)
    a4, a5, a6, a7 = ld4(p + 4, ASM, L2PF)
    a8, a9, a10, a11 = ld4(p + 8, ASM, L2PF)
    a12, a13, a14, a15 = ld4(p + 12, ASM, L2PF)
    if FP8:
        b = (b_pair(a0, a1, ASM), b_pair(a2, a3, ASM), b_pair(a4, a5, ASM), b_pair(a6, a7, ASM),
             b_pair(a8, a9, ASM), b_pair(a10, a11, ASM), b_pair(a12, a13, ASM),
             b_pair(a14, a15, ASM))
    else:   # (a constexpr branch: the tuples' lengths differ by design)
        b = (_b_word(a0, a1, a2, a3, PAIRED, ASM),  # type: ignore[assignment]
             _b_word(a4, a5, a6, a7, PAIRED, ASM), _b_word(a8, a9, a10, a11, PAIRED, ASM),
             _b_word(a12, a13, a14, a15, PAIRED, ASM))
    return b


@triton.jit
def _a_word(w, code, ok, ASM: tl.constexpr):  # type: ignore[no-untyped-def]
    """The 4 scaled pairs of one weight word, nibble r of both 16-bit halves (k = r, r + 4), times
    the group factor 2^(code - 1), as bf16x2 bits (GPU) or (lo, hi) fp32; the factor is 0 where
    the lane's group is past K (not ok: w was read in range, so its values are finite).
    Each pair: the nibbles isolated (one AND; the odd r from the word shifted by 8 once), one
    multiply placing two copies of each (sign to bit 15 / 31, magnitude to bits 8..6 / 24..22:
    v * 2^-126 as bf16, `moe_fp4.py`'s bias trick; the copies never overlap, so no carries) and
    one AND; then one `mul.rn.bf16x2` by 2^(code - 1) (exact; code > 128 gives inf)."""
    w8 = w >> 8
    # t * (2^A + 2^B) puts a nibble's sign (copy A) at bit 15 / 31 and its magnitude (copy B) at
    # bits 8..6 / 24..22: (A, B) = (12, 6) for nibbles at bits 0 / 16, (8, 2) at bits 4 / 20
    t0 = ((w & 0x000F000F) * ((1 << 12) + (1 << 6))) & 0x81C081C0
    t1 = ((w & 0x00F000F0) * ((1 << 8) + (1 << 2))) & 0x81C081C0
    t2 = ((w8 & 0x000F000F) * ((1 << 12) + (1 << 6))) & 0x81C081C0
    t3 = ((w8 & 0x00F000F0) * ((1 << 8) + (1 << 2))) & 0x81C081C0
    if ASM:
        f = (tl.minimum(code, 129) + 126) << 7
        f2 = tl.where(ok, f | (f << 16), 0)
        a = (hmul2(t0, f2), hmul2(t1, f2), hmul2(t2, f2), hmul2(t3, f2))
    else:
        f = tl.where(ok, ((tl.minimum(code, 129) + 126) << 23).to(tl.float32, bitcast=True), 0.0)
        a = (((t0 << 16).to(tl.float32, bitcast=True) * f,
              (t0 & 0xFFFF0000).to(tl.float32, bitcast=True) * f),
             ((t1 << 16).to(tl.float32, bitcast=True) * f,
              (t1 & 0xFFFF0000).to(tl.float32, bitcast=True) * f),
             ((t2 << 16).to(tl.float32, bitcast=True) * f,
              (t2 & 0xFFFF0000).to(tl.float32, bitcast=True) * f),
             ((t3 << 16).to(tl.float32, bitcast=True) * f,
              (t3 & 0xFFFF0000).to(tl.float32, bitcast=True) * f))
    return a


@triton.jit
def hmul2(a, f2):  # type: ignore[no-untyped-def]
    return tl.inline_asm_elementwise("mul.rn.bf16x2 $0, $1, $2;", "=r,r,r", [a, f2],
                                     dtype=tl.uint32, is_pure=True, pack=1)


@triton.jit
def cols(a, b, c, d):  # type: ignore[no-untyped-def]
    """The emulated MMA's (D[g, 2q], D[g, 2q + 1]), [.., 8 (g), 4 (q)] each, of one row half:
    D[g, n] = sum over the quad q' of a(g, q') . b(n, q') + c(g, q') . d(n, q') (a, c: A pairs,
    b, d: B pairs, (lo, hi) fp32 each [.., 8, 4] in the lane grid; B's g is the column n)."""
    # [.., 8 (g), 8 (n), 4 (q)] products a(g, q) * b(n, q), inline (no helper: see `_b_word`)
    p = ((tl.expand_dims(a[0], 3) * tl.expand_dims(b[0], 2)
          + tl.expand_dims(a[1], 3) * tl.expand_dims(b[1], 2))
         + (tl.expand_dims(c[0], 3) * tl.expand_dims(d[0], 2)
            + tl.expand_dims(c[1], 3) * tl.expand_dims(d[1], 2)))
    m = tl.sum(p, axis=4)                                     # [WK, WN, 8 (g), 8 (n)]
    return tl.split(tl.reshape(m, (m.shape[0], m.shape[1], 8, 4, 2)))


@triton.jit
def mma(acc, a0, a1, a2, a3, b0, b1, ASM: tl.constexpr):  # type: ignore[no-untyped-def]
    """acc (c0..c3) + the m16n8k16 product of A (a0 / a2: row g, a1 / a3: row g + 8) and B (b0,
    b1: column g): inline PTX on the GPU; else emulated in fp32 (`cols`)."""
    c0, c1, c2, c3 = acc
    if ASM:
        c0, c1, c2, c3 = tl.inline_asm_elementwise(
            "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {$0, $1, $2, $3}, "
            "{$4, $5, $6, $7}, {$8, $9}, {$10, $11, $12, $13};",
            "=f,=f,=f,=f,r,r,r,r,r,r,f,f,f,f", [a0, a1, a2, a3, b0, b1, c0, c1, c2, c3],
            dtype=(tl.float32, tl.float32, tl.float32, tl.float32), is_pure=True, pack=1)
    else:
        lo0, lo1 = cols(a0, b0, a2, b1)
        hi0, hi1 = cols(a1, b0, a3, b1)
        c0, c1, c2, c3 = c0 + lo0, c1 + lo1, c2 + hi0, c3 + hi1
    return c0, c1, c2, c3


@triton.jit
def matrix_step(acc, acc2, w_ptr, s_ptr, e, lo, hi, k, ok,  # type: ignore[no-untyped-def]
                 b, b2, stride_we, stride_wn, stride_se, stride_sn, NT: tl.constexpr,
                 ASM: tl.constexpr, L2PF: tl.constexpr, NA: tl.constexpr):
    """(acc, acc2) + one K step of one weight matrix: the lane's group at k of rows lo / hi
    (clamped in range), 8 MMAs with the B registers b (`b_regs`: columns 0..7) and, with NT 2,
    8 more with b2 (columns 8..15) on the same A fragments."""
    base = w_ptr + e * stride_we
    wl0, wl1, wl2, wl3 = ld4((base + lo * stride_wn + k // 2).to(tl.pointer_type(tl.uint32)),
                              ASM, L2PF, NA)
    wh0, wh1, wh2, wh3 = ld4((base + hi * stride_wn + k // 2).to(tl.pointer_type(tl.uint32)),
                              ASM, L2PF, NA)
    sbase = s_ptr + e * stride_se + k // 32
    cl = scale_code(sbase + lo * stride_sn, ASM)
    ch = scale_code(sbase + hi * stride_sn, ASM)
    for w in tl.static_range(4):
        wl = (wl0, wl1, wl2, wl3)[w]
        wh = (wh0, wh1, wh2, wh3)[w]
        al = _a_word(wl, cl, ok, ASM)
        ah = _a_word(wh, ch, ok, ASM)
        bw = b[w]
        acc = mma(acc, al[0], ah[0], al[1], ah[1], bw[0], bw[1], ASM)
        acc = mma(acc, al[2], ah[2], al[3], ah[3], bw[2], bw[3], ASM)
        if NT == 2:
            bw = b2[w]
            acc2 = mma(acc2, al[0], ah[0], al[1], ah[1], bw[0], bw[1], ASM)
            acc2 = mma(acc2, al[2], ah[2], al[3], ah[3], bw[2], bw[3], ASM)
    return acc, acc2


@triton.jit
def fp8_pairs(w, code, ok, MASK: tl.constexpr, ASM: tl.constexpr):  # type: ignore[no-untyped-def]
    """(pair A: bytes 0, 2; pair B: bytes 1, 3) of e4m3 code word w times the block factor
    2^(code - 7) (`fp8_frag.py` has the decode), as bf16x2 bits (GPU) or ((lo, hi) fp32, (lo, hi)
    fp32); MASK: the factor is 0 where not ok (a group past K, read in range)."""
    a = ((w & 0x007F007F) << 4) | ((w & 0x00800080) << 8)
    b = ((w >> 4) & 0x07F007F0) | (w & 0x80008000)
    if ASM:
        f = (tl.minimum(code, 135) + 120) << 7
        f2 = f | (f << 16)
        if MASK:
            f2 = tl.where(ok, f2, 0)
        pa, pb = hmul2(a, f2), hmul2(b, f2)
    else:
        f = ((tl.minimum(code, 135) + 120) << 23).to(tl.float32, bitcast=True)
        if MASK:
            f = tl.where(ok, f, 0.0)
        pa = ((a << 16).to(tl.float32, bitcast=True) * f,
              (a & 0xFFFF0000).to(tl.float32, bitcast=True) * f)
        pb = ((b << 16).to(tl.float32, bitcast=True) * f,
              (b & 0xFFFF0000).to(tl.float32, bitcast=True) * f)
    return pa, pb


@triton.jit
def b_pair(x0, x1, ASM: tl.constexpr):  # type: ignore[no-untyped-def]
    """The FP8 decode's B registers (x[4w], x[4w + 2]), (x[4w + 1], x[4w + 3]) from the activation
    words x0 = (x[4w], x[4w + 1]), x1 = (x[4w + 2], x[4w + 3])."""
    if ASM:
        b = (prmt_lo(x0, x1), prmt_hi(x0, x1))
    else:
        # NOTE: inline bit casts, no helper (the interpreter re-patches builtins per jit call)
        b = (((x0 << 16).to(tl.float32, bitcast=True), (x1 << 16).to(tl.float32, bitcast=True)),
             ((x0 & 0xFFFF0000).to(tl.float32, bitcast=True),
              (x1 & 0xFFFF0000).to(tl.float32, bitcast=True)))
    return b


@triton.jit
def fp8_code(row_ptr, k, ASM: tl.constexpr):  # type: ignore[no-untyped-def]
    """The UE8M0 code of the 128-k block at k of the FP8 scale row at row_ptr."""
    return scale_code(row_ptr + k // 128, ASM)


@triton.jit
def matrix_step_fp8(acc, acc2, w_ptr, s_ptr, e, lo, hi, k, ok,  # type: ignore[no-untyped-def]
                    b, b2, stride_we, stride_wn, stride_se, stride_sn, NT: tl.constexpr,
                    ASM: tl.constexpr, L2PF: tl.constexpr, NA: tl.constexpr):
    """`matrix_step` for e4m3 codes: the lane's 32 codes at k of rows lo / hi (8 words each, two
    16-byte loads), each row's 128 x 128 block code, 8 MMAs with the B pairs b (`b_regs`' FP8
    form; NT 2: 8 more with b2)."""
    base = w_ptr + e * stride_we
    rl = (base + lo * stride_wn + k).to(tl.pointer_type(tl.uint32))
    rh = (base + hi * stride_wn + k).to(tl.pointer_type(tl.uint32))
    l0, l1, l2, l3 = ld4(rl, ASM, L2PF, NA)
    l4, l5, l6, l7 = ld4(rl + 4, ASM, L2PF, NA)
    h0, h1, h2, h3 = ld4(rh, ASM, L2PF, NA)
    h4, h5, h6, h7 = ld4(rh + 4, ASM, L2PF, NA)
    sbase = s_ptr + e * stride_se
    cl = fp8_code(sbase + (lo // 128) * stride_sn, k, ASM)
    ch = fp8_code(sbase + (hi // 128) * stride_sn, k, ASM)
    ls = (l0, l1, l2, l3, l4, l5, l6, l7)
    hs = (h0, h1, h2, h3, h4, h5, h6, h7)
    for w in tl.static_range(8):
        la, lb = fp8_pairs(ls[w], cl, ok, True, ASM)
        ha, hb = fp8_pairs(hs[w], ch, ok, True, ASM)
        bw = b[w]
        acc = mma(acc, la, ha, lb, hb, bw[0], bw[1], ASM)
        if NT == 2:
            bw = b2[w]
            acc2 = mma(acc2, la, ha, lb, hb, bw[0], bw[1], ASM)
    return acc, acc2


@triton.jit
def lane_k(s, v, q, K):  # type: ignore[no-untyped-def]
    """(first k of the lane's group in K step s of virtual split v, in range): split v takes steps
    v, v + VK, ...; a group past K reads group 0 (in range, its factor zeroed)."""
    k = (s * _VK + v) * _STEP + 32 * q
    ok = k < K
    return tl.where(ok, k, 0), ok


@triton.jit
def gate_up_step(g, g2, u, u2, x_row, x_row2, w1_ptr, w3_ptr,  # type: ignore[no-untyped-def]
                  s1_ptr, s3_ptr, e, lo, hi, s, v, q, K, stride_we, stride_wn, stride_se,
                  stride_sn, NT: tl.constexpr, ASM: tl.constexpr, L2PF: tl.constexpr,
                  FP8: tl.constexpr, NA: tl.constexpr):
    """(g, g2, u, u2) + K step s of virtual split v of both matrices (g2 / u2: columns 8..15);
    FP8: e4m3 codes (`matrix_step_fp8`), else FP4; NA: the weights' loads skip L1 (`ld4`)."""
    k, ok = lane_k(s, v, q, K)
    if FP8:
        bf = b_regs(x_row, k, False, ASM, L2PF, True)
        bf2 = b_regs(x_row2, k, False, ASM, L2PF, True) if NT == 2 else bf
        g, g2 = matrix_step_fp8(g, g2, w1_ptr, s1_ptr, e, lo, hi, k, ok, bf, bf2, stride_we,
                                stride_wn, stride_se, stride_sn, NT, ASM, L2PF, NA)
        u, u2 = matrix_step_fp8(u, u2, w3_ptr, s3_ptr, e, lo, hi, k, ok, bf, bf2, stride_we,
                                stride_wn, stride_se, stride_sn, NT, ASM, L2PF, NA)
    else:
        b = b_regs(x_row, k, False, ASM, L2PF, False)
        b2 = b_regs(x_row2, k, False, ASM, L2PF, False) if NT == 2 else b
        g, g2 = matrix_step(g, g2, w1_ptr, s1_ptr, e, lo, hi, k, ok, b, b2, stride_we,
                            stride_wn, stride_se, stride_sn, NT, ASM, L2PF, NA)
        u, u2 = matrix_step(u, u2, w3_ptr, s3_ptr, e, lo, hi, k, ok, b, b2, stride_we,
                            stride_wn, stride_se, stride_sn, NT, ASM, L2PF, NA)
    return g, g2, u, u2


@triton.jit
def down_step(a, a2, h_row, h_row2, w_ptr, s_ptr, e, lo, hi,  # type: ignore[no-untyped-def]
               s, v, q, K, stride_we, stride_wn, stride_se, stride_sn, NT: tl.constexpr,
               ASM: tl.constexpr, L2PF: tl.constexpr, FP8: tl.constexpr, NA: tl.constexpr):
    """(a, a2) + K step s of virtual split v (a2: columns 8..15); FP8: e4m3 codes, h in plain
    order (the FP4 loop's gate/up stores it paired: `b_regs`)."""
    k, ok = lane_k(s, v, q, K)
    if FP8:
        bf = b_regs(h_row, k, False, ASM, L2PF, True)
        bf2 = b_regs(h_row2, k, False, ASM, L2PF, True) if NT == 2 else bf
        a, a2 = matrix_step_fp8(a, a2, w_ptr, s_ptr, e, lo, hi, k, ok, bf, bf2, stride_we,
                                stride_wn, stride_se, stride_sn, NT, ASM, L2PF, NA)
    else:
        b = b_regs(h_row, k, True, ASM, L2PF, False)
        b2 = b_regs(h_row2, k, True, ASM, L2PF, False) if NT == 2 else b
        a, a2 = matrix_step(a, a2, w_ptr, s_ptr, e, lo, hi, k, ok, b, b2, stride_we, stride_wn,
                            stride_se, stride_sn, NT, ASM, L2PF, NA)
    return a, a2
