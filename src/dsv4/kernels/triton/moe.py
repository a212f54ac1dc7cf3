"""Triton routed experts with weight-only quantised experts (spec §8, §11.2, §12; issue 7).

Owns `triton_routed_experts_quant`, the fast form of `kernels/ref/moe.py::routed_experts_quant`
(same signature, same semantics):

    y[t] = Σ_k weights[t,k] * W2_e( silu(min(W1_e x_t, limit)) * clamp(W3_e x_t, -limit, limit) ),
    e = indices[t,k]

Weight formats (`fmt`), all stacked over experts; w1 and w3 are concatenated along the output dim at
load time into one `w13` ([W1; W3], rows [0, I) gate, [I, 2I) up; `ref/moe.py::pack_w13` builds it):
    "fp4"   checkpoint layout: e2m1 packed uint8/int8, low nibble first. w13 [E, 2I, d/2] + UE8M0
            scales [E, 2I, d/32]; w2 [E, d, I/2] + [E, d, I/32].
    "fp8"   e4m3 [E, out, in] + UE8M0 128x128 block scales [E, ceil(out/128), ceil(in/128)]; the w13
            scale is cat(s1, s3) along dim 1, i.e. [E, 2 * ceil(I/128), ceil(d/128)] (w3's blocks
            start on a fresh block row, so I need not be a multiple of 128).
    "bf16"  plain [E, 2I, d] / [E, d, I] (any float dtype); scales are None.

Kernel design. Weights are dequantised in registers inside the K-loop: each [BLOCK_K, BLOCK_N] tile
of W^T is loaded as raw codes, decoded to bf16 (exact: both formats have <= 3 mantissa bits) and
fed to tl.dot with fp32 accumulation. Hopper has no FP4 MMA, so this is the weight-only scheme;
the activations stay bf16 (the QAT act_quant of §11 is not simulated). The power-of-two UE8M0
scales are exact wherever they are applied: FP8's 128x128 block scale multiplies each tile's
[BM, BLOCK_N] product once per output row; FP4's per-32 group scale is folded into the decoded
elements (default loop "scaled": the whole tile decoded, one dot per K tile), or into the product
per group ("split", the first loop), or left to `tl.dot_scaled` ("dot_scaled"). The inner loops
live in `moe_decode.py`; which loop and which tiles a call uses, in `moe_plan.py` (`variant=` and
the block knobs pin them). FP4 with bf16 x defaults to "frag" up to 16 rows per expert
(`moe_frag.py`: the words decoded straight into mma.sync fragments; one slot per program and no
tile map below 1/2 row per expert, then tiles of 8 rows; no copy of x); at decode (N*k <= E rows)
the other quantised cases default to "fma" (`moe_fma.py`): no tl.dot,
the weights decoded in their load layout and multiplied on the CUDA cores, BLOCK_M 1..4; its own
two kernels, with the same epilogues and the same tile map (none at BLOCK_M 1: one program row
per slot), after a reordered fp32 copy of x (`fma_activations`).
Grouping without a host sync. The N*k (token, slot) pairs are sorted by expert (stable) and each
expert's rows are cut into tiles of BLOCK_M ("moe_align_block_size" without materialised
padding): tile j of expert e covers sorted rows
[start_e + j*BLOCK_M, min(start_e + (j+1)*BLOCK_M, end_e)). The grid is a fixed upper bound on the
number of tiles, max_tiles = (N*k + min(E, N*k) * (BLOCK_M - 1)) // BLOCK_M, known from shapes
alone; a device-side tile map (tile -> expert, row start, row end: `moe_tile_map.py`, one launch
at decode sizes, torch ops above) tells each program what it owns, and surplus programs see an
empty range and exit.

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
The combine (`shared` addend, `out_dtype`; `kernels/ref/moe.py`'s module docstring): the
deterministic path's third launch, `moe_combine.py`, sums the k slots in ascending order in fp32,
adds `shared` and casts. The atomic path's sum is already in its [N, d] buffer: with a `shared`
or a 16-bit `out_dtype` the same kernel runs on it as k = 1 (sum + shared, cast); otherwise that
buffer is returned. `wait_shared` (the caller's join of the stream that produces `shared`) is
called after the tile map, before the gate/up launch: a side-stream kernel still running when the
gate/up grid starts slowed the launch from 53 to 79 us at batch-1 decode on the H200 (V4-Flash
shapes), more than the overlap gained. A `SharedJoin` with `beside_gemms` is called only before
the combine instead: the caller forked its side branch after the gate, for expert loops that
leave the memory system idle part of the time (the frag loops at decode; `model/moe.py`).

No host syncs: safe inside CUDA-graph capture. Every index must lie in [0, E) (not checked: a host
sync). Test: tests/kernels/test_moe_quant.py. Benchmark: benchmarks/kernels/bench_moe_quant.py.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from dsv4.kernels.ref.moe import SharedJoin, WaitShared, add_shared
from dsv4.kernels.triton.libm import libdevice_math
from dsv4.kernels.triton.moe_combine import down_output, triton_moe_combine
from dsv4.kernels.triton.moe_decode import tile_dot
from dsv4.kernels.triton.moe_dequant import check_dequant, dequant_chunks
from dsv4.kernels.triton.moe_fma import fma_activations, fma_launches
from dsv4.kernels.triton.moe_fp4 import fp4_word_order, planes_activations, planes_column
from dsv4.kernels.triton.moe_frag import frag_launches
from dsv4.kernels.triton.moe_plan import VARIANTS, MoePlan, plan_moe
from dsv4.kernels.triton.moe_plan import dequant_chunk as default_dequant_chunk
from dsv4.kernels.triton.moe_tile_map import expert_rows, tile_and_block, tile_map
from dsv4.kernels.triton.moe_w8a8 import w8a8_launches
from dsv4.kernels.triton.pdl import pdl_args
from dsv4.kernels.triton.pdl_enter import pdl_enter
from dsv4.kernels.triton.swiglu import swiglu_f32

FMTS = {"bf16": 0, "fp8": 1, "fp4": 2}
_FP8_BLOCK = 128
_FP4_GROUP = 32


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


_LIBDEVICE = libdevice_math(_gate_up_kernel)


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


def _check(x: torch.Tensor, w13: torch.Tensor, w13_scale: torch.Tensor | None, w2: torch.Tensor,
           w2_scale: torch.Tensor | None, indices: torch.Tensor, weights: torch.Tensor,
           fmt: str) -> None:
    if fmt not in FMTS:
        raise ValueError(f"fmt must be one of {sorted(FMTS)}; got {fmt!r}")
    if x.dim() != 2 or w13.dim() != 3 or w2.dim() != 3 or indices.dim() != 2:
        raise ValueError("expected x [N, d], w13 [E, 2I, *], w2 [E, d, *], indices [N, k]; "
                         f"got {tuple(x.shape)}, {tuple(w13.shape)}, {tuple(w2.shape)}, "
                         f"{tuple(indices.shape)}")
    if tuple(weights.shape) != tuple(indices.shape) or indices.shape[0] != x.shape[0]:
        raise ValueError(f"indices {tuple(indices.shape)} / weights {tuple(weights.shape)} "
                         "do not match x")
    if indices.dtype != torch.int64 or weights.dtype != torch.float32:
        raise ValueError("indices must be int64 and weights float32; "
                         f"got {indices.dtype}, {weights.dtype}")
    if (fmt == "bf16") != (w13_scale is None and w2_scale is None):
        raise ValueError(f"fmt {fmt!r}: scales must be given exactly for the quantised formats")
    pack = 2 if fmt == "fp4" else 1
    d, i2 = x.shape[1], w13.shape[1]
    if (w13.shape[2] * pack != d or w2.shape[1] != d or w2.shape[2] * pack * 2 != i2
            or w2.shape[0] != w13.shape[0]):
        raise ValueError(f"fmt {fmt!r}: w13 {tuple(w13.shape)} / w2 {tuple(w2.shape)} "
                         f"do not fit d = {d}")
    if fmt == "fp4" and (d % _FP4_GROUP or (i2 // 2) % _FP4_GROUP):
        raise ValueError(f"fp4 needs d and I multiples of {_FP4_GROUP}; got d = {d}, I = {i2 // 2}")
    for name, t in (("x", x), ("w13", w13), ("w2", w2), ("w13_scale", w13_scale),
                    ("w2_scale", w2_scale)):
        if t is not None and not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous")


def _raw(w: torch.Tensor, fmt: str) -> torch.Tensor:
    """Quantised codes as uint8 (the kernels decode them); bf16-path weights as they are."""
    return w if fmt == "bf16" else w.view(torch.uint8)


def triton_routed_experts_quant(x: torch.Tensor, w13: torch.Tensor, w13_scale: torch.Tensor | None,
                                w2: torch.Tensor, w2_scale: torch.Tensor | None,
                                indices: torch.Tensor, weights: torch.Tensor, limit: float,
                                fmt: str, *, deterministic: bool = False,
                                variant: str | None = None, block_m: int | None = None,
                                block_n: int | None = None, block_k: int | None = None,
                                num_warps: int | None = None,
                                num_stages: int | None = None,
                                prefetch: bool | None = None,
                                shared: torch.Tensor | None = None,
                                out_dtype: torch.dtype = torch.float32,
                                wait_shared: WaitShared | None = None,
                                act_quant: bool = False,
                                max_regs: int | None = None,
                                dequant_chunk: int | None = None) -> torch.Tensor:
    """Same contract as `routed_experts_quant`: [N, d] `out_dtype` (plus `shared`: module doc);
    `act_quant` (fmt "fp8" or "fp4"; FP4 exact where `moe_w8a8.py::check_fp4_a8_exact` holds):
    FP8 activations on FP8 tensor cores (`moe_w8a8.py`).

    x: [N, d] bf16 (or fp32); indices: [N, k] int64 in [0, E); weights: [N, k] fp32; weight layouts
    per `fmt` in the module docstring. Keyword arguments are tuning knobs, None = the plan's choice
    (`moe_plan.py`): `variant` the inner loop ("split", "scaled", "dot_scaled", "words", "fma";
    "dot_scaled" needs bf16 x), block sizes powers of two >= 16 (block_k <= 128, or <= 256 for
    FP4 "scaled" / "dot_scaled"; >= 32 for FP4; "fma": `plan_moe`'s `_plan_fma` limits);
    `block_n` pins both launches' BLOCK_N ("w8a8": the down launch's; gate/up's is 128);
    `max_regs` ("w8a8") caps the registers per thread of both launches. `dequant_chunk`: the
    experts decoded to bf16 that many at a time beside the bf16 loop (`moe_dequant.py`; 0: never;
    None: `moe_plan.py::dequant_chunk`, prefill sizes on CUDA); it takes no other knob.
    """
    _check(x, w13, w13_scale, w2, w2_scale, indices, weights, fmt)
    inter = w13.shape[1] // 2
    split = triton.cdiv(inter, _FP8_BLOCK) if fmt == "fp8" else inter  # w1 scale rows (fp8: blocks)
    s1 = w13_scale[:, :split] if w13_scale is not None else None
    s3 = w13_scale[:, split:] if w13_scale is not None else None
    knobs = (variant, block_m, block_n, block_k, num_warps, num_stages, prefetch, max_regs)
    pinned = act_quant or any(k is not None for k in knobs)
    E, nk = w13.shape[0], indices.numel()
    chunk = (dequant_chunk if dequant_chunk is not None
             else default_dequant_chunk(fmt, x.device, nk, E, pinned))
    if chunk:
        if pinned:
            raise ValueError("dequant_chunk runs the bf16 loop's own plan: give it no loop or "
                             "tile knob and no act_quant")
        check_dequant(fmt, inter, chunk)
        plan = plan_moe("bf16", None, x.dtype, x.device, nk, E, inter, x.shape[1])
        decoded = _Decoded(w13, w13_scale, w2, w2_scale, fmt, chunk)
        return _launch(x, w13[:, :inter], w13[:, inter:], None, None, w2, None, indices, weights,
                       limit, "bf16", deterministic, plan, (shared, out_dtype, wait_shared),
                       decoded)
    plan = plan_moe(fmt, variant, x.dtype, x.device, nk, E, inter,
                    x.shape[1], block_m=block_m, block_n=block_n, block_k=block_k,
                    num_warps=num_warps, num_stages=num_stages, prefetch=prefetch,
                    act_quant=act_quant, max_regs=max_regs)
    # w1 / w3 (and their scales) are views into w13 with identical strides, passed separately
    return _launch(x, w13[:, :inter], w13[:, inter:], s1, s3, w2, w2_scale, indices, weights, limit,
                   fmt, deterministic, plan, (shared, out_dtype, wait_shared))


def triton_routed_experts_quant_deterministic(x: torch.Tensor, w13: torch.Tensor,
                                              w13_scale: torch.Tensor | None, w2: torch.Tensor,
                                              w2_scale: torch.Tensor | None,
                                              indices: torch.Tensor, weights: torch.Tensor,
                                              limit: float, fmt: str, *,
                                              shared: torch.Tensor | None = None,
                                              out_dtype: torch.dtype = torch.float32,
                                              wait_shared: WaitShared | None = None,
                                              dequant_chunk: int | None = None
                                              ) -> torch.Tensor:
    """The kernel backend's `routed_experts_quant` op: `triton_routed_experts_quant` with the
    fixed-order (deterministic) epilogue, so greedy decoding is reproducible run to run.
    `dequant_chunk=0` (the backend's `invariant_plans`) keeps the quantised loop at every token
    count, whose rows do not depend on it."""
    return triton_routed_experts_quant(x, w13, w13_scale, w2, w2_scale, indices, weights, limit,
                                       fmt, deterministic=True, shared=shared,
                                       out_dtype=out_dtype, wait_shared=wait_shared,
                                       dequant_chunk=dequant_chunk)


def triton_routed_experts(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor,
                          indices: torch.Tensor, weights: torch.Tensor, limit: float, *,
                          shared: torch.Tensor | None = None,
                          out_dtype: torch.dtype = torch.float32,
                          wait_shared: WaitShared | None = None) -> torch.Tensor:
    """Same contract as `ref.moe.routed_experts` (the kernel backend's `routed_experts` op): plain
    float experts w1, w3 [E, I, d] and w2 [E, d, I] as the model stores them (no w13 copy), the bf16
    path of the kernel.

    The down projection writes per-(token, k) rows that are summed in a fixed order
    (`deterministic=True`): the atomic epilogue would make greedy decoding differ run to run.
    """
    if (w1.shape != w3.shape or w1.stride() != w3.stride()
            or not (w1.is_contiguous() and w2.is_contiguous())):
        raise ValueError(f"w1 {tuple(w1.shape)} / w3 {tuple(w3.shape)} must be contiguous twins "
                         "and w2 contiguous")
    if (x.dim() != 2 or w1.dim() != 3 or w1.shape[2] != x.shape[1]
            or tuple(w2.shape) != (w1.shape[0], x.shape[1], w1.shape[1])):
        raise ValueError(f"expected x [N, d], w1/w3 [E, I, d], w2 [E, d, I]; got {tuple(x.shape)}, "
                         f"{tuple(w1.shape)}, {tuple(w2.shape)}")
    if (indices.dtype != torch.int64 or weights.dtype != torch.float32
            or weights.shape != indices.shape):
        raise ValueError(f"indices [N, k] int64 and weights [N, k] float32; got {indices.dtype} "
                         f"{tuple(indices.shape)}, {weights.dtype} {tuple(weights.shape)}")
    plan = plan_moe("bf16", None, x.dtype, x.device, indices.numel(), w1.shape[0], w1.shape[1],
                    x.shape[1])
    return _launch(x.contiguous(), w1, w3, None, None, w2, None, indices, weights, limit, "bf16",
                   True, plan, (shared, out_dtype, wait_shared))


def _launch(x: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, s1: torch.Tensor | None,
            s3: torch.Tensor | None, w2: torch.Tensor, s2: torch.Tensor | None,
            indices: torch.Tensor, weights: torch.Tensor, limit: float, fmt: str,
            deterministic: bool, plan: MoePlan,
            combine: tuple[torch.Tensor | None, torch.dtype, WaitShared | None],
            decoded: _Decoded | None = None) -> torch.Tensor:
    """The two launches and the combine (`combine` = (shared, out_dtype, wait_shared)); w1 / w3
    (and s1 / s3) share their strides. With `decoded` (fmt "bf16", a bf16 plan) the bf16 loop runs
    on its stacks decoded by chunks, and w1 / w3 / w2 give shapes only. The callers check
    shapes."""
    N, topk = indices.shape
    E, d = w1.shape[0], x.shape[1]
    nk = N * topk
    if nk == 0:
        return add_shared(torch.zeros(N, d, dtype=torch.float32, device=x.device), *combine)
    fma = plan.variant == VARIANTS["fma"]
    frag = plan.variant == VARIANTS["frag"]
    # the fma and frag loops at BLOCK_M 1 need no tile map: one program row per slot;
    # the fma activation copy is preparation too, so it runs before the join
    slots = (frag or fma) and plan.block_m == 1
    tiles = None if slots else tile_map(indices, E, plan.block_m)
    code = FMTS[fmt]
    xs = fma_activations(x, code, plan.block_k) if fma else x
    shared, out_dtype, wait_shared = combine
    beside = isinstance(wait_shared, SharedJoin) and wait_shared.beside_gemms
    if wait_shared is not None and not beside:     # before the expert GEMMs (module docstring)
        wait_shared()
    rw = weights.reshape(-1).contiguous()
    s1 = s1.view(torch.uint8) if s1 is not None else w1
    s3 = s3.view(torch.uint8) if s3 is not None else w3
    s2 = s2.view(torch.uint8) if s2 is not None else w2
    if plan.variant == VARIANTS["w8a8"]:
        assert tiles is not None
        dest = w8a8_launches(x, _raw(w1, fmt), _raw(w3, fmt), s1, s3, _raw(w2, fmt), s2, tiles,
                             rw, limit, code, topk, plan, _LIBDEVICE)
    elif frag:
        dest = frag_launches(x, _raw(w1, fmt), _raw(w3, fmt), s1, s3, _raw(w2, fmt), s2, indices,
                             tiles, rw, limit, topk, deterministic, plan, _LIBDEVICE,
                             fp8=fmt == "fp8")
    elif fma:
        dest = fma_launches(x, xs, _raw(w1, fmt), _raw(w3, fmt), s1, s3, _raw(w2, fmt), s2,
                            indices, tiles, rw, limit, code, topk, deterministic, plan,
                            _LIBDEVICE)
    else:
        assert tiles is not None
        dest = _mma_launches(x, w1, w3, s1, s3, w2, s2, tiles, rw, limit, fmt, topk,
                             deterministic, plan, decoded)
    # the W8A8 loop always stores (token, k) rows (module docstring)
    rows = deterministic or plan.variant == VARIANTS["w8a8"]
    if wait_shared is not None and beside:         # the side branch ran beside the GEMMs
        wait_shared()
    if not rows and shared is None and out_dtype == torch.float32:
        return dest
    return triton_moe_combine(dest.view(N, topk if rows else 1, d), shared, out_dtype)


@dataclass(frozen=True)
class _Decoded:
    """Quantised stacks (`fmt` "fp4" / "fp8", layouts per the module docstring) that the bf16 loop
    reads decoded `chunk` experts at a time (`moe_dequant.py`)."""

    w13: torch.Tensor
    w13_scale: torch.Tensor | None
    w2: torch.Tensor
    w2_scale: torch.Tensor | None
    fmt: str
    chunk: int


def _mma_launches(x: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, s1: torch.Tensor,
                  s3: torch.Tensor, w2: torch.Tensor, s2: torch.Tensor,
                  tiles: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
                  rw: torch.Tensor, limit: float, fmt: str, topk: int, deterministic: bool,
                  plan: MoePlan, decoded: _Decoded | None) -> torch.Tensor:
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
        xs, _raw(w1, fmt), _raw(w3, fmt), s1, s3, h, order, rw, t_start, t_end, t_exp,
        d, inter, float(limit), e_lo, e_hi,
        xs.stride(0), w1.stride(0), w1.stride(1), s1.stride(0), s1.stride(1), h.stride(0),
        LIBDEVICE=_LIBDEVICE, BLOCK_N=bn, num_warps=warps, **common, **pdl_args(xs.device),
    )
    bn, warps = plan.down.block_n, plan.down.num_warps
    _down_kernel[(t_start.numel() * triton.cdiv(d, bn),)](
        h, _raw(w2, fmt), s2, dest, order, t_start, t_end, t_exp,
        inter, d, e_lo, e_hi,
        h.stride(0), w2.stride(0), w2.stride(1), s2.stride(0), s2.stride(1), dest.stride(0),
        ATOMIC=not deterministic, BLOCK_N=bn, num_warps=warps, **common, **pdl_args(h.device),
    )
