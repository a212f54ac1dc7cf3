"""The compressors' fp32 projections on the triton backend: the `project` op
(`kernels/ref/compressor.py::project`: x [T, k] in any float dtype, taken as its fp32 values, @ w
[n, k]^T fp32 -> [T, n] fp32).

Decode-sized calls run the skinny GEMM of `gemv.py` with fixed tiles and K splits
(`PROJECT_BLOCK_N`, `PROJECT_SPLITS`), so a column's sum order depends on K alone and a fused
group's columns (`model/fused_projections.py`) get the bits of the members' own projections;
larger calls run cuBLAS. `HeldProject` is the op with split-K counters held for the backend's
lifetime; `triton_project_invariant` the op under invariant launch plans.

Test: tests/kernels/test_project_gemv.py (decode rows),
tests/kernels/test_fused_projections_triton.py (fused groups).
"""

from __future__ import annotations

import torch

from dsv4.kernels.triton.gemv import FMA_MAX_M, MAX_TILES, GemvCounters, triton_linear

PROJECT_BLOCK_N = 16    # decode `triton_project`: output columns per program (FMA path)
PROJECT_SPLITS = 8      # and K splits (V4-Flash CSA: 160 tiles x 8 = 1,280 programs)


def triton_project(x: torch.Tensor, w: torch.Tensor,
                   counters: GemvCounters | None = None) -> torch.Tensor:
    """Same contract as `ref.compressor.project` (the triton backend's `project` op). Decode-sized
    x (at most `gemv.FMA_MAX_M` rows, any float dtype: a 16-bit x is read as it is and widened
    in registers, no fp32 copy of it per step): `triton_linear`, one launch streaming the fp32
    weight (cuBLAS runs these fp32 GEMVs at about half the copy rate), its tiles and K splits
    fixed (`PROJECT_BLOCK_N`, `PROJECT_SPLITS`) so a column's sum order depends on K alone: a
    fused group's columns get the bits of the members' own projections. `counters`: the backend's
    held split-K counters (calls are serial: the compressors run on one stream). More rows:
    cuBLAS, whose kernel (and a row's last bits) depends on the row count."""
    if x.shape[0] > FMA_MAX_M or w.shape[0] > PROJECT_BLOCK_N * MAX_TILES:
        return torch.nn.functional.linear(x.float(), w)
    held = counters.get(x.device) if counters is not None else None
    return triton_linear(x, w, block_n=PROJECT_BLOCK_N, split_k=PROJECT_SPLITS, dot=False,
                         counters=held, out_dtype=torch.float32)


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
    return bi_mm(x.float(), w.t())
