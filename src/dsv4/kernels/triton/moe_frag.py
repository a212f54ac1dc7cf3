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
7 copies are never stored) or one tile of the tile map (BLOCK_M 8 / 16: up to 8 / 16 sorted rows
of one expert; columns past the tile's end repeat its last row, unstored), times WK x WN warps:
WN row blocks of 16 (BLOCK_N = 16 WN) and WK = 2 or 4 warps over the K steps. The steps are dealt to
FRAG_SPLITS = 4 virtual splits (split v takes steps v, v + 4, ...: neighbouring warps read
neighbouring bytes), each with its own accumulators: warp wk runs split wk and, at WK 2, split
wk + 2 too (two independent MMA chains). The splits are summed in the fixed order (s0 + s2) +
(s1 + s3) before the epilogue (`_ksum`). Every tensor is [WK, WN, 8, 4] (or broadcast to it), one
element per thread: Triton's default layout puts lane 4g + q at [., ., g, q] and the warps on the
first two axes, which is what the inline-PTX mma assumes (no load or store anchors another layout
before the sum; `benchmarks/aot_compile_sm90.py` shows the layouts; the GPU parity tests check the
products).

Bits: a row's sum runs over fixed steps, splits, lanes and MMA slots that depend only on K, never on
WK, N, BLOCK_M or the other columns (an MMA column's sum never sees the others), so a token's output
does not depend on its batch or the launch. The gate/up epilogue writes h = swiglu(g, u) * w rounded
to bf16 (row: the sorted row; BLOCK_M 1: the slot). Without the inline PTX (the interpreter) the
same fragments are formed and the MMA is emulated in fp32 (`moe_frag_regs.py`, which holds one K
step's register work): the same values up to fp32 summation order.

The weights' loads may skip L1 (`MoePlan.stream_weights`, a knob, off by default: WNA): each
weight byte is read once, while L1 keeps the activations that every warp reads again.

FP8 (`fp8`; e4m3 codes, 128 x 128 UE8M0 blocks): the same programs, lanes, steps and splits; a
lane reads 32 codes (32 bytes) of each of its rows per K step, decoded as `fp8_frag.py` decodes
them (`moe_frag_regs.matrix_step_fp8`), against activations repacked into the matching pairs;
gate/up stores h in plain order.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsv4.kernels.triton.moe_combine import down_output
from dsv4.kernels.triton.moe_frag_regs import down_step, gate_up_step
from dsv4.kernels.triton.moe_plan import (
    FRAG_ROWS,
    FRAG_SPLITS,
    FRAG_STEP,
    MoePlan,
    frag_warps,
)
from dsv4.kernels.triton.moe_tile_map import TileMap, slot_or_tile
from dsv4.kernels.triton.pdl import pdl_args
from dsv4.kernels.triton.pdl_enter import pdl_enter
from dsv4.kernels.triton.swiglu import swiglu_f32

_STEP = tl.constexpr(FRAG_STEP)
_ROWS = tl.constexpr(FRAG_ROWS)
_VK = tl.constexpr(FRAG_SPLITS)


@triton.jit
def _lanes(WK: tl.constexpr, WN: tl.constexpr):  # type: ignore[no-untyped-def]
    """The [WK, WN, 8, 4] grid's index tensors (warp along K, warp along N, g, q)."""
    wk = tl.arange(0, WK)[:, None, None, None]
    wn = tl.arange(0, WN)[None, :, None, None]
    g = tl.arange(0, 8)[None, None, :, None]
    q = tl.arange(0, 4)[None, None, None, :]
    return wk, wn, g, q


@triton.jit
def _rows(OUT, WK: tl.constexpr, WN: tl.constexpr):  # type: ignore[no-untyped-def]
    """(wk, g, q, the lane's rows g and g + 8 clamped below OUT) of this program's block (its
    loads need no mask; the epilogue masks the stores)."""
    wk, wn, g, q = _lanes(WK, WN)
    row = tl.program_id(1) * (_ROWS * WN) + _ROWS * wn + g
    return wk, g, q, tl.minimum(row, OUT - 1), tl.minimum(row + 8, OUT - 1)


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
def _add2(a0, b0, a1, b1):  # type: ignore[no-untyped-def]
    return a0 + a1, b0 + b1


@triton.jit
def _ksum(a, b, wk, WK: tl.constexpr, ASM: tl.constexpr):  # type: ignore[no-untyped-def]
    """The sum over the 4 virtual K splits of one output, [WN, 8, 4], in the fixed order
    (s0 + s2) + (s1 + s3): a [WK, WN, 8, 4] holds split wk of each warp, b (WK 2) split wk + 2.
    WK 2: a + b = (s0 + s2, s1 + s3), summed over the 2 warps. WK 4 on the GPU: Triton's own
    reduction over the 4 warps, whose butterfly pairs warps 0 / 2 and 1 / 3 (the GPU tests
    assert that WK 2 and 4 agree bit for bit); the interpreter sums an axis in sequence, so
    there the pairs are written out (masked sums whose other terms are exact zeros)."""
    if WK == 2:
        tot = tl.sum(a + b, axis=0)
    elif ASM:
        tot = tl.sum(a, axis=0)
    else:
        lo, hi = tl.reduce((tl.where(wk % 2 == 0, a, 0.0), tl.where(wk % 2 == 1, a, 0.0)), 0,
                           _add2)
        tot = lo + hi
    return tot


@triton.jit
def _output(start, count, OUT, IDX: tl.constexpr,  # type: ignore[no-untyped-def]
            WN: tl.constexpr):
    """(sorted row, output column, mask) of output IDX = 0..3 of the lanes, [WN, 8, 4] each: c0 ..
    c3 = D[g, 2q], D[g, 2q + 1], D[g + 8, 2q], D[g + 8, 2q + 1] (D's column n is tile row n)."""
    wn = tl.arange(0, WN)[:, None, None]
    g = tl.arange(0, 8)[None, :, None]
    q = tl.arange(0, 4)[None, None, :]
    n = 2 * q + IDX % 2
    col = tl.program_id(1) * (_ROWS * WN) + _ROWS * wn + g + 8 * (IDX // 2)
    return start + tl.minimum(n, count - 1), col, (n < count) & (col < OUT)


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
    NT: tl.constexpr, ASM: tl.constexpr, LIBDEVICE: tl.constexpr, L2PF: tl.constexpr,
    FP8: tl.constexpr, PDL: tl.constexpr, WNA: tl.constexpr):
    """h[row, block] = swiglu(x w1^T, x w3^T) * the slot's weight, bf16, for program (tile,
    block of 16 WN rows of I); h's row is the sorted row (SLOTS: the slot). Warp wk runs virtual
    K split wk (accumulators ga .. ua2) and, at WK 2, split wk + 2 too (gb .. ub2)."""
    pdl_enter(PDL)
    start, end, e = slot_or_tile(t_start_ptr, t_end_ptr, exp_ptr, SLOTS)
    count = end - start
    if count > 0:
        wk, g, q, lo, hi = _rows(INTER, WK, WN)
        x_u32 = x_ptr.to(tl.pointer_type(tl.uint32))
        x_row = x_u32 + _slot(order_ptr, _col_rows(start, count, g), SLOTS) // TOPK * (
            stride_x // 2)
        x_row2 = x_u32 + _slot(order_ptr, _col_rows(start, count, g + 8), SLOTS) // TOPK * (
            stride_x // 2)
        ga, ga2, ua, ua2 = _zeros(WK, WN), _zeros(WK, WN), _zeros(WK, WN), _zeros(WK, WN)
        gb, gb2, ub, ub2 = _zeros(WK, WN), _zeros(WK, WN), _zeros(WK, WN), _zeros(WK, WN)
        for s in range(0, tl.cdiv(K, _STEP * _VK)):
            ga, ga2, ua, ua2 = gate_up_step(ga, ga2, ua, ua2, x_row, x_row2, w1_ptr, w3_ptr,
                                            s1_ptr, s3_ptr, e, lo, hi, s, wk, q, K, stride_we,
                                            stride_wn, stride_se, stride_sn, NT, ASM, L2PF, FP8,
                                            WNA)
            if WK == 2:
                gb, gb2, ub, ub2 = gate_up_step(gb, gb2, ub, ub2, x_row, x_row2, w1_ptr, w3_ptr,
                                                s1_ptr, s3_ptr, e, lo, hi, s, wk + 2, q, K,
                                                stride_we, stride_wn, stride_se, stride_sn, NT,
                                                ASM, L2PF, FP8, WNA)
        for j in tl.static_range(NT):          # column set j: tile rows 8j ..
            for i in tl.static_range(4):
                p, col, mask = _output(start + 8 * j, count - 8 * j, INTER, i, WN)
                gate = _ksum((ga, ga2)[j][i], (gb, gb2)[j][i], wk, WK, ASM)
                up = _ksum((ua, ua2)[j][i], (ub, ub2)[j][i], wk, WK, ASM)
                rw = tl.load(rw_ptr + _slot(order_ptr, p, SLOTS))
                h = swiglu_f32(gate, up, limit, tl.float32, LIBDEVICE) * rw
                hcol = col if FP8 else _paired(col)
                tl.store(h_ptr + p.to(tl.int64) * stride_h + hcol, h.to(h_ptr.dtype.element_ty),
                         mask=mask)


@triton.jit
def _down_frag_kernel(  # type: ignore[no-untyped-def]
    h_ptr, w_ptr, s_ptr, out_ptr, order_ptr, t_start_ptr, t_end_ptr, exp_ptr, K, D,
    stride_h, stride_we, stride_wn, stride_se, stride_sn, stride_o,
    TOPK: tl.constexpr, WK: tl.constexpr, WN: tl.constexpr, SLOTS: tl.constexpr,
    NT: tl.constexpr, ASM: tl.constexpr, ATOMIC: tl.constexpr, L2PF: tl.constexpr,
    FP8: tl.constexpr, PDL: tl.constexpr, WNA: tl.constexpr):
    """y = h[row] w2^T for program (tile, block of 16 WN rows of d): stored at the row's slot, or
    added into its token's (ATOMIC). Virtual K splits as in the gate/up kernel."""
    pdl_enter(PDL)
    start, end, e = slot_or_tile(t_start_ptr, t_end_ptr, exp_ptr, SLOTS)
    count = end - start
    if count > 0:
        wk, g, q, lo, hi = _rows(D, WK, WN)
        h_u32 = h_ptr.to(tl.pointer_type(tl.uint32))
        h_row = h_u32 + _col_rows(start, count, g) * (stride_h // 2)
        h_row2 = h_u32 + _col_rows(start, count, g + 8) * (stride_h // 2)
        a, a2, b, b2 = _zeros(WK, WN), _zeros(WK, WN), _zeros(WK, WN), _zeros(WK, WN)
        for s in range(0, tl.cdiv(K, _STEP * _VK)):
            a, a2 = down_step(a, a2, h_row, h_row2, w_ptr, s_ptr, e, lo, hi, s, wk, q, K,
                              stride_we, stride_wn, stride_se, stride_sn, NT, ASM, L2PF, FP8,
                              WNA)
            if WK == 2:
                b, b2 = down_step(b, b2, h_row, h_row2, w_ptr, s_ptr, e, lo, hi, s, wk + 2, q,
                                  K, stride_we, stride_wn, stride_se, stride_sn, NT, ASM, L2PF,
                                  FP8, WNA)
        for j in tl.static_range(NT):
            for i in tl.static_range(4):
                p, col, mask = _output(start + 8 * j, count - 8 * j, D, i, WN)
                y = _ksum((a, a2)[j][i], (b, b2)[j][i], wk, WK, ASM)
                slot = _slot(order_ptr, p, SLOTS)
                if ATOMIC:
                    tl.atomic_add(out_ptr + (slot // TOPK) * stride_o + col, y, mask=mask)
                else:
                    tl.store(out_ptr + slot * stride_o + col, y, mask=mask)


def frag_launches(x: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, s1: torch.Tensor,
                  s3: torch.Tensor, w2: torch.Tensor, s2: torch.Tensor, indices: torch.Tensor,
                  tiles: TileMap | None, rw: torch.Tensor, limit: float, topk: int,
                  deterministic: bool, plan: MoePlan, asm: bool,
                  fp8: bool = False) -> torch.Tensor:
    """The frag loop's gate/up and down launches (`moe.py::_launch` contract): FP4 (fp8: e4m3)
    codes as uint8, w1 / w3 (s1 / s3) sharing strides, x bf16; [N, d] fp32 out (deterministic: the
    [N*k, d] rows that the combine sums over k in a fixed order). tiles: the tile map of
    BLOCK_M 8 / 16 (up to 8 / 16 rows of one expert share each A fragment: one or two MMAs), or
    None (BLOCK_M 1: program t is slot t, its expert read from indices). asm: the inline PTX
    (GPU)."""
    assert x.dtype == torch.bfloat16, "the frag loop feeds bf16 activations to the MMA"
    if fp8 and (x.shape[1] % 32 or w1.shape[1] % 32):
        raise ValueError(f"fp8 variant 'frag' reads 32-k groups: d and I must be multiples of "
                         f"32; got {x.shape[1]}, {w1.shape[1]}")
    flat = indices.reshape(-1)
    slots = tiles is None
    nt = 1 if slots else plan.block_m // 8         # MMA column sets of 8 tile rows
    l2pf = 128 if slots else 256                    # the loads' L2 prefetch size (H200 sweep)
    order, t_start, t_end, t_exp = (flat, flat, flat, flat) if tiles is None else tiles
    nk, inter, d = flat.numel(), w1.shape[1], x.shape[1]
    h = torch.empty(nk, inter, dtype=torch.bfloat16, device=x.device)
    dest = down_output(nk, topk, d, deterministic, x.device)
    wk, wn = frag_warps(plan.gate_up.block_n, plan.gate_up.num_warps)
    _gate_up_frag_kernel[(t_exp.numel(), triton.cdiv(inter, plan.gate_up.block_n))](
        x, w1, w3, s1, s3, h, rw, order, t_start, t_end, t_exp, d, inter, float(limit),
        x.stride(0), w1.stride(0), w1.stride(1), s1.stride(0), s1.stride(1), h.stride(0),
        TOPK=topk, WK=wk, WN=wn, SLOTS=slots, NT=nt, ASM=asm, LIBDEVICE=asm, L2PF=l2pf,
        FP8=fp8, WNA=plan.stream_weights, num_warps=wk * wn, **pdl_args(x.device),
    )
    wk, wn = frag_warps(plan.down.block_n, plan.down.num_warps)
    _down_frag_kernel[(t_exp.numel(), triton.cdiv(d, plan.down.block_n))](
        h, w2, s2, dest, order, t_start, t_end, t_exp, inter, d,
        h.stride(0), w2.stride(0), w2.stride(1), s2.stride(0), s2.stride(1), dest.stride(0),
        TOPK=topk, WK=wk, WN=wn, SLOTS=slots, NT=nt, ASM=asm, ATOMIC=not deterministic, L2PF=l2pf,
        FP8=fp8, WNA=plan.stream_weights, num_warps=wk * wn, **pdl_args(h.device),
    )
    return dest
