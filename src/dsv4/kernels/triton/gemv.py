"""Skinny GEMM (GEMV) for decode projections: `triton_linear(x, w)` = `F.linear(x, w)` for few rows.

At decode the projections multiply M = 1..64 token rows by a weight of N x K: the weight's bytes are
the whole cost, so the kernel's job is to stream w from HBM at the copy rate on every SM. cuBLAS
picks split-K kernels plus a separate reduce kernel at these shapes (two launches); here it is one
launch with the cross-split reduction inside it, deterministic.

    y[m, n] = sum_k x[m, k] w[n, k]    x [M, K], w [N, K] (unit stride along K), y [M, N] contiguous

Grid: cdiv(N, BLOCK_N) N tiles x SPLIT_K K splits, one program each (pid = tile * SPLIT_K + split).
N tiles come first; SPLIT_K > 1 only when the N tiles alone would leave SMs idle (`plan_gemv`).
Each split covers a whole number of BLOCK_K blocks of K, looped with `tl.range(num_stages=)` so
the weight loads are software-pipelined (cp.async into shared memory) even where no tl.dot uses
them. Rows past N / past M are clamped to the last real row (unmasked, 16-byte vector loads;
never stored); only a K tail (K % BLOCK_K != 0) is masked. Two inner products, one per plan:

    FMA (DOT=False, small M): for each x row m (unrolled, ROWS = M): acc[:, m] +=
        sum_k w[:, k] x[m, k] on the CUDA cores in fp32, each K block summed within a warp (2-D
        tiles: a 3-D [M, N, K] product would spread K over the warps and sum through shared memory
        every block). No padding of M to 16; served up to FMA_LIMIT_M rows. SwiGLU mode (`up=`,
        FMA only): x is the gate, and each K block's x row is h = swiglu(gate, up) of the
        block's gate and up loads (`swiglu.py::swiglu_f32`) rounded to x's dtype, so y has the
        bits of `triton_swiglu` followed by the plain product (`swiglu_linear.py`).
    DOT (DOT=True): acc[BLOCK_N, BLOCK_M] = tl.dot(w_tile, x_tile^T) -- w is the MMA's M operand
        ("swap AB": the weight rows fill the tensor core's 64-row side, the tokens its >= 16 side,
        wgmma at BLOCK_N 64); bf16 / fp16 operands multiply exactly, fp32 accumulates. fp32 (or
        mixed-dtype) operands go through tl.dot in fp32 with input_precision "ieee" (no tf32: FMA
        on the CUDA cores, M padded to 16) unless the plan asks for "tf32x3".

Split-K reduction in the same launch (SPLIT_K > 1): each program stores its fp32 partial tile into
a workspace [SPLIT_K, M, N] (fresh per call), then bumps its N tile's int32 arrival counter
(CTA barrier, then one atomic_add, acq_rel, gpu scope: the pattern of topk_compact.py). The
program that brings it to SPLIT_K - 1 sums the tile's SPLIT_K partials in split order 0, 1, ...
(L1-bypassing loads), stores y and resets the counter to 0. Every y element is therefore the same
sum in the same order whichever program arrives last: bit-identical run to run, no float atomics.
The counters are one int32 per N tile in a buffer the caller holds (`counters`, e.g. from a
`GemvCounters`), zero when allocated and left zero by every call, so no memset node is needed;
without one a call takes a fresh zero-filled buffer (one memset). Split-K calls that share a
counter buffer must not overlap: one stream at a time (or each stream its own buffer).

Precision: fp32 accumulation of exact products (bf16 / fp16 products are exact in fp32); the sum
order differs from cuBLAS's, so results match `F.linear` within fp32 rounding of the K-sum,
then one rounding to the output dtype (a bf16 output can differ from cuBLAS's by one bf16 ulp).
Output dtype: x's (F.linear's for equal dtypes); mixed x / w dtypes compute
F.linear(x.float(), w.float()) and round to x's dtype (e.g. fp32 x against a bf16 weight, with no
fp32 copy of the weight). On the Triton interpreter (CPU tests) the DOT path upcasts 16-bit tiles
to fp32 before tl.dot (the interpreter's bf16 dot multiplies raw bit patterns,
triton-lang/triton#11584): the same exact products.

Plan (`plan_gemv`, host only, from (M, N, K, dtypes, SM count); no host sync, CUDA-graph safe):
FMA for M <= FMA_MAX_M, else DOT with BLOCK_M = max(16, next_pow2(M)); BLOCK_K covers 512 bytes of
a weight row (FMA) or 128 / 32 elements (DOT, 16-bit / fp32 operands); 4 warps; 1 / 4 stages;
BLOCK_N 16 (FMA) or 64 (DOT), at most next_pow2(N), halved (down to the warps / 16) while even the
most splits leave under half the target programs. Target: PROGRAMS_PER_SM programs per SM;
SPLIT_K = the splits that reach it, capped by the K blocks and by the last arrival's registers
(REDUCE_REGS partial values a thread), then evened out so no split is empty. Every knob is a
keyword of `triton_linear` (tests, `benchmarks/kernels/bench_gemv.py --sweep`). M is limited to
MAX_M: past it the call raises (a prefill-sized GEMM belongs to cuBLAS; the caller picks
F.linear).

Test: tests/kernels/test_gemv.py (the SwiGLU mode: test_swiglu_linear.py). Benchmark:
benchmarks/kernels/bench_gemv.py.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from dsv4.kernels.ops import DECODE_BLOCK_N
from dsv4.kernels.triton.gemv_tile import fma_block, store_tile, w_block
from dsv4.kernels.triton.launch import X_DTYPES, pow2, sms
from dsv4.kernels.triton.libm import libdevice_math
from dsv4.kernels.triton.pdl import pdl_args
from dsv4.kernels.triton.pdl_enter import pdl_enter

MAX_M = 64                  # rows served; more raise ValueError (use F.linear)
FMA_MAX_M = 4               # M up to this: CUDA-core FMA path; above: tl.dot
FMA_LIMIT_M = 32            # the FMA path (one unrolled pass per x row) serves at most this M
PROGRAMS_PER_SM = 4         # split-K target: programs per SM
FMA_BLOCK_BYTES = 512       # FMA path: bytes of a weight row per K block (32 lanes x 16 B)
REDUCE_REGS = 128           # default split-K: at most this many partial values a thread sums
MAX_TILES = 8192            # N tiles a split-K launch may have (the held counter buffer's size)
_MIN_DOT = 16               # tl.dot needs every dimension >= 16
PRECISIONS = ("ieee", "tf32x3")


@dataclass(frozen=True)
class GemvPlan:
    """Tile shape, K split and launch options of one `triton_linear` call.

    `split_k` is the effective number of K splits (each a whole number of BLOCK_K blocks, none
    empty); `dot` picks the tl.dot inner product over the FMA one; `precision` is tl.dot's
    input_precision for fp32 operands.
    """

    block_n: int
    block_k: int
    split_k: int
    num_warps: int
    num_stages: int
    dot: bool
    precision: str = "ieee"


@triton.jit(do_not_specialize=["M", "N"])
def _gemv_kernel(  # type: ignore[no-untyped-def]
    x_ptr, u_ptr, w_ptr, y_ptr, part_ptr, cnt_ptr, M, N, K, stride_xm, stride_um, stride_wn,
    k_per_split, limit,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
    NUM_STAGES: tl.constexpr, DOT: tl.constexpr, ROWS: tl.constexpr, UPCAST: tl.constexpr,
    PRECISION: tl.constexpr, EVEN_K: tl.constexpr, SWIGLU: tl.constexpr,
    LIBDEVICE: tl.constexpr, PDL: tl.constexpr):
    pid = tl.program_id(0)
    tile = pid // SPLIT_K
    split = pid % SPLIT_K
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    rows_x = tl.minimum(offs_m, M - 1).to(tl.int64)          # padding rows repeat real ones
    rows_w = tl.minimum(offs_n, N - 1).to(tl.int64)
    x_ptrs = x_ptr + rows_x[:, None] * stride_xm + offs_k[None, :]     # DOT path
    w_ptrs = w_ptr + rows_w[:, None] * stride_wn + offs_k[None, :]
    k_lo = split * k_per_split
    k_hi = tl.minimum(K, k_lo + k_per_split)
    pdl_enter(PDL)
    acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)            # y^T tile, both paths
    if DOT:
        for k0 in tl.range(k_lo, k_hi, BLOCK_K, num_stages=NUM_STAGES):
            wt = w_block(w_ptrs, k0, offs_k, K, EVEN_K)
            if EVEN_K:
                xt = tl.load(x_ptrs + k0)
            else:
                xt = tl.load(x_ptrs + k0, mask=(k0 + offs_k < K)[None, :], other=0.0)
            if UPCAST:
                acc = tl.dot(wt.to(tl.float32), tl.trans(xt.to(tl.float32)), acc,
                             input_precision=PRECISION)
            else:
                acc = tl.dot(wt, tl.trans(xt), acc)
    else:
        for k0 in tl.range(k_lo, k_hi, BLOCK_K, num_stages=NUM_STAGES):
            wt = w_block(w_ptrs, k0, offs_k, K, EVEN_K)
            acc = fma_block(acc, wt, k0, offs_k, x_ptr, u_ptr, K, stride_xm, stride_um, limit,
                             BLOCK_M, ROWS, EVEN_K, SWIGLU, LIBDEVICE)
    store_tile(acc, y_ptr, part_ptr, cnt_ptr, tile, split, M, N, offs_m, offs_n, SPLIT_K)


_LIBDEVICE = libdevice_math(_gemv_kernel)     # the SwiGLU mode's exp / division (libm.py)


def block_m(M: int, dot: bool) -> int:
    """Rows of the program's x tile: next_pow2(M), at least 16 on the tl.dot path."""
    return max(_MIN_DOT if dot else 1, triton.next_power_of_2(max(M, 1)))


def even_split(k_blocks: int, split_k: int) -> tuple[int, int]:
    """(splits, blocks per split) for at most `split_k` splits of `k_blocks`, none empty."""
    per = triton.cdiv(k_blocks, max(1, min(split_k, k_blocks)))
    return triton.cdiv(k_blocks, per), per


def plan_gemv(M: int, N: int, K: int, x_dtype: torch.dtype, w_dtype: torch.dtype,
              num_sms: int, *, block_n: int | None = None, block_k: int | None = None,
              split_k: int | None = None, num_warps: int | None = None,
              num_stages: int | None = None, dot: bool | None = None,
              precision: str | None = None) -> GemvPlan:
    """The plan of an [M, K] x [N, K]^T product on a GPU of `num_sms` SMs (module docstring);
    host arithmetic only. A knob given replaces the default; the defaults of the others follow
    it (the inner product picks the tile defaults, the tile sizes the split). Raises ValueError
    on an invalid knob."""
    dot = M > FMA_MAX_M if dot is None else dot
    least = _MIN_DOT if dot else 1
    if not dot and M > FMA_LIMIT_M:
        raise ValueError(f"dot=False serves M <= {FMA_LIMIT_M}; got M = {M}")
    w_bytes = w_dtype.itemsize
    wide = max(w_bytes, x_dtype.itemsize) >= 4
    if dot:
        bn, bk, warps, stages = 64, (32 if wide else 128), 4, 4
    else:
        bn, bk, warps, stages = 16, FMA_BLOCK_BYTES // w_bytes, 4, 1
    block_k = pow2("block_k", block_k, least) if block_k is not None else \
        min(bk, max(_MIN_DOT, triton.next_power_of_2(K)))
    num_warps = pow2("num_warps", num_warps, 1) if num_warps is not None else warps
    num_stages = stages if num_stages is None else num_stages
    if num_stages < 1:
        raise ValueError(f"num_stages must be >= 1; got {num_stages}")
    precision = "ieee" if precision is None else precision
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}; got {precision!r}")
    if split_k is not None and split_k < 1:
        raise ValueError(f"split_k must be >= 1; got {split_k}")
    k_blocks = triton.cdiv(max(K, 1), block_k)
    target = PROGRAMS_PER_SM * num_sms

    def most_splits(bn: int) -> int:
        """The default's split cap: the K blocks, and the last arrival's registers (it holds
        every split's share of the tile at once)."""
        if triton.cdiv(N, bn) > MAX_TILES:
            return 1
        per_thread = triton.cdiv(block_m(M, dot) * bn, 32 * num_warps)
        return min(k_blocks, max(1, REDUCE_REGS // per_thread))

    if block_n is None:
        block_n = min(bn, max(least, triton.next_power_of_2(N)))
        # narrower tiles while the split cap leaves the SMs under half the target programs
        while block_n > (_MIN_DOT if dot else num_warps) and \
                triton.cdiv(N, block_n) * most_splits(block_n) < target // 2:
            block_n //= 2
    else:
        pow2("block_n", block_n, least)
    if split_k is None:
        split_k = min(triton.cdiv(target, triton.cdiv(N, block_n)), most_splits(block_n))
    split, _ = even_split(k_blocks, split_k)
    return GemvPlan(block_n, block_k, split, num_warps, num_stages, dot, precision)


def _check(x: torch.Tensor, w: torch.Tensor) -> None:
    if x.dim() != 2:
        raise ValueError(f"x must be [M, K]; got shape {list(x.shape)}")
    if w.dim() != 2 or w.shape[1] != x.shape[1]:
        raise ValueError(f"w must be [N, K] with K = {x.shape[1]} (x's); got {list(w.shape)}")
    for name, t in (("x", x), ("w", w)):
        if t.dtype not in X_DTYPES:
            raise ValueError(f"{name} dtype {t.dtype} is not supported; allowed: "
                             f"{[str(d) for d in X_DTYPES]}")
        if t.shape[1] > 1 and t.stride(1) != 1:
            raise ValueError(f"{name} must have unit stride along K; got strides {t.stride()}")
    if x.shape[0] > MAX_M:
        raise ValueError(f"x has M = {x.shape[0]} rows; triton_linear serves M <= {MAX_M} "
                         "(larger GEMMs: F.linear)")
    if x.device != w.device:
        raise ValueError(f"x and w must be on one device; got {x.device} and {w.device}")


class GemvCounters:
    """Split-K arrival counters held across `triton_linear` calls (`counters=`): one zeroed int32
    buffer of MAX_TILES words per device, left zero by every call, so the calls need no memset.
    Allocated on first use outside CUDA-graph capture; a first use inside a capture takes a fresh
    zero-filled buffer that lives in the graph (correct on every replay). Calls sharing it must
    not overlap (one stream at a time)."""

    def __init__(self) -> None:
        self._held: dict[torch.device, torch.Tensor] = {}

    def get(self, device: torch.device) -> torch.Tensor:
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        buf = self._held.get(device)
        if buf is None:
            buf = torch.zeros(MAX_TILES, dtype=torch.int32, device=device)
            if not (device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
                self._held[device] = buf
        return buf


def triton_linear(x: torch.Tensor, w: torch.Tensor, *, block_n: int | None = None,
                  block_k: int | None = None, split_k: int | None = None,
                  num_warps: int | None = None, num_stages: int | None = None,
                  dot: bool | None = None, precision: str | None = None,
                  counters: torch.Tensor | None = None,
                  out_dtype: torch.dtype | None = None, up: torch.Tensor | None = None,
                  limit: float = 0.0) -> torch.Tensor:
    """y = x @ w.T (`F.linear(x, w)` without bias): x [M, K] with M <= MAX_M and unit column
    stride (any row stride), w [N, K] with unit stride along K, both bf16 / fp16 / fp32 -> y
    [M, N] contiguous in x's dtype, fp32 accumulation, one launch, bit-identical run to run.

    The knobs override `plan_gemv`'s choice (tests and sweeps): `block_n`, `block_k` (powers of
    two; >= 16 on the tl.dot path), `split_k` (at most this many K splits; the plan evens it out),
    `num_warps`, `num_stages`, `dot` (tl.dot vs FMA inner product), `precision` (tl.dot's
    input_precision for fp32 operands: "ieee" or "tf32x3"). Different knobs may give different
    last bits (another sum order). `counters`: a zeroed int32 buffer of >= N tiles words for the
    split-K arrival counters, left zero by every call (`GemvCounters.get`; default: a fresh zeroed
    one, i.e. one memset more; see the module docstring on streams). `out_dtype`: y's dtype
    (default x's): the fp32 sums are rounded to it once, so an fp32 y of 16-bit operands is
    `F.linear(x.float(), w.float())` up to the sum order.

    `up` (SwiGLU mode, FMA path only): x is the gate and the product's x is h = `swiglu(x, up,
    limit)` computed as `swiglu.py::swiglu_f32` does and rounded to x's dtype, where each K block
    is loaded; `up` matches x in shape, dtype and device (any row stride, unit column stride).
    The result is the bits of `triton_swiglu(x, up, limit)` through the same plan.
    """
    _check(x, w)
    if up is not None:
        if (up.shape != x.shape or up.dtype != x.dtype or up.device != x.device
                or (up.shape[1] > 1 and up.stride(1) != 1)):
            raise ValueError(f"up must match x in shape, dtype and device, with unit stride "
                             f"along K; got {list(up.shape)} {up.dtype} {up.device} strides "
                             f"{up.stride()}, x {list(x.shape)} {x.dtype} {x.device}")
        if dot:
            raise ValueError("the SwiGLU mode (up=) runs on the FMA path only; got dot=True")
        dot = False
    (M, K), N = x.shape, w.shape[0]
    out_dtype = x.dtype if out_dtype is None else out_dtype
    if out_dtype not in X_DTYPES:
        raise ValueError(f"out_dtype {out_dtype} is not supported; allowed: "
                         f"{[str(d) for d in X_DTYPES]}")
    y = torch.empty(M, N, dtype=out_dtype, device=x.device)
    if M == 0 or N == 0:
        return y
    if K == 0:
        return y.zero_()
    plan = plan_gemv(M, N, K, x.dtype, w.dtype, sms(x.device), block_n=block_n,
                     block_k=block_k, split_k=split_k, num_warps=num_warps,
                     num_stages=num_stages, dot=dot, precision=precision)
    tiles = triton.cdiv(N, plan.block_n)
    splits, per = even_split(triton.cdiv(K, plan.block_k), plan.split_k)
    part, cnt = y, y                            # unused unless split
    if splits > 1:
        cnt = (torch.zeros(tiles, dtype=torch.int32, device=x.device) if counters is None
               else counters)
        if (cnt.dtype != torch.int32 or cnt.numel() < tiles or not cnt.is_contiguous()
                or cnt.device != x.device):
            raise ValueError(f"counters must be a contiguous int32 tensor of >= {tiles} words on "
                             f"{x.device}; got {cnt.dtype} {cnt.numel()} on {cnt.device}, "
                             f"contiguous={cnt.is_contiguous()}")
        part = torch.empty(splits, M, N, dtype=torch.float32, device=x.device)
    # tl.dot in fp32: fp32 or mixed operands, and 16-bit ones under the interpreter (module doc)
    upcast = x.device.type != "cuda" or x.dtype != w.dtype or x.dtype == torch.float32
    u = x if up is None else up                 # unread without the SwiGLU mode
    _gemv_kernel[(tiles * splits,)](
        x, u, w, y, part, cnt, M, N, K, x.stride(0), u.stride(0), w.stride(0), per * plan.block_k,
        float(limit), BLOCK_M=block_m(M, plan.dot), BLOCK_N=plan.block_n, BLOCK_K=plan.block_k,
        SPLIT_K=splits, NUM_STAGES=plan.num_stages, DOT=plan.dot, ROWS=0 if plan.dot else M,
        UPCAST=upcast, PRECISION=plan.precision, EVEN_K=K % plan.block_k == 0,
        SWIGLU=up is not None, LIBDEVICE=_LIBDEVICE,
        num_warps=plan.num_warps, num_stages=plan.num_stages, **pdl_args(x.device))
    return y


DECODE_SPLIT_K = 1024       # and K elements per split at least (splits = K // this, >= 1)


def triton_decode_linear(x: torch.Tensor, w: torch.Tensor, *,
                         counters: torch.Tensor | None = None) -> torch.Tensor:
    """The triton backend's `linear` op: x [..., K] @ w [N, K]^T in x's dtype. Decode-sized calls
    (at most FMA_MAX_M rows, 16-bit x and w of one dtype, a call site's `counters`) run
    `triton_linear` on the FMA path with the tile width and the K splits fixed from K alone
    (`DECODE_BLOCK_N`, `DECODE_SPLIT_K`): a column's sum order then depends on K only, so a fused
    group's columns are the bits of its members' own calls, and a row's on nothing but its own
    values (the FMA path computes each row alone). Everything else: `F.linear` (cuBLAS)."""
    rows = x.numel() // max(1, x.shape[-1])
    if (counters is None or rows > FMA_MAX_M or rows == 0 or x.dtype != w.dtype
            or x.dtype not in (torch.bfloat16, torch.float16)
            or triton.cdiv(w.shape[0], DECODE_BLOCK_N) > counters.numel()):
        return torch.nn.functional.linear(x, w)
    K = x.shape[-1]
    y = triton_linear(x.reshape(rows, K), w, block_n=DECODE_BLOCK_N,
                      split_k=max(1, K // DECODE_SPLIT_K), dot=False, counters=counters)
    return y.view(*x.shape[:-1], w.shape[0])
