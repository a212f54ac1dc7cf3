"""Split-KV attention's last step and the attention's row store (`sparse_attention.py`).

`combine_splits` merges the NS partial results of a split-KV launch: for each (token, head) row,
part[t, h, s] = acc_s / l_s and lse[t, h, s] = m_s + log2 l_s (m in log2 units), and

    o[t, h] = Σ_s 2^(lse_s - peak) part_s / (Σ_s 2^(lse_s - peak) + 2^(sink_h - peak)),
    peak = max(max_s lse_s, sink_h),

one program per row and COMBINE_COLS columns, every split's columns loaded as one
[splits, columns] tile (all loads in flight at once; one program waiting on each split in turn
made a 900K list's combine as long as its attention) and summed in `tl.sum`'s fixed order.
`store_rows` writes o rows in the output dtype, de-rotating the trailing RoPE pairs when asked
(the no-split kernel's store and the combine's). Tested through `triton_sparse_attention`
(tests/kernels/test_sparse_attention_triton.py).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from dsv4.kernels.triton.pdl import pdl_args
from dsv4.kernels.triton.pdl_enter import pdl_enter

COMBINE_COLS = 128             # output columns per combine program
LOG2E = math.log2(math.e)   # exp(x) = exp2(x * LOG2E): the kernels work in log2 units


@triton.jit
def store_rows(out_ptr, o, t, offs_h, offs_d, mask,  # type: ignore[no-untyped-def]
               cos_ptr, sin_ptr, stride_ot, stride_oh, D, rope_first, stride_cs, col0,
               BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, DEROTATE: tl.constexpr):
    """Store o [BLOCK_H, BLOCK_D] fp32 rows of token t in out's dtype, at columns offs_d =
    col0 + arange(BLOCK_D) (col0 even: the tile holds whole pairs); DEROTATE: rounded to out's
    dtype first, then rotated by -φ on the trailing rope pairs (x[2i], x[2i+1]) in fp32 and
    rounded again: `ref/rope_norm.py::rope_inverse` of the stored rows."""
    dt = out_ptr.dtype.element_ty
    if DEROTATE:
        a, b = tl.split(tl.reshape(o.to(dt).to(tl.float32), (BLOCK_H, BLOCK_D // 2, 2)))
        pair = col0 // 2 + tl.arange(0, BLOCK_D // 2)
        is_rope = (pair >= rope_first) & (2 * pair < D)
        cos = tl.load(cos_ptr + t * stride_cs + (pair - rope_first), mask=is_rope, other=1.0)
        sin = -tl.load(sin_ptr + t * stride_cs + (pair - rope_first), mask=is_rope, other=0.0)
        cos, sin, is_rope = cos[None, :], sin[None, :], is_rope[None, :]
        o = tl.reshape(tl.join(tl.where(is_rope, a * cos - b * sin, a),
                               tl.where(is_rope, a * sin + b * cos, b)), (BLOCK_H, BLOCK_D))
    tl.store(out_ptr + t * stride_ot + offs_h[:, None] * stride_oh + offs_d[None, :], o.to(dt),
             mask=mask)


@triton.jit(do_not_specialize=["num_splits"])
def _combine_kernel(part_ptr, lse_ptr, sink_ptr, out_ptr,  # type: ignore[no-untyped-def]
                    cos_ptr, sin_ptr, H, D, num_splits, log2e, rope_first, stride_cs, stride_ot,
                    stride_oh, BLOCK_S: tl.constexpr, BLOCK_C: tl.constexpr,
                    EVEN_C: tl.constexpr, DEROTATE: tl.constexpr, PDL: tl.constexpr):
    """o[t, h, cols] = Σ_s 2^(lse_s - peak) part_s / (Σ_s 2^(lse_s - peak) + 2^(sink - peak));
    grid (T * H, cdiv(D, BLOCK_C)): one program per row and BLOCK_C columns, every split's
    columns loaded as one [BLOCK_S, BLOCK_C] tile (all loads in flight at once) and summed over
    the splits in the fixed order of `tl.sum`; DEROTATE as `store_rows`."""
    pdl_enter(PDL)
    row = tl.program_id(0).to(tl.int64)                                     # t * H + h
    t, h = row // H, row % H
    col0 = tl.program_id(1) * BLOCK_C
    offs_s = tl.arange(0, BLOCK_S)
    s_mask = offs_s < num_splits
    lse = tl.load(lse_ptr + row * num_splits + offs_s, mask=s_mask, other=float("-inf"))
    sink = tl.load(sink_ptr + h) * log2e
    peak = tl.maximum(tl.max(lse, axis=0), sink)
    w = tl.exp2(lse - peak)                                                 # 0 past num_splits
    den = tl.sum(w, axis=0) + tl.exp2(sink - peak)
    offs_c = col0 + tl.arange(0, BLOCK_C)
    # (a constant true mask when BLOCK_C divides D: 16-byte vectors, `tile_masks`)
    c_mask = (offs_c < D) | EVEN_C
    part = tl.load(part_ptr + (row * num_splits + offs_s)[:, None] * D + offs_c[None, :],
                   mask=s_mask[:, None] & c_mask[None, :], other=0.0)       # [BLOCK_S, BLOCK_C]
    acc = tl.sum(part * w[:, None], axis=0)
    store_rows(out_ptr, tl.reshape(acc / den, (1, BLOCK_C)), t, tl.full([1], 0, tl.int64) + h,
               offs_c, c_mask[None, :], cos_ptr, sin_ptr, stride_ot, stride_oh, D, rope_first,
               stride_cs, col0, 1, BLOCK_C, DEROTATE)


def combine_splits(part: torch.Tensor, lse: torch.Tensor, sink: torch.Tensor, out: torch.Tensor,
                   rope: tuple[torch.Tensor, torch.Tensor], rope_first: int, stride_cs: int,
                   derotate: bool) -> None:
    """out [T, H, D] <- the merge of part [T, H, S, D] fp32 and lse [T, H, S] fp32 with the
    sink [H] (fp32, natural log units), de-rotated by rope = (cos, sin) when `derotate`."""
    T, H, D = out.shape
    splits = part.shape[2]
    block_c = min(max(16, triton.next_power_of_2(D)), COMBINE_COLS)
    cos, sin = rope
    _combine_kernel[(T * H, triton.cdiv(D, block_c))](
        part, lse, sink, out, cos, sin, H, D, splits, LOG2E, rope_first, stride_cs,
        out.stride(0), out.stride(1), BLOCK_S=triton.next_power_of_2(splits), BLOCK_C=block_c,
        EVEN_C=D % block_c == 0, DEROTATE=derotate, num_warps=4, **pdl_args(part.device))
