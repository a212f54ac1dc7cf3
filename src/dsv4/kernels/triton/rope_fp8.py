"""The indexer's queries over FP8 keys in one launch: `triton_rope_fp8`, the fast form of
`kernels/ref/rope_norm.py::rope_fp8` (same signature, bit-equal).

With FP8 indexer keys (`index_cache_dtype="fp8"`) the scores run one FP8 dot per head, so each
head's rotated query is quantised as a key is (`ref/index_keys.py`: a power-of-two scale of its
amax, e4m3 codes). Done here, once per (token, head) where the query is rotated anyway, instead of
in every program of the `index_scores` launch (each would redo all of a token's heads).

Kernel design: one program per (token, head) row, as `triton_rope` (`rope_norm.py`): the row is
loaded once, rotated in fp32 (`rotate`, compiled without FMA contraction: `triton_rope`'s bits),
rounded to x's dtype as `rope` returns it, then quantised by `act_quant.py`'s `quant_row`; the
codes and the scale are stored. No host sync: graph-capture safe.
Test: tests/kernels/test_rope_fp8.py. Benchmark: benchmarks/kernels/bench_rope.py --fp8 (and
bench_index_scores.py --keys fp8q, the scores on these queries).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsv4.kernels.triton.act_quant import quant_row
from dsv4.kernels.triton.pdl import pdl_args
from dsv4.kernels.triton.pdl_enter import pdl_enter
from dsv4.kernels.triton.rope_norm import check_rope, rotate


@triton.jit
def _rope_fp8_kernel(x_ptr, cos_ptr, sin_ptr, codes_ptr,  # type: ignore[no-untyped-def]
                     scales_ptr, D, H, rope_first, stride_xt, stride_xh, stride_cs,
                     BLOCK_D: tl.constexpr, PDL: tl.constexpr):
    pdl_enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    t = row // H
    offs = tl.arange(0, BLOCK_D)
    mask = offs < D
    x = tl.load(x_ptr + t * stride_xt + (row - t * H) * stride_xh + offs, mask=mask, other=0.0)
    y = rotate(x.to(tl.float32), cos_ptr + t * stride_cs, sin_ptr + t * stride_cs, D,
               rope_first, BLOCK_D)
    y = y.to(x_ptr.dtype.element_ty).to(tl.float32)   # `rope`'s output, in x's dtype
    codes, scale = quant_row(y)                         # channels past D are 0: not the amax
    tl.store(codes_ptr + row * D + offs, codes, mask=mask)
    tl.store(scales_ptr + row, scale)


def triton_rope_fp8(x: torch.Tensor, cos: torch.Tensor,
                    sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as `ref.rope_norm.rope_fp8`: x [T, H, D] (unit last stride) -> (codes
    [T, H, D] float8_e4m3fn, scales [T, H] fp32), cos / sin [T, rd/2] fp32 contiguous."""
    if x.dim() != 3:
        raise ValueError(f"x must be [T, H, D]; got {list(x.shape)}")
    check_rope("x", x, cos, sin, x.shape[0])
    T, H, D = x.shape
    codes = torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=x.device)
    scales = torch.empty(T, H, dtype=torch.float32, device=x.device)
    if T * H == 0:
        return codes, scales
    block_d = max(16, triton.next_power_of_2(D))
    _rope_fp8_kernel[(T * H,)](
        x, cos, sin, codes, scales, D, H, D // 2 - cos.shape[-1], x.stride(0), x.stride(1),
        cos.stride(0), BLOCK_D=block_d, num_warps=max(1, min(8, block_d // 256)),
        enable_fp_fusion=False, **pdl_args(x.device))
    return codes, scales
