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

The tl.dot loops' two launches (gate/up with SwiGLU fused, then down) and their epilogues:
`moe_mma.py`. At prefill sizes FP4 runs the bf16 loop on the layer decoded to bf16 a chunk of
experts at a time, beside the GEMMs (`moe_dequant.py`; `moe_plan.py::dequant_chunk` decides).
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
sync). Test: tests/kernels/test_moe_quant.py. Benchmark: benchmarks/kernels/bench_moe_quant.py,
bench_moe_prefill.py.
"""

from __future__ import annotations

import torch
import triton

from dsv4.kernels.ref.moe import SharedJoin, WaitShared, add_shared
from dsv4.kernels.triton.moe_combine import triton_moe_combine
from dsv4.kernels.triton.moe_dequant import check_dequant
from dsv4.kernels.triton.moe_fma import fma_activations, fma_launches
from dsv4.kernels.triton.moe_frag import frag_launches
from dsv4.kernels.triton.moe_mma import FMTS, LIBDEVICE, Decoded, mma_launches, raw
from dsv4.kernels.triton.moe_plan import VARIANTS, MoePlan, plan_moe
from dsv4.kernels.triton.moe_plan import dequant_chunk as default_dequant_chunk
from dsv4.kernels.triton.moe_tile_map import tile_map
from dsv4.kernels.triton.moe_w8a8 import w8a8_launches

_FP8_BLOCK = 128
_FP4_GROUP = 32


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
                                stream_weights: bool | None = None,
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
    `max_regs` ("w8a8") caps the registers per thread of both launches; `stream_weights`
    ("frag") has its weights' loads skip L1 (`moe_plan.plan_moe`). `dequant_chunk`: the
    experts decoded to bf16 that many at a time beside the bf16 loop (`moe_dequant.py`; 0: never;
    None: `moe_plan.py::dequant_chunk`, prefill sizes on CUDA); it takes no other knob.
    """
    _check(x, w13, w13_scale, w2, w2_scale, indices, weights, fmt)
    inter = w13.shape[1] // 2
    split = triton.cdiv(inter, _FP8_BLOCK) if fmt == "fp8" else inter  # w1 scale rows (fp8: blocks)
    s1 = w13_scale[:, :split] if w13_scale is not None else None
    s3 = w13_scale[:, split:] if w13_scale is not None else None
    knobs = (variant, block_m, block_n, block_k, num_warps, num_stages, prefetch, max_regs,
             stream_weights)
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
        decoded = Decoded(w13, w13_scale, w2, w2_scale, fmt, chunk)
        return _launch(x, w13[:, :inter], w13[:, inter:], None, None, w2, None, indices, weights,
                       limit, "bf16", deterministic, plan, (shared, out_dtype, wait_shared),
                       decoded)
    plan = plan_moe(fmt, variant, x.dtype, x.device, nk, E, inter,
                    x.shape[1], block_m=block_m, block_n=block_n, block_k=block_k,
                    num_warps=num_warps, num_stages=num_stages, prefetch=prefetch,
                    act_quant=act_quant, max_regs=max_regs, stream_weights=stream_weights)
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
            decoded: Decoded | None = None) -> torch.Tensor:
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
        dest = w8a8_launches(x, raw(w1, fmt), raw(w3, fmt), s1, s3, raw(w2, fmt), s2, tiles,
                             rw, limit, code, topk, plan, LIBDEVICE)
    elif frag:
        dest = frag_launches(x, raw(w1, fmt), raw(w3, fmt), s1, s3, raw(w2, fmt), s2, indices,
                             tiles, rw, limit, topk, deterministic, plan, LIBDEVICE,
                             fp8=fmt == "fp8")
    elif fma:
        dest = fma_launches(x, xs, raw(w1, fmt), raw(w3, fmt), s1, s3, raw(w2, fmt), s2,
                            indices, tiles, rw, limit, code, topk, deterministic, plan,
                            LIBDEVICE)
    else:
        assert tiles is not None
        dest = mma_launches(x, w1, w3, s1, s3, w2, s2, tiles, rw, limit, fmt, topk,
                             deterministic, plan, decoded)
    # the W8A8 loop always stores (token, k) rows (module docstring)
    rows = deterministic or plan.variant == VARIANTS["w8a8"]
    if wait_shared is not None and beside:         # the side branch ran beside the GEMMs
        wait_shared()
    if not rows and shared is None and out_dtype == torch.float32:
        return dest
    return triton_moe_combine(dest.view(N, topk if rows else 1, d), shared, out_dtype)
