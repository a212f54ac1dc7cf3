"""Checkpoint weights decoded to a float dtype at memory bandwidth: FP4 groups and FP8 blocks.

`triton_dequant_fp4_group(weight, scale, dtype)` and `triton_dequant_fp8_block(weight, scale,
dtype)` are the kernels of `ref/quant.py::dequant_fp4_group` / `dequant_fp8_block` (same
signatures), for a matrix [out, in] or a stack of them [E, out, in] (a MoE layer's experts, one
grid plane per matrix), with an optional `out=` buffer (a reused scratch, no allocation):

    FP4: weight uint8 [..., out, in/2] (low nibble = element 2i), scale e8m0 [..., out, in/32]
    FP8: weight e4m3 [..., out, in], scale e8m0 [..., ceil(out/128), ceil(in/128)]
    value = code * 2^(scale - 127), rounded once to `dtype`.

Exact: every e2m1 / e4m3 value times a power of two is a float32 value, and one rounding to
`dtype` (exact in bf16 / fp32 for the scales real checkpoints hold) gives the reference's bits.
Unlike the reference, the kernels do not refuse NaN codes or overflow (that would need a host
sync): they decode what the loader validated. The scales decode as exp2(code - 127) in fp32, not
through `moe_decode.py::e8m0` (the experts' bit-built decode), which makes the FP4 kernel 7-16%
slower on an H100 (benchmarks/results/quant_moe_h200_202612.md).

Grid: (row tiles, column tiles, matrices); each program reads a [BLOCK_R, BLOCK_C] tile of codes
(bytes) and writes its decoded values, the FP4 pairs interleaved in registers so each row's stores
are contiguous. No host sync; CUDA-graph safe.

Use: the FP8 linears' prefill path (`fp8_linear.py`, from DEQUANT_MIN_M rows) decodes the weight
once per call; the quantised experts' prefill path decodes a layer's experts chunk by chunk into
bf16 buffers (`moe_dequant.py`). Test: tests/kernels/test_dequant_triton.py. Benchmark:
benchmarks/kernels/bench_dequant.py.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsv4.kernels.ref import quant

# (rows, code bytes) per program: 4 KB of codes; the fastest tile of an H100 sweep on every case
# of benchmarks/kernels/bench_dequant.py (benchmarks/results/quant_moe_h200_202612.md)
FP4_TILE = (8, 512)
FP8_TILE = (8, 512)
NUM_WARPS = 4
_OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@triton.jit
def _e2m1(n):  # type: ignore[no-untyped-def]
    """fp32 value of e2m1 codes n (int32 in [0, 16)): sign bit 3, exponent bits 2-1, mantissa 0;
    exponent 0 is subnormal (0 or 0.5). fp32 arithmetic, not `moe_decode.py::e2m1`'s bf16 bits:
    widened to fp32 for the scale, those compiled to 127 registers per thread against 75 here
    (sm_90, benchmarks/results/quant_moe_h200_202612.md)."""
    mag = n & 7
    e = mag >> 1
    m = (mag & 1).to(tl.float32)
    v = tl.where(e == 0, 0.5 * m, (1.0 + 0.5 * m) * tl.exp2((e - 1).to(tl.float32)))
    return tl.where((n & 8) != 0, -v, v)


@triton.jit
def _fp4_kernel(w_ptr, s_ptr, o_ptr, rows, half,  # type: ignore[no-untyped-def]
                stride_we, stride_wr, stride_se, stride_sr, stride_oe, stride_or,
                BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    e = tl.program_id(2).to(tl.int64)
    r = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    ok = (r < rows)[:, None] & (c < half)[None, :]
    codes = tl.load(w_ptr + e * stride_we + r[:, None] * stride_wr + c[None, :], mask=ok,
                    other=0).to(tl.int32)
    # 32 values (16 bytes) per scale
    s = tl.load(s_ptr + e * stride_se + r[:, None] * stride_sr + (c // 16)[None, :], mask=ok,
                other=127)
    scale = tl.exp2(s.to(tl.float32) - 127.0)
    values = tl.interleave(_e2m1(codes & 15) * scale, _e2m1(codes >> 4) * scale)
    cols = tl.program_id(1) * 2 * BLOCK_C + tl.arange(0, 2 * BLOCK_C)
    ok2 = (r < rows)[:, None] & (cols < 2 * half)[None, :]
    tl.store(o_ptr + e * stride_oe + r[:, None] * stride_or + cols[None, :],
             values.to(o_ptr.dtype.element_ty), mask=ok2)


@triton.jit
def _fp8_kernel(w_ptr, s_ptr, o_ptr, rows, cols,  # type: ignore[no-untyped-def]
                stride_we, stride_wr, stride_se, stride_sr, stride_oe, stride_or,
                BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    e = tl.program_id(2).to(tl.int64)
    r = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    ok = (r < rows)[:, None] & (c < cols)[None, :]
    codes = tl.load(w_ptr + e * stride_we + r[:, None] * stride_wr + c[None, :], mask=ok, other=0)
    s = tl.load(s_ptr + e * stride_se + (r // 128)[:, None] * stride_sr + (c // 128)[None, :],
                mask=ok, other=127)
    values = codes.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    values = values * tl.exp2(s.to(tl.float32) - 127.0)
    tl.store(o_ptr + e * stride_oe + r[:, None] * stride_or + c[None, :],
             values.to(o_ptr.dtype.element_ty), mask=ok)


def _as_stack(t: torch.Tensor, what: str) -> torch.Tensor:
    """One-byte codes (any one-byte dtype) as uint8: a 2-D matrix as a stack of one, a 3-D stack
    as it is; rows contiguous."""
    if t.element_size() != 1 or t.dtype == torch.bool:
        raise TypeError(f"{what}: {t.dtype} is not a one-byte encoding")
    t = t if t.dtype == torch.uint8 else t.view(torch.uint8)
    if t.dim() not in (2, 3):
        raise ValueError(f"{what} must be [out, in] or [E, out, in]; got {tuple(t.shape)}")
    t = t if t.dim() == 3 else t.unsqueeze(0)
    return t if t.stride(-1) == 1 else t.contiguous()


def _output(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device,
            out: torch.Tensor | None) -> torch.Tensor:
    if dtype not in _OUT_DTYPES:
        raise ValueError(f"dtype {dtype}; allowed: {', '.join(map(str, _OUT_DTYPES))}")
    if out is None:
        return torch.empty(shape, dtype=dtype, device=device)
    if tuple(out.shape) != shape or out.dtype != dtype or out.stride(-1) != 1:
        raise ValueError(f"out {tuple(out.shape)} {out.dtype} must be {shape} {dtype}, rows "
                         "contiguous")
    return out


def triton_dequant_fp4_group(weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, *,
                             out: torch.Tensor | None = None,
                             tile: tuple[int, int] = FP4_TILE) -> torch.Tensor:
    """Packed FP4 [..., out, in/2] with e8m0 scales [..., out, in/32] -> `dtype` [..., out, in]
    (module docstring); `out`: the result's buffer; `tile`: (rows, code bytes) per program,
    powers of two (a benchmark knob)."""
    w = _as_stack(weight, "triton_dequant_fp4_group weight")
    E, rows, half = w.shape
    groups = -(-2 * half // quant.FP4_GROUP)
    s = _as_stack(scale, "triton_dequant_fp4_group scale")
    if tuple(s.shape) != (E, rows, groups):
        raise ValueError(f"scale {tuple(scale.shape)} does not fit weight {tuple(weight.shape)}"
                         f" (expected {(E, rows, groups)[3 - scale.dim():]})")
    shape = (*weight.shape[:-1], 2 * half)
    result = _output(shape, dtype, weight.device, out)
    o = result if result.dim() == 3 else result.unsqueeze(0)
    br, bc = tile
    grid = (triton.cdiv(rows, br), triton.cdiv(half, bc), E)
    _fp4_kernel[grid](w, s, o, rows, half, w.stride(0), w.stride(1), s.stride(0), s.stride(1),
                      o.stride(0), o.stride(1), BLOCK_R=br, BLOCK_C=bc, num_warps=NUM_WARPS)
    return result


def triton_dequant_fp8_block(weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, *,
                             out: torch.Tensor | None = None,
                             tile: tuple[int, int] = FP8_TILE) -> torch.Tensor:
    """FP8 e4m3 [..., out, in] with e8m0 128x128 block scales -> `dtype` [..., out, in] (module
    docstring); `out`: the result's buffer; `tile`: (rows, columns) per program, powers of two
    (a benchmark knob)."""
    w = _as_stack(weight, "triton_dequant_fp8_block weight")
    E, rows, cols = w.shape
    b = quant.FP8_BLOCK
    s = _as_stack(scale, "triton_dequant_fp8_block scale")
    if tuple(s.shape) != (E, -(-rows // b), -(-cols // b)):
        raise ValueError(f"scale {tuple(scale.shape)} does not fit weight {tuple(weight.shape)}")
    result = _output(tuple(weight.shape), dtype, weight.device, out)
    o = result if result.dim() == 3 else result.unsqueeze(0)
    br, bc = tile
    grid = (triton.cdiv(rows, br), triton.cdiv(cols, bc), E)
    _fp8_kernel[grid](w, s, o, rows, cols, w.stride(0), w.stride(1), s.stride(0), s.stride(1),
                      o.stride(0), o.stride(1), BLOCK_R=br, BLOCK_C=bc, num_warps=NUM_WARPS)
    return result
