"""The shared expert's SwiGLU and its w2 projection in one launch at decode:
`triton_swiglu_linear(gate, up, limit, w, counters=)` = `linear(swiglu(gate, up, limit), w)`.

At a batch-1 decode step the shared expert's SwiGLU (`swiglu.py`, one element-wise launch) and w2
(`gemv.py::triton_decode_linear`, a split-K GEMV) sit one after the other on the critical path.
Here the GEMV computes the SwiGLU where it loads its x: `gemv.py::triton_linear` in its SwiGLU
mode loads, for each K block, the block's gate and up values (the two column halves of the fused
w1 | w3 output, read in place whatever their row strides), computes h as `swiglu.py::swiglu_f32`
does (the same libm calls), rounds h to the activation dtype and multiplies it with the weight
tile as the plain product does. The plan is `triton_decode_linear`'s (tile width
`DECODE_BLOCK_N`, K splits from K alone), so the result is bit-identical to `triton_swiglu`
followed by `triton_decode_linear` (the serving path's two launches it replaces), and a row's bits
depend on that row only. Each program computes h for its own K range (the N tiles share none of
it): CUDA-core work per K block beside the weight tile's loads, no extra weight bytes.

Outside the decode shape (more than FMA_MAX_M rows, no counters, gate / up / w not of one 16-bit
dtype, a layout other than 2-D with unit column strides, too few counters) the call runs those two
launches instead (`triton_swiglu`, then `triton_decode_linear`, i.e. F.linear there): the same
values as `ref/moe.py::swiglu_linear`, bit-equal on a GPU. No host sync: CUDA-graph capturable.

Test: tests/kernels/test_swiglu_linear.py. Benchmark: benchmarks/kernels/bench_gemv.py (the SwiGLU
rows, `--swiglu-m`).
"""

from __future__ import annotations

import torch
import triton

from dsv4.kernels.ops import DECODE_BLOCK_N
from dsv4.kernels.ref.fp8_linear import dense_linear
from dsv4.kernels.triton.gemv import (
    DECODE_SPLIT_K,
    FMA_MAX_M,
    triton_decode_linear,
    triton_linear,
)
from dsv4.kernels.triton.swiglu import triton_swiglu


def fused(gate: torch.Tensor, up: torch.Tensor, w: torch.Tensor,
          counters: torch.Tensor | None) -> bool:
    """Whether the call runs as one launch (the decode shape; module docstring)."""
    return (counters is not None and gate.dim() == 2 and 0 < gate.shape[0] <= FMA_MAX_M
            and gate.shape[1] > 0 and up.shape == gate.shape
            and gate.dtype == up.dtype == w.dtype
            and gate.dtype in (torch.bfloat16, torch.float16)
            and gate.stride(1) == 1 and up.stride(1) == 1
            and gate.device == up.device == w.device
            and w.dim() == 2 and w.shape[1] == gate.shape[1] and w.stride(1) == 1
            and triton.cdiv(w.shape[0], DECODE_BLOCK_N) <= counters.numel())


def triton_swiglu_linear(gate: torch.Tensor, up: torch.Tensor, limit: float, w: torch.Tensor, *,
                         counters: torch.Tensor | None = None) -> torch.Tensor:
    """The triton backend's `swiglu_linear` op: gate, up [N, I] and w [d, I] -> [N, d] in gate's
    dtype, `triton_decode_linear(triton_swiglu(gate, up, limit), w, counters=counters)` in one
    launch at decode, those two launches otherwise (module docstring). `counters`: w's call
    site's zeroed int32 split-K counters (>= d / DECODE_BLOCK_N words), left zero."""
    if not fused(gate, up, w, counters):
        return triton_decode_linear(triton_swiglu(gate, up, limit), w, counters=counters)
    K = gate.shape[1]
    return triton_linear(gate, w, block_n=DECODE_BLOCK_N, split_k=max(1, K // DECODE_SPLIT_K),
                         dot=False, counters=counters, up=up, limit=limit)


def triton_swiglu_linear_invariant(gate: torch.Tensor, up: torch.Tensor, limit: float,
                                   w: torch.Tensor, *,
                                   counters: torch.Tensor | None = None) -> torch.Tensor:
    """The `invariant_plans` form: `triton_swiglu`, then `dense_linear` (F.linear) at every row
    count, `counters` unused. That is the composition `ForwardMode.values` computes (the backend's
    `swiglu` op, then the w2 linear), so a token's bits do not depend on the token count."""
    return dense_linear(triton_swiglu(gate, up, limit), w)
