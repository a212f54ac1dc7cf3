"""Reference RoPE-row gathers: the executable specification of `kernels/triton/rope_rows.py`.

A serving step reads its RoPE (cos, sin) rows from the tables' caches (`model/layers/rope.py`,
`RotaryEmbedding.build_cache`): each cache is a contiguous [2, P, R] fp32 tensor, the cos rows of
positions 0 .. P-1 then their sin rows (R = rope_head_dim / 2). `rope_rows` takes several
(cache, positions) pairs, each positions an int64 tensor of any shape [*S], and returns per pair
what `RotaryEmbedding.lookup` returns: (cos, sin), each [*S, R], the two halves of one contiguous
[2, *S, R] buffer (so each is contiguous, as the fused RoPE kernels require). The values are copies
of cache rows: any backend returns the same bits.

Positions must lie in [0, P): not checked here (a host sync); the reference's `index_select`
raises on one outside, the kernel writes zeros for it. At most `ROPE_ROWS_MAX_PAIRS` pairs per
call (one launch of the kernel serves them all); `check_pairs` holds the checks both backends
make.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from dsv4.kernels.ops import ROPE_ROWS_MAX_PAIRS


def check_pairs(pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Raises ValueError unless there are at most `ROPE_ROWS_MAX_PAIRS` pairs, each cache a
    contiguous [2, P, R] fp32 tensor and each positions an int64 tensor, all on one device
    (values are not read: that would sync)."""
    if len(pairs) > ROPE_ROWS_MAX_PAIRS:
        raise ValueError(f"rope_rows takes at most {ROPE_ROWS_MAX_PAIRS} (cache, positions) "
                         f"pairs; got {len(pairs)}")
    for i, (cache, positions) in enumerate(pairs):
        if cache.dim() != 3 or cache.shape[0] != 2 or cache.dtype != torch.float32:
            raise ValueError(f"pair {i}: cache must be [2, P, R] float32; got "
                             f"{list(cache.shape)} {cache.dtype}")
        if not cache.is_contiguous():
            raise ValueError(f"pair {i}: cache must be contiguous; got strides {cache.stride()}")
        if positions.dtype != torch.int64:
            raise ValueError(f"pair {i}: positions must be int64; got {positions.dtype}")
    devices = {t.device for pair in pairs for t in pair}
    if len(devices) > 1:
        raise ValueError(f"all caches and positions must be on one device; got "
                         f"{sorted(map(str, devices))}")


def rope_rows(pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]
              ) -> tuple[tuple[torch.Tensor, torch.Tensor], ...]:
    """Per (cache [2, P, R], positions [*S]) pair: (cos, sin) [*S, R] fp32, the cache rows of
    `positions` (one `index_select` per pair, `RotaryEmbedding.lookup`'s gather)."""
    check_pairs(pairs)
    out = []
    for cache, positions in pairs:
        rows = cache.index_select(1, positions.reshape(-1))
        rows = rows.view(2, *positions.shape, cache.shape[2])
        out.append((rows[0], rows[1]))
    return tuple(out)
