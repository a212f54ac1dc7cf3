"""The FP8 linear at decode on the tensor cores ("frag"): e4m3 codes decoded in registers straight
into mma.sync A fragments (bf16), up to 8 token rows as the MMA's 8 columns. A path of
`fp8_linear.py::triton_fp8_linear` (bf16 x, M <= 8, K a multiple of 128), its default for M 5..8
(`plan_fp8_linear`; at M <= 4 the FMA path measured faster: this loop has one K step's loads in
flight per warp, benchmarks/results/quant_moe_h200_202612.md).

Why: the CUDA-core FMA path spends ~5 SASS instructions per weight (the e4m3 -> f16 -> f32
conversions, the FFMA, the row sums) for each token row, and the swap-AB tl.dot pads M to 16 and
converts through fp32. Here a word of 4 codes costs ~9 instructions (two bf16 pairs: ANDs, shifts
and ORs, then one `mul.rn.bf16x2` each by the block scale), ~3 per weight in the loop's SASS, for
up to 8 tokens at once, and the multiply-adds are one m16n8k16 per 256 weights of a warp.

Decode. e4m3 bits s eeee mmm placed as bf16 bits s 0000eeee mmm0000 are the code's value times
2^-120, exactly (e = 0, the e4m3 subnormals, lands on bf16 subnormals m/8 2^-126); multiplying by
2^(c - 7) (c: the block's UE8M0 code, so 2^(c - 127) 2^120) gives the weight exactly in bf16 for
any code whose product is a bf16 normal (c >= 10). A code past 134 would need a factor past bf16's
range: it is clamped to an infinite factor, so such a block shows as inf, never as a wrong finite
value. Word w = bytes (b0, b1, b2, b3) = k (4w .. 4w + 3) of a lane's group yields pair A (b0, b2)
and pair B (b1, b3); the activations' words (x[4w], x[4w + 1]), (x[4w + 2], x[4w + 3]) are
repacked into the same pairs (one `prmt` each), so each MMA k slot holds matching k.

Fragments (as `moe_frag.py`): a warp owns 16 weight rows; lane (g, q) holds rows g and g + 8 and,
per K step of 128 k (one scale block), the 32 k at 32 q: 32 bytes of each row (two 16-byte loads)
and the 32 activations of token g (clamped below M; its columns are never stored). An MMA takes
word w of both rows: a0 / a2 = row g's pairs A / B, a1 / a3 = row g + 8's. D's c0 / c1 are row
g's outputs for tokens 2q / 2q + 1, c2 / c3 row g + 8's.

Grid: N tiles of BLOCK_N = 16 WN rows (WN warps) x SPLIT_K K splits (whole steps), one program
each; the splits reduce in the launch (`gemv_tile.py::store_tile`'s contract: fp32 partials, an
arrival counter per tile, the last arrival sums in split order). A row's sum runs over fixed
steps, lanes and MMA slots that depend on K and the plan's split only, never on M: a token's
output does not depend on the other rows of its batch (M = 1..8) at one plan. Groups (`rows_g`):
output row n reads x's group n // rows_g (attention's grouped wo_a; rows_g % BLOCK_N == 0).

Without the inline PTX (the interpreter) the same fragments are formed as fp32 pairs and the MMA
is emulated in fp32 (`moe_frag_regs.py::cols`): the same values up to fp32 summation order.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsv4.kernels.triton.moe_frag_regs import b_pair, fp8_pairs, ld4, mma, scale_code
from dsv4.kernels.triton.pdl import pdl_args
from dsv4.kernels.triton.pdl_enter import pdl_enter

STEP = 128                   # k per K step: one scale block (a quad's 4 lanes x 32 k)
MAX_M = 8                    # token rows: the MMA's 8 columns
_STEP = tl.constexpr(STEP)


@triton.jit
def _step(acc, x_row, w_lo, w_hi, s_row, s, q,  # type: ignore[no-untyped-def]
          ASM: tl.constexpr):
    """acc + K step s: the lane's 32 k of rows lo / hi (8 code words each) against token g's."""
    k = s * _STEP + 32 * q
    xp = x_row + k // 2
    wl = w_lo + k // 4
    wh = w_hi + k // 4
    x0, x1, x2, x3 = ld4(xp, ASM, 128)
    x4, x5, x6, x7 = ld4(xp + 4, ASM, 128)
    x8, x9, x10, x11 = ld4(xp + 8, ASM, 128)
    x12, x13, x14, x15 = ld4(xp + 12, ASM, 128)
    l0, l1, l2, l3 = ld4(wl, ASM, 128)
    l4, l5, l6, l7 = ld4(wl + 4, ASM, 128)
    h0, h1, h2, h3 = ld4(wh, ASM, 128)
    h4, h5, h6, h7 = ld4(wh + 4, ASM, 128)
    code = scale_code(s_row + s, ASM)
    xs = (x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15)
    ls = (l0, l1, l2, l3, l4, l5, l6, l7)
    hs = (h0, h1, h2, h3, h4, h5, h6, h7)
    for w in tl.static_range(8):
        la, lb = fp8_pairs(ls[w], code, True, False, ASM)
        ha, hb = fp8_pairs(hs[w], code, True, False, ASM)
        b0, b1 = b_pair(xs[2 * w], xs[2 * w + 1], ASM)
        acc = mma(acc, la, ha, lb, hb, b0, b1, ASM)
    return acc


@triton.jit
def _out(c, row, tok, y_ptr, part_ptr, split, M, N,  # type: ignore[no-untyped-def]
         SPLIT_K: tl.constexpr, LAST: tl.constexpr):
    """Store output c (row, token): y directly (SPLIT_K 1), split `split`'s partial, or (LAST)
    the sum of the SPLIT_K partials in split order."""
    mask = (row < N) & (tok < M)
    off = tok.to(tl.int64) * N + row
    plane = M.to(tl.int64) * N
    if SPLIT_K == 1:
        tl.store(y_ptr + off, c.to(y_ptr.dtype.element_ty), mask=mask)
    elif LAST:
        total = tl.load(part_ptr + off, mask=mask, other=0.0, cache_modifier=".cg")
        for s in tl.static_range(1, SPLIT_K):
            total += tl.load(part_ptr + s * plane + off, mask=mask, other=0.0,
                             cache_modifier=".cg")
        tl.store(y_ptr + off, total.to(y_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(part_ptr + split * plane + off, c, mask=mask)


@triton.jit(do_not_specialize=["M", "N"])
def _fp8_frag_kernel(  # type: ignore[no-untyped-def]
    x_ptr, w_ptr, s_ptr, y_ptr, part_ptr, cnt_ptr, M, N, K, stride_xm, stride_xg, rows_g,
    stride_wn, stride_sn, steps_per_split, WN: tl.constexpr, SPLIT_K: tl.constexpr,
    ASM: tl.constexpr, PDL: tl.constexpr):
    """y[tok, row] = sum_k x[tok, group(row), k] dequant(w)[row, k] for program (tile of 16 WN
    rows, K split); x bf16 with even strides (16-byte aligned rows), w uint8 codes."""
    pdl_enter(PDL)
    pid = tl.program_id(0)
    tile = pid // SPLIT_K
    split = pid % SPLIT_K
    # the [1, WN, 8, 4] lane grid of `moe_frag.py` (one K warp): lane 4g + q of warp wn
    wn = tl.arange(0, WN)[None, :, None, None]
    g = tl.arange(0, 8)[None, None, :, None]
    q = tl.arange(0, 4)[None, None, None, :]
    row = tile * (16 * WN) + 16 * wn + g                       # the lane's row g (lo)
    lo = tl.minimum(row, N - 1).to(tl.int64)
    hi = tl.minimum(row + 8, N - 1).to(tl.int64)
    group = (tile * (16 * WN) // rows_g).to(tl.int64)
    tok = tl.minimum(g, M - 1).to(tl.int64)
    x_row = x_ptr.to(tl.pointer_type(tl.uint32)) + (tok * stride_xm + group * stride_xg) // 2
    w_u32 = w_ptr.to(tl.pointer_type(tl.uint32))
    w_lo = w_u32 + lo * (stride_wn // 4)
    w_hi = w_u32 + hi * (stride_wn // 4)
    s_row = s_ptr + (lo // 128) * stride_sn
    z = tl.zeros((1, WN, 8, 4), dtype=tl.float32)
    acc = (z, z, z, z)
    s_lo = split * steps_per_split
    s_hi = tl.minimum(K // _STEP, s_lo + steps_per_split)
    for s in range(s_lo, s_hi):                               # K % 128 == 0: whole groups
        acc = _step(acc, x_row, w_lo, w_hi, s_row, s, q, ASM)
    t0, t1 = 2 * q, 2 * q + 1
    outs = ((acc[0], row, t0), (acc[1], row, t1), (acc[2], row + 8, t0), (acc[3], row + 8, t1))
    for i in tl.static_range(4):
        _out(outs[i][0], outs[i][1], outs[i][2], y_ptr, part_ptr, split, M, N, SPLIT_K, False)
    if SPLIT_K > 1:
        tl.debug_barrier()          # every thread's partial stores precede the release below
        done = tl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel", scope="gpu")
        if done == SPLIT_K - 1:     # the tile's last arrival: sum the partials in split order
            for i in tl.static_range(4):
                _out(outs[i][0], outs[i][1], outs[i][2], y_ptr, part_ptr, split, M, N, SPLIT_K,
                     True)
            tl.store(cnt_ptr + tile, 0)                          # zero for the next call


def frag_launch(x3: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, y: torch.Tensor,
                part: torch.Tensor, cnt: torch.Tensor, rows_g: int, block_n: int, splits: int,
                steps_per_split: int) -> None:
    """Launch the kernel: x3 [M, g, K] bf16, w [N, K] codes, scale, y [M, N] out; part / cnt
    the split-K workspace and counters (unused at one split); grid N tiles x splits."""
    M, _, K = x3.shape
    N = w.shape[0]
    _fp8_frag_kernel[(triton.cdiv(N, block_n) * splits,)](
        x3, w.view(torch.uint8), scale.view(torch.uint8), y, part, cnt, M, N, K, x3.stride(0),
        x3.stride(1), rows_g, w.stride(0), scale.stride(0), steps_per_split, WN=block_n // 16,
        SPLIT_K=splits, ASM=x3.device.type == "cuda", num_warps=block_n // 16,
        **pdl_args(x3.device))
