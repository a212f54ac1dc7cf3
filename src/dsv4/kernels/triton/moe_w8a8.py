"""W8A8 routed experts on FP8 tensor cores: the fast form of `ref/moe.py::routed_experts_a8` for
FP8 experts (`triton_routed_experts_quant(..., fmt="fp8", act_quant=True)`, variant "w8a8").

DeepGEMM's scheme (spec §11.1-2, the reference model's numerics): activations quantised per token
and per 128 channels (`act_quant.py`), weights e4m3 with 128x128 block scales. Each K step is one
128-wide block: an e4m3 x e4m3 dot into a fresh fp32 tile (wgmma at BLOCK_M >= 64 on sm_90, whose
accumulation inside one dot is less precise than fp32), then promoted: multiplied by the
activation rows' scales times the weight block's scale (one per tile: BLOCK_N <= 128 divides
128; powers of two: exact) and added to the fp32 accumulator, one FFMA per element (`fp8_dot.py`).
So the MMA runs at FP8 rate and no rounding crosses a 128-block boundary below fp32.

Two launches on the tile map and 1-D grid of `moe.py` (a tile's output blocks adjacent):
  1. gate/up: A = the token's e4m3 row of x (gathered; its scales beside it), two accumulators,
     SwiGLU + clamp in fp32, h rounded to x's dtype (as the reference), then quantised in the
     epilogue: BLOCK_N = 128 is one scale block of h, so each program writes its rows' e4m3 codes
     and one scale per row ([N*k, I] bytes + [N*k, ceil(I/128)] fp32, sorted order). No routing
     weight here: it would change h's quantisation.
  2. down: A = h's codes (contiguous rows) with their scales; the epilogue multiplies the fp32
     rows by the routing weight, then adds atomically into out[token] or stores the (token, k)
     row (deterministic), as `moe.py`.
The fp32 dots of the interpreter (FP32_DOT) decode both operands to fp32: exact products.
Test: tests/kernels/test_moe_w8a8.py. Benchmark: benchmarks/kernels/bench_moe_quant.py
(`--act-quant`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_wait

from dsv4.kernels.triton.act_quant import quant_rows, triton_act_quant
from dsv4.kernels.triton.fp8_dot import fp8_block_dot, promote, round_bf16
from dsv4.kernels.triton.moe_plan import MoePlan
from dsv4.kernels.triton.moe_tile_map import TileMap, tile_and_block
from dsv4.kernels.triton.pdl import pdl_args
from dsv4.kernels.triton.swiglu import swiglu_f32

W8A8_BLOCK = 128
"""The K step, the activation scale block and the weight scale block, all one."""

X_DTYPES = (torch.float32, torch.bfloat16)


@triton.jit
def _w8a8_gate_up_kernel(  # type: ignore[no-untyped-def]
    x_ptr, xs_ptr, w1_ptr, w3_ptr, s1_ptr, s3_ptr, h_ptr, hs_ptr, order_ptr,
    t_start_ptr, t_end_ptr, t_exp_ptr, K, INTER, limit,
    stride_x, stride_xs, stride_we, stride_wn, stride_se, stride_sn, stride_h, stride_hs,
    TOPK: tl.constexpr, H_BF16: tl.constexpr, FP32_DOT: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, LIBDEVICE: tl.constexpr, PDL: tl.constexpr):
    if PDL:  # programmatic dependent launch: the prior kernel's writes first
        gdc_wait()
    tile, n_block = tile_and_block(INTER, BLOCK_N)
    row_start = tl.load(t_start_ptr + tile)
    row_end = tl.load(t_end_ptr + tile)
    if row_start < row_end:
        e = tl.load(t_exp_ptr + tile).to(tl.int64)  # NOTE: int64: e * stride_we passes 2^31 (Flash)
        offs_p = row_start.to(tl.int64) + tl.arange(0, BLOCK_M)  # NOTE: int64: N*k*I can pass 2^31
        p_mask = offs_p < row_end
        tok = tl.load(order_ptr + offs_p, mask=p_mask, other=0) // TOPK
        offs_n = n_block * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = offs_n < INTER
        w_rows = e * stride_we + offs_n[None, :] * stride_wn
        s_row = e * stride_se + (n_block * BLOCK_N // 128) * stride_sn
        acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, 128):
            offs_k = k0 + tl.arange(0, 128)
            k_mask = offs_k < K
            a_ptrs = x_ptr + tok[:, None] * stride_x + offs_k[None, :]
            a_mask = p_mask[:, None] & k_mask[None, :]
            w_mask = k_mask[:, None] & n_mask[None, :]
            xs = tl.load(xs_ptr + tok * stride_xs + k0 // 128, mask=p_mask, other=0.0)
            part = fp8_block_dot(a_ptrs, a_mask, w1_ptr + w_rows + offs_k[:, None], w_mask,
                                 FP32_DOT)
            acc_g = promote(acc_g, part, xs, s1_ptr + s_row + k0 // 128)
            part = fp8_block_dot(a_ptrs, a_mask, w3_ptr + w_rows + offs_k[:, None], w_mask,
                                 FP32_DOT)
            acc_u = promote(acc_u, part, xs, s3_ptr + s_row + k0 // 128)
        h = swiglu_f32(acc_g, acc_u, limit, tl.float32, LIBDEVICE)
        if H_BF16:    # rounded to x's dtype, as the reference's h
            h = round_bf16(h)
        codes, scale = quant_rows(tl.where(n_mask[None, :], h, 0.0))
        tl.store(h_ptr + offs_p[:, None] * stride_h + offs_n[None, :], codes,
                 mask=p_mask[:, None] & n_mask[None, :])
        tl.store(hs_ptr + offs_p * stride_hs + n_block, scale, mask=p_mask)


@triton.jit
def _w8a8_down_kernel(  # type: ignore[no-untyped-def]
    h_ptr, hs_ptr, w_ptr, s_ptr, out_ptr, order_ptr, rw_ptr, t_start_ptr, t_end_ptr, t_exp_ptr,
    K, D, stride_h, stride_hs, stride_we, stride_wn, stride_se, stride_sn, stride_o,
    TOPK: tl.constexpr, FP32_DOT: tl.constexpr, ATOMIC: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, PDL: tl.constexpr):
    if PDL:  # programmatic dependent launch: the prior kernel's writes first
        gdc_wait()
    tile, n_block = tile_and_block(D, BLOCK_N)
    row_start = tl.load(t_start_ptr + tile)
    row_end = tl.load(t_end_ptr + tile)
    if row_start < row_end:
        e = tl.load(t_exp_ptr + tile).to(tl.int64)
        offs_p = row_start.to(tl.int64) + tl.arange(0, BLOCK_M)  # NOTE: int64: N*k*I can pass 2^31
        p_mask = offs_p < row_end
        slot = tl.load(order_ptr + offs_p, mask=p_mask, other=0)
        offs_n = n_block * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = offs_n < D
        w_rows = e * stride_we + offs_n[None, :] * stride_wn
        s_row = e * stride_se + (n_block * BLOCK_N // 128) * stride_sn
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, 128):
            offs_k = k0 + tl.arange(0, 128)
            k_mask = offs_k < K
            hs = tl.load(hs_ptr + offs_p * stride_hs + k0 // 128, mask=p_mask, other=0.0)
            part = fp8_block_dot(h_ptr + offs_p[:, None] * stride_h + offs_k[None, :],
                              p_mask[:, None] & k_mask[None, :], w_ptr + w_rows + offs_k[:, None],
                              k_mask[:, None] & n_mask[None, :], FP32_DOT)
            acc = promote(acc, part, hs, s_ptr + s_row + k0 // 128)
        acc = acc * tl.load(rw_ptr + slot, mask=p_mask, other=0.0)[:, None]
        o_mask = p_mask[:, None] & n_mask[None, :]
        if ATOMIC:
            tok = slot // TOPK
            tl.atomic_add(out_ptr + tok[:, None] * stride_o + offs_n[None, :], acc, mask=o_mask)
        else:
            tl.store(out_ptr + slot[:, None] * stride_o + offs_n[None, :], acc, mask=o_mask)


def w8a8_launches(x: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, s1: torch.Tensor,
                  s3: torch.Tensor, w2: torch.Tensor, s2: torch.Tensor, tiles: TileMap,
                  rw: torch.Tensor, limit: float, topk: int, deterministic: bool, plan: MoePlan,
                  libdevice: bool) -> torch.Tensor:
    """x's quantisation and the two launches: [N, d] fp32 (atomic) or the [N*k, d] rows
    (deterministic) that `moe.py`'s combine sums over k. Weights are uint8 e4m3 codes, scales uint8
    e8m0 codes (w1 / w3 and s1 / s3 share their strides); the callers check shapes."""
    if x.dtype not in X_DTYPES:
        raise ValueError(f"act_quant takes bf16 or fp32 activations; got {x.dtype}")
    order, t_start, t_end, t_exp = tiles
    N, d, inter, nk = x.shape[0], w2.shape[1], w1.shape[1], rw.numel()
    xq, xs = triton_act_quant(x, W8A8_BLOCK)
    xq = xq.view(torch.uint8)
    h = torch.empty(nk, inter, dtype=torch.uint8, device=x.device)
    hs = torch.empty(nk, triton.cdiv(inter, W8A8_BLOCK), dtype=torch.float32, device=x.device)
    fp32_dot = x.device.type != "cuda"
    common = {"TOPK": topk, "FP32_DOT": fp32_dot, "BLOCK_M": plan.block_m,
              "num_stages": plan.num_stages}
    bn, warps = plan.gate_up.block_n, plan.gate_up.num_warps
    assert bn == W8A8_BLOCK, "the gate/up epilogue quantises one 128-wide block of h per program"
    _w8a8_gate_up_kernel[(t_start.numel() * triton.cdiv(inter, bn),)](
        xq, xs, w1, w3, s1, s3, h, hs, order, t_start, t_end, t_exp, d, inter, float(limit),
        xq.stride(0), xs.stride(0), w1.stride(0), w1.stride(1), s1.stride(0), s1.stride(1),
        h.stride(0), hs.stride(0), H_BF16=x.dtype == torch.bfloat16, BLOCK_N=bn, num_warps=warps,
        LIBDEVICE=libdevice, **common, **pdl_args(x.device))
    dest = (torch.zeros(N, d, dtype=torch.float32, device=x.device) if not deterministic
            else torch.empty(nk, d, dtype=torch.float32, device=x.device))
    bn, warps = plan.down.block_n, plan.down.num_warps
    _w8a8_down_kernel[(t_start.numel() * triton.cdiv(d, bn),)](
        h, hs, w2, s2, dest, order, rw, t_start, t_end, t_exp, inter, d,
        h.stride(0), hs.stride(0), w2.stride(0), w2.stride(1), s2.stride(0), s2.stride(1),
        dest.stride(0), ATOMIC=not deterministic, BLOCK_N=bn, num_warps=warps, **common,
        **pdl_args(h.device))
    return dest
