"""fp32 exp / log1p that round as torch's CUDA element-wise kernels do, for kernels whose outputs
must match a torch reference bit for bit (the MoE gate's scores, SwiGLU).

torch's CUDA kernels call `expf` / `log1pf` / IEEE division, which compile to libdevice's
`__nv_expf` / `__nv_log1pf` / `div.rn`; Triton's `tl.exp` is the approximate `ex2.approx` path and
its `/` is not always IEEE. So on a GPU these helpers call libdevice (and callers divide with
`tl.math.div_rn`, take roots with `tl.sqrt_rn`). The interpreter cannot run extern calls: there
`LIBDEVICE` is False and they fall back to numpy's exp / log (log1p by the compensated
`log(1 + y) * y / ((1 + y) - 1)`), a few ulp from torch's CPU results.

`LIBDEVICE` is a constexpr argument of the kernels; their wrappers pass `libdevice_math(kernel)`.
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra import libdevice


def libdevice_math(kernel: object) -> bool:
    """True when `kernel` compiles for a GPU (libdevice available), False under the interpreter."""
    from triton.runtime.interpreter import InterpretedFunction

    return not isinstance(kernel, InterpretedFunction)


@triton.jit
def exp_f32(x, LIBDEVICE: tl.constexpr):  # type: ignore[no-untyped-def]
    """expf(x) of fp32 x."""
    if LIBDEVICE:
        return libdevice.exp(x)
    else:
        return tl.exp(x)


@triton.jit
def log1p_f32(y, LIBDEVICE: tl.constexpr):  # type: ignore[no-untyped-def]
    """log1pf(y) of fp32 y > -1."""
    if LIBDEVICE:
        return libdevice.log1p(y)
    else:
        u = 1.0 + y
        d = tl.where(u == 1.0, 1.0, u - 1.0)
        return tl.where(u == 1.0, y, tl.log(u) * tl.math.div_rn(y, d))


@triton.jit
def softplus_f32(x, LIBDEVICE: tl.constexpr):  # type: ignore[no-untyped-def]
    """torch's `F.softplus(x)` (beta 1, threshold 20) of fp32 x: x above 20, else log1p(exp(x))."""
    return tl.where(x > 20.0, x, log1p_f32(exp_f32(x, LIBDEVICE), LIBDEVICE))


@triton.jit
def silu_f32(x, LIBDEVICE: tl.constexpr):  # type: ignore[no-untyped-def]
    """torch's `F.silu(x)` of fp32 x: x / (1 + exp(-x)), IEEE division."""
    return tl.math.div_rn(x, 1.0 + exp_f32(-x, LIBDEVICE))
