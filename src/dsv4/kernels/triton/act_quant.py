"""Triton FP8 activation quantisation: the fast form of `kernels/ref/act_quant.py::act_quant`.

`triton_act_quant(x, block)` has the reference's signature and bits: per row and per `block`
columns, the power-of-two scale of the block's amax (`pow2_ceil_scale`, computed on the fp32 bits)
and the e4m3 codes of x / s (`quant_rows`: the reciprocal of s built from its bits, so the
multiply is exact; `round_e4m3` rounds to nearest even in fp32, so the convert is exact).
`quant_rows` is also the epilogue of the W8A8 expert kernels (`moe_w8a8.py`), which quantise
their hidden activations in registers.

One program per BLOCK_ROWS rows and one column block: no reduction crosses programs. Test:
tests/kernels/test_act_quant.py. Benchmark: benchmarks/kernels/bench_act_quant.py.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsv4.kernels.ref.act_quant import ACT_BLOCK, AMAX_FLOOR, E4M3_MAX

BLOCK_ROWS = 16
_FLOOR = tl.constexpr(AMAX_FLOOR)
_MAX = tl.constexpr(E4M3_MAX)
_INV_MAX = tl.constexpr(1.0 / E4M3_MAX)


@triton.jit
def pow2_ceil_scale(amax):  # type: ignore[no-untyped-def]
    """fp32 2^ceil(log2(max(amax, 1e-4) / 448)) from the bits of the product (as the reference):
    the exponent field, plus one where any mantissa bit is set."""
    t = tl.maximum(amax, _FLOOR) * _INV_MAX
    bits = t.to(tl.int32, bitcast=True)
    exponent = ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).to(tl.int32)
    return (exponent << 23).to(tl.float32, bitcast=True)


@triton.jit
def quant_rows(v):  # type: ignore[no-untyped-def]
    """(e4m3 codes [R, B] as uint8, fp32 scales [R]) of fp32 v [R, B], one block per row; columns
    outside the block must hold 0 (they cannot raise the amax)."""
    scale = pow2_ceil_scale(tl.max(tl.abs(v), axis=1))
    return e4m3_codes(v, inv_pow2(scale)[:, None]).to(tl.uint8, bitcast=True), scale


@triton.jit
def quant_row(v):  # type: ignore[no-untyped-def]
    """(e4m3 codes [B] as fp8e4nv, fp32 scale) of one fp32 row v [B] as one block (an FP8
    indexer key or query head, `ref/index_keys.py`); lanes outside the block must hold 0."""
    scale = pow2_ceil_scale(tl.max(tl.abs(v), axis=0))
    return e4m3_codes(v, inv_pow2(scale)), scale


@triton.jit
def inv_pow2(scale):  # type: ignore[no-untyped-def]
    """1 / scale for a power-of-two fp32 scale, from the bits (biased exponent 254 - e): exact,
    whatever the division's rounding."""
    return ((254 - (scale.to(tl.int32, bitcast=True) >> 23)) << 23).to(tl.float32, bitcast=True)


@triton.jit
def e4m3_codes(v, inv):  # type: ignore[no-untyped-def]
    """The e4m3 codes (fp8e4nv) of fp32 v * inv, inv the (broadcast) `inv_pow2` of v's scale."""
    return round_e4m3(tl.clamp(v * inv, -_MAX, _MAX)).to(tl.float8e4nv)


@triton.jit
def round_e4m3(v):  # type: ignore[no-untyped-def]
    """fp32 v (|v| <= 448) rounded to the nearest e4m3 value, ties to even, still fp32: normal
    range on the bits (3 mantissa bits kept, a carry may bump the exponent), subnormal range
    (|v| < 2^-6: multiples of 2^-9) by adding and removing 1.5 * 2^14, whose ulp is 2^-9; the
    sign put back on the bits (torch's convert keeps it on a zero). The
    convert to e4m3 that follows is then exact, whatever its own rounding (the interpreter's does
    not carry a rounded-up mantissa into the exponent)."""
    a = tl.abs(v)
    bits = a.to(tl.int32, bitcast=True)
    bits = (bits + 0x7FFFF + ((bits >> 20) & 1)) & -0x100000
    mag = tl.where(a < 0.015625, (a + 24576.0) - 24576.0, bits.to(tl.float32, bitcast=True))
    sign = v.to(tl.int32, bitcast=True) & -0x80000000      # a negative value's zero stays -0.0
    return (mag.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)


@triton.jit
def half_order(c, BLOCK: tl.constexpr):  # type: ignore[no-untyped-def]
    """Where column c (0..BLOCK-1) of a block sits in the even / odd order (the FP4 W8A8 loop's
    operand order): the even columns first (c / 2), then the odd ones (BLOCK / 2 + c // 2)."""
    return (c % 2) * (BLOCK // 2) + c // 2


@triton.jit
def _act_quant_kernel(x_ptr, q_ptr, s_ptr, N, D,  # type: ignore[no-untyped-def]
                      stride_x, stride_q, stride_s,
                      BLOCK: tl.constexpr, BLOCK_ROWS: tl.constexpr, HALF_ORDER: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    cb = tl.program_id(1)
    cols = cb * BLOCK + tl.arange(0, BLOCK)
    mask = (rows < N)[:, None] & (cols < D)[None, :]
    x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0)
    q, scale = quant_rows(x.to(tl.float32))
    dest = cols
    if HALF_ORDER:
        dest = cb * BLOCK + half_order(tl.arange(0, BLOCK), BLOCK)
    tl.store(q_ptr + rows[:, None] * stride_q + dest[None, :], q, mask=mask)
    tl.store(s_ptr + rows * stride_s + cb, scale, mask=rows < N)


def triton_act_quant(x: torch.Tensor, block: int = ACT_BLOCK, *,
                     half_order: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as `ref/act_quant.py::act_quant` for x [N, d] (bf16 / fp16 / fp32; rows may
    be strided, columns contiguous): (codes [N, d] float8_e4m3fn, scales [N, ceil(d/block)] fp32).
    `block` a power of two >= 16. `half_order`: each block's codes stored with its even columns
    first, then its odd ones (the FP4 W8A8 loop's operand order; d a multiple of block)."""
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"x must be [N, d] with contiguous columns; got shape {tuple(x.shape)}, "
                         f"strides {x.stride()}")
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"x.dtype must be bfloat16, float16 or float32; got {x.dtype}")
    if block < 16 or block & (block - 1):
        raise ValueError(f"block={block} is invalid; allowed: a power of two >= 16")
    N, d = x.shape
    if half_order and d % block:
        raise ValueError(f"half_order needs d a multiple of block = {block}; got d = {d}")
    q = torch.empty(N, d, dtype=torch.uint8, device=x.device)
    s = torch.empty(N, triton.cdiv(d, block), dtype=torch.float32, device=x.device)
    if N and d:
        _act_quant_kernel[(triton.cdiv(N, BLOCK_ROWS), s.shape[1])](
            x, q, s, N, d, x.stride(0), q.stride(0), s.stride(0),
            BLOCK=block, BLOCK_ROWS=BLOCK_ROWS, HALF_ORDER=half_order, num_warps=4)
    return q.view(torch.float8_e4m3fn), s
