"""W8A8 FP8 linear on FP8 tensor cores: `triton_fp8_linear_a8(x, w, scale)`, the fast form of
`ref/fp8_linear.py::fp8_linear_a8` (the reference model's FP8 linears, spec §11.1).

    y[m, n] = Σ_kb xs[m, kb] s[n // 128, kb] Σ_{k in block kb} q[m, k] code[n, k]

x is quantised first (`act_quant.py`: e4m3 codes q, one power-of-two scale xs per row and 128
columns); w is the checkpoint's e4m3 codes [N, K] with UE8M0 128x128 block scales. Each K step is
one scale block: an FP8 dot into a fresh tile, promoted into the fp32 accumulator
(`fp8_dot.py`). One rounding to x's dtype at the store (bf16 rounded on the bits, so the
interpreter's truncating convert does not change it).

For prefill-sized M (the weight-only `fp8_linear.py` keeps decode, where one weight byte per
product is the cost and the activations' quantisation would only add work). Grid: M tiles x N
tiles in groups of GROUP_M row tiles per column sweep (the tiles that run together share their
weight columns and activation rows in L2). Rows past M / N are masked; K need not be a multiple of
128 (the last block is partial, its scale the block's).

Precision: exact e4m3 products; on sm_90 at BLOCK_M >= 64 QGMMA's accumulation inside one
instruction (~1e-4 relative of a block's sum), then fp32. Test: tests/kernels/test_fp8_linear_a8.py.
Benchmark: benchmarks/kernels/bench_fp8_linear.py (`--a8`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsv4.kernels.triton.act_quant import triton_act_quant
from dsv4.kernels.triton.fp8_dot import fp8_block_dot, promote, round_bf16
from dsv4.kernels.triton.fp8_linear import check_operands
from dsv4.kernels.triton.pdl import pdl_args
from dsv4.kernels.triton.pdl_enter import pdl_enter

BLOCK = 128
GROUP_M = 8
X_DTYPES = (torch.bfloat16, torch.float32)


@triton.jit
def _fp8_linear_a8_kernel(  # type: ignore[no-untyped-def]
    x_ptr, xs_ptr, w_ptr, s_ptr, y_ptr, M, N, K, stride_x, stride_xs, stride_w, stride_s,
    stride_y, FP32_DOT: tl.constexpr, Y_BF16: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr, PDL: tl.constexpr):
    pdl_enter(PDL)
    pid = tl.program_id(0)
    m_tiles, n_tiles = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
    group = pid // (GROUP_M * n_tiles)
    first = group * GROUP_M
    rows = tl.minimum(m_tiles - first, GROUP_M)
    m_tile = first + (pid % (GROUP_M * n_tiles)) % rows
    n_tile = (pid % (GROUP_M * n_tiles)) // rows
    offs_m = m_tile.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = n_tile.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask, n_mask = offs_m < M, offs_n < N
    s_row = s_ptr + (n_tile * BLOCK_N // 128) * stride_s
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, 128):
        offs_k = k0 + tl.arange(0, 128)
        k_mask = offs_k < K
        part = fp8_block_dot(x_ptr + offs_m[:, None] * stride_x + offs_k[None, :],
                             m_mask[:, None] & k_mask[None, :],
                             w_ptr + offs_n[None, :] * stride_w + offs_k[:, None],
                             k_mask[:, None] & n_mask[None, :], FP32_DOT)
        xs = tl.load(xs_ptr + offs_m * stride_xs + k0 // 128, mask=m_mask, other=0.0)
        acc = promote(acc, part, xs, s_row + k0 // 128)
    if Y_BF16:
        acc = round_bf16(acc)
    tl.store(y_ptr + offs_m[:, None] * stride_y + offs_n[None, :],
             acc.to(y_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


def _check(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor) -> None:
    """The weight-only linear's operand rules, and x bf16 / fp32 (the store's rounding is made
    exact for those: `round_bf16`)."""
    check_operands(x, w, scale)
    if x.dtype not in X_DTYPES:
        raise ValueError(f"x must be [M, K] of {[str(d) for d in X_DTYPES]}; got {x.dtype}")


def triton_fp8_linear_a8(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, *,
                         block_m: int | None = None, block_n: int | None = None,
                         num_warps: int | None = None,
                         num_stages: int | None = None) -> torch.Tensor:
    """Same contract as `fp8_linear_a8` for x [M, K] (bf16 / fp32): [M, N] in x's dtype. Knobs
    (None: BLOCK_M 64 up to M = 128, else 128; BLOCK_N 128; 8 warps at 128 x 128, else 4; 3
    stages): block_m / block_n powers of two in [16, 128]."""
    _check(x, w, scale)
    M, K = x.shape
    N = w.shape[0]
    bm = block_m or (64 if M <= 128 else 128)
    bn = block_n or BLOCK
    for name, b in (("block_m", bm), ("block_n", bn)):
        if not 16 <= b <= 128 or b & (b - 1):
            raise ValueError(f"{name}={b} is invalid; allowed: a power of two in [16, 128]")
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if M == 0 or N == 0:
        return y
    q, xs = triton_act_quant(x, BLOCK)
    grid = (triton.cdiv(M, bm) * triton.cdiv(N, bn),)
    _fp8_linear_a8_kernel[grid](
        q, xs, w.view(torch.float8_e4m3fn), scale.view(torch.uint8), y, M, N, K, q.stride(0),
        xs.stride(0), w.stride(0), scale.stride(0), y.stride(0),
        FP32_DOT=x.device.type != "cuda", Y_BF16=x.dtype == torch.bfloat16, BLOCK_M=bm,
        BLOCK_N=bn, GROUP_M=GROUP_M, num_warps=num_warps or (8 if bm * bn >= 128 * 128 else 4),
        num_stages=num_stages or 3, **pdl_args(x.device))
    return y
