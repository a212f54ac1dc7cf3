"""The compressors' fp32 projections on the triton backend: the `project` op
(`kernels/ref/compressor.py::project`: x [T, k] in any float dtype @ w [n, k]^T, fp32 or, in a
checkpoint-format model, bf16 -> [T, n] fp32, both operands taken as their fp32 values).

Decode-sized calls run the skinny GEMM of `gemv.py` with fixed tiles and K splits, so a column's
sum order depends on K (and the row count's class) alone and a fused group's columns
(`model/fused_projections.py`) get the bits of the members' own projections:
- up to `gemv.FMA_MAX_M` rows: the FMA path (`PROJECT_BLOCK_N`, `PROJECT_SPLITS`), exact fp32
  products; a 16-bit x gives the bits of its fp32 copy;
- up to `gemv.MAX_M` rows: the tl.dot path in "tf32x3" (`PROJECT_DOT_BLOCK_N`,
  `PROJECT_DOT_SPLITS`): each fp32 operand split into a tf32 head and tail, three tensor-core
  products (tail x tail dropped), fp32 accumulation: within 1.5e-6 of max |y| of the float64
  product on the H200 at V4-Flash's compressor shapes, where cuBLAS's fp32 GEMM (FFMA on the
  CUDA cores, its kernel chosen per row count) ran 1.1-4.1x slower at 8-56 rows
  (benchmarks/results/serving_h200_202612.md). A 16-bit x is not bit-equal to its fp32 copy
  here (the tensor cores' accumulation of the products its zero tails drop), only as close.
A bf16 weight (checkpoint format) streams half the bytes: widened in registers on the FMA path
and, with an fp32 x, on the tl.dot path (exact in tf32: tf32x3 drops nothing of it); with a
16-bit x as well, the tl.dot path multiplies both in bf16 MMAs (exact products, fp32 sums).
Larger calls (prefill) run cuBLAS. With a bf16 x on CUDA they run on the tensor cores with fp32
output (`torch.mm(..., out_dtype=torch.float32)`): a bf16 weight (checkpoint format) as it is, an
fp32 weight as the sum of its three bf16 pieces (`bf16_pieces`: hi + mid + lo, which hold its 24
significant bits), each product exact in fp32 and the three partial results summed lo first. That
is the fp32 GEMM's contract (products of the operands' fp32 values, fp32 sums in cuBLAS's order)
at bf16 tensor-core speed: cuBLAS's fp32 SGEMM took 12% of a flash-4l 8K-token prefill chunk on
the H100 (benchmarks/results/quant_moe_h200_202612.md). Other dtypes (an fp32 or fp16 x) and the
CPU: `F.linear` of the fp32 values. `HeldProject` is the
op with split-K counters held for the backend's lifetime; `triton_project_invariant` the op
under invariant launch plans.

Test: tests/kernels/test_project_gemv.py (decode rows),
tests/kernels/test_fused_projections_triton.py (fused groups).
"""

from __future__ import annotations

import torch
import triton

from dsv4.kernels.triton.gemv import FMA_MAX_M, MAX_M, MAX_TILES, GemvCounters, triton_linear

PROJECT_BLOCK_N = 16    # decode `triton_project`: output columns per program (FMA path)
PROJECT_SPLITS = 8      # and K splits (V4-Flash CSA: 160 tiles x 8 = 1,280 programs)
PROJECT_DOT_BLOCK_N = 64    # the tf32x3 tl.dot path (FMA_MAX_M < rows <= MAX_M): columns per
PROJECT_DOT_SPLITS = 8      # program and K splits (the best pinned pair for the fused V4-Flash
                            # groups, 2560 and 1024 columns, at 8 to 56 rows on the H200)


def triton_project(x: torch.Tensor, w: torch.Tensor,
                   counters: GemvCounters | None = None) -> torch.Tensor:
    """Same contract as `ref.compressor.project` (the triton backend's `project` op). Decode-sized
    x (at most `gemv.MAX_M` rows, any float dtype: a 16-bit x is read as it is and widened in
    registers, no fp32 copy of it per step; likewise a bf16 w): `triton_linear`, one launch
    streaming the weight, its tiles and K splits fixed (module docstring) so a column's sum order
    depends on K, the path and w's dtype alone: a fused group's columns get the bits of the
    members' own projections. `counters`: the backend's held split-K counters (calls are serial:
    the compressors run on one stream). More rows: cuBLAS, whose kernel (and a row's last bits)
    depends on the row count."""
    fma = x.shape[0] <= FMA_MAX_M
    block_n, splits = ((PROJECT_BLOCK_N, PROJECT_SPLITS) if fma
                       else (PROJECT_DOT_BLOCK_N, PROJECT_DOT_SPLITS))
    if x.shape[0] > MAX_M or triton.cdiv(w.shape[0], block_n) > MAX_TILES:
        return prefill_project(x, w)
    held = counters.get(x.device) if counters is not None else None
    return triton_linear(x, w, block_n=block_n, split_k=splits, dot=not fma,
                         precision=None if fma else "tf32x3", counters=held,
                         out_dtype=torch.float32)


def bf16_pieces(w: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """An fp32 w as bf16 pieces, largest first, whose fp32 sum is w: each piece is the
    round-to-nearest bf16 of what the ones before leave (exact in fp32), so three hold w's 24
    significant bits (up to a sign flip's one bit, 2^-24 of |w|). A bf16 w is its own piece."""
    if w.dtype == torch.bfloat16:
        return (w,)
    assert w.dtype == torch.float32, w.dtype
    pieces, rest = [], w
    for _ in range(3):
        piece = rest.to(torch.bfloat16)
        pieces.append(piece)
        rest = rest - piece.float()
    return tuple(pieces)


def prefill_project(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """`project` for more rows than the skinny GEMM takes (module docstring; also the MoE gate's
    logits at prefill, `moe_gate_logits.py`): a bf16 x on CUDA times each bf16 piece of w on the
    tensor cores, fp32 out, summed smallest first; otherwise `F.linear` of the fp32 values."""
    if not (x.is_cuda and x.dtype == torch.bfloat16 and w.dtype in (torch.bfloat16,
                                                                     torch.float32)):
        return torch.nn.functional.linear(x.float(), w.float())
    x2 = x.reshape(-1, x.shape[-1])
    out: torch.Tensor | None = None
    for piece in reversed(bf16_pieces(w)):
        y = torch.mm(x2, piece.t(), out_dtype=torch.float32)
        out = y if out is None else out.add_(y)
    assert out is not None
    return out.view(*x.shape[:-1], w.shape[0])


class HeldProject:
    """The triton backend's `project` op: `triton_project` with split-K counters held for the
    backend instance's lifetime (calls are serial: the compressors run on one stream)."""

    def __init__(self) -> None:
        self.counters = GemvCounters()

    def __call__(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return triton_project(x, w, self.counters)


def triton_project_invariant(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """`project` with a row's bits independent of the row count: the fixed-tile Triton GEMM of
    `batch_invariant.py` (the backend's op under invariant launch plans)."""
    from dsv4.kernels.triton.batch_invariant import bi_mm
    return bi_mm(x.float(), w.float().t())
