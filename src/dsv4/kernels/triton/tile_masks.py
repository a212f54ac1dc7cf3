"""Masks of 2-D tiles that keep Triton's 16-byte vector loads and stores.

Owns `rows_mask`, shared by the gathering kernels. A mask against a runtime width (`offs_d < D`) is
not provably uniform over a 16-byte vector, so a tile load or store under it compiles to one access
per element: on sm_90 the sparse attention's key gather (D 512) becomes 512 2-byte loads a thread,
the indexer scores' (Id 128) 128, and neither can become cp.async. When the width equals the tile's
(EVEN_D), masking whole rows only is exact and keeps the vectors
(benchmarks/aot_compile_sm90.py --kernels attention; benchmarks/results/kernels_i_h200_202611.md).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def rows_mask(rows, d_mask, EVEN_D: tl.constexpr):  # type: ignore[no-untyped-def]
    """[R, BLOCK_D] mask of whole rows (rows: [R] bool, d_mask: [BLOCK_D] bool): without the column
    mask when the width is the tile's (EVEN_D)."""
    if EVEN_D:
        mask = tl.broadcast_to(rows[:, None], (rows.shape[0], d_mask.shape[0]))
    else:
        mask = rows[:, None] & d_mask[None, :]
    return mask
