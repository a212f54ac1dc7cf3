"""The compressors' gate-score position embedding in one launch: `triton_add_ape`, the fast form of
`kernels/ref/compressor.py::add_ape` (same signature, bit-equal: one fp32 add per element).

A compressor's gate scores get `ape[p % ratio]` added for each token at position p. In torch that
is a remainder, a row gather and an add (three launches per compressor per step, six compressors
in a V4-Flash decode step). Here one program per BLOCK_T tokens loads each token's position,
takes p % ratio (positions are >= 0, so Triton's truncating remainder is torch's floor one), and
adds that ape row to the token's score row in place. T, W and the strides change from step to
step and are not specialised on. No host sync: CUDA-graph capturable.

Test: tests/kernels/test_add_ape.py (interpreter parity; its GPU part on CUDA).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_wait

from dsv4.kernels.triton.pdl import pdl_args

BLOCK_ELEMS = 4096      # score elements per program (rows x the row width, powers of two)


@triton.jit(do_not_specialize=["T", "W", "ratio", "stride_s", "stride_a"])
def _add_ape_kernel(score_ptr, ape_ptr, pos_ptr,  # type: ignore[no-untyped-def]
                    T, W, ratio, stride_s, stride_a,
                    BLOCK_T: tl.constexpr, BLOCK_W: tl.constexpr, PDL: tl.constexpr):
    if PDL:  # programmatic dependent launch: the prior kernel's writes first
        gdc_wait()
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, BLOCK_W)
    live_t = rows < T
    live = live_t[:, None] & (cols < W)[None, :]
    r = tl.load(pos_ptr + rows, mask=live_t, other=0) % ratio
    at = score_ptr + rows.to(tl.int64)[:, None] * stride_s + cols[None, :]
    bias = tl.load(ape_ptr + r.to(tl.int64)[:, None] * stride_a + cols[None, :], mask=live,
                   other=0.0)
    tl.store(at, tl.load(at, mask=live, other=0.0) + bias, mask=live)


def triton_add_ape(score: torch.Tensor, ape: torch.Tensor, positions: torch.Tensor,
                   ratio: int) -> None:
    """Same contract as `add_ape`: score [T, W] fp32 (unit column stride) += ape[positions %
    ratio] in place; ape [ratio, W] fp32 (unit column stride); positions [T] int64, contiguous,
    >= 0 (not checked: a host sync); all on one device."""
    if (score.dim() != 2 or ape.dim() != 2 or ape.shape != (ratio, score.shape[1])
            or tuple(positions.shape) != (score.shape[0],)):
        raise ValueError(f"score [T, W], ape [ratio={ratio}, W] and positions [T] expected; got "
                         f"{tuple(score.shape)}, {tuple(ape.shape)}, {tuple(positions.shape)}")
    if (score.dtype != torch.float32 or ape.dtype != torch.float32
            or positions.dtype != torch.int64):
        raise ValueError(f"score and ape must be float32 and positions int64; got {score.dtype}, "
                         f"{ape.dtype}, {positions.dtype}")
    if len({score.device, ape.device, positions.device}) != 1:
        raise ValueError(f"score on {score.device}, ape on {ape.device}, positions on "
                         f"{positions.device}: expected one device")
    T, W = score.shape
    if T == 0 or W == 0:
        return
    if score.stride(1) != 1 or ape.stride(1) != 1 or not positions.is_contiguous():
        raise ValueError("score and ape need unit column stride, positions contiguous")
    block_w = triton.next_power_of_2(W)
    block_t = max(1, min(triton.next_power_of_2(T), BLOCK_ELEMS // block_w))
    _add_ape_kernel[(triton.cdiv(T, block_t),)](
        score, ape, positions, T, W, ratio, score.stride(0), ape.stride(0),
        BLOCK_T=block_t, BLOCK_W=block_w, **pdl_args(score.device))
