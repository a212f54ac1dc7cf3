"""Batch-invariant CUDA matmuls and row reductions: a row's bits do not depend on the row count.

Owns the CUDA side of `kernels/ref/batch_invariant.py::batch_invariant()`: while the context is
open, `ATEN_OVERRIDES` replaces aten's CUDA kernels of mm, bmm, addmm, sum.dim_IntList, mean.dim,
_softmax, _log_softmax and logsumexp. cuBLAS and torch's reduction kernels pick tiles, split-K and
block shapes from the whole shape, so an output row's reduction order (and its last bits) depends
on how many rows share the call; here it depends on the reduction length alone. The aten
overloads' table (`ATEN_OVERRIDES`, with the dtype fallbacks) is `batch_invariant_aten.py`.

    bi_mm / bi_bmm / bi_addmm   c[b, m, :] = alpha * a[b, m, :] @ w[b] + beta * bias[m, :]
        grid (tiles_m * tiles_n, B); one program per BLOCK_M x BLOCK_N output tile, one sequential
        loop over K in BLOCK_K steps, acc = tl.dot(a_tile, w_tile, acc) in fp32, no split-K;
        rows past M / columns past N read row m % M / column n % N (never stored), so every load
        but the K tail is unmasked; stored once in the input dtype (aten.mm's), bias and alpha /
        beta folded in fp32 before that rounding (cuBLAS's epilogue).
    bi_sum_rows                 s[r] = sum_n x[r, n] in fp32; one program per BLOCK_R rows,
        acc[BLOCK_R, BLOCK_N] += x[rows, chunk] over the N / BLOCK_N chunks in order, then one
        tl.sum over BLOCK_N (a fixed tree).
    sum_dim, mean_dim           reduced dims permuted last, contiguous, viewed [R, N], bi_sum_rows
                                (mean: / N), one rounding to the result dtype.
    softmax, log_softmax        over [R, N] (dim moved last): m = amax (order-free: max is
    logsumexp                   exact), e = exp(x - m) element-wise, the sum by bi_sum_rows; all
                                in fp32, one rounding; logsumexp shifts by 0 where |m| = inf, as
                                aten does.

Why a row is invariant: the tile config (`mm_config`, `sum_config`) is a function of (N, K,
dtype) / N only, never of M or R; a row sits in tile m // BLOCK_M at position m % BLOCK_M in
every call with more than m rows, and its tile computes it with the same compiled kernel, the same
K loop and the same MMA / reduction tree. Nothing reads other rows' values into a row's result.
Compiled variants: M and R are not specialised on (`do_not_specialize`: M = 1 or M % 16 == 0
compile no other code) and a GEMM of one matrix passes batch strides 0 (not M * K). Triton still
specialises pointers on 16-byte alignment and strides on 16-divisibility; for the GEMM that
changes how tiles are loaded (vector width, cp.async pipelining), not the MMA, whose instruction
and layout follow the tile shape, warps and dtype (checked on the GPU by
test_operand_alignment_does_not_change_bits). The row sum's tl.sum tree follows its load layout,
so `bi_sum_rows` always hands the kernel an aligned, row-contiguous tensor. Element-wise CUDA ops
(sub, exp, log, div, casts) round each element alone, so the composites inherit the invariance.

Fixed configs (untuned on hardware: `benchmarks/kernels/bench_batch_invariant.py --sweep`;
block n / k are at most next_pow2(N) / next_pow2(K), at least 16). Compiled offline for sm_90
(Triton 3.6, F.linear's layout, aligned operands; registers per thread, spills, shared memory):

    dtype        N        block m/n/k  warps stages  MMA     regs  spill  smem
    bf16 / fp16  >= 8192  128/128/64   8     3       wgmma   128   0      96 KB
    bf16 / fp16  < 8192   128/64/64    4     4       wgmma   128   0      96 KB  (2x the programs
                                                                                of a GEMV)
    fp32         any      64/64/32     4     2       FMA     128   0      16 KB  ("ieee": no tf32)
    row sum      any      BLOCK_N = min(next_pow2(N), 4096), BLOCK_R = 4096 / BLOCK_N, 8 warps

Operands the compiler cannot prove 16-byte aligned (K or a row stride not a multiple of 8 bf16)
compile without the cp.async pipeline (24 KB smem, up to 255 registers): correct, slower.

Semantics kept from aten: output dtypes (16-bit in -> 16-bit out for mm / sum / mean / softmax;
`half_to_float`; sum's and mean's `dtype`), keepdim, empty dims (sum 0, mean nan, logsumexp
-inf), all -inf softmax rows (nan). Not covered (the `ATEN_OVERRIDES` fall back to aten's `.out`
kernels, which are not row-invariant): fp64 / complex / integer matmuls and reductions (integer
sums are exact anyway), and every op not listed (mv, baddbmm, backward kernels such as
_softmax_backward_data). Accuracy differs from cuBLAS by fp32 rounding order only; fp32 matmuls
are always ieee (tf32 off, torch's default).

On the Triton interpreter (CPU tests) 16-bit tiles are upcast to fp32 before tl.dot (exact: 16-bit
products are exact in fp32): the interpreter's tl.dot multiplies raw bf16 bit patterns
(triton-lang/triton#11584, see sparse_attention.py). No host syncs: graph-capture safe.

Test: tests/kernels/test_batch_invariant_triton.py; benchmark:
benchmarks/kernels/bench_batch_invariant.py.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
WIDE_N = 8192                   # 16-bit GEMMs at least this wide take 128-wide N tiles
SUM_TILE = 4096                 # elements of one row-sum tile (BLOCK_R * BLOCK_N)
_MIN_DOT = 16                   # tl.dot needs every dimension >= 16
_MAX_GRID_Y = 65535             # CUDA limit on grid dim 1 (the batch)


@dataclass(frozen=True)
class MMConfig:
    """Tile shape and launch options of one GEMM; `group_m` orders tiles for L2 reuse only."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    group_m: int = 8


@triton.jit(do_not_specialize=["M"])
def _mm_kernel(  # type: ignore[no-untyped-def]
    a_ptr, w_ptr, bias_ptr, c_ptr, M, N, K, alpha, beta,
    stride_ab, stride_am, stride_ak, stride_wb, stride_wk, stride_wn,
    stride_xm, stride_xn, stride_cb, stride_cm, stride_cn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    HAS_BIAS: tl.constexpr, SCALE: tl.constexpr, FP32_DOT: tl.constexpr, EVEN_K: tl.constexpr,
):
    pid = tl.program_id(0)
    batch = tl.program_id(1).to(tl.int64)
    tiles_m, tiles_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * tiles_n                       # tile order: which program, not what
    first_m = (pid // per_group) * GROUP_M
    rows_in_group = tl.minimum(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % rows_in_group
    pid_n = (pid % per_group) // rows_in_group
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    rows = (offs_m % M).to(tl.int64)                    # padding rows repeat real ones, unstored
    cols = (offs_n % N).to(tl.int64)
    a_ptrs = a_ptr + batch * stride_ab + rows[:, None] * stride_am + offs_k[None, :] * stride_ak
    w_ptrs = w_ptr + batch * stride_wb + offs_k[:, None] * stride_wk + cols[None, :] * stride_wn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        if EVEN_K:
            a = tl.load(a_ptrs)
            w = tl.load(w_ptrs)
        else:
            k_ok = offs_k < K - k * BLOCK_K
            a = tl.load(a_ptrs, mask=k_ok[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=k_ok[:, None], other=0.0)
        if FP32_DOT:
            acc = tl.dot(a.to(tl.float32), w.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(a, w, acc)
        a_ptrs += BLOCK_K * stride_ak
        w_ptrs += BLOCK_K * stride_wk
    mask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
    if HAS_BIAS:
        bias = tl.load(bias_ptr + rows[:, None] * stride_xm + cols[None, :] * stride_xn)
        acc = acc * alpha + bias.to(tl.float32) * beta
    elif SCALE:
        acc = acc * alpha
    c_ptrs = c_ptr + batch * stride_cb + rows[:, None] * stride_cm + cols[None, :] * stride_cn
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["R"])
def _sum_rows_kernel(  # type: ignore[no-untyped-def]
    x_ptr, out_ptr, R, N, stride_r,
    BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, EVEN_N: tl.constexpr,
):
    offs_r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    base = x_ptr + (offs_r % R).to(tl.int64)[:, None] * stride_r
    offs_n = tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_R, BLOCK_N), dtype=tl.float32)
    for start in range(0, N, BLOCK_N):
        if EVEN_N:
            x = tl.load(base + (start + offs_n)[None, :])
        else:
            x = tl.load(base + (start + offs_n)[None, :],
                        mask=(start + offs_n < N)[None, :], other=0.0)
        acc += x.to(tl.float32)
    tl.store(out_ptr + offs_r, tl.sum(acc, axis=1), mask=offs_r < R)


def _pow2_at_least(n: int, least: int) -> int:
    return max(least, triton.next_power_of_2(max(n, 1)))


def mm_config(N: int, K: int, dtype: torch.dtype) -> MMConfig:
    """The fixed GEMM config of (N, K, dtype): the module docstring's table. Never depends on M:
    that is what makes a row's result independent of the row count."""
    if dtype == torch.float32:
        base = MMConfig(64, 64, 32, 4, 2)
    elif N >= WIDE_N:
        base = MMConfig(128, 128, 64, 8, 3)
    else:
        base = MMConfig(128, 64, 64, 4, 4)
    return replace(base, block_n=min(base.block_n, _pow2_at_least(N, _MIN_DOT)),
                   block_k=min(base.block_k, _pow2_at_least(K, _MIN_DOT)))


def sum_config(N: int) -> tuple[int, int, int]:
    """(block_r, block_n, num_warps) of a row sum of length N: a function of N only."""
    block_n = min(_pow2_at_least(N, _MIN_DOT), SUM_TILE)
    return SUM_TILE // block_n, block_n, 8


def _check_mm(a: torch.Tensor, w: torch.Tensor, batched: bool) -> None:
    want = 3 if batched else 2
    if a.dim() != want or w.dim() != want:
        raise ValueError(f"operands must be {want}-D; got {list(a.shape)} and {list(w.shape)}")
    if a.shape[-1] != w.shape[-2] or (batched and a.shape[0] != w.shape[0]):
        raise ValueError(f"shapes {list(a.shape)} and {list(w.shape)} cannot be multiplied")
    if a.dtype != w.dtype or a.dtype not in FLOAT_DTYPES:
        raise ValueError(f"operands must share one of {[str(d) for d in FLOAT_DTYPES]}; "
                         f"got {a.dtype} and {w.dtype}")
    if a.device != w.device:
        raise ValueError(f"operands must be on one device; got {a.device} and {w.device}")


def _launch_mm(a: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, alpha: float,
               beta: float, config: MMConfig | None) -> torch.Tensor:
    """a [B, M, K] @ w [B, K, N] (+ bias broadcast to [M, N]) -> [B, M, N] in a's dtype."""
    B, M, K = a.shape
    N = w.shape[2]
    out = torch.empty(B, M, N, dtype=a.dtype, device=a.device)
    if out.numel() == 0:
        return out
    cfg = config or mm_config(N, K, a.dtype)
    x = a.new_zeros(1) if bias is None else bias.expand(M, N)
    fp32_dot = a.device.type != "cuda" or a.dtype == torch.float32
    tiles = triton.cdiv(M, cfg.block_m) * triton.cdiv(N, cfg.block_n)
    # NOTE: batch strides 0 when B = 1: a[None].stride(0) = M * K would make the compiled variant
    # (16-divisibility specialisation) depend on M.
    sa, sw, sc = ((t.stride(0) if B > 1 else 0) for t in (a, w, out))
    for b0 in range(0, B, _MAX_GRID_Y):
        b1 = min(B, b0 + _MAX_GRID_Y)
        _mm_kernel[(tiles, b1 - b0)](
            a[b0:b1], w[b0:b1], x, out[b0:b1], M, N, K, alpha, beta,
            sa, a.stride(1), a.stride(2), sw, w.stride(1), w.stride(2),
            x.stride(0), x.stride(-1), sc, out.stride(1), out.stride(2),
            BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
            HAS_BIAS=bias is not None, SCALE=alpha != 1, FP32_DOT=fp32_dot,
            EVEN_K=K % cfg.block_k == 0, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return out


def bi_mm(a: torch.Tensor, w: torch.Tensor, *, config: MMConfig | None = None) -> torch.Tensor:
    """a [M, K] @ w [K, N] -> [M, N] in their (shared) dtype; any strides (w may be a transposed
    weight, as F.linear passes it). `config` is a knob for tests and sweeps: a different config
    gives other bits, so both sides of a comparison must use the same."""
    _check_mm(a, w, batched=False)
    return _launch_mm(a[None], w[None], None, 1.0, 0.0, config)[0]


def bi_bmm(a: torch.Tensor, w: torch.Tensor, *, config: MMConfig | None = None) -> torch.Tensor:
    """a [B, M, K] @ w [B, K, N] -> [B, M, N], each batch as `bi_mm`."""
    _check_mm(a, w, batched=True)
    return _launch_mm(a, w, None, 1.0, 0.0, config)


def bi_addmm(bias: torch.Tensor, a: torch.Tensor, w: torch.Tensor, *, beta: float = 1,
             alpha: float = 1, config: MMConfig | None = None) -> torch.Tensor:
    """beta * bias + alpha * (a @ w) with bias broadcastable to [M, N] (aten.addmm; beta = 0
    ignores bias, nan included). Folded in fp32, rounded once."""
    _check_mm(a, w, batched=False)
    if bias.dtype not in FLOAT_DTYPES or bias.device != a.device:
        raise ValueError(f"bias must be one of {[str(d) for d in FLOAT_DTYPES]} on {a.device}; "
                         f"got {bias.dtype} on {bias.device}")
    torch.broadcast_shapes(bias.shape, (a.shape[0], w.shape[1]))
    keep = None if beta == 0 else bias
    return _launch_mm(a[None], w[None], keep, float(alpha), float(beta), config)[0]


def bi_sum_rows(x: torch.Tensor) -> torch.Tensor:
    """x [R, N] of bf16 / fp16 / fp32 -> [R] fp32 row sums, each in an order fixed by N.

    NOTE: the final tl.sum's tree follows the load layout, which Triton derives from the pointer's
    16-byte alignment and the row stride's divisibility; so the kernel always reads a 16-byte
    aligned, row-contiguous tensor (a copy when x is not one), and its code depends on N alone.
    """
    if x.dim() != 2 or x.dtype not in FLOAT_DTYPES:
        raise ValueError(f"x must be [R, N] of {[str(d) for d in FLOAT_DTYPES]}; "
                         f"got {list(x.shape)} {x.dtype}")
    R, N = x.shape
    out = torch.zeros(R, dtype=torch.float32, device=x.device)
    if R == 0 or N == 0:
        return out
    if (x.data_ptr() % 16 or (N > 1 and x.stride(1) != 1) or (R > 1 and x.stride(0) != N)):
        x = x.clone(memory_format=torch.contiguous_format)
    block_r, block_n, warps = sum_config(N)
    _sum_rows_kernel[(triton.cdiv(R, block_r),)](
        x, out, R, N, N, BLOCK_R=block_r, BLOCK_N=block_n, EVEN_N=N % block_n == 0,
        num_warps=warps)
    return out


def _reduced_dims(ndim: int, dim: Sequence[int] | None) -> list[int]:
    """Sorted, wrapped reduction dims (None or [] = all; a 0-d tensor takes dim 0 or -1)."""
    n = max(ndim, 1)
    if not dim:
        return list(range(n))
    if any(not -n <= d < n for d in dim):
        raise IndexError(f"dims {list(dim)} out of range for a {ndim}-d tensor")
    dims = sorted(d % n for d in dim)
    if len(set(dims)) != len(dims):
        raise ValueError(f"dims {list(dim)} repeat a dim")
    return dims


def _rows(x: torch.Tensor, dims: list[int]) -> torch.Tensor:
    """x with `dims` permuted last, as [R, N] (a view when the layout allows)."""
    kept = [d for d in range(x.dim()) if d not in dims]
    R = math.prod(x.shape[d] for d in kept)
    return x.permute(*kept, *dims).reshape(R, math.prod(x.shape[d] for d in dims))


def _reduced_shape(x: torch.Tensor, dims: list[int], keepdim: bool) -> list[int]:
    if x.dim() == 0:
        return []
    return [1 if d in dims else s for d, s in enumerate(x.shape) if keepdim or d not in dims]


def _row_sums(x: torch.Tensor, dim: Sequence[int] | None, dtype: torch.dtype | None
              ) -> tuple[torch.Tensor, list[int], int]:
    """(fp32 sums over `dim` as [R], the reduced dims, N) of x cast to `dtype` first (aten's
    rule; no cast needed for fp32, the accumulator's type). Raises ValueError unless the result
    dtype is bf16 / fp16 / fp32 and x is real."""
    if (dtype or x.dtype) not in FLOAT_DTYPES or x.is_complex():
        raise ValueError(f"batch-invariant sums take real x with a {FLOAT_DTYPES} result; got "
                         f"{x.dtype} -> {dtype or x.dtype}")
    if dtype is not None and dtype not in (x.dtype, torch.float32):
        x = x.to(dtype)
    elif x.dtype not in FLOAT_DTYPES:
        x = x.float()
    dims = _reduced_dims(x.dim(), dim)
    rows = _rows(x.reshape(1) if x.dim() == 0 else x, dims)
    return bi_sum_rows(rows), dims, rows.shape[1]


def sum_dim(x: torch.Tensor, dim: Sequence[int] | None = None, keepdim: bool = False, *,
            dtype: torch.dtype | None = None) -> torch.Tensor:
    """aten.sum.dim_IntList for floating x (or any x with a floating `dtype`)."""
    sums, dims, _ = _row_sums(x, dim, dtype)
    return sums.to(dtype or x.dtype).view(_reduced_shape(x, dims, keepdim))


def mean_dim(x: torch.Tensor, dim: Sequence[int] | None = None, keepdim: bool = False, *,
             dtype: torch.dtype | None = None) -> torch.Tensor:
    """aten.mean.dim: the fp32 sum divided by N (nan for N = 0), rounded once."""
    sums, dims, n = _row_sums(x, dim, dtype)
    return (sums / n).to(dtype or x.dtype).view(_reduced_shape(x, dims, keepdim))


def _last_dim_rows(x: torch.Tensor, dim: int) -> tuple[torch.Tensor, Callable[[torch.Tensor],
                                                                             torch.Tensor]]:
    """(x with `dim` moved last as fp32 [R, N], the map of a [R, N] result back to x's layout)."""
    d = _reduced_dims(x.dim(), [dim])[0]
    xs = x.reshape(1) if x.dim() == 0 else x
    rows = _rows(xs, [d]).float()
    moved = list(xs.movedim(d, -1).shape)

    def restore(y: torch.Tensor) -> torch.Tensor:
        out = y.view(moved).movedim(-1, d)
        return out.contiguous().view(x.shape)
    return rows, restore


def _shifted(rows: torch.Tensor) -> torch.Tensor:
    """rows - rowmax (a new fp32 tensor)."""
    return rows - rows.amax(dim=1, keepdim=True)


def softmax(x: torch.Tensor, dim: int, half_to_float: bool = False) -> torch.Tensor:
    """aten._softmax: exp(x - max) / sum in fp32, rounded once to x's dtype (fp32 with
    half_to_float)."""
    out_dtype = torch.float32 if half_to_float else x.dtype
    if x.numel() == 0:
        return torch.empty_like(x, dtype=out_dtype)
    rows, restore = _last_dim_rows(x, dim)
    e = _shifted(rows).exp_()
    return restore(e.div_(bi_sum_rows(e)[:, None]).to(out_dtype))


def log_softmax(x: torch.Tensor, dim: int, half_to_float: bool = False) -> torch.Tensor:
    """aten._log_softmax: (x - max) - log(sum exp(x - max)) in fp32, rounded once."""
    out_dtype = torch.float32 if half_to_float else x.dtype
    if x.numel() == 0:
        return torch.empty_like(x, dtype=out_dtype)
    rows, restore = _last_dim_rows(x, dim)
    y = _shifted(rows)
    return restore(y.sub_(bi_sum_rows(y.exp()).log()[:, None]).to(out_dtype))


def logsumexp(x: torch.Tensor, dim: Sequence[int], keepdim: bool = False) -> torch.Tensor:
    """aten.logsumexp for floating x: log(sum exp(x - m)) + m, m = max with |m| = inf -> 0."""
    dims = _reduced_dims(x.dim(), dim)
    rows = _rows(x.reshape(1) if x.dim() == 0 else x, dims).float()
    if rows.shape[1] == 0:
        m = rows.new_zeros(rows.shape[0])
    else:
        m = rows.amax(dim=1)
        m = m.masked_fill(m.abs() == math.inf, 0.0)
    out = bi_sum_rows((rows - m[:, None]).exp_()).log_().add_(m)
    return out.to(x.dtype).view(_reduced_shape(x, dims, keepdim))
