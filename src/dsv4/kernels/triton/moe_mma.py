"""The routed experts' tl.dot loops (`moe.py`'s default past the decode loops): the gate/up and
down kernels and their launches, over the whole layer or a decoded chunk of it.

Two launches, each on a 1-D grid of max_tiles x cdiv(out, BLOCK_N) programs, the output blocks of
one tile adjacent (BLOCK_N per launch: `moe_plan.py`; the order only decides which programs run
together: a tile's activation rows are read from HBM about once, not once per output block):
  1. gate/up: A = x[token of each sorted row] (gathered rows), two accumulators (W1 rows n, W3 rows
     I + n) so SwiGLU + clamp and the routing weight are fused in the epilogue (the shared
     expert's math, `swiglu.py::swiglu_f32`, in fp32); writes h [N*k, I] (x.dtype) in sorted
     order.
  2. down: A = h rows (contiguous), y = h @ W2^T; the epilogue either atomically adds y into
     out[token] (fp32, default: the k contributions of a token land in an unspecified order, so the
     result is not bit-reproducible run to run), or with `deterministic=True` stores y at its
     (token, k) slot of an [N*k, d] fp32 buffer (extra N*k*d*8 bytes of traffic). The W8A8
     loop always stores rows: on the H200 its atomic epilogue was slower at every N measured
     (benchmarks/results/quant_moe_h200_202612.md).
Each program finds its tile in the tile map (`moe_tile_map.py::expert_rows`: the tile's expert,
its sorted rows, and whether it is live; a launch over the experts [e_lo, e_hi) alone, the
decoded chunks of `moe_dequant.py`, reads its weights at e - e_lo and leaves other tiles dead).
The inner loops (`moe_decode.py::tile_dot`) decode the weight codes per `FMTS` code and variant.
No host syncs. Test: tests/kernels/test_moe_quant.py, test_moe_dequant.py.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from dsv4.kernels.triton.libm import libdevice_math
from dsv4.kernels.triton.moe_combine import down_output
from dsv4.kernels.triton.moe_decode import tile_dot
from dsv4.kernels.triton.moe_dequant import dequant_chunks
from dsv4.kernels.triton.moe_fp4 import fp4_word_order, planes_activations, planes_column
from dsv4.kernels.triton.moe_plan import VARIANTS, MoePlan
from dsv4.kernels.triton.moe_tile_map import expert_rows, tile_and_block
from dsv4.kernels.triton.pdl import pdl_args
from dsv4.kernels.triton.pdl_enter import pdl_enter
from dsv4.kernels.triton.swiglu import swiglu_f32

FMTS = {"bf16": 0, "fp8": 1, "fp4": 2}


@triton.jit
def _gate_up_kernel(  # type: ignore[no-untyped-def]
    x_ptr, w1_ptr, w3_ptr, s1_ptr, s3_ptr, h_ptr, order_ptr, rw_ptr, t_start_ptr, t_end_ptr,
    t_exp_ptr, K, INTER, limit, e_lo, e_hi,
    stride_x, stride_we, stride_wn, stride_se, stride_sn, stride_h,
    TOPK: tl.constexpr, FMT: tl.constexpr, VARIANT: tl.constexpr, FP32_DOT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    LIBDEVICE: tl.constexpr, PDL: tl.constexpr):
    pdl_enter(PDL)
    tile, n_block = tile_and_block(INTER, BLOCK_N)
    e, offs_p, p_mask, live = expert_rows(t_start_ptr, t_end_ptr, t_exp_ptr, tile, e_lo, e_hi,
                                          BLOCK_M)
    if live:
        slot = tl.load(order_ptr + offs_p, mask=p_mask, other=0)
        tok = slot // TOPK
        offs_n = n_block * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = offs_n < INTER
        x_rows = x_ptr + tok[:, None] * stride_x
        acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            a = _a_tile(x_rows, p_mask, k0, K, FMT, VARIANT, BLOCK_K)
            acc_g = tile_dot(acc_g, a, x_rows, p_mask[:, None], w1_ptr, s1_ptr, e, offs_n, k0, K,
                             n_mask, stride_we, stride_wn, stride_se, stride_sn, FMT, VARIANT,
                             FP32_DOT, BLOCK_K)
            acc_u = tile_dot(acc_u, a, x_rows, p_mask[:, None], w3_ptr, s3_ptr, e, offs_n, k0, K,
                             n_mask, stride_we, stride_wn, stride_se, stride_sn, FMT, VARIANT,
                             FP32_DOT, BLOCK_K)
        rw = tl.load(rw_ptr + slot, mask=p_mask, other=0.0)
        h = swiglu_f32(acc_g, acc_u, limit, tl.float32, LIBDEVICE) * rw[:, None]
        cols = offs_n
        if FMT == 2 and VARIANT == 5:   # h in the down launch's planes order
            cols = planes_column(offs_n, BLOCK_K)
        tl.store(h_ptr + offs_p[:, None] * stride_h + cols[None, :],
                 h.to(h_ptr.dtype.element_ty), mask=p_mask[:, None] & n_mask[None, :])


LIBDEVICE = libdevice_math(_gate_up_kernel)


@triton.jit
def _a_tile(a_rows, p_mask, k0, K, FMT: tl.constexpr,  # type: ignore[no-untyped-def]
            VARIANT: tl.constexpr, BLOCK_K: tl.constexpr):
    """[BM, BLOCK_K] activation tile at k0 (a_rows: [BM, 1] row pointers), its columns in the
    weight tile's k order (FP4 "words": `fp4_word_order`); a placeholder for split and planes FP4,
    which load their columns themselves."""
    if FMT == 2 and (VARIANT == 0 or VARIANT == 5):
        a = tl.zeros((1, 1), dtype=tl.float32)
    else:
        offs_k = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(a_rows + offs_k[None, :], mask=p_mask[:, None] & (offs_k < K)[None, :],
                    other=0.0)
        if FMT == 2 and VARIANT == 3:
            a = fp4_word_order(a)
    return a


@triton.jit
def _down_kernel(  # type: ignore[no-untyped-def]
    h_ptr, w_ptr, s_ptr, out_ptr, order_ptr, t_start_ptr, t_end_ptr, t_exp_ptr,
    K, D, e_lo, e_hi,
    stride_h, stride_we, stride_wn, stride_se, stride_sn, stride_o,
    TOPK: tl.constexpr, FMT: tl.constexpr, VARIANT: tl.constexpr, FP32_DOT: tl.constexpr,
    ATOMIC: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    PDL: tl.constexpr):
    pdl_enter(PDL)
    tile, n_block = tile_and_block(D, BLOCK_N)
    e, offs_p, p_mask, live = expert_rows(t_start_ptr, t_end_ptr, t_exp_ptr, tile, e_lo, e_hi,
                                          BLOCK_M)
    if live:
        slot = tl.load(order_ptr + offs_p, mask=p_mask, other=0)
        offs_n = n_block * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = offs_n < D
        h_rows = h_ptr + offs_p[:, None] * stride_h
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            a = _a_tile(h_rows, p_mask, k0, K, FMT, VARIANT, BLOCK_K)
            acc = tile_dot(acc, a, h_rows, p_mask[:, None], w_ptr, s_ptr, e, offs_n, k0, K,
                           n_mask, stride_we, stride_wn, stride_se, stride_sn, FMT, VARIANT,
                           FP32_DOT, BLOCK_K)
        o_mask = p_mask[:, None] & n_mask[None, :]
        if ATOMIC:
            tok = slot // TOPK
            tl.atomic_add(out_ptr + tok[:, None] * stride_o + offs_n[None, :], acc, mask=o_mask)
        else:
            tl.store(out_ptr + slot[:, None] * stride_o + offs_n[None, :], acc, mask=o_mask)


def raw(w: torch.Tensor, fmt: str) -> torch.Tensor:
    """Quantised codes as uint8 (the kernels decode them); bf16-path weights as they are."""
    return w if fmt == "bf16" else w.view(torch.uint8)


@dataclass(frozen=True)
class Decoded:
    """Quantised stacks (`fmt` "fp4" / "fp8", layouts per the module docstring) that the bf16 loop
    reads decoded `chunk` experts at a time (`moe_dequant.py`)."""

    w13: torch.Tensor
    w13_scale: torch.Tensor | None
    w2: torch.Tensor
    w2_scale: torch.Tensor | None
    fmt: str
    chunk: int


def mma_launches(x: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, s1: torch.Tensor,
                  s3: torch.Tensor, w2: torch.Tensor, s2: torch.Tensor,
                  tiles: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
                  rw: torch.Tensor, limit: float, fmt: str, topk: int, deterministic: bool,
                  plan: MoePlan, decoded: Decoded | None) -> torch.Tensor:
    """The gate/up and down launches of the tl.dot loops: [N, d] fp32 (atomic) or the [N*k, d]
    rows (deterministic) that the combine sums over k; with `decoded`, one pair per chunk."""
    d, inter, nk = w2.shape[1], w1.shape[1], rw.numel()
    h = torch.empty(nk, inter, dtype=x.dtype, device=x.device)
    dest = down_output(nk, topk, d, deterministic, x.device)
    planes = fmt == "fp4" and plan.variant == VARIANTS["planes"]
    xs = planes_activations(x, plan.block_k) if planes else x
    pair = functools.partial(_mma_pair, xs, h, dest, tiles, rw, limit, topk, deterministic, plan,
                             x.device.type != "cuda" or x.dtype == torch.float32)
    if decoded is None:
        pair(w1, w3, s1, s3, w2, s2, fmt, 0, w1.shape[0])
        return dest
    assert fmt == "bf16", "decoded chunks run the bf16 loop"

    def gemms(b13: torch.Tensor, b2: torch.Tensor, lo: int, hi: int) -> None:
        pair(b13[:, :inter], b13[:, inter:], b13, b13, b2, b2, "bf16", lo, hi)
    assert decoded.w13_scale is not None and decoded.w2_scale is not None
    dequant_chunks(decoded.w13, decoded.w13_scale, decoded.w2, decoded.w2_scale, decoded.fmt,
                   decoded.chunk, gemms)
    return dest


def _mma_pair(xs: torch.Tensor, h: torch.Tensor, dest: torch.Tensor,
              tiles: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
              rw: torch.Tensor, limit: float, topk: int, deterministic: bool, plan: MoePlan,
              fp32_x: bool, w1: torch.Tensor, w3: torch.Tensor, s1: torch.Tensor,
              s3: torch.Tensor, w2: torch.Tensor, s2: torch.Tensor, fmt: str, e_lo: int,
              e_hi: int) -> None:
    """One gate/up and one down launch over the experts [e_lo, e_hi), whose weights are entries
    0 .. e_hi - e_lo of the stacks given (`moe_tile_map.py::expert_rows`)."""
    order, t_start, t_end, t_exp = tiles
    d, inter = w2.shape[1], w1.shape[1]
    # fp32 activations or fp32 plain weights (a float32 model) need fp32 (ieee) dots: a bf16 dot
    # would round them (the fp32 log-prob drift in benchmarks/results/kernels_ii_h200_202611.md);
    # and the interpreter's bf16 dot is broken (`fp32_x` covers both the CPU and fp32 x).
    fp32_dot = fp32_x or w1.dtype == torch.float32
    common = {"TOPK": topk, "FMT": FMTS[fmt], "VARIANT": plan.variant, "FP32_DOT": fp32_dot,
              "BLOCK_M": plan.block_m, "BLOCK_K": plan.block_k, "num_stages": plan.num_stages}
    bn, warps = plan.gate_up.block_n, plan.gate_up.num_warps
    _gate_up_kernel[(t_start.numel() * triton.cdiv(inter, bn),)](
        xs, raw(w1, fmt), raw(w3, fmt), s1, s3, h, order, rw, t_start, t_end, t_exp,
        d, inter, float(limit), e_lo, e_hi,
        xs.stride(0), w1.stride(0), w1.stride(1), s1.stride(0), s1.stride(1), h.stride(0),
        LIBDEVICE=LIBDEVICE, BLOCK_N=bn, num_warps=warps, **common, **pdl_args(xs.device),
    )
    bn, warps = plan.down.block_n, plan.down.num_warps
    _down_kernel[(t_start.numel() * triton.cdiv(d, bn),)](
        h, raw(w2, fmt), s2, dest, order, t_start, t_end, t_exp,
        inter, d, e_lo, e_hi,
        h.stride(0), w2.stride(0), w2.stride(1), s2.stride(0), s2.stride(1), dest.stride(0),
        ATOMIC=not deterministic, BLOCK_N=bn, num_warps=warps, **common, **pdl_args(h.device),
    )
