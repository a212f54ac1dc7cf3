"""SwiGLU with the clamp at `limit` in one element-wise launch: `triton_swiglu`, the fast form of
`kernels/ref/moe.py::swiglu` (same signature), and `swiglu_f32`, the epilogue math the routed
experts' gate/up kernel (`kernels/triton/moe.py`) shares.

The reference on bf16 inputs rounds to the input dtype after each torch op (the clamps, the silu,
the product), each computed in fp32; `swiglu_f32` rounds at the same points (a no-op in fp32) and
computes silu with torch's CUDA math (`libm.py`), so on a GPU the result is bit-equal to the
reference's. Under the interpreter silu differs from torch's CPU one by a few fp32 ulp, which the
rounding to bf16 almost always hides. The shared expert's gate and up [N, I] go through it on the
serving path and under `ForwardMode.values`. No host sync: CUDA-graph capturable; element-wise,
so a token's row does not depend on the row count.

Test: tests/kernels/test_swiglu.py. Benchmark: benchmarks/kernels/bench_moe_gate.py (with the
gate's selection).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsv4.kernels.triton.launch import X_DTYPES
from dsv4.kernels.triton.libm import libdevice_math, silu_f32

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


@triton.jit(do_not_specialize=["n"])
def _swiglu_kernel(g_ptr, u_ptr, out_ptr, n, limit,  # type: ignore[no-untyped-def]
                   BLOCK: tl.constexpr, LIBDEVICE: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    live = offs < n
    g = tl.load(g_ptr + offs, mask=live, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + offs, mask=live, other=0.0).to(tl.float32)
    dtype = out_ptr.dtype.element_ty
    tl.store(out_ptr + offs, swiglu_f32(g, u, limit, dtype, LIBDEVICE).to(dtype), mask=live)


_LIBDEVICE = libdevice_math(_swiglu_kernel)


def triton_swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    """Same contract as `swiglu`: gate and up of one shape, float dtype and device -> a contiguous
    tensor of that shape and dtype."""
    if gate.shape != up.shape or gate.dtype != up.dtype or gate.device != up.device:
        raise ValueError(f"gate and up must match in shape, dtype and device; got "
                         f"{tuple(gate.shape)} {gate.dtype} {gate.device}, {tuple(up.shape)} "
                         f"{up.dtype} {up.device}")
    if gate.dtype not in X_DTYPES:
        raise ValueError(f"dtype must be one of {X_DTYPES}; got {gate.dtype}")
    g, u = gate.contiguous(), up.contiguous()
    out = torch.empty_like(g, memory_format=torch.contiguous_format)
    n = g.numel()
    if n:
        _swiglu_kernel[(triton.cdiv(n, BLOCK),)](g, u, out, n, float(limit), BLOCK=BLOCK,
                                                LIBDEVICE=_LIBDEVICE)
    return out
