"""Reference per-token small ops of the attention block (spec §6.1-6.2), the executable specs of
`kernels/triton/rope_norm.py` (same signatures):

    q_norm_rope         q = RoPE(q / rms(q))                 per head, unweighted norm (the q path after wq_b)
    kv_norm_rope_store  pool[slots] = RoPE(w * kv / rms(kv))  the window kv: weighted norm, RoPE, cache write
    rope_inverse        o = RoPE^-1(o)                        de-rotation of the attention output

They compute exactly what `model/attention.py` computed inline before the ops existed (same torch ops in the
same order), so the `ref` backend's serving path is unchanged bit for bit.
"""

from __future__ import annotations

import torch

from dsv4.model.layers.norm import rms_norm, rms_normalize
from dsv4.model.layers.rope import apply_rope


def q_norm_rope(q: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, eps: float) -> torch.Tensor:
    """q: [T, H, D] -> [T, H, D] (q's dtype); cos/sin: [T, rd/2] fp32 (RoPE on the trailing rd channels)."""
    return apply_rope(rms_normalize(q, eps), cos.unsqueeze(-2), sin.unsqueeze(-2))


def kv_norm_rope_store(kv: torch.Tensor, weight: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor,
                       pool: torch.Tensor, slots: torch.Tensor) -> None:
    """kv: [T, D]; weight: [D] fp32; cos/sin: [T, rd/2]; pool: [N, D]; slots: [T] int64 rows of pool (in place)."""
    pool[slots] = apply_rope(rms_norm(kv, weight, eps), cos, sin).to(pool.dtype)


def rope_inverse(o: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """o: [T, H, D] -> [T, H, D] rotated by -φ on the trailing rd channels."""
    return apply_rope(o, cos.unsqueeze(-2), sin.unsqueeze(-2), inverse=True)
