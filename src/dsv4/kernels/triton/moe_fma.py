"""The routed experts' "fma" inner loop (kernels/triton/moe.py): few rows per expert, no tl.dot.

At decode the N*k rows spread over the experts with ~1 row each, so a [16, BLOCK_N] MMA tile is
15/16 padding and the decoded weight tile has to reach the MMA operand layout through shared
memory. Here the weights stay in the layout they are loaded in and meet the activations on the CUDA
cores; `plan_moe` picks this loop while nk <= `FMA_MAX_MEAN_ROWS` * E (or `variant="fma"`).

One program: BLOCK_M sorted rows of one expert (`moe_tile_map.py`; BLOCK_M 1, 2 or 4: the rows are
a leading dim of every product), BLOCK_N output rows of W. Each K step loads W's
[BLOCK_N, C, CHUNK] tile, CHUNK k contiguous in one thread (16 bytes: FP4 one 32-wide scale group
as 4 words, FP8 16 codes), decodes it in registers, and per (row m, n, chunk) sums the CHUNK
products in-thread in a fixed order (an FFMA chain), multiplies the chunk's partial by its scale
factor and adds it to the element-wise fp32 accumulator acc[m, n, c]. After the K loop one
`tl.sum` over c (in-thread, then lanes) gives the [BLOCK_M, BLOCK_N] result. So a row's value is
a fixed function of its own activations and BLOCK_K / BLOCK_N / num_warps (the reduction's
layout): never of the other rows of its tile or batch; the plan's fma tiles do not depend on N.

FP4 (why the scale goes on the partial, not into the weights as "words" does): the e2m1 bits are
placed as in `moe_fp4.py` ("words" shifts: the pair (k, k + 4) of nibble r in one 32-bit word)
and each bf16 half moved to an fp32's top half (`<< 16`, `& 0xFFFF0000`): v * 2^-126 exactly, no
multiply. The activations enter pre-scaled by 2^ACT_SHIFT (a fp32 copy written once per launch:
x by `fma_activations`, h by the gate/up epilogue), so the products v * a * 2^(ACT_SHIFT - 126)
stay normal, and the group factor 2^(s - 1 - ACT_SHIFT) multiplies each 32-product partial: per
weight 2 shifts + 2 logic ops per pair, 1 unpack, 1 FFMA, plus 1/32 FFMA; folding the scale
would add a bf16x2 multiply per pair and force a per-element accumulator. Exact products for
|a| < 2^(128 - ACT_SHIFT) and scale codes <= 190 (2^63); a code above is clamped to 191, whose
factor is inf (inf / NaN out, never a wrong finite value), as in `moe_fp4.py`.
FP8: e4m3 -> fp32 with the packed converts (`w_tile`'s), activations unscaled; the tile's
128x128 block scale ([BLOCK_N] per K step: BLOCK_K divides 128) multiplies each chunk's partial.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsv4.kernels.triton.moe_decode import e8m0
from dsv4.kernels.triton.moe_plan import MoePlan
from dsv4.kernels.triton.moe_tile_map import TileMap
from dsv4.kernels.triton.swiglu import swiglu_f32

ACT_SHIFT = 62          # FP4: activations enter the K loop times 2^ACT_SHIFT (module docstring)
FP4_CHUNK = 32          # k per thread chunk: one scale group, 16 bytes
FP8_CHUNK = 16          # 16 e4m3 codes


def act_shift(fmt: int) -> int:
    """log2 of the activations' pre-scale for FMT code `fmt` (2 = fp4)."""
    return ACT_SHIFT if fmt == 2 else 0


@triton.jit
def _fp4_weights(w_ptr, s_ptr, e, rows, k0, K, n_mask,  # type: ignore[no-untyped-def]
                 stride_we, stride_wn, stride_se, stride_sn, C: tl.constexpr,
                 SHIFT: tl.constexpr):
    """([BLOCK_N, C, 32] fp32 v * 2^-126 of W rows at k in [k0, k0 + 32 C); [BLOCK_N, C] group
    factors 2^(s - 1 - SHIFT)). Within each 8 k, position 4h + 2v + u holds k = 4h + 2u + v (word
    half h, nibble r = 2u + v of it: the joins' order; `_acts` permutes the activations alike)."""
    offs_g = k0 // 32 + tl.arange(0, C)
    g_mask = n_mask[:, None] & (offs_g * 32 < K)[None, :]
    codes = tl.load(s_ptr + e * stride_se + rows[:, None] * stride_sn + offs_g[None, :],
                    mask=g_mask, other=127).to(tl.uint32)
    factor = ((tl.minimum(codes, 191) + (126 - SHIFT)) << 23).to(tl.float32, bitcast=True)
    words = w_ptr.to(tl.pointer_type(tl.uint32)) + (e * stride_we
                                                    + rows[:, None, None] * stride_wn) // 4
    x = tl.load(words + offs_g[None, :, None] * 4 + tl.arange(0, 4)[None, None, :],
                mask=g_mask[:, :, None], other=0)                    # [BN, C, 4] words
    mag, sign = 0x01C001C0, 0x80008000
    w0 = _halves(((x << 6) & mag) | ((x << 12) & sign))
    w1 = _halves(((x << 2) & mag) | ((x << 8) & sign))
    w2 = _halves(((x >> 2) & mag) | ((x << 4) & sign))
    w3 = _halves(((x >> 6) & mag) | (x & sign))
    w = tl.join(tl.join(w0, w1), tl.join(w2, w3))     # [BN, C, 4, h, v, u]: k = 4h + 2u + v
    return tl.reshape(w, (rows.shape[0], C, 32)), factor


@triton.jit
def _halves(pair):  # type: ignore[no-untyped-def]
    """[.., 2] fp32 of the low / high bf16 half of each uint32 (exact: bf16 is fp32's top half)."""
    lo = (pair << 16).to(tl.float32, bitcast=True)
    hi = (pair & 0xFFFF0000).to(tl.float32, bitcast=True)
    return tl.join(lo, hi)


@triton.jit
def _fp8_weights(w_ptr, s_ptr, e, rows, k0, K, n_mask,  # type: ignore[no-untyped-def]
                 stride_we, stride_wn, stride_se, stride_sn, C: tl.constexpr):
    """([BLOCK_N, C, 16] fp32 e4m3 values of W rows at k in [k0, k0 + 16 C); [BLOCK_N, 1] block
    scales 2^(s - 127), one per row: the step lies in one 128-wide k block)."""
    offs_k = k0 + tl.arange(0, C)[:, None] * 16 + tl.arange(0, 16)[None, :]
    mask = n_mask[:, None, None] & (offs_k < K)[None, :, :]
    codes = tl.load(w_ptr + e * stride_we + rows[:, None, None] * stride_wn + offs_k[None, :, :],
                    mask=mask, other=0)
    w = codes.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    scale = e8m0(tl.load(s_ptr + e * stride_se + (rows // 128) * stride_sn + k0 // 128,
                         mask=n_mask, other=127))
    return w, scale[:, None]


@triton.jit
def _acts(a_rows, p_mask, k0, K, FMT: tl.constexpr,  # type: ignore[no-untyped-def]
          C: tl.constexpr):
    """[BM, C, CHUNK] fp32 activations at k0 (a_rows: [BM] row pointers), in the weights' k
    order (FP4: `fma_order` within each 8)."""
    CHUNK: tl.constexpr = 32 if FMT == 2 else 16
    offs = k0 + tl.arange(0, C)[:, None] * CHUNK + tl.arange(0, CHUNK)[None, :]
    a = tl.load(a_rows[:, None, None] + offs[None, :, :],
                mask=p_mask[:, None, None] & (offs < K)[None, :, :], other=0.0)
    if FMT == 2:
        BM: tl.constexpr = a.shape[0]
        a = tl.reshape(tl.permute(tl.reshape(a, (BM, C, 4, 2, 2, 2)), (0, 1, 2, 3, 5, 4)),
                       (BM, C, 32))
    return a


@triton.jit
def fma_step(acc, a, w_ptr, s_ptr, e, rows, k0, K, n_mask,  # type: ignore[no-untyped-def]
             stride_we, stride_wn, stride_se, stride_sn, FMT: tl.constexpr, C: tl.constexpr,
             SHIFT: tl.constexpr):
    """acc [BM, BLOCK_N, C] + the scaled chunk partials of one K step (a: `_acts`)."""
    if FMT == 2:
        w, factor = _fp4_weights(w_ptr, s_ptr, e, rows, k0, K, n_mask, stride_we, stride_wn,
                                 stride_se, stride_sn, C, SHIFT)
    else:
        w, factor = _fp8_weights(w_ptr, s_ptr, e, rows, k0, K, n_mask, stride_we, stride_wn,
                                 stride_se, stride_sn, C)
    part = tl.sum(w[None, :, :, :] * a[:, None, :, :], axis=3)
    return acc + part * factor[None, :, :]


@triton.jit
def _gate_up_fma_kernel(  # type: ignore[no-untyped-def]
    x_ptr, w1_ptr, w3_ptr, s1_ptr, s3_ptr, h_ptr, order_ptr, rw_ptr, t_start_ptr, t_end_ptr,
    t_exp_ptr, K, INTER, limit,
    stride_x, stride_we, stride_wn, stride_se, stride_sn, stride_h,
    TOPK: tl.constexpr, FMT: tl.constexpr, SHIFT: tl.constexpr, H_DTYPE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    NUM_STAGES: tl.constexpr, LIBDEVICE: tl.constexpr,
):
    """h[p, n] = the gate/up epilogue of rows p of one tile; x: fp32 pre-scaled by 2^SHIFT; h is
    written the same way (fp32 of the H_DTYPE-rounded value times 2^SHIFT) for the down launch."""
    CHUNK: tl.constexpr = 32 if FMT == 2 else 16
    C: tl.constexpr = BLOCK_K // CHUNK
    tile = tl.program_id(0)
    row_start = tl.load(t_start_ptr + tile)
    row_end = tl.load(t_end_ptr + tile)
    if row_start < row_end:
        e = tl.load(t_exp_ptr + tile).to(tl.int64)  # NOTE: int64: e * stride_we passes 2^31 (Flash)
        offs_p = row_start.to(tl.int64) + tl.arange(0, BLOCK_M)
        p_mask = offs_p < row_end
        slot = tl.load(order_ptr + offs_p, mask=p_mask, other=0)
        x_rows = x_ptr + (slot // TOPK) * stride_x
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = offs_n < INTER
        acc_g = tl.zeros((BLOCK_M, BLOCK_N, C), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_M, BLOCK_N, C), dtype=tl.float32)
        for k0 in tl.range(0, K, BLOCK_K, num_stages=NUM_STAGES):
            a = _acts(x_rows, p_mask, k0, K, FMT, C)
            acc_g = fma_step(acc_g, a, w1_ptr, s1_ptr, e, offs_n, k0, K, n_mask, stride_we,
                             stride_wn, stride_se, stride_sn, FMT, C, SHIFT)
            acc_u = fma_step(acc_u, a, w3_ptr, s3_ptr, e, offs_n, k0, K, n_mask, stride_we,
                             stride_wn, stride_se, stride_sn, FMT, C, SHIFT)
        rw = tl.load(rw_ptr + slot, mask=p_mask, other=0.0)
        h = swiglu_f32(tl.sum(acc_g, axis=2), tl.sum(acc_u, axis=2), limit, tl.float32,
                       LIBDEVICE) * rw[:, None]
        h = h.to(H_DTYPE).to(tl.float32) * _pow2(SHIFT)
        tl.store(h_ptr + offs_p[:, None] * stride_h + offs_n[None, :], h,
                 mask=p_mask[:, None] & n_mask[None, :])


@triton.jit
def _down_fma_kernel(  # type: ignore[no-untyped-def]
    h_ptr, w_ptr, s_ptr, out_ptr, order_ptr, t_start_ptr, t_end_ptr, t_exp_ptr,
    K, D,
    stride_h, stride_we, stride_wn, stride_se, stride_sn, stride_o,
    TOPK: tl.constexpr, FMT: tl.constexpr, SHIFT: tl.constexpr, ATOMIC: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    NUM_STAGES: tl.constexpr,
):
    CHUNK: tl.constexpr = 32 if FMT == 2 else 16
    C: tl.constexpr = BLOCK_K // CHUNK
    tile = tl.program_id(0)
    row_start = tl.load(t_start_ptr + tile)
    row_end = tl.load(t_end_ptr + tile)
    if row_start < row_end:
        e = tl.load(t_exp_ptr + tile).to(tl.int64)
        offs_p = row_start.to(tl.int64) + tl.arange(0, BLOCK_M)
        p_mask = offs_p < row_end
        slot = tl.load(order_ptr + offs_p, mask=p_mask, other=0)
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = offs_n < D
        h_rows = h_ptr + offs_p * stride_h
        acc = tl.zeros((BLOCK_M, BLOCK_N, C), dtype=tl.float32)
        for k0 in tl.range(0, K, BLOCK_K, num_stages=NUM_STAGES):
            a = _acts(h_rows, p_mask, k0, K, FMT, C)
            acc = fma_step(acc, a, w_ptr, s_ptr, e, offs_n, k0, K, n_mask, stride_we,
                           stride_wn, stride_se, stride_sn, FMT, C, SHIFT)
        y = tl.sum(acc, axis=2)
        o_mask = p_mask[:, None] & n_mask[None, :]
        if ATOMIC:
            tok = slot // TOPK
            tl.atomic_add(out_ptr + tok[:, None] * stride_o + offs_n[None, :], y, mask=o_mask)
        else:
            tl.store(out_ptr + slot[:, None] * stride_o + offs_n[None, :], y, mask=o_mask)


@triton.jit
def _pow2(SHIFT: tl.constexpr):  # type: ignore[no-untyped-def]
    """2^SHIFT as fp32 (0 <= SHIFT < 128), built from its bits."""
    return tl.full((1,), (SHIFT + 127) << 23, tl.int32).to(tl.float32, bitcast=True)


def fma_activations(x: torch.Tensor, fmt: int) -> torch.Tensor:
    """x as the fma kernels read it: fp32 times 2^act_shift(fmt) (one launch; exact below
    2^(128 - ACT_SHIFT))."""
    out = torch.empty(x.shape, dtype=torch.float32, device=x.device)
    return torch.mul(x, float(2 ** act_shift(fmt)), out=out)


_H_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


def fma_launches(x: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, s1: torch.Tensor,
                 s3: torch.Tensor, w2: torch.Tensor, s2: torch.Tensor, tiles: TileMap,
                 rw: torch.Tensor, limit: float, fmt: int, topk: int, deterministic: bool,
                 plan: MoePlan, libdevice: bool) -> torch.Tensor:
    """The fma loop's gate/up and down launches (`moe.py::_launch` contract): quantised codes as
    uint8, w1 / w3 (s1 / s3) sharing strides; [N, d] fp32 out (deterministic: [N*k, d] rows
    summed over k in a fixed order)."""
    order, t_start, t_end, t_exp = tiles
    nk, inter, d = order.numel(), w1.shape[1], x.shape[1]
    N = nk // topk
    xs = fma_activations(x, fmt)
    common = {"TOPK": topk, "FMT": fmt, "SHIFT": act_shift(fmt), "BLOCK_M": plan.block_m,
              "BLOCK_K": plan.block_k, "NUM_STAGES": plan.num_stages}
    h = torch.empty(nk, inter, dtype=torch.float32, device=x.device)
    bn, warps = plan.gate_up.block_n, plan.gate_up.num_warps
    _gate_up_fma_kernel[(t_start.numel(), triton.cdiv(inter, bn))](
        xs, w1, w3, s1, s3, h, order, rw, t_start, t_end, t_exp, d, inter, float(limit),
        xs.stride(0), w1.stride(0), w1.stride(1), s1.stride(0), s1.stride(1), h.stride(0),
        H_DTYPE=_H_DTYPES[x.dtype], LIBDEVICE=libdevice, BLOCK_N=bn, num_warps=warps, **common,
    )
    dest = (torch.zeros(N, d, dtype=torch.float32, device=x.device) if not deterministic
            else torch.empty(nk, d, dtype=torch.float32, device=x.device))
    bn, warps = plan.down.block_n, plan.down.num_warps
    _down_fma_kernel[(t_start.numel(), triton.cdiv(d, bn))](
        h, w2, s2, dest, order, t_start, t_end, t_exp, inter, d,
        h.stride(0), w2.stride(0), w2.stride(1), s2.stride(0), s2.stride(1), dest.stride(0),
        ATOMIC=not deterministic, BLOCK_N=bn, num_warps=warps, **common,
    )
    return dest if not deterministic else dest.view(N, topk, d).sum(dim=1)
