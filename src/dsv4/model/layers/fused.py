"""`FusedRows`: the weights of projections of one input stacked as one [sum(out), in] matrix.

The serving path runs such a group as one GEMM and splits the output by columns, where each small
projection would be a kernel launch of its own (a batch-1 decode step is launch-bound). The
projections' parameters are views of the stacked matrix's row blocks, so they keep their names,
their shapes and their memory (`model/fused_projections.py` builds the groups); the full-sequence
path reads the parameters as before. The split outputs are column slices of the GEMM's output:
rows with a stride of sum(out) elements and a unit column stride.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from dsv4.kernels.ops import LinearOp


class FusedRows:
    """`weight` [sum(sizes), in]: the row blocks, in order, of the group's projections' weights."""

    def __init__(self, weight: torch.Tensor, sizes: Sequence[int]) -> None:
        assert weight.dim() == 2 and sum(sizes) == weight.shape[0], "sizes must tile the rows"
        self.weight, self.sizes = weight, tuple(sizes)
        # the group's zeroed split-K counters for the `linear` op (`model/decode_gemv.py`)
        self.counters: torch.Tensor | None = None

    def gemm(self, ops: LinearOp | None) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
        """The GEMM this group runs: the serving path's `linear` op with the group's counters
        when it has them (and `ops`), else F.linear."""
        if ops is None or self.counters is None:
            return F.linear
        return functools.partial(ops, counters=self.counters)

    def __call__(self, x: torch.Tensor,
                 gemm: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = F.linear
                 ) -> tuple[torch.Tensor, ...]:
        """x [..., in] -> each projection's output [..., size] (column slices of one GEMM's output,
        `gemm(x, weight)`: F.linear, or e.g. a kernel backend's `project` op).

        Each slice is its own `narrow` view, not one of `split`'s outputs: an op may then write a
        slice in place (`add_ape` on the gate scores) with autograd recording on as well."""
        y, start, out = gemm(x, self.weight), 0, []
        for size in self.sizes:
            out.append(y.narrow(-1, start, size))
            start += size
        return tuple(out)

    def holds(self, weights: Sequence[torch.Tensor]) -> bool:
        """True when `weights` are, in order, exactly views of this matrix's row blocks (a
        parameter replaced since, rather than written in place, makes it False)."""
        if len(weights) != len(self.sizes):
            return False
        base, row = self.weight, 0
        for w, size in zip(weights, self.sizes, strict=True):
            if (w.untyped_storage().data_ptr() != base.untyped_storage().data_ptr()
                    or w.storage_offset() != base.storage_offset() + row * base.stride(0)
                    or tuple(w.shape) != (size, base.shape[1]) or w.stride() != base.stride()
                    or w.dtype != base.dtype):
                return False
            row += size
        return True
