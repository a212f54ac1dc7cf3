"""Row argmax split over many programs per row: `triton_argmax`, the fast form of
`kernels/ref/argmax.py::argmax` (same signature, bit-equal int64 indices).

The greedy sampler takes the argmax of each [V] logits row (V = 129,280 for V4). `torch.argmax`
reduces a row in one CTA, so a small decode batch reads its few rows through a handful of SMs.
Here two launches share the work:

    stage 1, grid (B, cdiv(V, BLOCK_V)): each program reduces BLOCK_V columns of one row to one
             int64 key (below); partials [B, cdiv(V, BLOCK_V)]
    stage 2, grid (B,): each program takes the max of its row's partials and decodes the index

The key packs the order of a value and its index into one int64, so one max-reduction gives both
the maximum and its first index: `(ordered(x) << 32) + (2**32 - 1 - index)`. `ordered` maps the
fp32 bits to an int32 of the same order (non-negative floats keep their bits, negative ones flip
the low 31 bits), with -0.0 mapped like +0.0 (they are equal) and every NaN, of either sign,
mapped above +inf (NaN is the maximum, as in torch). Equal values then compare by the low half,
largest for the lowest index: the first maximum wins, in a chunk and across chunks, whatever the
order of the reduction. Lanes past V load -inf with an index past V, so they lose to every real
column (an all -inf row returns 0). Inputs of bf16 / fp16 are widened to fp32 first (exact, order
preserving).

The plan is fixed (BLOCK_V does not depend on B), and the result is exact in any plan: a row's
index never depends on the other rows. B and the chunk count are not specialised on; V and the
row stride only on their divisibility by 16 (Triton's default), which gives 16-byte loads on V4's
vocabulary (129,280 = 16 x 8,080). So a model compiles one variant of each stage. No host sync,
no host-to-device copy: CUDA-graph capturable. Rows may be strided (unit column stride).

Test: tests/kernels/test_argmax.py. Benchmark: benchmarks/kernels/bench_argmax.py.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsv4.kernels.triton.launch import X_DTYPES, pow2
from dsv4.kernels.triton.pdl import pdl_args
from dsv4.kernels.triton.pdl_enter import pdl_enter

BLOCK_V = 4096       # columns per stage-1 program: 32 programs per row at V = 129,280
MAX_V = 2**28        # chunks per row stay within a grid's second axis (65,535)


@triton.jit(do_not_specialize=["num_chunks"])
def _argmax_partial_kernel(x_ptr, part_ptr, V, stride_x,  # type: ignore[no-untyped-def]
                           num_chunks, BLOCK_V: tl.constexpr, PDL: tl.constexpr):
    pdl_enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    cols = chunk * BLOCK_V + tl.arange(0, BLOCK_V)
    x = tl.load(x_ptr + row * stride_x + cols, mask=cols < V, other=float("-inf"))
    x = x.to(tl.float32)
    bits = x.to(tl.int32, bitcast=True)
    ordered = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    ordered = tl.where(x == 0.0, 0, ordered)                 # -0.0 == +0.0
    ordered = tl.where(x != x, 0x7FFFFFFF, ordered)          # NaN: above +inf (0x7F800000)
    low = 4294967295 - cols.to(tl.int64)                     # 2**32 - 1 - index
    key = (ordered.to(tl.int64) << 32) + low
    tl.store(part_ptr + row * num_chunks + chunk, tl.max(key, axis=0))


@triton.jit(do_not_specialize=["num_chunks"])
def _argmax_final_kernel(part_ptr, out_ptr, num_chunks,  # type: ignore[no-untyped-def]
                         BLOCK_C: tl.constexpr, PDL: tl.constexpr):
    pdl_enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, BLOCK_C)
    # padding lanes repeat chunk 0's key: a max over copies of a real key changes nothing
    key = tl.load(part_ptr + row * num_chunks + tl.where(c < num_chunks, c, 0))
    best = tl.max(key, axis=0)
    tl.store(out_ptr + row, 4294967295 - (best & 4294967295))


def triton_argmax(x: torch.Tensor, block_v: int = BLOCK_V) -> torch.Tensor:
    """Same contract as `argmax`: x [B, V] (V >= 1, V <= 2**28) fp32 / bf16 / fp16 -> [B] int64,
    each row's first maximum (a NaN is the largest value). A column stride other than 1 costs a
    copy. `block_v`: columns per stage-1 program, a power of two (tests use small ones to cover
    many chunks on small rows); the result does not depend on it."""
    pow2("block_v", block_v, 1)
    if x.dim() != 2 or x.shape[1] < 1:
        raise ValueError(f"x [B, V >= 1] expected; got {tuple(x.shape)}")
    if x.dtype not in X_DTYPES:
        raise ValueError(f"x dtype {x.dtype} is not supported; allowed: {list(X_DTYPES)}")
    if x.shape[1] > MAX_V:
        raise ValueError(f"V = {x.shape[1]} is invalid; allowed: V <= 2**28")
    if x.stride(1) != 1 and x.shape[1] > 1:
        x = x.contiguous()
    B, V = x.shape
    out = torch.empty(B, dtype=torch.int64, device=x.device)
    if B == 0:
        return out
    block_v = min(block_v, triton.next_power_of_2(V))
    chunks = triton.cdiv(V, block_v)
    part = torch.empty(B, chunks, dtype=torch.int64, device=x.device)
    _argmax_partial_kernel[(B, chunks)](x, part, V, x.stride(0), chunks, BLOCK_V=block_v,
                            **pdl_args(x.device))
    _argmax_final_kernel[(B,)](part, out, chunks, BLOCK_C=triton.next_power_of_2(chunks),
                          **pdl_args(part.device))
    return out
