"""Weight-only FP8 linear: `triton_fp8_linear(x, w, scale)` = `x @ dequant(w, scale).T`, any M.

DeepSeek-V4 stores its dense linears as e4m3 codes w [N, K] with one UE8M0 scale per 128x128 block
(scale [ceil(N/128), ceil(K/128)], 2^(c-127)). The weight stays in that encoding in GPU memory (one
byte per weight, half of bf16) and is decoded in registers; the spec is `ref/fp8_linear.py`.

    y[m, n] = sum_kb s[n // 128, kb] * sum_{k in block kb} x[m, k] code[n, k]

Grid: M tiles x N tiles x SPLIT_K K splits, one program each (pid = tile * SPLIT_K + split, tile =
m_tile * n_tiles + n_tile). A K step is KB whole scale blocks (BLOCK_K = 128 KB), and BLOCK_N
divides 128, so each block of a step meets exactly one scale: a block's partial product (fp32) is
multiplied by that power of two, which is exact (the scale only shifts exponents). Codes are loaded
as bytes, bitcast to float8e4nv and converted through fp32 to x's dtype (exact). Rows past N / M
are clamped to the last real row (never stored); only a K tail (K % BLOCK_K != 0) is masked. Inner
products, as in `gemv.py`:

    FMA (small M): per x row (unrolled, ROWS = M) a [BLOCK_N, KB, 128] multiply, in-warp sums per
        block, times the blocks' scales, summed, on the CUDA cores in fp32 (KB 2-4: 256-512 bytes
        of a weight row per step, so a program streams whole lines with few steps);
    DOT (KB = 1): acc[BLOCK_N, BLOCK_M] += s * tl.dot(w_tile, x_tile^T) ("swap AB": the weight
        rows fill the MMA's 64-row side); 16-bit x multiplies the decoded codes exactly in the MMA,
        fp32 accumulates; fp32 x (or the interpreter) runs tl.dot in fp32 with input_precision
        "ieee".

SwiGLU mode (`up=`, the shared expert's w2 at decode): x is the gate, and at M <= SWIGLU_MAX_M
the FMA path computes h = swiglu(gate, up) where it loads each x block (`swiglu.py::swiglu_f32`,
rounded to x's dtype), so the `swiglu` op's launch is saved and the bits are those of
`triton_swiglu` then the product; larger M and the other paths run `triton_swiglu` first (at M =
4 the one launch, whose every tile recomputes h, is slower than the two on the H200:
benchmarks/results/quant_moe_h200_202612.md).

Groups (`groups=g`, attention's grouped `wo_a`): x [M, g, K], and output row n reads x row
(m, n // (N / g)): the block-diagonal product of g groups in one launch (N / g whole scale blocks,
so a program's rows sit in one group).

Split-K (one M tile only): each program stores its fp32 partial [M, N] tile into a workspace, bumps
its N tile's int32 arrival counter, and the last arrival sums the partials in split order (the
in-launch, deterministic reduction of `gemv.py`, same counter contract: a zeroed buffer left zero;
by default a fresh one per call, so concurrent streams never share one).

Plan: `fp8_plan.py::plan_fp8_linear` (host only, CUDA-graph safe); every knob is a keyword of
`triton_fp8_linear` (tests, sweeps).

Prefill (M >= DEQUANT_MIN_M, no knob given): the weight is decoded to x's dtype by one launch of
`dequant.py::triton_dequant_fp8_block` (exact, near the byte floor) and the product is the
reference's own `F.linear` (cuBLAS; groups: one `bmm`). There the tiles above are 1.1-4x slower
than this path on flash-4l's shapes at M = 512-8192 (H100), whose decode costs about one read of
the codes and one write of the bf16 weight (1.14x that floor):
benchmarks/results/quant_moe_h200_202612.md. The values are the reference's, i.e. the model's
whose linears were dequantised at load.

Precision: exact products and power-of-two scales, fp32 sums in another order than F.linear's,
one rounding to x's dtype: fp32 results within fp32 rounding of the reference, bf16 within one ulp.

Test: tests/kernels/test_fp8_linear.py, tests/kernels/test_fp8_swiglu.py (the SwiGLU mode).
Benchmark: benchmarks/kernels/bench_fp8_linear.py.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from dsv4.kernels.triton.dequant import triton_dequant_fp8_block
from dsv4.kernels.triton.fp8_frag import frag_launch
from dsv4.kernels.triton.fp8_plan import BLOCK, plan_fp8_linear
from dsv4.kernels.triton.gemv import even_split
from dsv4.kernels.triton.gemv_tile import store_tile
from dsv4.kernels.triton.launch import X_DTYPES, sms
from dsv4.kernels.triton.libm import libdevice_math
from dsv4.kernels.triton.moe_decode import e8m0
from dsv4.kernels.triton.pdl import pdl_args
from dsv4.kernels.triton.pdl_enter import pdl_enter
from dsv4.kernels.triton.swiglu import swiglu_f32, triton_swiglu

SWIGLU_MAX_M = 2            # the SwiGLU mode computes h in the FMA kernel up to this M
DEQUANT_MIN_M = 512         # from this M: decode the weight, then F.linear (module docstring)


@triton.jit
def _x_rows(x_ptr, rows_x, stride_xm, stride_xg, n_tile, rows_g,  # type: ignore[no-untyped-def]
            BLOCK_N: tl.constexpr):
    """The x row pointers of this program's M rows: group n_tile * BLOCK_N // rows_g of each
    token (rows_g = N without groups: group 0)."""
    group = (n_tile * BLOCK_N // rows_g).to(tl.int64)
    return x_ptr + rows_x * stride_xm + group * stride_xg


@triton.jit
def _fma_x(  # type: ignore[no-untyped-def]
    x_ptr, u_ptr, m, M, k, k_ok, stride_xm, stride_xg, stride_um, n_tile, rows_g, limit,
    BLOCK_N: tl.constexpr, EVEN_K: tl.constexpr, SWIGLU: tl.constexpr, LIBDEVICE: tl.constexpr):
    """x row m's values at k (fp32) for the FMA path; in the SwiGLU mode h = swiglu(x, up) of
    that row's gate (x) and up loads, as `swiglu.py::swiglu_f32` computes it, rounded to x's
    dtype (the `swiglu` op's bits)."""
    row = tl.minimum(m, M - 1).to(tl.int64)
    xm_ptr = _x_rows(x_ptr, row, stride_xm, stride_xg, n_tile, rows_g, BLOCK_N)
    if EVEN_K:
        xf = tl.load(xm_ptr + k).to(tl.float32)
    else:
        xf = tl.load(xm_ptr + k, mask=k_ok, other=0.0).to(tl.float32)
    if SWIGLU:
        if EVEN_K:
            uf = tl.load(u_ptr + row * stride_um + k).to(tl.float32)
        else:
            uf = tl.load(u_ptr + row * stride_um + k, mask=k_ok, other=0.0).to(tl.float32)
        dtype = x_ptr.dtype.element_ty
        xf = swiglu_f32(xf, uf, limit, dtype, LIBDEVICE).to(dtype).to(tl.float32)
    return xf


@triton.jit
def _fma_load(w_ptrs, s_row, k0, offs_k, kb, K,  # type: ignore[no-untyped-def]
              EVEN_K: tl.constexpr):
    """One FMA step's weight operands at k0: the codes [BLOCK_N, KB, 128] and the KB blocks'
    scales (fp32 powers of two)."""
    if EVEN_K:
        codes = tl.load(w_ptrs + k0)
        s = e8m0(tl.load(s_row + k0 // 128 + kb))
    else:
        k_ok = k0 + offs_k < K
        b_ok = k0 // 128 + kb < tl.cdiv(K, 128)
        codes = tl.load(w_ptrs + k0, mask=k_ok[None, :, :], other=0)
        s = e8m0(tl.load(s_row + k0 // 128 + kb, mask=b_ok, other=0))
    return codes, s


@triton.jit
def _fma_step(  # type: ignore[no-untyped-def]
    acc, codes, s, k0, offs_k, x_ptr, u_ptr, M, K, stride_xm, stride_xg, stride_um, n_tile,
    rows_g, limit, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, ROWS: tl.constexpr,
    EVEN_K: tl.constexpr, SWIGLU: tl.constexpr, LIBDEVICE: tl.constexpr):
    """acc [BLOCK_N, BLOCK_M] plus one FMA step: per x row (unrolled) the [BLOCK_N, KB, 128]
    products, in-warp sums per block, times the blocks' scales, summed."""
    k_ok = k0 + offs_k < K
    cols_m = tl.arange(0, BLOCK_M)[None, :]
    if not SWIGLU:
        wf = codes.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    for m in tl.static_range(ROWS):
        xf = _fma_x(x_ptr, u_ptr, m, M, k0 + offs_k, k_ok, stride_xm, stride_xg,
                    stride_um, n_tile, rows_g, limit, BLOCK_N, EVEN_K, SWIGLU, LIBDEVICE)
        if SWIGLU:  # decoded after h: the codes' fp32 copies and h's temporaries are
            wf = codes.to(tl.float8e4nv, bitcast=True).to(tl.float32)   # not live at once
        blocks = tl.sum(wf * xf[None, :, :], axis=2)                  # [BLOCK_N, KB]
        part = tl.sum(blocks * s[None, :], axis=1)
        acc += tl.where(cols_m == m, part[:, None], 0.0)
    return acc


@triton.jit(do_not_specialize=["M", "N"])
def _fp8_linear_kernel(  # type: ignore[no-untyped-def]
    x_ptr, u_ptr, w_ptr, s_ptr, y_ptr, part_ptr, cnt_ptr, M, N, K, stride_xm, stride_xg,
    stride_um, rows_g, stride_wn, stride_sn, k_per_split, limit, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, KB: tl.constexpr, SPLIT_K: tl.constexpr, NUM_STAGES: tl.constexpr,
    DOT: tl.constexpr, ROWS: tl.constexpr, FP32_DOT: tl.constexpr, EVEN_K: tl.constexpr,
    SWIGLU: tl.constexpr, LIBDEVICE: tl.constexpr, PDL: tl.constexpr):
    BLOCK_K: tl.constexpr = 128 * KB
    pid = tl.program_id(0)
    tile = pid // SPLIT_K
    split = pid % SPLIT_K
    n_tiles = tl.cdiv(N, BLOCK_N)
    m_tile = tile // n_tiles
    n_tile = tile % n_tiles
    offs_m = m_tile * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = n_tile * BLOCK_N + tl.arange(0, BLOCK_N)
    rows_x = tl.minimum(offs_m, M - 1).to(tl.int64)
    rows_w = tl.minimum(offs_n, N - 1).to(tl.int64)
    s_row = s_ptr + ((n_tile * BLOCK_N) // 128).to(tl.int64) * stride_sn  # one block row
    k_lo = split * k_per_split
    k_hi = tl.minimum(K, k_lo + k_per_split)
    # FMA path: a step is KB scale blocks of 128 k: [BLOCK_N, KB, 128] codes, x as [KB, 128]
    kb = tl.arange(0, KB)
    fma_k = kb[:, None] * 128 + tl.arange(0, 128)[None, :]
    fma_w = w_ptr + rows_w[:, None, None] * stride_wn + fma_k[None, :, :]
    pdl_enter(PDL)
    acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    if DOT:
        offs_k = tl.arange(0, BLOCK_K)
        x_rows = _x_rows(x_ptr, rows_x, stride_xm, stride_xg, n_tile, rows_g, BLOCK_N)
        x_ptrs = x_rows[:, None] + offs_k[None, :]
        w_ptrs = w_ptr + rows_w[:, None] * stride_wn + offs_k[None, :]
        for k0 in tl.range(k_lo, k_hi, BLOCK_K, num_stages=NUM_STAGES):
            k_ok = k0 + offs_k < K
            if EVEN_K:
                codes = tl.load(w_ptrs + k0)
                xt = tl.load(x_ptrs + k0)
            else:
                codes = tl.load(w_ptrs + k0, mask=k_ok[None, :], other=0)
                xt = tl.load(x_ptrs + k0, mask=k_ok[None, :], other=0.0)
            wf = codes.to(tl.float8e4nv, bitcast=True).to(tl.float32)
            s = e8m0(tl.load(s_row + k0 // 128))
            if FP32_DOT:
                part = tl.dot(wf, tl.trans(xt.to(tl.float32)), input_precision="ieee")
            else:
                part = tl.dot(wf.to(xt.dtype), tl.trans(xt))
            acc += part * s
    else:
        for k0 in tl.range(k_lo, k_hi, BLOCK_K, num_stages=NUM_STAGES):
            codes, s = _fma_load(fma_w, s_row, k0, fma_k, kb, K, EVEN_K)
            acc = _fma_step(acc, codes, s, k0, fma_k, x_ptr, u_ptr, M, K, stride_xm, stride_xg,
                            stride_um, n_tile, rows_g, limit, BLOCK_N, BLOCK_M, ROWS, EVEN_K,
                            SWIGLU, LIBDEVICE)
    store_tile(acc, y_ptr, part_ptr, cnt_ptr, n_tile, split, M, N, offs_m, offs_n, SPLIT_K)


_LIBDEVICE = libdevice_math(_fp8_linear_kernel)  # the SwiGLU mode's exp / division (libm.py)


def check_operands(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor) -> None:
    """x [M, K], w [N, K] e4m3 codes, scale the UE8M0 codes of its 128x128 blocks: shapes,
    dtypes, unit last-dim strides, one device (ValueError naming the operand)."""
    if x.dim() != 2 or x.dtype not in X_DTYPES:
        raise ValueError(f"x must be [M, K] of {[str(d) for d in X_DTYPES]}; "
                         f"got {list(x.shape)} {x.dtype}")
    if w.dim() != 2 or w.shape[1] != x.shape[1] or w.dtype not in (torch.float8_e4m3fn,
                                                                   torch.uint8):
        raise ValueError(f"w must be [N, K = {x.shape[1]}] e4m3 codes (float8_e4m3fn or uint8); "
                         f"got {list(w.shape)} {w.dtype}")
    blocks = (triton.cdiv(w.shape[0], BLOCK), triton.cdiv(w.shape[1], BLOCK))
    if tuple(scale.shape) != blocks or scale.element_size() != 1:
        raise ValueError(f"scale must be {list(blocks)} UE8M0 codes (one byte each); "
                         f"got {list(scale.shape)} {scale.dtype}")
    for name, t in (("x", x), ("w", w), ("scale", scale)):
        if t.shape[1] > 1 and t.stride(1) != 1:
            raise ValueError(f"{name} must have unit stride along its last dim; "
                             f"got strides {t.stride()}")
    if len({x.device, w.device, scale.device}) != 1:
        raise ValueError(f"x, w and scale must be on one device; got {x.device}, {w.device}, "
                         f"{scale.device}")


def _check_up(x: torch.Tensor, up: torch.Tensor, groups: int) -> None:
    """The SwiGLU mode's `up` (ValueError naming what is wrong)."""
    if groups != 1:
        raise ValueError(f"the SwiGLU mode (up=) takes groups 1; got {groups}")
    if (up.shape != x.shape or up.dtype != x.dtype or up.device != x.device
            or (up.shape[-1] > 1 and up.stride(-1) != 1)):
        raise ValueError(f"up must match x in shape, dtype and device, with unit stride along K; "
                         f"got {list(up.shape)} {up.dtype} {up.device} strides {up.stride()}, "
                         f"x {list(x.shape)} {x.dtype} {x.device}")


def _frag_ok(x3: torch.Tensor, w: torch.Tensor, K: int) -> bool:
    """Whether the frag path can read these operands: bf16 x whose rows and groups start on 16
    bytes, codes whose rows do too, K whole 128-k steps."""
    return (x3.dtype == torch.bfloat16 and K % BLOCK == 0 and x3.stride(0) % 8 == 0
            and x3.stride(1) % 8 == 0 and x3.data_ptr() % 16 == 0 and w.stride(0) % 16 == 0
            and w.data_ptr() % 16 == 0)


def _dequant_linear(x3: torch.Tensor, w: torch.Tensor, scale: torch.Tensor,
                    groups: int) -> torch.Tensor:
    """The prefill path: x3 [M, g, K] times the weight decoded to x's dtype -> [M, g, N / g]
    (groups 1: [M, 1, N]); per group one batched product."""
    weight = triton_dequant_fp8_block(w, scale, x3.dtype)
    if groups == 1:
        return F.linear(x3[:, 0], weight).unsqueeze(1)
    rows = weight.shape[0] // groups
    per_group = weight.view(groups, rows, -1).transpose(1, 2)           # [g, K, N / g]
    return torch.bmm(x3.transpose(0, 1), per_group).transpose(0, 1)


def triton_fp8_linear(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, *,
                      groups: int = 1, block_m: int | None = None, block_n: int | None = None,
                      split_k: int | None = None, num_warps: int | None = None,
                      num_stages: int | None = None, dot: bool | None = None,
                      kb: int | None = None, frag: bool | None = None,
                      counters: torch.Tensor | None = None, up: torch.Tensor | None = None,
                      limit: float = 0.0) -> torch.Tensor:
    """y = x @ dequant(w, scale).T: x [..., K] bf16 / fp16 / fp32 (unit stride along K), w [N, K]
    e4m3 codes, scale [ceil(N/128), ceil(K/128)] UE8M0 codes -> y [..., N] in x's dtype, fp32
    accumulation, one launch, bit-identical run to run (from M = DEQUANT_MIN_M with no knob
    given: the weight's decode, then the reference's `F.linear`; module docstring). `groups`
    g > 1: the block-diagonal product (`ref/fp8_linear.py::fp8_linear`): x [..., g, K] ->
    [..., g, N / g], group i through weight rows [i N / g, (i + 1) N / g), which must be whole
    scale blocks; one launch. The knobs
    override `plan_fp8_linear` (tests, sweeps); `counters`: a zeroed int32 buffer of >= N tiles
    words for split-K, left zero (default: a fresh one per call).

    `up` (SwiGLU mode, the shared expert's w2; groups 1): x is the gate and the product's input
    is h = swiglu(x, up, limit), `up` matching x in shape, dtype and device (unit stride along
    K). On the FMA path h is computed where x is loaded (`swiglu_f32`, rounded to x's dtype: the
    `triton_swiglu` bits, one launch); on the other paths `triton_swiglu` runs first. Either way
    the result is the bits of `triton_swiglu` followed by this call without `up`."""
    K, N = x.shape[-1], w.shape[0]
    if up is not None:
        _check_up(x, up, groups)
    if groups < 1 or (groups > 1 and (x.dim() < 2 or x.shape[-2] != groups
                                      or N % (groups * BLOCK))):
        raise ValueError(f"groups must be >= 1, with x [..., groups, K] and N = {N} a multiple "
                         f"of groups x {BLOCK}; got groups {groups}, x {list(x.shape)}")
    lead = x.shape[:-2] if groups > 1 else x.shape[:-1]
    x3 = x.reshape(-1, groups, K)
    check_operands(x3[:, 0], w, scale)
    M = x3.shape[0]
    shape = (*lead, groups, N // groups) if groups > 1 else (*lead, N)
    knobs = (block_m, block_n, split_k, num_warps, num_stages, dot, kb, frag)
    if M >= DEQUANT_MIN_M and N and K and all(k is None for k in knobs):
        h = x3 if up is None else triton_swiglu(x, up, limit).reshape(M, groups, K)
        return _dequant_linear(h, w, scale, groups).reshape(shape)
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if M == 0 or N == 0:
        return y.view(shape)
    if K == 0:
        return y.zero_().view(shape)
    plan = plan_fp8_linear(M, N, K, sms(x.device), block_m=block_m, block_n=block_n,
                           split_k=split_k, num_warps=num_warps, num_stages=num_stages, dot=dot,
                           kb=kb, frag=frag, frag_ok=_frag_ok(x3, w, K))
    if up is not None and (plan.dot or plan.frag or M > SWIGLU_MAX_M):   # two launches
        return triton_fp8_linear(triton_swiglu(x, up, limit), w, scale, block_m=block_m,
                                 block_n=block_n, split_k=split_k, num_warps=num_warps,
                                 num_stages=num_stages, dot=dot, kb=kb, frag=frag,
                                 counters=counters)
    if up is not None and num_stages is None:
        # the SwiGLU mode runs unpipelined: pipelined, its sm_90 loop grows ~5x and reaches 228
        # registers (benchmarks/aot_compile_sm90.py); the stages change no sum, only the loads
        plan = dataclasses.replace(plan, num_stages=1)
    m_tiles, n_tiles = triton.cdiv(M, plan.block_m), triton.cdiv(N, plan.block_n)
    splits, per = even_split(triton.cdiv(K, BLOCK * plan.kb), plan.split_k)
    part, cnt = y, y                                    # unused unless split
    if splits > 1:
        cnt = (torch.zeros(n_tiles, dtype=torch.int32, device=x.device) if counters is None
               else counters)
        if cnt.dtype != torch.int32 or cnt.numel() < n_tiles or cnt.device != x.device:
            raise ValueError(f"counters must be int32 of >= {n_tiles} words on {x.device}; "
                             f"got {cnt.dtype} {cnt.numel()} on {cnt.device}")
        part = torch.empty(splits, M, N, dtype=torch.float32, device=x.device)
    if plan.frag:
        frag_launch(x3, w, scale, y, part, cnt, N // groups, plan.block_n, splits, per)
        return y.view(shape)
    fp32_dot = x.device.type != "cuda" or x.dtype == torch.float32
    u2 = x3[:, 0] if up is None else up.reshape(M, K)
    _fp8_linear_kernel[(m_tiles * n_tiles * splits,)](
        x3, u2, w.view(torch.uint8), scale.view(torch.uint8), y, part, cnt, M, N, K,
        x3.stride(0), x3.stride(1), u2.stride(0), N // groups, w.stride(0), scale.stride(0),
        per * BLOCK * plan.kb, limit, BLOCK_M=plan.block_m, BLOCK_N=plan.block_n, KB=plan.kb,
        SPLIT_K=splits, NUM_STAGES=plan.num_stages, DOT=plan.dot, ROWS=0 if plan.dot else M,
        FP32_DOT=fp32_dot, EVEN_K=K % (BLOCK * plan.kb) == 0, SWIGLU=up is not None,
        LIBDEVICE=_LIBDEVICE, num_warps=plan.num_warps, num_stages=plan.num_stages,
        **pdl_args(x.device))
    return y.view(shape)
