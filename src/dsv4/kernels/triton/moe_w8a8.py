"""W8A8 routed experts on FP8 tensor cores: the fast form of `ref/moe.py::routed_experts_a8` for
FP8 and FP4 experts (`triton_routed_experts_quant(..., act_quant=True)`, variant "w8a8").

DeepGEMM's scheme (spec §11.1-2, the reference model's numerics): activations quantised per token
and per 128 channels (`act_quant.py`), weights e4m3 with 128x128 block scales. Each K step is one
128-wide block: an e4m3 x e4m3 dot into a fresh fp32 tile (wgmma at BLOCK_M >= 64 on sm_90, whose
accumulation inside one dot is less precise than fp32), then promoted: multiplied by the
activation rows' scales times the weight block's scale (one per tile: BLOCK_N <= 128 divides
128; powers of two: exact) and added to the fp32 accumulator, one FFMA per element (`fp8_dot.py`).
So the MMA runs at FP8 rate and no rounding crosses a 128-block boundary below fp32.

FP4 weights (e2m1, per-32 UE8M0 scales, the checkpoint's experts) run the same loop: each row's
128-wide block takes its largest group scale as the block scale and its weights become e4m3
values e2m1 * 2^(s - smax) in registers (`_fp4_block`; exact while the block's scales span at
most 8 binades, `check_fp4_a8_exact`), the low nibbles against the activations' even columns and
the high ones against the odd columns (x and h stored in that order per block, `half_order`), so
no join or reshape sits between the decode and the FP8 MMA. d and I must be multiples of 128.

Two launches on the tile map and 1-D grid of `moe.py` (a tile's output blocks adjacent):
  1. gate/up: A = the token's e4m3 row of x (gathered; its scales beside it), two accumulators,
     SwiGLU + clamp in fp32, h rounded to x's dtype (as the reference), then quantised in the
     epilogue: BLOCK_N = 128 is one scale block of h, so each program writes its rows' e4m3 codes
     and one scale per row ([N*k, I] bytes + [N*k, ceil(I/128)] fp32, sorted order). No routing
     weight here: it would change h's quantisation.
  2. down: A = h's codes (contiguous rows) with their scales; the epilogue multiplies the fp32
     rows by the routing weight and stores the (token, k) row, which `moe.py`'s combine sums
     in a fixed order: always, as it is faster than atomic adds into out[token] here (`moe.py`).
The fp32 dots of the interpreter (FP32_DOT) decode both operands to fp32: exact products.
Test: tests/kernels/test_moe_w8a8.py. Benchmark: benchmarks/kernels/bench_moe_quant.py
(variant `w8a8`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsv4.kernels.triton.act_quant import half_order, quant_rows, triton_act_quant
from dsv4.kernels.triton.fp8_dot import fp8_block_dot, promote, round_bf16
from dsv4.kernels.triton.moe_decode import e8m0
from dsv4.kernels.triton.moe_plan import MoePlan
from dsv4.kernels.triton.moe_tile_map import TileMap, tile_and_block, tile_rows
from dsv4.kernels.triton.pdl import pdl_args
from dsv4.kernels.triton.pdl_enter import pdl_enter
from dsv4.kernels.triton.swiglu import swiglu_f32

W8A8_BLOCK = 128
"""The K step, the activation scale block and the weight scale block, all one."""

X_DTYPES = (torch.float32, torch.bfloat16)
FP8, FP4 = 1, 2             # the FMT codes of `moe_mma.py::FMTS`
MAX_FP4_SPREAD = 8          # binades between a 128-block's group scales that decode exactly


@triton.jit
def _weight_block(acc, a_rows, p_mask, a_scale, w_ptr, s_ptr, e,  # type: ignore[no-untyped-def]
                  offs_n, n_mask, n0, k0, K, stride_we, stride_wn, stride_se, stride_sn,
                  FMT: tl.constexpr, FP32_DOT: tl.constexpr):
    """acc + the 128-wide K block at k0 of A (rows a_rows [BM, 1], e4m3 codes; scales a_scale
    [BM]) times W_e^T (rows offs_n, the first n0), promoted in fp32. FMT 1: e4m3 weights, one
    dot. FMT 2: e2m1 weights decoded to e4m3 (`_fp4_block`), two dots (K a multiple of 128)."""
    # if / else, not an early return: the compiler type-checks code after a return (FMT 2's
    # weights are bytes, FMT 1's e4m3)
    if FMT == 2:
        acc = _fp4_block(acc, a_rows, p_mask, a_scale, w_ptr, s_ptr, e, offs_n, n_mask, k0,
                         stride_we, stride_wn, stride_se, stride_sn, FP32_DOT)
    else:
        offs_k = k0 + tl.arange(0, 128)
        k_mask = offs_k < K
        part = fp8_block_dot(a_rows + offs_k[None, :], p_mask[:, None] & k_mask[None, :],
                             w_ptr + e * stride_we + offs_n[None, :] * stride_wn
                             + offs_k[:, None], k_mask[:, None] & n_mask[None, :], FP32_DOT)
        # one scale block row for the tile: BLOCK_N <= 128 divides 128
        s_row = s_ptr + e * stride_se + (n0 // 128) * stride_sn
        acc = promote(acc, part, a_scale, s_row + k0 // 128)
    return acc


@triton.jit
def _fp4_e4m3(nib, t):  # type: ignore[no-untyped-def]
    """e2m1 code nib (int32 in [0, 16)) times 2^-d as an e4m3 value, t = 252 - 2d. Built as fp32
    bits: a magnitude code mag >= 2 (2^(e-1) (1 + m / 2)) has the bits (mag + 252) << 22, mag 1
    (0.5) has (mag + 251) << 22, and 2^-d takes 2d off the same field; then the sign, then the
    convert, exact while d <= 8 (`check_fp4_a8_exact`)."""
    mag = nib & 7
    bits = tl.where(mag == 0, 0, (mag + t - (mag == 1).to(tl.int32)) << 22)
    return (bits | ((nib & 8) << 28)).to(tl.float32, bitcast=True).to(tl.float8e4nv)


@triton.jit
def _col(t, g, c: tl.constexpr):  # type: ignore[no-untyped-def]
    """Column c of a [BN, 4] tensor t (g: arange(0, 4)[None, :]) as [BN, 1]."""
    return tl.sum(tl.where(g == c, t, 0), axis=1)[:, None]


@triton.jit
def _fp4_block(acc, a_rows, p_mask, a_scale, w_ptr, s_ptr, e,  # type: ignore[no-untyped-def]
               offs_n, n_mask, k0, stride_we, stride_wn, stride_se, stride_sn,
               FP32_DOT: tl.constexpr):
    """One 128-wide K block of e2m1 weights (64 bytes per row: byte j holds k = 2j, 2j + 1) and
    their four per-32 UE8M0 scales: each row's largest scale 2^(smax - 127) becomes the block's
    (applied at the promotion, per output column), each weight e2m1 * 2^(s - smax) an e4m3 value.
    The low nibbles meet the activations' even columns, the high ones the odd columns: the
    activations of a block are in `half_order` (evens, then odds), so each operand is a plain
    [BN, 64] tile and no join or reshape stands between the decode and the MMA."""
    offs_j = tl.arange(0, 64)
    row = w_ptr + e * stride_we + offs_n[:, None] * stride_wn
    raw = tl.load(row + k0 // 2 + offs_j[None, :], mask=n_mask[:, None], other=0).to(tl.int32)
    g = tl.arange(0, 4)[None, :]
    s4 = tl.load(s_ptr + e * stride_se + offs_n[:, None] * stride_sn + k0 // 32 + g,
                 mask=n_mask[:, None], other=0).to(tl.int32)           # [BN, 4] group scales
    smax = tl.max(s4, axis=1)
    t4 = 252 - 2 * tl.minimum(smax[:, None] - s4, 60)        # 252 - 2d per group (d >= 0)
    # each byte's group (j // 16) from the four columns: selects, no per-element gather
    j = offs_j[None, :]
    t = tl.where(j < 32, tl.where(j < 16, _col(t4, g, 0), _col(t4, g, 1)),
                 tl.where(j < 48, _col(t4, g, 2), _col(t4, g, 3)))
    lo = tl.trans(_fp4_e4m3(raw & 15, t))
    hi = tl.trans(_fp4_e4m3(raw >> 4, t))
    offs_a = k0 + offs_j
    a_lo = tl.load(a_rows + offs_a[None, :], mask=p_mask[:, None], other=0.0)
    a_hi = tl.load(a_rows + 64 + offs_a[None, :], mask=p_mask[:, None], other=0.0)
    if FP32_DOT:
        part = tl.dot(a_lo.to(tl.float32), lo.to(tl.float32), input_precision="ieee")
        part = tl.dot(a_hi.to(tl.float32), hi.to(tl.float32), part, input_precision="ieee")
    else:
        part = tl.dot(a_hi, hi, tl.dot(a_lo, lo))
    return acc + part * a_scale[:, None] * e8m0(smax)[None, :]


@triton.jit
def _w8a8_gate_up_kernel(  # type: ignore[no-untyped-def]
    x_ptr, xs_ptr, w1_ptr, w3_ptr, s1_ptr, s3_ptr, h_ptr, hs_ptr, order_ptr,
    t_start_ptr, t_end_ptr, t_exp_ptr, K, INTER, limit,
    stride_x, stride_xs, stride_we, stride_wn, stride_se, stride_sn, stride_h, stride_hs,
    TOPK: tl.constexpr, FMT: tl.constexpr, H_BF16: tl.constexpr, FP32_DOT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, LIBDEVICE: tl.constexpr, PDL: tl.constexpr):
    pdl_enter(PDL)
    tile, n_block = tile_and_block(INTER, BLOCK_N)
    e, offs_p, p_mask, live = tile_rows(t_start_ptr, t_end_ptr, t_exp_ptr, tile, BLOCK_M)
    if live:
        tok = tl.load(order_ptr + offs_p, mask=p_mask, other=0) // TOPK
        offs_n = n_block * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = offs_n < INTER
        acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        a_rows = x_ptr + tok[:, None] * stride_x
        for k0 in range(0, K, 128):
            xs = tl.load(xs_ptr + tok * stride_xs + k0 // 128, mask=p_mask, other=0.0)
            acc_g = _weight_block(acc_g, a_rows, p_mask, xs, w1_ptr, s1_ptr, e, offs_n, n_mask,
                                  n_block * BLOCK_N, k0, K, stride_we, stride_wn, stride_se,
                                  stride_sn, FMT, FP32_DOT)
            acc_u = _weight_block(acc_u, a_rows, p_mask, xs, w3_ptr, s3_ptr, e, offs_n, n_mask,
                                  n_block * BLOCK_N, k0, K, stride_we, stride_wn, stride_se,
                                  stride_sn, FMT, FP32_DOT)
        h = swiglu_f32(acc_g, acc_u, limit, tl.float32, LIBDEVICE)
        if H_BF16:    # rounded to x's dtype, as the reference's h
            h = round_bf16(h)
        codes, scale = quant_rows(tl.where(n_mask[None, :], h, 0.0))
        cols = offs_n
        if FMT == 2:     # FP4 weights: h in the down launch's even / odd order (module doc)
            cols = n_block * BLOCK_N + half_order(tl.arange(0, BLOCK_N), BLOCK_N)
        tl.store(h_ptr + offs_p[:, None] * stride_h + cols[None, :],
                 codes.to(tl.float8e4nv, bitcast=True),
                 mask=p_mask[:, None] & n_mask[None, :])
        tl.store(hs_ptr + offs_p * stride_hs + n_block, scale, mask=p_mask)


@triton.jit
def _w8a8_down_kernel(  # type: ignore[no-untyped-def]
    h_ptr, hs_ptr, w_ptr, s_ptr, out_ptr, order_ptr, rw_ptr, t_start_ptr, t_end_ptr, t_exp_ptr,
    K, D, stride_h, stride_hs, stride_we, stride_wn, stride_se, stride_sn, stride_o,
    TOPK: tl.constexpr, FMT: tl.constexpr, FP32_DOT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PDL: tl.constexpr):
    pdl_enter(PDL)
    tile, n_block = tile_and_block(D, BLOCK_N)
    e, offs_p, p_mask, live = tile_rows(t_start_ptr, t_end_ptr, t_exp_ptr, tile, BLOCK_M)
    if live:
        slot = tl.load(order_ptr + offs_p, mask=p_mask, other=0)
        offs_n = n_block * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = offs_n < D
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        a_rows = h_ptr + offs_p[:, None] * stride_h
        for k0 in range(0, K, 128):
            hs = tl.load(hs_ptr + offs_p * stride_hs + k0 // 128, mask=p_mask, other=0.0)
            acc = _weight_block(acc, a_rows, p_mask, hs, w_ptr, s_ptr, e, offs_n, n_mask,
                                n_block * BLOCK_N, k0, K, stride_we, stride_wn, stride_se,
                                stride_sn, FMT, FP32_DOT)
        acc = acc * tl.load(rw_ptr + slot, mask=p_mask, other=0.0)[:, None]
        tl.store(out_ptr + slot[:, None] * stride_o + offs_n[None, :], acc,
                 mask=p_mask[:, None] & n_mask[None, :])


def check_fp4_a8_exact(scale: torch.Tensor) -> None:
    """Raise ValueError unless FP4 weights with these per-32 UE8M0 scales ([..., in / 32] codes,
    in a multiple of 128) decode to e4m3 exactly in the W8A8 loop: within each row's 128-wide
    block every group scale is at most 8 binades below the largest (an e2m1 value 0.5 .. 6 times
    2^-8 is still an e4m3 value; below, the smallest round). Reads the scales on the host: call it
    once, where the weights are loaded."""
    codes = scale.view(torch.uint8).to(torch.int16)
    blocks = codes.reshape(*codes.shape[:-1], -1, 4)
    spread = int((blocks.amax(-1) - blocks.amin(-1)).max()) if blocks.numel() else 0
    if spread > MAX_FP4_SPREAD:
        raise ValueError(f"fp4 scales span {spread} binades within a 128-wide block; the W8A8 "
                         f"loop decodes to e4m3 exactly up to {MAX_FP4_SPREAD}")


def maxnreg_option(max_regs: int | None) -> dict[str, int]:
    """A register cap as Triton's launch / compile option (None: the compiler's choice)."""
    return {} if max_regs is None else {"maxnreg": max_regs}


def w8a8_launches(x: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, s1: torch.Tensor,
                  s3: torch.Tensor, w2: torch.Tensor, s2: torch.Tensor, tiles: TileMap,
                  rw: torch.Tensor, limit: float, fmt: int, topk: int, plan: MoePlan,
                  libdevice: bool) -> torch.Tensor:
    """x's quantisation and the two launches (fmt: FP8 or FP4): the [N*k, d] fp32 rows that
    `moe.py`'s combine sums over k (always: faster than an atomic epilogue, and deterministic).
    Weights are e4m3 codes (FP8) or packed e2m1 pairs (FP4: exact only where
    `check_fp4_a8_exact` holds), scales uint8 e8m0 codes (w1 / w3 and s1 / s3 share their
    strides); the callers check shapes."""
    if x.dtype not in X_DTYPES:
        raise ValueError(f"act_quant takes bf16 or fp32 activations; got {x.dtype}")
    assert fmt in (FP8, FP4), fmt
    order, t_start, t_end, t_exp = tiles
    d, inter, nk = w2.shape[1], w1.shape[1], rw.numel()
    if fmt == FP4 and (d % W8A8_BLOCK or inter % W8A8_BLOCK):
        raise ValueError(f"fp4 with act_quant needs d and I multiples of {W8A8_BLOCK}; got "
                         f"d = {d}, I = {inter}")
    xq, xs = triton_act_quant(x, W8A8_BLOCK, half_order=fmt == FP4)
    e4m3 = torch.float8_e4m3fn     # the dots' operands (`fp8_dot.py`), FP4 weights stay packed
    w1, w3, w2 = ((w.view(e4m3) for w in (w1, w3, w2)) if fmt == FP8 else (w1, w3, w2))
    h = torch.empty(nk, inter, dtype=e4m3, device=x.device)
    hs = torch.empty(nk, triton.cdiv(inter, W8A8_BLOCK), dtype=torch.float32, device=x.device)
    fp32_dot = x.device.type != "cuda"
    common = {"TOPK": topk, "FMT": fmt, "FP32_DOT": fp32_dot, "BLOCK_M": plan.block_m,
              "num_stages": plan.num_stages}
    bn, warps = plan.gate_up.block_n, plan.gate_up.num_warps
    assert bn == W8A8_BLOCK, "the gate/up epilogue quantises one 128-wide block of h per program"
    _w8a8_gate_up_kernel[(t_start.numel() * triton.cdiv(inter, bn),)](
        xq, xs, w1, w3, s1, s3, h, hs, order, t_start, t_end, t_exp, d, inter, float(limit),
        xq.stride(0), xs.stride(0), w1.stride(0), w1.stride(1), s1.stride(0), s1.stride(1),
        h.stride(0), hs.stride(0), H_BF16=x.dtype == torch.bfloat16, BLOCK_N=bn, num_warps=warps,
        LIBDEVICE=libdevice, **common, **maxnreg_option(plan.gate_up.max_regs),
        **pdl_args(x.device))
    dest = torch.empty(nk, d, dtype=torch.float32, device=x.device)
    bn, warps = plan.down.block_n, plan.down.num_warps
    _w8a8_down_kernel[(t_start.numel() * triton.cdiv(d, bn),)](
        h, hs, w2, s2, dest, order, rw, t_start, t_end, t_exp, inter, d,
        h.stride(0), hs.stride(0), w2.stride(0), w2.stride(1), s2.stride(0), s2.stride(1),
        dest.stride(0), BLOCK_N=bn, num_warps=warps, **common,
        **maxnreg_option(plan.down.max_regs), **pdl_args(h.device))
    return dest
