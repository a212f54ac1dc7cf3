"""The MoE layer's combine in one launch: `triton_moe_combine`, the fast form of
`kernels/ref/moe.py::moe_combine` (same signature).

The deterministic routed-experts epilogue (`moe.py`) leaves one weighted expert output per
(token, slot) in an fp32 buffer [N, k, d]; the layer's output is their sum plus the shared expert's
output, rounded once to the model dtype. Here that is one element-wise pass instead of a reduce, a
cast, an add and a cast:

    out[t, :] = (((p[t, 0] + p[t, 1]) + p[t, 2]) + ... + p[t, k-1] + float(shared[t])) -> out dtype

Every add is one fp32 add in that fixed order (no products, so no FMA contraction): the result is
bit-equal to the reference's on a GPU and under the interpreter, and a row does not depend on the
row count. Grid (N, cdiv(d, BLOCK_D)), one program per row chunk. No host sync: CUDA-graph safe.
Test: tests/kernels/test_moe_combine.py. Benchmark: benchmarks/kernels/bench_moe_combine.py.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsv4.kernels.triton.launch import X_DTYPES
from dsv4.kernels.triton.pdl import pdl_args
from dsv4.kernels.triton.pdl_enter import pdl_enter

BLOCK_D = 512           # columns per program: 4 fp32 (one 16-byte vector) per thread at 4 warps
NUM_WARPS = 4


@triton.jit
def _combine_kernel(  # type: ignore[no-untyped-def]
    parts_ptr, shared_ptr, out_ptr, D, stride_pn, stride_pk, stride_s, stride_o,
    TOPK: tl.constexpr, HAS_SHARED: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl_enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < D
    src = parts_ptr + row * stride_pn + cols
    acc = tl.load(src, mask=mask, other=0.0)
    for j in tl.static_range(1, TOPK):          # ascending slots, one fp32 add each
        acc += tl.load(src + j * stride_pk, mask=mask, other=0.0)
    if HAS_SHARED:
        acc += tl.load(shared_ptr + row * stride_s + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, acc.to(out_ptr.dtype.element_ty), mask=mask)


def _check(parts: torch.Tensor, shared: torch.Tensor | None, out_dtype: torch.dtype) -> None:
    if parts.dim() != 3 or parts.dtype != torch.float32 or parts.shape[1] < 1:
        raise ValueError(f"parts must be [N, k >= 1, d] float32; got {tuple(parts.shape)} "
                         f"{parts.dtype}")
    if parts.shape[2] > 1 and parts.stride(2) != 1:
        raise ValueError(f"parts must have unit stride along d; got strides {parts.stride()}")
    if out_dtype not in X_DTYPES:
        raise ValueError(f"out_dtype {out_dtype} is not supported; allowed: "
                         f"{[str(d) for d in X_DTYPES]}")
    if shared is None:
        return
    N, _, d = parts.shape
    if (tuple(shared.shape) != (N, d) or shared.dtype not in X_DTYPES
            or shared.device != parts.device):
        raise ValueError(f"shared must be [N, d] = [{N}, {d}] of {[str(t) for t in X_DTYPES]} "
                         f"on {parts.device}; got {tuple(shared.shape)} {shared.dtype} "
                         f"{shared.device}")


def down_output(nk: int, topk: int, d: int, deterministic: bool,
                device: torch.device) -> torch.Tensor:
    """The fp32 buffer an expert down launch writes: [N*k, d] rows that the combine sums over k
    (deterministic), or a zeroed [N, d] the atomic epilogue adds into. Made before the gate/up
    launch, so that no torch kernel sits between the two PDL launches."""
    if deterministic:
        return torch.empty(nk, d, dtype=torch.float32, device=device)
    return torch.zeros(nk // topk, d, dtype=torch.float32, device=device)


def triton_moe_combine(parts: torch.Tensor, shared: torch.Tensor | None,
                       out_dtype: torch.dtype) -> torch.Tensor:
    """Same contract as `moe_combine`: parts [N, k, d] fp32 (unit stride along d), shared [N, d]
    bf16 / fp16 / fp32 or None -> [N, d] `out_dtype` (bf16 / fp16 / fp32), contiguous, in one
    launch (module docstring)."""
    _check(parts, shared, out_dtype)
    N, topk, d = parts.shape
    out = torch.empty(N, d, dtype=out_dtype, device=parts.device)
    if N == 0 or d == 0:
        return out
    if shared is not None and d > 1 and shared.stride(1) != 1:
        shared = shared.contiguous()
    block = min(BLOCK_D, triton.next_power_of_2(d))
    shared_arg = shared if shared is not None else parts
    _combine_kernel[(N, triton.cdiv(d, block))](
        parts, shared_arg, out, d, parts.stride(0), parts.stride(1), shared_arg.stride(0),
        out.stride(0), TOPK=topk, HAS_SHARED=shared is not None, BLOCK=block,
        num_warps=NUM_WARPS, **pdl_args(parts.device))
    return out
