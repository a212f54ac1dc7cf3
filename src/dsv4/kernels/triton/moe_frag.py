"""The routed experts' "frag" loop (kernels/triton/moe.py): FP4 weights decoded in registers
straight into mma.sync A fragments, no shared memory; up to 8 rows of one expert per program.

Why: at decode each expert holds ~1 row, and the "fma" loop (`moe_fma.py`) spends ~3.6 CUDA-core
instructions per weight (decode ~2.6, one FFMA); its kernels issue on about half their cycles and
run at 2.2x their byte floor (benchmarks/results/quant_moe_h200_202612.md). Here a pair of weights
costs ~4 instructions (one AND, one multiply and one AND place both nibbles: `moe_fp4.py`'s bias
trick; then one `mul.rn.bf16x2` by the group scale) and the multiply-adds run on the tensor
cores: one m16n8k16 per 256 weights of a warp, whose 8 columns are up to 8 rows of the expert.

Fragments, read from the checkpoint's layout as it is (no re-layout; byte j of a row holds
k = 2j, 2j + 1). A warp owns 16 weight rows; lane (g, q) = (lane / 4, lane % 4) holds rows g and
g + 8 (its A fragment rows) and, per K step of STEP = 128 k, the 32-k scale group k0 + 32q .. of
each: one 16-byte vector per row and matrix (a quad's 4 lanes read 64 contiguous bytes of a row),
and one scale code per row. Word w of that group (k = 8w .. 8w + 7) decodes into 4 bf16 pairs
(nibble r of both halves: k = 8w + r, 8w + r + 4), scaled by the group factor; pairs 0, 1 feed one
mma (a0 / a2 from row g, a1 / a3 from row g + 8) and pairs 2, 3 a second one. An MMA's 16 k slots
are thus 4 lanes x 4 k of 4 different groups: the dot product does not care which k sits in which
slot as long as B holds the same activations there, so lane (g, q) builds its B registers (column
g) from the same k: the activations x[k0 + 32q ..] of tile row g as bf16 words, repacked into the
pairs (k, k + 4) (h: written in that order by the gate/up epilogue). D's c0 / c1 are then rows g's
partial sums for tile rows 2q / 2q + 1, c2 / c3 row g + 8's.

A program is one (token, k) slot (BLOCK_M 1: no tile map; every column is the slot's row and the
7 copies are never stored) or one tile of the tile map (BLOCK_M 8: up to 8 sorted rows of one
expert; columns past the tile's end repeat its last row, unstored), times WK x WN warps: WN row
blocks of 16 (BLOCK_N = 16 WN) and WK warps splitting the K steps (warp wk takes steps wk,
wk + WK, ...: neighbouring warps read neighbouring bytes), summed across warps (`tl.sum` over the
warp axis) before the epilogue. Every tensor is [WK, WN, 8, 4] (or broadcast to it), one element
per thread: Triton's default layout puts lane 4g + q at [., ., g, q] and the warps on the first
two axes, which is what the inline-PTX mma assumes (no load or store anchors another layout before
the sum; `benchmarks/aot_compile_sm90.py` shows the layouts; the GPU parity tests check the
products).

Bits: a row's sum runs over fixed steps, lanes and MMA slots that depend only on (K, WK), never on
N, BLOCK_M or the other columns (an MMA column's sum never sees the others), so a token's output
does not depend on its batch. The gate/up epilogue writes h = swiglu(g, u) * w rounded to bf16
(row: the sorted row; BLOCK_M 1: the slot). Without the inline PTX (the interpreter) the same
fragments are formed and the MMA is emulated in fp32 (`_cols`): the same values up to fp32
summation order.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_wait

from dsv4.kernels.triton.moe_plan import FRAG_ROWS, MoePlan, frag_warps
from dsv4.kernels.triton.moe_plan import FRAG_STEP as STEP
from dsv4.kernels.triton.moe_tile_map import TileMap
from dsv4.kernels.triton.pdl import pdl_args
from dsv4.kernels.triton.swiglu import swiglu_f32

_STEP = tl.constexpr(STEP)
_ROWS = tl.constexpr(FRAG_ROWS)


@triton.jit
def _lanes(WK: tl.constexpr, WN: tl.constexpr):  # type: ignore[no-untyped-def]
    """The [WK, WN, 8, 4] grid's index tensors (warp along K, warp along N, g, q)."""
    wk = tl.arange(0, WK)[:, None, None, None]
    wn = tl.arange(0, WN)[None, :, None, None]
    g = tl.arange(0, 8)[None, None, :, None]
    q = tl.arange(0, 4)[None, None, None, :]
    return wk, wn, g, q


@triton.jit
def _ld4(ptr, ASM: tl.constexpr):  # type: ignore[no-untyped-def]
    """The 4 uint32 words at ptr (16-byte aligned): one vector load per thread on the GPU."""
    if ASM:
        w0, w1, w2, w3 = tl.inline_asm_elementwise(
            "ld.global.nc.v4.u32 {$0, $1, $2, $3}, [$4];", "=r,=r,=r,=r,l", [ptr],
            dtype=(tl.uint32, tl.uint32, tl.uint32, tl.uint32), is_pure=True, pack=1)
    else:
        w0, w1, w2, w3 = tl.load(ptr), tl.load(ptr + 1), tl.load(ptr + 2), tl.load(ptr + 3)
    return w0, w1, w2, w3


@triton.jit
def _code(ptr, ASM: tl.constexpr):  # type: ignore[no-untyped-def]
    """One UE8M0 scale code as uint32 (an inline byte load on the GPU: no layout anchor)."""
    if ASM:
        c = tl.inline_asm_elementwise("ld.global.nc.u8 $0, [$1];", "=r,l", [ptr],
                                      dtype=tl.uint32, is_pure=True, pack=1)
    else:
        c = tl.load(ptr).to(tl.uint32)
    return c


@triton.jit
def _f32(bits):  # type: ignore[no-untyped-def]
    """The fp32 of the bf16 in the low 16 bits."""
    return ((bits & 0xFFFF) << 16).to(tl.float32, bitcast=True)


@triton.jit
def _b_word(x0, x1, x2, x3, PAIRED: tl.constexpr,  # type: ignore[no-untyped-def]
            ASM: tl.constexpr):
    """The B registers of one 8-k word: the pairs (r, r + 4), r = 0..3, as bf16x2 bits (GPU) or
    (lo, hi) fp32. PAIRED: x0..x3 already are those pairs (h as the gate/up epilogue writes it);
    else they are the activation words (0, 1) .. (6, 7), repacked (one `prmt` each on the GPU)."""
    if PAIRED:
        if ASM:
            b = (x0, x1, x2, x3)
        else:
            b = ((_f32(x0), _f32(x0 >> 16)), (_f32(x1), _f32(x1 >> 16)),
                 (_f32(x2), _f32(x2 >> 16)), (_f32(x3), _f32(x3 >> 16)))
    elif ASM:
        b = (_prmt_lo(x0, x2), _prmt_hi(x0, x2), _prmt_lo(x1, x3), _prmt_hi(x1, x3))
    else:
        b = ((_f32(x0), _f32(x2)), (_f32(x0 >> 16), _f32(x2 >> 16)),
             (_f32(x1), _f32(x3)), (_f32(x1 >> 16), _f32(x3 >> 16)))
    return b


@triton.jit
def _prmt_lo(a, b):  # type: ignore[no-untyped-def]
    """(a.lo, b.lo) as 16-bit halves: one `prmt.b32`."""
    return tl.inline_asm_elementwise("prmt.b32 $0, $1, $2, 0x5410;", "=r,r,r", [a, b],
                                     dtype=tl.uint32, is_pure=True, pack=1)


@triton.jit
def _prmt_hi(a, b):  # type: ignore[no-untyped-def]
    """(a.hi, b.hi) as 16-bit halves: one `prmt.b32`."""
    return tl.inline_asm_elementwise("prmt.b32 $0, $1, $2, 0x7632;", "=r,r,r", [a, b],
                                     dtype=tl.uint32, is_pure=True, pack=1)


@triton.jit
def _b_regs(row_ptr, k, PAIRED: tl.constexpr, ASM: tl.constexpr):  # type: ignore[no-untyped-def]
    """The lane's B registers for its 32-k group at k (4 words x 4 pairs): the activations
    x[k .. k + 32) of the row at row_ptr (uint32 words of bf16 pairs; `_b_word`)."""
    p = row_ptr + k // 2
    a0, a1, a2, a3 = _ld4(p, ASM)
    a4, a5, a6, a7 = _ld4(p + 4, ASM)
    a8, a9, a10, a11 = _ld4(p + 8, ASM)
    a12, a13, a14, a15 = _ld4(p + 12, ASM)
    return (_b_word(a0, a1, a2, a3, PAIRED, ASM), _b_word(a4, a5, a6, a7, PAIRED, ASM),
            _b_word(a8, a9, a10, a11, PAIRED, ASM), _b_word(a12, a13, a14, a15, PAIRED, ASM))


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
    t = (_place(w & 0x000F000F, 12, 6), _place(w & 0x00F000F0, 8, 2),
         _place(w8 & 0x000F000F, 12, 6), _place(w8 & 0x00F000F0, 8, 2))
    if ASM:
        f = (tl.minimum(code, 129) + 126) << 7
        f2 = tl.where(ok, f | (f << 16), 0)
        a = (_hmul2(t[0], f2), _hmul2(t[1], f2), _hmul2(t[2], f2), _hmul2(t[3], f2))
    else:
        f = tl.where(ok, ((tl.minimum(code, 129) + 126) << 23).to(tl.float32, bitcast=True), 0.0)
        a = ((_f32(t[0]) * f, _f32(t[0] >> 16) * f), (_f32(t[1]) * f, _f32(t[1] >> 16) * f),
             (_f32(t[2]) * f, _f32(t[2] >> 16) * f), (_f32(t[3]) * f, _f32(t[3] >> 16) * f))
    return a


@triton.jit
def _place(t, A: tl.constexpr, B: tl.constexpr):  # type: ignore[no-untyped-def]
    """bf16x2 bits of the nibbles t holds, one per 16-bit half: t * (2^A + 2^B) puts the sign
    (copy A) at bit 15 / 31 and the magnitude (copy B) at bits 8..6 / 24..22."""
    return (t * ((1 << A) + (1 << B))) & 0x81C081C0


@triton.jit
def _hmul2(a, f2):  # type: ignore[no-untyped-def]
    return tl.inline_asm_elementwise("mul.rn.bf16x2 $0, $1, $2;", "=r,r,r", [a, f2],
                                     dtype=tl.uint32, is_pure=True, pack=1)


@triton.jit
def _cols(a, b, c, d):  # type: ignore[no-untyped-def]
    """The emulated MMA's (D[g, 2q], D[g, 2q + 1]), [.., 8 (g), 4 (q)] each, of one row half:
    D[g, n] = sum over the quad q' of a(g, q') . b(n, q') + c(g, q') . d(n, q') (a, c: A pairs,
    b, d: B pairs, (lo, hi) fp32 each [.., 8, 4] in the lane grid; B's g is the column n)."""
    p = (_outer(a[0], b[0]) + _outer(a[1], b[1])) + (_outer(c[0], d[0]) + _outer(c[1], d[1]))
    m = tl.sum(p, axis=4)                                     # [WK, WN, 8 (g), 8 (n)]
    return tl.split(tl.reshape(m, (m.shape[0], m.shape[1], 8, 4, 2)))


@triton.jit
def _outer(a, b):  # type: ignore[no-untyped-def]
    """[.., 8 (g), 8 (n), 4 (q)]: a(g, q) * b(n, q)."""
    return tl.expand_dims(a, 3) * tl.expand_dims(b, 2)


@triton.jit
def _mma(acc, a0, a1, a2, a3, b0, b1, ASM: tl.constexpr):  # type: ignore[no-untyped-def]
    """acc (c0..c3) + the m16n8k16 product of A (a0 / a2: row g, a1 / a3: row g + 8) and B (b0,
    b1: column g): inline PTX on the GPU; else emulated in fp32 (`_cols`)."""
    c0, c1, c2, c3 = acc
    if ASM:
        c0, c1, c2, c3 = tl.inline_asm_elementwise(
            "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {$0, $1, $2, $3}, "
            "{$4, $5, $6, $7}, {$8, $9}, {$10, $11, $12, $13};",
            "=f,=f,=f,=f,r,r,r,r,r,r,f,f,f,f", [a0, a1, a2, a3, b0, b1, c0, c1, c2, c3],
            dtype=(tl.float32, tl.float32, tl.float32, tl.float32), is_pure=True, pack=1)
    else:
        lo0, lo1 = _cols(a0, b0, a2, b1)
        hi0, hi1 = _cols(a1, b0, a3, b1)
        c0, c1, c2, c3 = c0 + lo0, c1 + lo1, c2 + hi0, c3 + hi1
    return c0, c1, c2, c3


@triton.jit
def _matrix_step(acc, acc2, w_ptr, s_ptr, e, lo, hi, k, ok,  # type: ignore[no-untyped-def]
                 b, b2, stride_we, stride_wn, stride_se, stride_sn, NT: tl.constexpr,
                 ASM: tl.constexpr):
    """(acc, acc2) + one K step of one weight matrix: the lane's group at k of rows lo / hi
    (clamped in range), 8 MMAs with the B registers b (`_b_regs`: columns 0..7) and, with NT 2,
    8 more with b2 (columns 8..15) on the same A fragments."""
    base = w_ptr + e * stride_we
    wl0, wl1, wl2, wl3 = _ld4((base + lo * stride_wn + k // 2).to(tl.pointer_type(tl.uint32)),
                              ASM)
    wh0, wh1, wh2, wh3 = _ld4((base + hi * stride_wn + k // 2).to(tl.pointer_type(tl.uint32)),
                              ASM)
    sbase = s_ptr + e * stride_se + k // 32
    cl = _code(sbase + lo * stride_sn, ASM)
    ch = _code(sbase + hi * stride_sn, ASM)
    for w in tl.static_range(4):
        wl = (wl0, wl1, wl2, wl3)[w]
        wh = (wh0, wh1, wh2, wh3)[w]
        al = _a_word(wl, cl, ok, ASM)
        ah = _a_word(wh, ch, ok, ASM)
        bw = b[w]
        acc = _mma(acc, al[0], ah[0], al[1], ah[1], bw[0], bw[1], ASM)
        acc = _mma(acc, al[2], ah[2], al[3], ah[3], bw[2], bw[3], ASM)
        if NT == 2:
            bw = b2[w]
            acc2 = _mma(acc2, al[0], ah[0], al[1], ah[1], bw[0], bw[1], ASM)
            acc2 = _mma(acc2, al[2], ah[2], al[3], ah[3], bw[2], bw[3], ASM)
    return acc, acc2


@triton.jit
def _rows(OUT, WK: tl.constexpr, WN: tl.constexpr):  # type: ignore[no-untyped-def]
    """(wk, g, q, the lane's rows g and g + 8 clamped below OUT) of this program's block (its
    loads need no mask; the epilogue masks the stores)."""
    wk, wn, g, q = _lanes(WK, WN)
    row = tl.program_id(1) * (_ROWS * WN) + _ROWS * wn + g
    return wk, g, q, tl.minimum(row, OUT - 1), tl.minimum(row + 8, OUT - 1)


@triton.jit
def _lane_k(s, wk, q, K, WK: tl.constexpr):  # type: ignore[no-untyped-def]
    """(first k of the lane's group in K step s of warp wk, in range): warp wk takes steps
    wk, wk + WK, ...; a group past K reads group 0 (in range, its factor zeroed)."""
    k = (s * WK + wk) * _STEP + 32 * q
    ok = k < K
    return tl.where(ok, k, 0), ok


@triton.jit
def _tile(t_start_ptr, t_end_ptr, exp_ptr,  # type: ignore[no-untyped-def]
          SLOTS: tl.constexpr):
    """(first sorted row, row count, expert) of this program's tile: the tile map's, or with SLOTS
    (no tile map) program t is sorted row t = slot t alone, its expert from the flat indices."""
    t = tl.program_id(0)
    if SLOTS:
        start, count = t, 1
    else:
        start = tl.load(t_start_ptr + t)
        count = tl.load(t_end_ptr + t) - start
    return start, count, tl.load(exp_ptr + t).to(tl.int64)   # NOTE: int64: e * stride_we > 2^31


@triton.jit
def _slot(order_ptr, p, SLOTS: tl.constexpr):  # type: ignore[no-untyped-def]
    """The (token, k) slot of sorted row p (in range)."""
    if SLOTS:
        slot = p
    else:
        slot = tl.load(order_ptr + p)
    return slot


@triton.jit
def _col_rows(start, count, g):  # type: ignore[no-untyped-def]
    """The sorted row of MMA column g (tile row g; past the tile's end its last row: loads stay
    in range, and those columns are never stored)."""
    return (start + tl.minimum(g, count - 1)).to(tl.int64)


@triton.jit
def _zeros(WK: tl.constexpr, WN: tl.constexpr):  # type: ignore[no-untyped-def]
    z = tl.zeros((WK, WN, 8, 4), dtype=tl.float32)
    return z, z, z, z


@triton.jit
def _output(c, IDX: tl.constexpr, start, count, OUT,  # type: ignore[no-untyped-def]
            WN: tl.constexpr):
    """Output IDX = 0..3 of the lanes after the sum over the K warps, [WN, 8, 4] each: (value,
    sorted row, output column, mask) of c0 .. c3 = D[g, 2q], D[g, 2q + 1], D[g + 8, 2q],
    D[g + 8, 2q + 1] (D's column n is tile row n)."""
    wn = tl.arange(0, WN)[:, None, None]
    g = tl.arange(0, 8)[None, :, None]
    q = tl.arange(0, 4)[None, None, :]
    n = 2 * q + IDX % 2
    col = tl.program_id(1) * (_ROWS * WN) + _ROWS * wn + g + 8 * (IDX // 2)
    return tl.sum(c, axis=0), start + tl.minimum(n, count - 1), col, (n < count) & (col < OUT)


@triton.jit
def _paired(n):  # type: ignore[no-untyped-def]
    """Where column n of h sits in the down launch's B order: within each 8, the pairs
    (r, r + 4) as words r = 0..3."""
    return n - n % 8 + 2 * (n % 4) + (n % 8) // 4


@triton.jit
def _gate_up_frag_kernel(  # type: ignore[no-untyped-def]
    x_ptr, w1_ptr, w3_ptr, s1_ptr, s3_ptr, h_ptr, rw_ptr, order_ptr, t_start_ptr, t_end_ptr,
    exp_ptr, K, INTER, limit,
    stride_x, stride_we, stride_wn, stride_se, stride_sn, stride_h,
    TOPK: tl.constexpr, WK: tl.constexpr, WN: tl.constexpr, SLOTS: tl.constexpr,
    NT: tl.constexpr, ASM: tl.constexpr, LIBDEVICE: tl.constexpr, PDL: tl.constexpr):
    """h[row, block] = swiglu(x w1^T, x w3^T) * the slot's weight, bf16, for program (tile,
    block of 16 WN rows of I); h's row is the sorted row (SLOTS: the slot)."""
    if PDL:  # programmatic dependent launch: the prior kernel's writes first
        gdc_wait()
    start, count, e = _tile(t_start_ptr, t_end_ptr, exp_ptr, SLOTS)
    if count > 0:
        wk, g, q, lo, hi = _rows(INTER, WK, WN)
        x_u32 = x_ptr.to(tl.pointer_type(tl.uint32))
        x_row = x_u32 + _slot(order_ptr, _col_rows(start, count, g), SLOTS) // TOPK * (
            stride_x // 2)
        x_row2 = x_u32 + _slot(order_ptr, _col_rows(start, count, g + 8), SLOTS) // TOPK * (
            stride_x // 2)
        acc_g, acc_g2 = _zeros(WK, WN), _zeros(WK, WN)
        acc_u, acc_u2 = _zeros(WK, WN), _zeros(WK, WN)
        for s in range(0, tl.cdiv(K, _STEP * WK)):
            k, ok = _lane_k(s, wk, q, K, WK)
            b = _b_regs(x_row, k, False, ASM)
            b2 = _b_regs(x_row2, k, False, ASM) if NT == 2 else b
            acc_g, acc_g2 = _matrix_step(acc_g, acc_g2, w1_ptr, s1_ptr, e, lo, hi, k, ok, b, b2,
                                         stride_we, stride_wn, stride_se, stride_sn, NT, ASM)
            acc_u, acc_u2 = _matrix_step(acc_u, acc_u2, w3_ptr, s3_ptr, e, lo, hi, k, ok, b, b2,
                                         stride_we, stride_wn, stride_se, stride_sn, NT, ASM)
        for j in tl.static_range(NT):          # column set j: tile rows 8j ..
            for i in tl.static_range(4):
                gate, p, col, mask = _output((acc_g, acc_g2)[j][i], i, start + 8 * j,
                                             count - 8 * j, INTER, WN)
                up = tl.sum((acc_u, acc_u2)[j][i], axis=0)
                rw = tl.load(rw_ptr + _slot(order_ptr, p, SLOTS))
                h = swiglu_f32(gate, up, limit, tl.float32, LIBDEVICE) * rw
                tl.store(h_ptr + p.to(tl.int64) * stride_h + _paired(col),
                         h.to(h_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _down_frag_kernel(  # type: ignore[no-untyped-def]
    h_ptr, w_ptr, s_ptr, out_ptr, order_ptr, t_start_ptr, t_end_ptr, exp_ptr, K, D,
    stride_h, stride_we, stride_wn, stride_se, stride_sn, stride_o,
    TOPK: tl.constexpr, WK: tl.constexpr, WN: tl.constexpr, SLOTS: tl.constexpr,
    NT: tl.constexpr, ASM: tl.constexpr, ATOMIC: tl.constexpr, PDL: tl.constexpr):
    """y = h[row] w2^T for program (tile, block of 16 WN rows of d): stored at the row's slot, or
    added into its token's (ATOMIC)."""
    if PDL:  # programmatic dependent launch: the prior kernel's writes first
        gdc_wait()
    start, count, e = _tile(t_start_ptr, t_end_ptr, exp_ptr, SLOTS)
    if count > 0:
        wk, g, q, lo, hi = _rows(D, WK, WN)
        h_u32 = h_ptr.to(tl.pointer_type(tl.uint32))
        h_row = h_u32 + _col_rows(start, count, g) * (stride_h // 2)
        h_row2 = h_u32 + _col_rows(start, count, g + 8) * (stride_h // 2)
        acc, acc2 = _zeros(WK, WN), _zeros(WK, WN)
        for s in range(0, tl.cdiv(K, _STEP * WK)):
            k, ok = _lane_k(s, wk, q, K, WK)
            b = _b_regs(h_row, k, True, ASM)
            b2 = _b_regs(h_row2, k, True, ASM) if NT == 2 else b
            acc, acc2 = _matrix_step(acc, acc2, w_ptr, s_ptr, e, lo, hi, k, ok, b, b2, stride_we,
                                     stride_wn, stride_se, stride_sn, NT, ASM)
        for j in tl.static_range(NT):
            for i in tl.static_range(4):
                y, p, col, mask = _output((acc, acc2)[j][i], i, start + 8 * j, count - 8 * j, D,
                                          WN)
                slot = _slot(order_ptr, p, SLOTS)
                if ATOMIC:
                    tl.atomic_add(out_ptr + (slot // TOPK) * stride_o + col, y, mask=mask)
                else:
                    tl.store(out_ptr + slot * stride_o + col, y, mask=mask)


def frag_launches(x: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, s1: torch.Tensor,
                  s3: torch.Tensor, w2: torch.Tensor, s2: torch.Tensor, indices: torch.Tensor,
                  tiles: TileMap | None, rw: torch.Tensor, limit: float, topk: int,
                  deterministic: bool, plan: MoePlan, asm: bool) -> torch.Tensor:
    """The frag loop's gate/up and down launches (`moe.py::_launch` contract): FP4 codes as
    uint8, w1 / w3 (s1 / s3) sharing strides, x bf16; [N, d] fp32 out (deterministic: the
    [N*k, d] rows that the combine sums over k in a fixed order). tiles: the tile map of
    BLOCK_M 8 / 16 (up to 8 / 16 rows of one expert share each A fragment: one or two MMAs), or
    None (BLOCK_M 1: program t is slot t, its expert read from indices). asm: the inline PTX
    (GPU)."""
    assert x.dtype == torch.bfloat16, "the frag loop feeds bf16 activations to the MMA"
    flat = indices.reshape(-1)
    slots = tiles is None
    nt = 1 if slots else plan.block_m // 8         # MMA column sets of 8 tile rows
    order, t_start, t_end, t_exp = (flat, flat, flat, flat) if tiles is None else tiles
    nk, inter, d = flat.numel(), w1.shape[1], x.shape[1]
    h = torch.empty(nk, inter, dtype=torch.bfloat16, device=x.device)
    wk, wn = frag_warps(plan.gate_up.block_n, plan.gate_up.num_warps)
    _gate_up_frag_kernel[(t_exp.numel(), triton.cdiv(inter, plan.gate_up.block_n))](
        x, w1, w3, s1, s3, h, rw, order, t_start, t_end, t_exp, d, inter, float(limit),
        x.stride(0), w1.stride(0), w1.stride(1), s1.stride(0), s1.stride(1), h.stride(0),
        TOPK=topk, WK=wk, WN=wn, SLOTS=slots, NT=nt, ASM=asm, LIBDEVICE=asm, num_warps=wk * wn,
        **pdl_args(x.device),
    )
    dest = (torch.zeros(nk // topk, d, dtype=torch.float32, device=x.device)
            if not deterministic else torch.empty(nk, d, dtype=torch.float32, device=x.device))
    wk, wn = frag_warps(plan.down.block_n, plan.down.num_warps)
    _down_frag_kernel[(t_exp.numel(), triton.cdiv(d, plan.down.block_n))](
        h, w2, s2, dest, order, t_start, t_end, t_exp, inter, d,
        h.stride(0), w2.stride(0), w2.stride(1), s2.stride(0), s2.stride(1), dest.stride(0),
        TOPK=topk, WK=wk, WN=wn, SLOTS=slots, NT=nt, ASM=asm, ATOMIC=not deterministic,
        num_warps=wk * wn, **pdl_args(h.device),
    )
    return dest
