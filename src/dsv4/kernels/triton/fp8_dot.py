"""FP8 x FP8 tensor-core steps shared by the W8A8 kernels (`moe_w8a8.py`, `fp8_linear_a8.py`).

DeepGEMM's scheme: each K step is one 128-wide scale block, an e4m3 x e4m3 dot into a fresh fp32
tile (`fp8_block_dot`; FP8 wgmma, QGMMA, at BLOCK_M >= 64 on sm_90, whose accumulation inside one
instruction is less precise than fp32), promoted into the fp32 accumulator by the activation rows'
scales times the weight block's scale (`promote`: powers of two, exact; one FFMA per element).
Under the interpreter (FP32_DOT) both operands are decoded to fp32: exact products.
Operand pointers are float8e4nv (torch.float8_e4m3fn storage): the codes go from global into
shared memory as they are and the wgmma reads both operands there. Loading uint8 and bitcasting
would route A through registers (a register-operand wgmma: ~45 more registers per thread at the
64 x 128 tile, the difference between one resident CTA per SM and two).
"""

from __future__ import annotations

import triton
import triton.language as tl

from dsv4.kernels.triton.moe_decode import e8m0


@triton.jit
def round_bf16(v):  # type: ignore[no-untyped-def]
    """Finite fp32 v rounded to bf16 precision (nearest, ties to even) on the bits, still fp32:
    the GPU's convert, and the interpreter's (which truncates) made exact."""
    bits = v.to(tl.int32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -0x10000
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def fp8_block_dot(a_ptrs, a_mask, w_ptrs, w_mask,  # type: ignore[no-untyped-def]
                  FP32_DOT: tl.constexpr):
    """One 128-wide K block: [BM, 128] e4m3 values times [128, BN] e4m3 values (float8e4nv
    pointers) -> [BM, BN] fp32 (a fresh accumulator: the caller scales it before adding)."""
    a = tl.load(a_ptrs, mask=a_mask, other=0.0)
    w = tl.load(w_ptrs, mask=w_mask, other=0.0)
    if FP32_DOT:
        return tl.dot(a.to(tl.float32), w.to(tl.float32), input_precision="ieee")
    return tl.dot(a, w)


@triton.jit
def promote(acc, part, a_scale, s_ptr):  # type: ignore[no-untyped-def]
    """acc + part * (a_scale * w_scale)[:, None]: a_scale [BM] the rows' activation scales, w_scale
    the weight block's e8m0 scale at s_ptr, one for the whole tile (BLOCK_N <= 128 divides 128,
    so a tile's output rows lie in one 128-row scale block). Powers of two: exact (barring an
    underflow of the product below 2^-126, far from real scales). One FFMA per element."""
    return acc + part * (a_scale * e8m0(tl.load(s_ptr)))[:, None]
