"""`FusedRows`: the weights of projections of one input stacked as one [sum(out), in] matrix.

The serving path runs such a group as one GEMM and splits the output by columns, where each small
projection would be a kernel launch of its own (a batch-1 decode step is launch-bound). The
projections' parameters are views of the stacked matrix's row blocks, so they keep their names,
their shapes and their memory (`model/fused_projections.py` builds the groups); the full-sequence
path reads the parameters as before. The split outputs are column slices of the GEMM's output:
rows with a stride of sum(out) elements and a unit column stride.

A group of checkpoint-format FP8 linears (`model/quant_linear.py`) stacks their e4m3 codes the
same way and their 128x128 UE8M0 scales beside them (`scale`): each member but the last holds whole
scale blocks of rows, so member i's blocks are the stacked scale's rows from its first row / 128.
It runs as one `quant_linear` call on the group's own split-K counters.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from dsv4.kernels.ops import DECODE_BLOCK_N
from dsv4.kernels.ref.fp8_linear import fp8_linear
from dsv4.kernels.ref.quant import FP8_BLOCK
from dsv4.kernels.registry import KernelOps


class FusedRows:
    """`weight` [sum(sizes), in]: the row blocks, in order, of the group's projections' weights;
    with `scale` (FP8 codes) their stacked block scales [ceil(sum(sizes) / 128), ceil(in / 128)]."""

    def __init__(self, weight: torch.Tensor, sizes: Sequence[int],
                 scale: torch.Tensor | None = None) -> None:
        assert weight.dim() == 2 and sum(sizes) == weight.shape[0], "sizes must tile the rows"
        assert scale is None or all(n % FP8_BLOCK == 0 for n in sizes[:-1]), \
            "FP8 members but the last must hold whole scale blocks"
        self.weight, self.sizes, self.scale = weight, tuple(sizes), scale
        # the group's zeroed split-K counters for the `linear` op (`model/decode_gemv.py`); an
        # FP8 group always has them (the `quant_linear` op's, one word per DECODE_BLOCK_N rows)
        self.counters: torch.Tensor | None = (
            None if scale is None else torch.zeros(-(-weight.shape[0] // DECODE_BLOCK_N),
                                                   dtype=torch.int32, device=weight.device))

    def gemm(self, ops: KernelOps | None
             ) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
        """The GEMM this group runs: for FP8 codes the backend's `quant_linear` op (the
        reference without `ops`); else the `linear` op with the group's counters when it has
        them (and `ops`), else F.linear."""
        if self.scale is not None:
            op = fp8_linear if ops is None else ops.quant_linear
            return functools.partial(op, scale=self.scale, counters=self.counters)
        if ops is None or self.counters is None:
            return F.linear
        return functools.partial(ops.linear, counters=self.counters)

    def __call__(self, x: torch.Tensor,
                 gemm: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = F.linear
                 ) -> tuple[torch.Tensor, ...]:
        """x [..., in] -> each projection's output [..., size] (column slices of one GEMM's output,
        `gemm(x, weight)`: F.linear, or e.g. a kernel backend's `project` op).

        Each slice is its own `narrow` view, not one of `split`'s outputs: an op may then write a
        slice in place with autograd recording on as well."""
        y, start, out = gemm(x, self.weight), 0, []
        for size in self.sizes:
            out.append(y.narrow(-1, start, size))
            start += size
        return tuple(out)

    def holds(self, weights: Sequence[torch.Tensor],
              scales: Sequence[torch.Tensor] | None = None) -> bool:
        """True when `weights` (and for an FP8 group `scales`) are, in order, exactly views of
        this group's row blocks (a parameter or buffer replaced since, rather than written in
        place, makes it False)."""
        if len(weights) != len(self.sizes) or (scales is None) != (self.scale is None):
            return False
        row = block = 0
        for i, size in enumerate(self.sizes):
            if not _views_rows(weights[i], self.weight, row, size):
                return False
            if scales is not None and self.scale is not None and not _views_rows(
                    scales[i], self.scale, block, -(-size // FP8_BLOCK)):
                return False
            row, block = row + size, block + size // FP8_BLOCK
        return True


def _views_rows(t: torch.Tensor, base: torch.Tensor, row: int, rows: int) -> bool:
    """Whether t is exactly rows [row, row + rows) of base (same storage, offset, stride)."""
    return (t.untyped_storage().data_ptr() == base.untyped_storage().data_ptr()
            and t.storage_offset() == base.storage_offset() + row * base.stride(0)
            and tuple(t.shape) == (rows, base.shape[1]) and t.stride() == base.stride()
            and t.dtype == base.dtype)
