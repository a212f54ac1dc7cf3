"""SwiGLU with the clamp at `limit` in one element-wise launch: `triton_swiglu`, the fast form of
`kernels/ref/moe.py::swiglu` (same signature), and `swiglu_f32`, the epilogue math the routed
experts' gate/up kernel (`kernels/triton/moe.py`) shares.

The reference on bf16 inputs rounds to the input dtype after each torch op (the clamps, the silu,
the product), each computed in fp32; `swiglu_f32` rounds at the same points (a no-op in fp32) and
computes silu with torch's CUDA math (`libm.py`), so on a GPU the result is bit-equal to the
reference's. Under the interpreter silu differs from torch's CPU one by a few fp32 ulp, which the
rounding to bf16 almost always hides. The shared expert's gate and up [N, I] go through it on the
serving path and under `ForwardMode.values`, read in place where they are the two column halves of
one fused GEMM's output (row-strided); at decode, where w2 has split-K counters, `swiglu_f32` runs
inside w2's GEMV instead (`swiglu_linear.py`, the same bits). No host sync: CUDA-graph capturable;
element-wise, so a token's row does not depend on the row count.

Test: tests/kernels/test_swiglu.py. Benchmark: benchmarks/kernels/bench_moe_gate.py (with the
gate's selection).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsv4.kernels.triton.launch import X_DTYPES
from dsv4.kernels.triton.libm import libdevice_math, silu_f32
from dsv4.kernels.triton.pdl import pdl_args
from dsv4.kernels.triton.pdl_enter import pdl_enter

BLOCK = 1024


@triton.jit
def swiglu_f32(g, u, limit, DTYPE: tl.constexpr,  # type: ignore[no-untyped-def]
               LIBDEVICE: tl.constexpr):
    """silu(min(g, limit)) * clamp(u, -limit, limit) of fp32 g, u, each step rounded to DTYPE (the
    reference's tensors' dtype) and returned in fp32 (the caller rounds the product)."""
    g = tl.minimum(g, limit).to(DTYPE).to(tl.float32)
    s = silu_f32(g, LIBDEVICE).to(DTYPE).to(tl.float32)
    u = tl.minimum(tl.maximum(u, -limit), limit).to(DTYPE).to(tl.float32)
    return s * u


@triton.jit(do_not_specialize=["n", "cols", "stride_g", "stride_u"])
def _swiglu_kernel(g_ptr, u_ptr, out_ptr, n, cols,  # type: ignore[no-untyped-def]
                   stride_g, stride_u, limit, BLOCK: tl.constexpr, LIBDEVICE: tl.constexpr,
                   PDL: tl.constexpr):
    pdl_enter(PDL)
    # element i of the contiguous output is (row, col) = divmod(i, cols) of gate / up, whose rows
    # may lie `stride_g` / `stride_u` elements apart (contiguous inputs: one row of n)
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    live = offs < n
    row = offs // cols
    col = offs - row * cols
    g = tl.load(g_ptr + row * stride_g + col, mask=live, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + row * stride_u + col, mask=live, other=0.0).to(tl.float32)
    dtype = out_ptr.dtype.element_ty
    tl.store(out_ptr + offs, swiglu_f32(g, u, limit, dtype, LIBDEVICE).to(dtype), mask=live)


_LIBDEVICE = libdevice_math(_swiglu_kernel)


def triton_swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    """Same contract as `swiglu`: gate and up of one shape, float dtype and device -> a contiguous
    tensor of that shape and dtype. 2-D gate and up with unit column stride are read in place
    whatever their row strides (the two column halves of a fused w1 | w3 GEMM's output); other
    layouts are made contiguous first."""
    if gate.shape != up.shape or gate.dtype != up.dtype or gate.device != up.device:
        raise ValueError(f"gate and up must match in shape, dtype and device; got "
                         f"{tuple(gate.shape)} {gate.dtype} {gate.device}, {tuple(up.shape)} "
                         f"{up.dtype} {up.device}")
    if gate.dtype not in X_DTYPES:
        raise ValueError(f"dtype must be one of {X_DTYPES}; got {gate.dtype}")
    out = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    n = gate.numel()
    if not n:
        return out
    g, u = gate, up
    if gate.dim() == 2 and gate.stride(1) == 1 and up.stride(1) == 1:
        cols, stride_g, stride_u = gate.shape[1], gate.stride(0), up.stride(0)
    else:
        g, u = gate.contiguous(), up.contiguous()
        cols = stride_g = stride_u = n
    _swiglu_kernel[(triton.cdiv(n, BLOCK),)](g, u, out, n, cols, stride_g, stride_u, float(limit),
                                            BLOCK=BLOCK, LIBDEVICE=_LIBDEVICE, **pdl_args(g.device))
    return out
