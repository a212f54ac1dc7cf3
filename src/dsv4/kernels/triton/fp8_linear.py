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

Groups (`groups=g`, attention's grouped `wo_a`): x [M, g, K], and output row n reads x row
(m, n // (N / g)): the block-diagonal product of g groups in one launch (N / g whole scale blocks,
so a program's rows sit in one group).

Split-K (one M tile only): each program stores its fp32 partial [M, N] tile into a workspace, bumps
its N tile's int32 arrival counter, and the last arrival sums the partials in split order (the
in-launch, deterministic reduction of `gemv.py`, same counter contract: a zeroed buffer left zero;
by default a fresh one per call, so concurrent streams never share one).

Plan (`plan_fp8_linear`, host only, from (M, N, K, x dtype, SM count); CUDA-graph safe):
- decode, M <= FMA_MAX_M: FMA, BLOCK_M next_pow2(M), (KB, BLOCK_N, stages) FMA_TILES[BLOCK_M],
  4 warps;
- decode, M <= 8 with bf16 x, K % 128 == 0 and 16-byte aligned rows: the tensor-core decode path
  (`fp8_frag.py`: codes decoded into mma.sync fragments, BLOCK_N FRAG_BLOCK_N, split-K to
  FRAG_PROGRAMS_PER_SM programs per SM, at least FRAG_MIN_STEPS 128-k steps a split; 0.70-1.06x the
  swap-AB tl.dot's time at M = 8 on flash-4l's shapes, slower than FMA at M = 1);
- decode, M <= DECODE_MAX_M: DOT, BLOCK_M max(16, next_pow2(M)), BLOCK_N 64, 4 warps, 4 stages;
- then split-K (one M tile) up to PROGRAMS_PER_SM programs per SM, capped by the K blocks and the
  last arrival's registers, evened out so no split is empty; BLOCK_N halves (down to 16) while the
  splits alone cannot fill half the target;
- prefill, M > DECODE_MAX_M: DOT tiles BLOCK_M 64 (M <= 128) or 128, BLOCK_N 128, 8 warps, 3
  stages, no split.
Every knob is a keyword of `triton_fp8_linear` (tests, sweeps).

Precision: exact products and power-of-two scales, fp32 sums in another order than F.linear's,
one rounding to x's dtype: fp32 results within fp32 rounding of the reference, bf16 within one ulp.

Test: tests/kernels/test_fp8_linear.py. Benchmark: benchmarks/kernels/bench_fp8_linear.py.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_wait

from dsv4.kernels.triton.fp8_frag import MAX_M as FRAG_MAX_M
from dsv4.kernels.triton.fp8_frag import frag_launch
from dsv4.kernels.triton.gemv import (
    FMA_LIMIT_M,
    FMA_MAX_M,
    PROGRAMS_PER_SM,
    REDUCE_REGS,
    even_split,
    store_tile,
)
from dsv4.kernels.triton.launch import X_DTYPES, pow2, sms
from dsv4.kernels.triton.moe_decode import e8m0
from dsv4.kernels.triton.pdl import pdl_args

BLOCK = 128                 # the scale block (and the K step)
DECODE_MAX_M = 64           # above: prefill tiles, no split-K
_MIN_DOT = 16               # tl.dot needs every dimension >= 16
# FMA path per BLOCK_M (next_pow2(M) <= FMA_MAX_M): (scale blocks of 128 k per K step, weight
# rows per program, pipeline stages), the fastest of an H200 sweep over flash-4l's FP8 linears
# (benchmarks/results/quant_moe_h200_202612.md)
FMA_TILES = {1: (4, 32, 1), 2: (4, 32, 1), 4: (2, 32, 2)}
FRAG_BLOCK_N = 16           # frag path: weight rows per program (1 warp; H200 sweep at M = 8)
FRAG_PROGRAMS_PER_SM = 16   # frag path: split-K target
FRAG_MIN_STEPS = 2          # frag path: 128-k steps per split at least
# FMA_MAX_M, FMA_LIMIT_M, PROGRAMS_PER_SM, REDUCE_REGS: the skinny GEMM's (`gemv.py`), same plan


@dataclass(frozen=True)
class Fp8LinearPlan:
    """Tile shape, K split and launch options of one `triton_fp8_linear` call."""

    block_m: int
    block_n: int
    split_k: int
    num_warps: int
    num_stages: int
    dot: bool
    kb: int = 1             # scale blocks (128 k) per K step: FMA_TILES' on the FMA path
    frag: bool = False      # the tensor-core decode path (`fp8_frag.py`): block_n = 16 x warps


@triton.jit
def _x_rows(x_ptr, rows_x, stride_xm, stride_xg, n_tile, rows_g,  # type: ignore[no-untyped-def]
            BLOCK_N: tl.constexpr):
    """The x row pointers of this program's M rows: group n_tile * BLOCK_N // rows_g of each
    token (rows_g = N without groups: group 0)."""
    group = (n_tile * BLOCK_N // rows_g).to(tl.int64)
    return x_ptr + rows_x * stride_xm + group * stride_xg


@triton.jit(do_not_specialize=["M", "N"])
def _fp8_linear_kernel(  # type: ignore[no-untyped-def]
    x_ptr, w_ptr, s_ptr, y_ptr, part_ptr, cnt_ptr, M, N, K, stride_xm, stride_xg, rows_g,
    stride_wn, stride_sn, k_per_split, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    KB: tl.constexpr, SPLIT_K: tl.constexpr, NUM_STAGES: tl.constexpr, DOT: tl.constexpr,
    ROWS: tl.constexpr, FP32_DOT: tl.constexpr, EVEN_K: tl.constexpr, PDL: tl.constexpr):
    if PDL:  # programmatic dependent launch: the prior kernel's writes first
        gdc_wait()
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
        # a step is KB scale blocks of 128 k: [BLOCK_N, KB, 128] codes, x as [KB, 128]
        kb = tl.arange(0, KB)
        offs_k = kb[:, None] * 128 + tl.arange(0, 128)[None, :]
        w_ptrs = w_ptr + rows_w[:, None, None] * stride_wn + offs_k[None, :, :]
        cols_m = tl.arange(0, BLOCK_M)[None, :]
        for k0 in tl.range(k_lo, k_hi, BLOCK_K, num_stages=NUM_STAGES):
            k_ok = k0 + offs_k < K
            b_ok = k0 // 128 + kb < tl.cdiv(K, 128)
            if EVEN_K:
                codes = tl.load(w_ptrs + k0)
                s = e8m0(tl.load(s_row + k0 // 128 + kb))
            else:
                codes = tl.load(w_ptrs + k0, mask=k_ok[None, :, :], other=0)
                s = e8m0(tl.load(s_row + k0 // 128 + kb, mask=b_ok, other=0))
            wf = codes.to(tl.float8e4nv, bitcast=True).to(tl.float32)
            for m in tl.static_range(ROWS):
                xm_ptr = _x_rows(x_ptr, tl.minimum(m, M - 1).to(tl.int64), stride_xm, stride_xg,
                                 n_tile, rows_g, BLOCK_N)
                if EVEN_K:
                    xm = tl.load(xm_ptr + k0 + offs_k)
                else:
                    xm = tl.load(xm_ptr + k0 + offs_k, mask=k_ok, other=0.0)
                blocks = tl.sum(wf * xm.to(tl.float32)[None, :, :], axis=2)   # [BLOCK_N, KB]
                part = tl.sum(blocks * s[None, :], axis=1)
                acc += tl.where(cols_m == m, part[:, None], 0.0)
    store_tile(acc, y_ptr, part_ptr, cnt_ptr, n_tile, split, M, N, offs_m, offs_n, SPLIT_K)


def _tile_defaults(M: int, dot: bool) -> tuple[int, int, int, int]:
    """(block_m, block_n, num_warps, num_stages) of the module docstring's plan."""
    if not dot:
        bm = triton.next_power_of_2(max(M, 1))
        _, bn, stages = FMA_TILES.get(bm, FMA_TILES[FMA_MAX_M])
        return bm, bn, 4, stages
    if M <= DECODE_MAX_M:
        return max(_MIN_DOT, triton.next_power_of_2(M)), 64, 4, 4
    return (64 if M <= 128 else 128), 128, 8, 3


def plan_fp8_linear(M: int, N: int, K: int, num_sms: int, *, block_m: int | None = None,
                    block_n: int | None = None, split_k: int | None = None,
                    num_warps: int | None = None, num_stages: int | None = None,
                    dot: bool | None = None, kb: int | None = None, frag: bool | None = None,
                    frag_ok: bool = False) -> Fp8LinearPlan:
    """The plan of an [M, K] x FP8 [N, K]^T product on `num_sms` SMs (module docstring); a knob
    given replaces its default. `frag_ok`: the operands suit the frag path (bf16 x, K % 128 ==
    0, aligned rows), which is then the default for FMA_MAX_M < M <= 8 unless another path's
    knob is given (at M <= FMA_MAX_M the FMA path measured faster on the H200).
    Raises ValueError on an invalid knob."""
    if frag is None:
        frag = frag_ok and FMA_MAX_M < M <= FRAG_MAX_M and dot is None and kb is None \
            and block_m is None and num_stages is None
    if frag:
        return _plan_frag(M, N, K, num_sms, block_n, split_k, num_warps, frag_ok)
    dot = M > FMA_MAX_M if dot is None else dot
    if not dot and M > FMA_LIMIT_M:
        raise ValueError(f"dot=False serves M <= {FMA_LIMIT_M}; got M = {M}")
    bm, bn, warps, stages = _tile_defaults(M, dot)
    least = _MIN_DOT if dot else 1
    block_m = bm if block_m is None else pow2("block_m", block_m, least)
    if not dot and block_m < M:
        raise ValueError(f"dot=False needs block_m >= M = {M}; got {block_m}")
    num_warps = warps if num_warps is None else pow2("num_warps", num_warps, 1)
    num_stages = stages if num_stages is None else num_stages
    if num_stages < 1:
        raise ValueError(f"num_stages must be >= 1; got {num_stages}")
    if split_k is not None and split_k < 1:
        raise ValueError(f"split_k must be >= 1; got {split_k}")
    k_blocks, m_tiles = triton.cdiv(max(K, 1), BLOCK), triton.cdiv(max(M, 1), block_m)
    if kb is None:
        most = FMA_TILES.get(block_m, FMA_TILES[FMA_MAX_M])[0]
        kb = 1 if dot else min(most, triton.next_power_of_2(k_blocks))
    elif pow2("kb", kb, 1) > 1 and dot:
        raise ValueError(f"kb > 1 (scale blocks per K step) is the FMA path's; got {kb}")
    k_steps = triton.cdiv(k_blocks, kb)
    target = PROGRAMS_PER_SM * num_sms

    def most_splits(bn_: int) -> int:
        if m_tiles > 1:
            return 1
        per_thread = triton.cdiv(block_m * bn_, 32 * num_warps)
        return min(k_steps, max(1, REDUCE_REGS // per_thread))

    if block_n is None:
        block_n = min(bn, max(least, triton.next_power_of_2(N)))
        while M <= DECODE_MAX_M and block_n > max(least, 16) and \
                triton.cdiv(N, block_n) * most_splits(block_n) < target // 2:
            block_n //= 2
    elif pow2("block_n", block_n, least) > BLOCK:
        raise ValueError(f"block_n must divide the scale block {BLOCK}; got {block_n}")
    if split_k is None:
        split_k = min(triton.cdiv(target, m_tiles * triton.cdiv(N, block_n)),
                      most_splits(block_n))
    elif m_tiles > 1 and split_k > 1:
        raise ValueError(f"split_k > 1 needs one M tile (M <= block_m = {block_m}); got M = {M}")
    splits, _ = even_split(k_steps, split_k)
    return Fp8LinearPlan(block_m, block_n, splits, num_warps, num_stages, dot, kb)


def _plan_frag(M: int, N: int, K: int, num_sms: int, block_n: int | None, split_k: int | None,
               num_warps: int | None, frag_ok: bool) -> Fp8LinearPlan:
    """The frag path's plan: BLOCK_N 16 x warps rows per program (FRAG_BLOCK_N), K split into
    whole 128-k steps until FRAG_PROGRAMS_PER_SM programs per SM, each split at least
    FRAG_MIN_STEPS steps."""
    if not frag_ok or M > FRAG_MAX_M:
        raise ValueError(f"frag=True needs bf16 x with 16-byte aligned rows, K % {BLOCK} == 0 and "
                         f"M <= {FRAG_MAX_M}; got M = {M}, K = {K}")
    bn = FRAG_BLOCK_N if block_n is None else pow2("block_n", block_n, 16)
    if bn > 64 or (num_warps is not None and num_warps != bn // 16):
        raise ValueError(f"frag=True takes block_n 16, 32 or 64 and num_warps = block_n / 16; "
                         f"got {bn}, {num_warps}")
    steps, tiles = K // BLOCK, triton.cdiv(N, bn)
    if split_k is None:
        split_k = min(triton.cdiv(FRAG_PROGRAMS_PER_SM * num_sms, tiles),
                      max(1, steps // FRAG_MIN_STEPS))
    splits, _ = even_split(steps, split_k)
    return Fp8LinearPlan(min(M, FRAG_MAX_M), bn, splits, bn // 16, 1, False, 1, True)


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


def _frag_ok(x3: torch.Tensor, w: torch.Tensor, K: int) -> bool:
    """Whether the frag path can read these operands: bf16 x whose rows and groups start on 16
    bytes, codes whose rows do too, K whole 128-k steps."""
    return (x3.dtype == torch.bfloat16 and K % BLOCK == 0 and x3.stride(0) % 8 == 0
            and x3.stride(1) % 8 == 0 and x3.data_ptr() % 16 == 0 and w.stride(0) % 16 == 0
            and w.data_ptr() % 16 == 0)


def triton_fp8_linear(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, *,
                      groups: int = 1, block_m: int | None = None, block_n: int | None = None,
                      split_k: int | None = None, num_warps: int | None = None,
                      num_stages: int | None = None, dot: bool | None = None,
                      kb: int | None = None, frag: bool | None = None,
                      counters: torch.Tensor | None = None) -> torch.Tensor:
    """y = x @ dequant(w, scale).T: x [..., K] bf16 / fp16 / fp32 (unit stride along K), w [N, K]
    e4m3 codes, scale [ceil(N/128), ceil(K/128)] UE8M0 codes -> y [..., N] in x's dtype, fp32
    accumulation, one launch, bit-identical run to run. `groups` g > 1: the block-diagonal
    product (`ref/fp8_linear.py::fp8_linear`): x [..., g, K] -> [..., g, N / g], group i through
    weight rows [i N / g, (i + 1) N / g), which must be whole scale blocks; one launch. The knobs
    override `plan_fp8_linear` (tests, sweeps); `counters`: a zeroed int32 buffer of >= N tiles
    words for split-K, left zero (default: a fresh one per call)."""
    K, N = x.shape[-1], w.shape[0]
    if groups < 1 or (groups > 1 and (x.dim() < 2 or x.shape[-2] != groups
                                      or N % (groups * BLOCK))):
        raise ValueError(f"groups must be >= 1, with x [..., groups, K] and N = {N} a multiple "
                         f"of groups x {BLOCK}; got groups {groups}, x {list(x.shape)}")
    lead = x.shape[:-2] if groups > 1 else x.shape[:-1]
    x3 = x.reshape(-1, groups, K)
    check_operands(x3[:, 0], w, scale)
    M = x3.shape[0]
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    shape = (*lead, groups, N // groups) if groups > 1 else (*lead, N)
    if M == 0 or N == 0:
        return y.view(shape)
    if K == 0:
        return y.zero_().view(shape)
    plan = plan_fp8_linear(M, N, K, sms(x.device), block_m=block_m, block_n=block_n,
                           split_k=split_k, num_warps=num_warps, num_stages=num_stages, dot=dot,
                           kb=kb, frag=frag, frag_ok=_frag_ok(x3, w, K))
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
    _fp8_linear_kernel[(m_tiles * n_tiles * splits,)](
        x3, w.view(torch.uint8), scale.view(torch.uint8), y, part, cnt, M, N, K, x3.stride(0),
        x3.stride(1), N // groups, w.stride(0), scale.stride(0), per * BLOCK * plan.kb,
        BLOCK_M=plan.block_m, BLOCK_N=plan.block_n, KB=plan.kb, SPLIT_K=splits,
        NUM_STAGES=plan.num_stages, DOT=plan.dot, ROWS=0 if plan.dot else M,
        FP32_DOT=fp32_dot, EVEN_K=K % (BLOCK * plan.kb) == 0, num_warps=plan.num_warps,
        num_stages=plan.num_stages, **pdl_args(x.device))
    return y.view(shape)
