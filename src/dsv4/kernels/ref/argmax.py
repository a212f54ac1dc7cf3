"""Reference row argmax: the executable specification of `kernels/triton/argmax.py`.

`torch.argmax(x, dim=-1)` on a [B, V] float tensor: per row the index of its largest value, the
FIRST (lowest) index among equal maxima, and a NaN counts as larger than every number (the first
NaN wins; torch's `GreaterOrNan` comparator, the same on CPU and CUDA). -0.0 equals +0.0, and a
row of -inf returns 0. The greedy sampler depends on the lowest-index tie rule: a request decodes
the same tokens whichever backend picks them.
"""

from __future__ import annotations

import torch


def argmax(x: torch.Tensor) -> torch.Tensor:
    """x [B, V] (V >= 1) float -> [B] int64: each row's first maximum (NaN is the largest)."""
    return torch.argmax(x, dim=-1)
